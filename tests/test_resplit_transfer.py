"""KV between workers that split one model different numbers of ways (heterogeneous tensor parallelism,
kv_transfer/transports/resplit.py): the prefill side copies each decode rank's heads into staging caches laid out the
decode side's way and sends those. Real transports on 127.0.0.1; real workers against the unsplit engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import engine_config, make_engine, slow_params, usable_transports
from test_kv_transfer_e2e import run_on_pair
from transport_helpers import as_bytes, fill, wait_sent, wait_until
from pdcluster.engine.mamba_state import MambaStateShape
from pdcluster.engine.mamba_state_blocks import read_state_floats, write_state_floats
from pdcluster.engine.mamba_state_resplit import resplit_state, split_shape
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.protocol import HandshakeError, Hello, KVLayout, check_compatible
from pdcluster.kv_transfer.transports import TransportConfig, get_transport_class
from pdcluster.kv_transfer.transports.base import ShmOptions
from pdcluster.kv_transfer.transports.ranked import RankedTransport
from pdcluster.kv_transfer.transports.resplit import ResplitSender, head_pieces

TRANSPORTS = usable_transports()
NUM_HEADS, NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 4, 3, 32, 4, 8

pytestmark = pytest.mark.timeout(120)


def test_head_pieces_cover_each_peer_ranks_heads_once():
    # decode split more ways: a slice of one of our ranks each
    assert head_pieces(4, 2, 4, False) == [[(0, slice(0, 1), slice(0, 1))], [(0, slice(1, 2), slice(0, 1))],
                                           [(1, slice(0, 1), slice(0, 1))], [(1, slice(1, 2), slice(0, 1))]]
    # decode split fewer ways: our ranks' heads side by side
    assert head_pieces(4, 4, 2, False) == [[(0, slice(0, 1), slice(0, 1)), (1, slice(0, 1), slice(1, 2))],
                                           [(2, slice(0, 1), slice(0, 1)), (3, slice(0, 1), slice(1, 2))]]
    assert head_pieces(6, 2, 3, False) == [[(0, slice(0, 2), slice(0, 2))],
                                           [(0, slice(2, 3), slice(0, 1)), (1, slice(0, 1), slice(1, 2))],
                                           [(1, slice(1, 3), slice(0, 2))]]
    assert head_pieces(1, 2, 4, True) == [[(0, slice(None), slice(None))]] * 4  # MLA: rank 0's whole latent
    with pytest.raises(ValueError, match="4 KV heads do not split 2 and 3 ways"):
        head_pieces(4, 2, 3, False)


def _config() -> TransportConfig:
    return TransportConfig(timeout_s=5.0, chunk_bytes=8 << 10, max_inflight_chunks=2, secret="s3cret",
                           shm=ShmOptions(ring_bytes=64 << 10))


@pytest.fixture
def sides():
    """``side(name, role, num_ranks, seed)`` -> (transport, caches): a worker's caches split ``num_ranks`` ways (the
    whole model's NUM_HEADS KV heads), random contents; a sender is a ResplitSender as the workers make it."""
    made = []

    def side(name: str, role: str, num_ranks: int, seed: int):
        cls = get_transport_class(name)
        shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS // num_ranks, HEAD_DIM)
        caches = [cls.allocate_kv_cache(shape, torch.float32) for _ in range(num_ranks)]
        for r, cache in enumerate(caches):
            fill(cache, seed + r)
        parts = [cls(cache, role, _config()) for cache in caches]
        made.extend(parts)
        transport = RankedTransport(parts) if num_ranks > 1 else parts[0]
        if role == "sender":
            transport = ResplitSender(transport, caches, make_part=lambda c: cls(c, "sender", _config()),
                                      allocate=cls.allocate_kv_cache)
            made.append(transport)
        return transport, caches

    yield side
    for t in made:
        t.close()


def _whole(caches: list[torch.Tensor]) -> torch.Tensor:
    """The whole model's cache from its ranks' (heads side by side)."""
    return torch.cat(caches, dim=4)


