"""The offload tiers in the engine (issue 27): a prompt whose blocks the device pool evicted comes back
from host memory or disk instead of being recomputed, with the same tokens as without tiers; disk faults
mean recompute, never a wrong token; a request aborted while its blocks load leaks nothing."""

from __future__ import annotations

import functools
import random
import time

import pytest

from conftest import make_engine
from pdcluster.engine.request import RequestStatus
from pdcluster.engine.sampling_params import SamplingParams

BLOCK = 16
POOL = 24  # blocks: two 160-token prompts do not fit together, so the first one's blocks are evicted
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 40000) for _ in range(length)] for _ in range(n)]


def _run(engine, prompts):
    """One at a time (the evictions happen between them); outputs in order."""
    return [engine.generate([p], GREEDY)[0] for p in prompts]


@pytest.fixture(scope="module")
def reference():
    """The same sequence of prompts on an engine without tiers (nothing comes back: all recomputed)."""
    engine = make_engine(num_kv_blocks=POOL, dtype="bfloat16")
    a, b, c = _prompts(1, 3, 160)
    return [a, b, c, a, b], [o.token_ids for o in _run(engine, [a, b, c, a, b])]


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_evicted_prefix_comes_back_from_a_lower_tier_token_exact(reference, tiers, tmp_path):
    prompts, expected = reference
    kwargs = {}
    if "host" in tiers:
        kwargs["kv_offload_host_gib"] = 12 * 2 * 2 * BLOCK * 4 * 16 * 2 / (1 << 30) if tiers == "host+disk" else 0.01
    if "disk" in tiers:
        kwargs.update(kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gib=0.05)
    engine = make_engine(num_kv_blocks=POOL, dtype="bfloat16", **kwargs)
    outputs = _run(engine, prompts)
    assert [o.token_ids for o in outputs] == expected
    # The repeat finds all 9 full blocks of its prompt (159 usable tokens), most of them in a lower tier.
    assert outputs[0].num_offloaded_tokens == 0
    assert outputs[3].num_cached_tokens == 9 * BLOCK, outputs[3]
    assert outputs[3].num_offloaded_tokens >= 4 * BLOCK, outputs[3]
    kinds = {(kind, tier) for kind, tier, _ in engine.kv_events.drain()}
    assert ("stored", "device") in kinds and ("removed", "device") in kinds
    assert any(kind == "stored" and tier != "device" for kind, tier in kinds)
    assert engine.scheduler.num_free_blocks == POOL
    engine.offload.close()


def test_disk_faults_mean_recompute_never_a_wrong_token(reference, tmp_path):
    prompts, expected = reference
    engine = make_engine(num_kv_blocks=POOL, dtype="bfloat16", kv_offload_disk_dir=str(tmp_path),
                         kv_offload_disk_gib=0.05)
    outputs = _run(engine, prompts[:3])
    disk = engine.offload.tiers.disk
    assert disk.flush()
    files = sorted(disk.directory.glob("*.kvb"))
    assert len(files) >= 6
    for i, path in enumerate(files):  # every other file deleted, the rest corrupted in one byte
        if i % 2:
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    outputs += _run(engine, prompts[3:])
    assert [o.token_ids for o in outputs] == expected
    # The first prompt's blocks on disk were all damaged: recomputed. (The second's were written again
    # after the damage, when the repeat of the first evicted them: they load.)
    assert outputs[3].num_offloaded_tokens == 0
    assert engine.offload.tiers.counters["disk"].failed_loads >= 1
    assert engine.scheduler.num_free_blocks == POOL
    engine.offload.close()


def test_abort_while_loading_frees_every_block_once(reference, tmp_path):
    prompts, _ = reference
    engine = make_engine(num_kv_blocks=POOL, dtype="bfloat16", kv_offload_host_gib=0.01)
    _run(engine, prompts[:3])
    request_id = engine.add_request(prompts[0], GREEDY)
    engine.scheduler.schedule()  # starts the load: the request waits outside the queues
    request = engine.scheduler.requests[request_id]
    assert request.status == RequestStatus.WAITING_FOR_OFFLOAD and engine.scheduler.offload.num_loading == 1
    engine.abort_request(request_id)
    assert engine.scheduler.num_free_blocks < POOL  # held until the loader is done with them
    for _ in range(500):  # bounded: steps poll the load; its end gives the blocks back
        engine.step()
        if engine.scheduler.num_free_blocks == POOL:
            break
        time.sleep(0.01)
    assert engine.scheduler.num_free_blocks == POOL
    assert not engine.has_unfinished() and engine.scheduler.offload.num_loading == 0
    engine.offload.close()


