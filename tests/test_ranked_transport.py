"""The ranked transport (kv_transfer/transports/ranked.py): a tensor-parallel worker's KV, one real transport per
rank's cache on 127.0.0.1, driven as one. Rank r's blocks land in the peer's rank r cache and nowhere else; a
transfer is delivered (received) only when every rank's part is, and fails once when any part fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transport_helpers import ALL_LAYERS, SHAPE, as_bytes, assert_landed, fill, wait_sent, wait_until
from pdcluster.kv_transfer.transports import TransportConfig, available_transports, get_transport_class
from pdcluster.kv_transfer.transports.base import ShmOptions
from pdcluster.kv_transfer.transports.ranked import RankedTransport

AVAILABLE = available_transports()
NAMES = [pytest.param(n, marks=pytest.mark.skipif(AVAILABLE[n] is not None, reason=str(AVAILABLE[n])))
         for n in ("tcp", "shm")]
NUM_RANKS = 2

pytestmark = pytest.mark.timeout(60)


def config() -> TransportConfig:
    return TransportConfig(timeout_s=5.0, chunk_bytes=16 << 10, max_inflight_chunks=2,
                           shm=ShmOptions(ring_bytes=64 << 10))


@pytest.fixture
def ranked_pair():
    """``ranked_pair(name, num_rx_ranks) -> (rx, rx_caches, tx, tx_caches)``: a sender split NUM_RANKS ways and a
    receiver split ``num_rx_ranks`` ways, unconnected; every transport is closed at the end."""
    made = []

    def _pair(name: str, num_rx_ranks: int = NUM_RANKS):
        cls = get_transport_class(name)

        def side(role: str, num_ranks: int, seed: int):
            caches = [cls.allocate_kv_cache(SHAPE, torch.float32) for _ in range(num_ranks)]
            for r, cache in enumerate(caches):
                fill(cache, seed + r)
            parts = [cls(cache, role, config()) for cache in caches]
            made.extend(parts)
            return (RankedTransport(parts) if num_ranks > 1 else parts[0]), caches

        rx, rx_caches = side("receiver", num_rx_ranks, 10)
        tx, tx_caches = side("sender", NUM_RANKS, 20)
        return rx, rx_caches, tx, tx_caches

    yield _pair
    for t in made:
        t.close()


@pytest.mark.parametrize("name", NAMES)
def test_each_ranks_blocks_land_in_the_peers_same_rank(ranked_pair, name):
    rx, rx_caches, tx, tx_caches = ranked_pair(name)
    tx.connect("d0", rx.local_descriptor())
    before = [as_bytes(c).clone() for c in rx_caches]
    src, dst = [3, 7, 11], [40, 2, 63]
    rx.expect("req", dst)
    for layer in ALL_LAYERS:  # layer by layer, as the prefill connector sends a prompt's full blocks
        tx.send("d0", "req", [layer], np.array(src), np.array(dst))
    done, failed = wait_sent(tx, {"req"}, 10.0)
    assert done == {"req"} and not failed
    for rx_cache, want, tx_cache in zip(rx_caches, before, tx_caches):
        assert_landed(rx_cache, want, tx_cache, src, dst)
    # poll_received: once per send, after every rank's part of it has landed
    received: list = []
    assert wait_until(lambda: received.extend(rx.poll_received()) or len(received) >= len(ALL_LAYERS))
    assert sorted(layers for _, layers in received) == [[layer] for layer in ALL_LAYERS]
    assert tx.block_layer_bytes() == NUM_RANKS * tx.parts[0].block_layer_bytes()


@pytest.mark.parametrize("name", NAMES)
def test_a_transfer_one_rank_refuses_fails_once_and_is_never_delivered(ranked_pair, name):
    rx, rx_caches, tx, _ = ranked_pair(name)
    tx.connect("d0", rx.local_descriptor())
    rx.parts[0].expect("req", [5])  # rank 1's receiver never expected it: its part is refused
    before = as_bytes(rx_caches[1]).clone()
    tx.send("d0", "req", ALL_LAYERS, np.array([1]), np.array([5]))
    reports: list = []
    assert wait_until(lambda: reports.append(tx.poll_sent()) or any(f for _, f in reports), 10.0)
    for _ in range(20):  # rank 0's part is delivered too: neither it nor a second failure is reported
        reports.append(tx.poll_sent())
    delivered = [t for d, _ in reports for t in d]
    failed = [f for _, fs in reports for f in fs]
    assert delivered == [] and len(failed) == 1
    assert failed[0][0] == "req" and failed[0][1].startswith("rank 1:")
    assert torch.equal(as_bytes(rx_caches[1]), before)


@pytest.mark.parametrize("name", NAMES)
def test_peers_split_different_ways_do_not_connect(ranked_pair, name):
    rx, _, tx, _ = ranked_pair(name, num_rx_ranks=1)
    with pytest.raises(ConnectionError, match="split 1 way.*ours 2.*same --tensor-parallel-size"):
        tx.connect("d0", rx.local_descriptor())


def test_revoke_answers_for_every_rank():
    """The receiver's revoke is True only if no rank's part can still be written; otherwise poll_revoked lists the
    transfer once every such rank's part has said so."""

    class Part:  # the receiver side of a transport whose sender pushes into its memory (shm push, cuda_ipc)
        role, name, config, kv_cache = "receiver", "fake", None, None

        def __init__(self, safe_now: bool):
            self.safe_now, self.revoked = safe_now, []

        def revoke(self, transfer_id):
            return self.safe_now

        def poll_revoked(self):
            out, self.revoked = self.revoked, []
            return out

    parts = [Part(True), Part(False), Part(False)]
    rx = RankedTransport(parts)
    assert rx.revoke("a") is False
    parts[1].revoked = ["a"]
    assert rx.poll_revoked() == []
    parts[2].revoked = ["a"]
    assert rx.poll_revoked() == ["a"]
    assert rx.poll_revoked() == []
    assert RankedTransport([Part(True), Part(True)]).revoke("b") is True