@pytest.mark.parametrize("name", [n for n in ("tcp", "shm") if n in TRANSPORTS])
@pytest.mark.parametrize("ours, theirs", [(1, 2), (2, 1), (2, 4), (4, 2), (4, 1)])
def test_each_decode_rank_gets_its_heads_of_the_sent_blocks_only(sides, name, ours, theirs):
    tx, tx_caches = sides(name, "sender", ours, 20)
    rx, rx_caches = sides(name, "receiver", theirs, 10)
    before = _whole(rx_caches).clone()
    tx.connect("d0", rx.local_descriptor())
    src, dst = [3, 7, 11], [30, 2, 17]
    rx.expect("req", dst)
    for layer in range(NUM_LAYERS):  # layer by layer, as a prompt's full blocks go
        tx.send("d0", "req", [layer], np.array(src), np.array(dst))
    tx.send("d0", "req", range(NUM_LAYERS), np.array(src[-1:]), np.array(dst[-1:]))  # the flush's repeat
    done, failed = wait_sent(tx, {"req"}, 10.0)
    assert done == {"req"} and not failed
    want = before.clone()
    want[:, :, dst] = _whole(tx_caches)[:, :, src]
    assert torch.equal(as_bytes(_whole(rx_caches)), as_bytes(want))  # those heads, those blocks, nothing else
    received: list = []
    assert wait_until(lambda: received.extend(rx.poll_received()) or len(received) >= NUM_LAYERS + 1)
    assert len(tx._splits) == 1 and tx._splits[theirs].num_ranks == theirs
    assert tx.block_layer_bytes_to("d0") == rx.block_layer_bytes() == tx.block_layer_bytes()  # the same heads in all


@pytest.mark.parametrize("ours, theirs", [(2, 4), (2, 1)])
def test_an_mla_latent_whole_on_every_rank_reaches_each_decode_rank_from_rank_0(ours, theirs):
    """One plane, one latent "head" whole on every rank (DeepSeek split over ranks): each decode rank gets our rank 0's
    latent, and a send counts the bytes the decode side's ranks take."""
    cls = get_transport_class("tcp")
    shape = (NUM_LAYERS, 1, NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM)
    tx_caches = [torch.randn(shape) for _ in range(ours)]
    rx_caches = [torch.zeros(shape) for _ in range(theirs)]
    parts = [cls(c, "sender", _config()) for c in tx_caches]
    rx_parts = [cls(c, "receiver", _config()) for c in rx_caches]
    tx = ResplitSender(RankedTransport(parts), tx_caches, make_part=lambda c: cls(c, "sender", _config()),
                       allocate=cls.allocate_kv_cache)
    rx = RankedTransport(rx_parts) if theirs > 1 else rx_parts[0]
    try:
        tx.connect("d0", rx.local_descriptor())
        rx.expect("req", [4, 5])
        tx.send("d0", "req", range(NUM_LAYERS), np.array([9, 1]), np.array([4, 5]))
        done, failed = wait_sent(tx, {"req"}, 10.0)
        assert done == {"req"} and not failed
        for cache in rx_caches:
            assert torch.equal(cache[:, :, [4, 5]], tx_caches[0][:, :, [9, 1]])
        assert tx.block_layer_bytes_to("d0") == theirs * BLOCK_SIZE * HEAD_DIM * 4
        assert tx.block_layer_bytes() == ours * BLOCK_SIZE * HEAD_DIM * 4
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("name", [n for n in ("tcp", "shm") if n in TRANSPORTS])
def test_peers_of_our_split_and_of_others_at_once(sides, name):
    """One sender, two decode peers: one split our way (our own transport, no staging), one split another way."""
    tx, tx_caches = sides(name, "sender", 2, 20)
    same, same_caches = sides(name, "receiver", 2, 10)
    other, other_caches = sides(name, "receiver", 1, 30)
    tx.connect("same", same.local_descriptor())
    tx.connect("other", other.local_descriptor())
    assert list(tx._splits) == [1]  # staging only for the other split
    same.expect("a", [1, 2])
    other.expect("b", [5, 6])
    tx.send("same", "a", range(NUM_LAYERS), np.array([8, 9]), np.array([1, 2]))
    tx.send("other", "b", range(NUM_LAYERS), np.array([9, 10]), np.array([5, 6]))
    done, failed = wait_sent(tx, {"a", "b"}, 10.0)
    assert done == {"a", "b"} and not failed
    whole = _whole(tx_caches)
    assert torch.equal(as_bytes(_whole(same_caches)[:, :, [1, 2]]), as_bytes(whole[:, :, [8, 9]]))
    assert torch.equal(as_bytes(other_caches[0][:, :, [5, 6]]), as_bytes(whole[:, :, [9, 10]]))