def test_hybrids_and_no_prefix_cache_refuse_the_tiers_in_one_line():
    from pdcluster.engine.config import ConfigError

    with pytest.raises(ConfigError, match="turn prefix caching on"):
        make_engine(kv_offload_host_gib=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="is a hybrid"):
        make_engine("tiny-hybrid", kv_offload_host_gib=0.01)


def test_requests_back_from_a_load_never_deadlock_a_full_pool():
    """Three longer turns at once, each continuing a prompt that is in host memory: they all finish and
    every block comes back (requests waiting after a load used to sit on their loaded blocks while the
    first of them could not grow, with nothing running to preempt)."""
    rng = random.Random(0)
    engine = make_engine(num_kv_blocks=POOL, kv_offload_host_gib=0.01)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompts = [[rng.randrange(10, 40000) for _ in range(160)] for _ in range(3)]
    for p in prompts:  # one at a time: each pushes the one before down to host memory
        engine.generate([p], params)
    ids = [engine.add_request(p + [rng.randrange(10, 40000) for _ in range(160)], params) for p in prompts]
    done = set()
    deadline = time.monotonic() + 60
    while engine.has_work() and time.monotonic() < deadline:  # bounded in time
        done |= {out.request_id for out in engine.step() if out.finished}
    assert done == set(ids)
    assert engine.scheduler.num_free_blocks == POOL and engine.scheduler.offload.num_loading == 0
    engine.offload.close()


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_a_model_split_over_two_ranks_offloads_every_ranks_heads_and_loads_them_back(tiers, tmp_path):
    """Tensor parallelism on a CPU (2 ranks): an evicted block leaves every rank's cache as one column, the unsplit
    model's shape (the ranks' heads side by side), and comes back into every rank's cache; in bf16 the tokens are the
    split engine's without tiers (rank 1's heads lost or misplaced on the way would change them)."""
    prompts, expected = _split_reference()
    kwargs = (dict(kv_offload_host_gib=0.01) if tiers == "host"
              else dict(kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gib=0.05))
    engine = make_engine(num_kv_blocks=POOL, dtype="bfloat16", tensor_parallel_size=2, **kwargs)
    try:
        assert len(engine.offload.columns.caches) == 2
        whole = make_engine(num_kv_blocks=1, dtype="bfloat16").kv_cache
        assert engine.offload.columns.block_shape == (*whole.shape[:2], *whole.shape[3:])
        outputs = _run(engine, prompts)
        assert [o.token_ids for o in outputs] == expected
        assert outputs[3].num_cached_tokens == 9 * BLOCK, outputs[3]
        assert outputs[3].num_offloaded_tokens >= 4 * BLOCK, outputs[3]
        assert engine.scheduler.num_free_blocks == POOL
    finally:
        engine.offload.close()
        engine.close()


@functools.cache
def _split_reference() -> tuple[list[list[int]], list[list[int]]]:
    """The prompts of ``reference`` on the model split over two ranks, without tiers (everything recomputed)."""
    engine = make_engine(num_kv_blocks=POOL, dtype="bfloat16", tensor_parallel_size=2)
    try:
        a, b, c = _prompts(1, 3, 160)
        return [a, b, c, a, b], [o.token_ids for o in _run(engine, [a, b, c, a, b])]
    finally:
        engine.close()


def test_block_columns_of_split_caches_read_side_by_side_and_write_all_or_nothing():
    import torch

    from pdcluster.engine.kv_offload.block_columns import BlockColumns

    caches = [torch.randn(3, 2, 5, 4, heads, 8) for heads in (2, 1)]
    columns = BlockColumns(caches)
    assert columns.block_shape == (3, 2, 4, 3, 8)
    column = columns.read(2)
    assert torch.equal(column[..., :2, :], caches[0][:, :, 2]) and torch.equal(column[..., 2:, :], caches[1][:, :, 2])
    before = [c.clone() for c in caches]
    assert not columns.write(4, lambda out: False)  # a failed load: no rank holds part of the block
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
    assert columns.write(4, lambda out: out.copy_(column) is not None)
    assert torch.equal(caches[0][:, :, 4], caches[0][:, :, 2]) and torch.equal(caches[1][:, :, 4], caches[1][:, :, 2])
    from pdcluster.engine.kv_offload.events import layout_namespace

    # a split model's blocks go to a disk folder of their own: another split's KV rounds differently
    assert layout_namespace("m", "bfloat16", caches[0], "", 2) != layout_namespace("m", "bfloat16", caches[0], "", 1)
    assert layout_namespace("m", "bfloat16", caches[0]) == layout_namespace("m", "bfloat16", caches[0], "", 1)
    with pytest.raises(ValueError, match="differ in more than their heads"):
        BlockColumns([torch.zeros(3, 2, 5, 4, 2, 8), torch.zeros(3, 2, 5, 4, 2, 4)])