@pytest.mark.parametrize("name", [n for n in ("tcp", "shm") if n in TRANSPORTS])
def test_a_refused_resplit_transfer_fails_once_and_lands_nothing(sides, name):
    tx, _ = sides(name, "sender", 2, 20)
    rx, rx_caches = sides(name, "receiver", 4, 10)
    before = as_bytes(_whole(rx_caches)).clone()
    tx.connect("d0", rx.local_descriptor())
    tx.send("d0", "never-expected", range(NUM_LAYERS), np.array([1]), np.array([2]))
    done, failed = wait_sent(tx, {"never-expected"}, 10.0)
    assert not done and list(failed) == ["never-expected"]
    assert torch.equal(as_bytes(_whole(rx_caches)), before)
    with pytest.raises(IndexError, match=r"source block ids must be in \[0, 32\)"):
        tx.send("d0", "bad", [0], np.array([NUM_BLOCKS]), np.array([0]))
    with pytest.raises(KeyError, match="unknown peer 'nobody'"):
        tx.send("nobody", "x", [0], np.array([1]), np.array([1]))


# ---- a hybrid's Mamba state --------------------------------------------------------------------------------------

WHOLE_STATE = MambaStateShape(num_mamba_layers=2, conv_dim=8 * 4 + 2 * 4 * 3, conv_width=3, num_heads=8, head_dim=4,
                              state_size=3)  # 8 heads of 4 and 4 groups of state 3: x 32 | B 12 | C 12 channels


def _rank_state(whole_conv, whole_ssm, rank: int, num_ranks: int) -> torch.Tensor:
    """Rank ``rank``'s packed floats where the model splits ``num_ranks`` ways: its heads' x, its groups' B and C, its
    heads' SSM state (engine/tensor_parallel/shard_hybrid.py's cut), conv layers then SSM layers."""
    def part(t):
        n = t.shape[0] // num_ranks
        return t[rank * n:(rank + 1) * n]

    conv = [torch.cat([part(c[:32]), part(c[32:44]), part(c[44:])]) for c in whole_conv]
    return torch.cat([t.reshape(-1) for t in conv + [part(s) for s in whole_ssm]])


@pytest.mark.parametrize("ours, theirs", [(1, 2), (2, 1), (2, 4), (4, 2), (4, 1)])
def test_a_mamba_state_packed_by_our_ranks_is_repacked_for_each_peer_rank(ours, theirs):
    g = torch.Generator().manual_seed(ours * 10 + theirs)
    whole_conv = [torch.randn(WHOLE_STATE.conv_dim, 3, generator=g) for _ in range(2)]
    whole_ssm = [torch.randn(8, 4, 3, generator=g) for _ in range(2)]
    shape = split_shape(WHOLE_STATE, 1, ours)
    block_ids = np.array([5, 2])  # the state's blocks: ours and the staging's (the mirror)
    caches = [torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, 4 // ours, HEAD_DIM) for _ in range(ours)]
    peers = [torch.full((NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, 4 // theirs, HEAD_DIM), 7.0) for _ in range(theirs)]
    for rank, cache in enumerate(caches):
        write_state_floats(cache, block_ids, _rank_state(whole_conv, whole_ssm, rank, ours))
    resplit_state(caches, peers, block_ids, shape=shape)
    peer_shape = split_shape(shape, ours, theirs)
    assert peer_shape == split_shape(WHOLE_STATE, 1, theirs)
    for rank, peer in enumerate(peers):
        assert torch.equal(read_state_floats(peer, block_ids, peer_shape),
                           _rank_state(whole_conv, whole_ssm, rank, theirs))
        untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
        untouched[block_ids] = False
        assert bool((peer[:, :, untouched] == 7.0).all())  # nothing outside the state's blocks


# ---- the handshake ----------------------------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=4, num_draft_layers=0, block_size=16, num_kv_heads=2, head_dim=32, dtype="float32",
                  tensor_parallel_size=2)


def _hello(role: str, layout: KVLayout) -> Hello:
    return Hello(worker_id=role[0] + "0", role=role, layout=layout, model_fingerprint="m", transport="tcp",
                 transport_descriptor={}, nonce=b"n" * 16, hmac=b"h" * 32)


def test_the_handshake_pairs_splits_of_one_model_and_refuses_the_rest():
    whole = dataclasses.replace(LAYOUT, num_kv_heads=4, tensor_parallel_size=1)
    check_compatible(_hello("prefill", LAYOUT), _hello("decode", whole))  # 2 x 2 heads == 1 x 4
    check_compatible(_hello("decode", whole), _hello("prefill", LAYOUT))
    mla = dataclasses.replace(LAYOUT, num_kv_heads=1, num_planes=1)
    check_compatible(_hello("prefill", mla), _hello("decode", dataclasses.replace(mla, tensor_parallel_size=4)))
    with pytest.raises(HandshakeError, match=r"layout.tensor_parallel_size differs: prefill 'p0' has 2, decode 'd0' "
                                             r"has 1 \(their caches hold 4 and 2 KV heads in all\)"):
        check_compatible(_hello("prefill", LAYOUT), _hello("decode", dataclasses.replace(whole, num_kv_heads=2)))
    hybrid = dataclasses.replace(LAYOUT, num_state_blocks=2, state_num_layers=3, state_conv_dim=8, state_conv_width=4,
                                 state_num_heads=2, state_head_dim=4, state_size=8)
    whole_hybrid = dataclasses.replace(hybrid, num_kv_heads=4, tensor_parallel_size=1, state_conv_dim=16,
                                       state_num_heads=4)
    check_compatible(_hello("prefill", hybrid), _hello("decode", whole_hybrid))
    with pytest.raises(HandshakeError, match=r"\(their Mamba states hold 4 and 8 heads, 16 and 16 conv channels"):
        check_compatible(_hello("prefill", hybrid), _hello("decode", dataclasses.replace(whole_hybrid,
                                                                                         state_num_heads=8)))
    with pytest.raises(HandshakeError, match="layout.num_state_blocks differs"):
        check_compatible(_hello("prefill", hybrid), _hello("decode", dataclasses.replace(whole_hybrid,
                                                                                         num_state_blocks=3)))
    with pytest.raises(HandshakeError, match="layout.block_size differs"):  # the other fields still count
        check_compatible(_hello("prefill", LAYOUT), _hello("decode", dataclasses.replace(whole, block_size=32)))


# ---- workers --------------------------------------------------------------------------------------------------

NUM_KV_BLOCKS = 128


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", slow_params([t for t in ("tcp", "shm", "ucx", "nccl") if t in TRANSPORTS],
                                                  slow=("ucx", "nccl")))
@pytest.mark.parametrize("prefill_ranks, decode_ranks", [(2, 1), (1, 2)])
def test_workers_split_different_ways_equal_the_single_engine(tiny_dir, transport, prefill_ranks, decode_ranks):
    """tiny-random's 2 KV heads: a prefill worker split 2 ways feeding a whole decode worker, and the reverse; the
    tokens of the unsplit engine, every block of both back, and only the decode side's bytes sent."""
    cfg = dict(num_kv_blocks=NUM_KV_BLOCKS, max_model_len=1536, prefill_chunk_size=16)
    prompts = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 17, 45, 100])]
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    expected = [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_KV_BLOCKS).generate(prompts, params)]
    run = run_on_pair(engine_config(tensor_parallel_size=prefill_ranks, **cfg),
                      TransferConfig(transport=transport, secret="s3cret"), prompts, params, NUM_KV_BLOCKS,
                      decode_cfg=engine_config(tensor_parallel_size=decode_ranks, **cfg))
    assert run.tokens == expected
    assert run.stats[0]["bytes_sent"] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", [t for t in ("tcp", "shm") if t in TRANSPORTS])
@pytest.mark.parametrize("model, prefill_ranks, decode_ranks", [("tiny-hybrid", 2, 1), ("tiny-hybrid", 1, 2),
                                                                pytest.param("tiny-hybrid-moe", 2, 1,
                                                                             marks=pytest.mark.slow)])
def test_hybrid_workers_split_different_ways_equal_the_single_engine(model, transport, prefill_ranks, decode_ranks):
    """A hybrid's Mamba state, packed per rank, re-packed for the decode side's ranks (engine/mamba_state_resplit.py)
    beside its attention layers' KV heads: the tokens of the unsplit engine, every block of both back."""
    cfg = dict(num_kv_blocks=NUM_KV_BLOCKS, max_model_len=512, prefill_chunk_size=16)
    prompts = [[(13 * i + 5 * j) % 450 + 4 for j in range(n)] for i, n in enumerate([5, 17, 40, 90])]
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3)
    expected = [o.token_ids for o in make_engine(model, **cfg).generate(prompts, params)]
    run = run_on_pair(engine_config(model, tensor_parallel_size=prefill_ranks, **cfg),
                      TransferConfig(transport=transport, secret="s3cret"), prompts, params, NUM_KV_BLOCKS,
                      decode_cfg=engine_config(model, tensor_parallel_size=decode_ranks, **cfg))
    assert run.tokens == expected
    assert run.prefill_engine.num_state_blocks == run.decode_engine.num_state_blocks > 0
