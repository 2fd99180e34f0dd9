"""The offload tiers on their own (engine/kv_offload/): host LRU pushing blocks down to disk, disk files
checked on read (deleted, truncated, corrupted -> a miss, never wrong KV), a restarted worker finding its
blocks, events for every store and removal."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.block_manager import chained_block_hashes
from pdcluster.engine.kv_offload.disk_tier import DiskTier
from pdcluster.engine.kv_offload.host_tier import HostTier
from pdcluster.engine.kv_offload.config import OffloadConfig
from pdcluster.engine.kv_offload.tiers import OffloadTiers

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block_size, kv heads, head_dim


def _block(seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_block_hashes_are_the_same_in_every_process():
    # A fixed value: Python's hash() of a tuple holding None changes per process on 3.11.
    assert chained_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [-3251428344978824213, -2543332785878942959]


def test_host_tier_evicts_least_recently_used():
    host = HostTier(2, SHAPE, torch.bfloat16)
    assert host.store(1, _block(1)) is None and host.store(2, _block(2)) is None
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    assert host.load(1, out) and torch.equal(out, _block(1))  # 1 is now the most recently used
    evicted_hash, evicted_kv = host.store(3, _block(3))
    assert evicted_hash == 2 and torch.equal(evicted_kv, _block(2))
    assert 1 in host and 3 in host and 2 not in host


def test_blocks_move_down_to_disk_and_load_back_exactly(tmp_path):
    events = []
    tiers = OffloadTiers(OffloadConfig(host_gib=2 * 256 / (1 << 30), disk_dir=str(tmp_path), disk_gib=0.001),
                         SHAPE, torch.bfloat16, "layout-a", on_event=events.append)
    assert tiers.host.capacity_blocks == 2
    for h in (10, 11, 12, 13):
        tiers.offload(h, _block(h))
    tiers.disk.flush()
    assert [tiers.tier_of(h) for h in (10, 11, 12, 13)] == ["disk", "disk", "host", "host"]
    assert tiers.match([10, 11, 12, 13, 99, 10]) == 4
    for h in (10, 11, 12, 13):
        out = torch.zeros(SHAPE, dtype=torch.bfloat16)
        assert tiers.load(h, out) and torch.equal(out, _block(h)), h
    assert ("removed", "host", [10]) in [(e.kind, e.tier, e.block_hashes) for e in events]
    assert sum(1 for e in events if e.kind == "stored" and e.tier == "disk") == 2
    tiers.close()


def test_disk_faults_are_misses_never_wrong_kv(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, SHAPE, torch.bfloat16, "layout-a")
    for h in (1, 2, 3, 4):
        disk.store(h, _block(h))
    assert disk.flush()
    disk.path_of(1).unlink()  # deleted
    data = bytearray(disk.path_of(2).read_bytes())
    data[-1] ^= 0x40  # one bit of the payload
    disk.path_of(2).write_bytes(bytes(data))
    disk.path_of(3).write_bytes(disk.path_of(3).read_bytes()[:40])  # truncated
    assert disk.load(1) is None and disk.load(2) is None and disk.load(3) is None
    assert torch.equal(disk.load(4), _block(4))
    assert 1 not in disk and 2 not in disk and 3 not in disk and disk.num_failed_reads == 3
    disk.close()


def test_a_restarted_worker_finds_its_blocks_and_no_other_layouts(tmp_path):
    first = DiskTier(tmp_path, 1 << 20, SHAPE, torch.bfloat16, "layout-a")
    first.store(-5, _block(5))
    first.close()
    again = DiskTier(tmp_path, 1 << 20, SHAPE, torch.bfloat16, "layout-a")
    assert -5 in again and torch.equal(again.load(-5), _block(5))
    other = DiskTier(tmp_path, 1 << 20, SHAPE, torch.bfloat16, "layout-b")
    assert -5 not in other


def test_disk_capacity_drops_oldest_files(tmp_path):
    block_bytes = _block(0).numel() * 2
    disk = DiskTier(tmp_path, 3 * (block_bytes + 32), SHAPE, torch.bfloat16, "layout-a")
    removed = []
    disk.on_evicted = removed.extend
    for h in range(5):
        disk.store(h, _block(h))
        disk.flush()
    assert disk.hashes() == [2, 3, 4] and removed == [0, 1]
    assert sorted(p.name for p in disk.directory.iterdir()) == sorted(disk.path_of(h).name for h in (2, 3, 4))


def test_clear_forgets_every_block_of_every_tier_and_says_so(tmp_path, monkeypatch):
    """A prefix-cache reset (LLMEngine.reset_prefix_cache) empties host memory and disk, each block told removed in
    its tier, the tiers' accounting whole (audit.py); a disk write under way when the index empties lands no file (a
    restarted worker would find it again), and writes still queued are skipped."""
    import time

    from pdcluster.engine.kv_offload.audit import audit_tiers

    events = []
    tiers = OffloadTiers(OffloadConfig(host_gib=2 * 256 / (1 << 30), disk_dir=str(tmp_path), disk_gib=0.001),
                         SHAPE, torch.bfloat16, "layout-a", on_event=events.append)
    disk = tiers.disk
    for h in (10, 11, 12):  # 10 moves on to disk
        tiers.offload(h, _block(h))
    assert disk.flush()
    write = disk._write
    monkeypatch.setattr(disk, "_write", lambda *a: (time.sleep(0.2), write(*a)))  # slow: writes queue up
    for h in (13, 14, 15):  # 11, 12, 13 move on to disk, not yet written
        tiers.offload(h, _block(h))
    time.sleep(0.05)  # the writer is inside the first of them
    held = tiers.held_hashes()
    assert held == {"host": [14, 15], "disk": [10, 11, 12, 13]}
    events.clear()
    tiers.clear()
    assert {(e.kind, e.tier): sorted(e.block_hashes) for e in events} == {("removed", "host"): [14, 15],
                                                                           ("removed", "disk"): [10, 11, 12, 13]}
    assert tiers.held_hashes() == {"host": [], "disk": []} and tiers.match([10, 14]) == 0
    assert not tiers.load(14, torch.empty(SHAPE, dtype=torch.bfloat16))
    assert not list(disk.directory.iterdir()), "a block file outlived the clear"
    report = audit_tiers(tiers)
    assert report["problems"] == [] and report["tiers"]["host"]["free_slots"] == 2
    # The tiers serve on: a block stored after the clear is kept and loads back.
    tiers.offload(16, _block(16))
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    assert tiers.load(16, out) and torch.equal(out, _block(16))
    tiers.close()
    restarted = DiskTier(tmp_path, 0.001 * (1 << 30), SHAPE, torch.bfloat16, "layout-a")
    assert restarted.hashes() == [], "a restarted worker found blocks written before the clear"
    restarted.close()


def test_bad_configurations_name_the_flag():
    import pytest

    with pytest.raises(ValueError, match="kv_offload_disk_gib"):
        OffloadConfig(disk_dir="/tmp/x").validate()
    with pytest.raises(ValueError, match="kv_offload_disk_dir"):
        OffloadConfig(disk_gib=1).validate()
    with pytest.raises(ValueError, match="kv_offload_host_gib"):
        OffloadConfig(host_gib=-1).validate()


def test_evicted_device_blocks_come_back_through_the_loader(tmp_path):
    """The block manager's eviction hook copies a cached block out before its next owner writes it; the
    loader thread copies it into fresh blocks; a corrupt disk file ends the loaded prefix there."""
    from pdcluster.engine.block_manager import BlockManager
    from pdcluster.engine.kv_offload.manager import LoadJob, OffloadManager
    from pdcluster.engine.request import Request
    from pdcluster.engine.sampling_params import SamplingParams

    num_blocks, block_size = 4, 4
    kv_cache = torch.randn((2, 2, num_blocks, block_size, 1, 8)).to(torch.bfloat16)
    block_bytes = 2 * 2 * block_size * 8 * 2
    manager = OffloadManager(OffloadConfig(host_gib=2 * block_bytes / (1 << 30), disk_dir=str(tmp_path), disk_gib=0.001),
                             kv_cache, "layout-a")
    events = []
    bm = BlockManager(num_blocks, block_size, on_evict=manager.on_evict, on_event=lambda k, hs: events.append((k, hs)))
    first = Request("a", list(range(16)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(first, 16)
    first.num_computed_tokens = 16
    bm.cache_full_blocks(first)
    hashes = list(bm._req_hashes["a"])
    original = {h: kv_cache[:, :, b].clone() for h, b in zip(hashes, first.block_ids)}
    assert events == [("stored", hashes)]
    bm.free(first)
    other = Request("b", list(range(100, 116)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(other, 16)  # takes every block: all four cached ones are evicted
    kv_cache[:, :, other.block_ids] = 0  # the new owner writes its KV
    manager.tiers.disk.flush()
    # The tail is freed (and so evicted) first: the prefix stays in the faster tier.
    assert [manager.tiers.tier_of(h) for h in hashes] == ["host", "host", "disk", "disk"]
    assert manager.match(hashes) == 4
    bm.free(other)
    again = Request("c", list(range(16)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(again, 16)
    manager.start_load(LoadJob("c", hashes, list(again.block_ids)))
    (job,) = manager.wait_all()
    assert job.num_loaded == 4
    for h, b in zip(hashes, again.block_ids):
        assert torch.equal(kv_cache[:, :, b], original[h])
    # A corrupt third block: the first two arrive, the rest is recomputed.
    path = manager.tiers.disk.path_of(hashes[2])
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    manager.start_load(LoadJob("d", hashes, list(again.block_ids)))
    (job,) = manager.wait_all()
    assert job.num_loaded == 2 and manager.tiers.tier_of(hashes[2]) is None
    manager.close()


def test_a_failed_disk_write_is_announced_removed_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The disk filling up mid-write: the block is lost (a cache), its temporary file removed, and the
    "stored" event it got when queued is followed by "removed" (the router's index must not keep it); a
    write the full queue drops is never announced at all."""
    import pdcluster.engine.kv_offload.disk_tier as disk_module

    events = []
    tiers = OffloadTiers(OffloadConfig(0.0, str(tmp_path), 0.01), SHAPE, torch.bfloat16, "ns",
                         on_event=lambda e: events.append((e.kind, e.tier, list(e.block_hashes))))

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_module.os, "replace", disk_full)
    tiers.offload(7, _block(1))
    assert tiers.disk.flush()
    assert events == [("stored", "disk", [7]), ("removed", "disk", [7])]
    assert 7 not in tiers.disk and not list(tiers.disk.directory.glob("*.tmp"))
    monkeypatch.undo()
    events.clear()
    tiers.disk.store = lambda block_hash, block_kv, copied=None: False  # the write queue is full
    tiers.offload(8, _block(2))
    assert events == []
    tiers.close()


def test_the_eviction_hook_says_whether_the_new_owner_writes_outside_the_steps():
    """A block taken by a step's allocation and one taken for a load or a transfer (out of stream) are told apart:
    the offload manager copies the second kind out on its own stream (see the gpu test below)."""
    from pdcluster.engine.block_manager import BlockManager
    from pdcluster.engine.request import Request
    from pdcluster.engine.sampling_params import SamplingParams

    evicted = []
    bm = BlockManager(1, 4, on_evict=lambda block_id, block_hash, out_of_stream: evicted.append(out_of_stream))
    for name, take in (("a", lambda r: bm.allocate_slots(r, 4)), ("b", lambda r: bm.reserve(r, 4)),
                       ("c", lambda r: bm.allocate_slots(r, 4, out_of_stream=True)), ("d", None)):
        request = Request(name, list(range(4)), SamplingParams(max_tokens=1))
        if take is None:
            assert bm.allocate_slots(request, 4)
            break
        assert take(request)
        request.num_computed_tokens = 4
        bm.cache_full_blocks(request)
        bm.free(request)
    assert evicted == [True, True, False]  # b's, c's and d's allocations each evicted the one cached block


def _sleep_compute_stream() -> None:
    """A step still running on the compute stream: a kernel that spins ~0.2 s (4e8 cycles at ~2 GHz)."""
    torch.cuda._sleep(400_000_000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("writer", ["loader", "transfer"])
def test_a_block_taken_for_an_out_of_stream_writer_keeps_its_old_kv_in_the_host_tier(writer):
    """With a step still queued on the compute stream, a cached block taken for the loader (or reserved for a KV
    transfer, whose landing writes on a stream of its own) is copied out before that writer's bytes land: the
    host tier keeps the block's old KV under its hash. Queued behind the step, the copy would read the new bytes."""
    from pdcluster.engine.block_manager import BlockManager
    from pdcluster.engine.kv_offload.manager import LoadJob, OffloadManager
    from pdcluster.engine.request import Request
    from pdcluster.engine.sampling_params import SamplingParams

    kv_cache = torch.randn((2, 2, 1, 4, 1, 8), device="cuda").to(torch.bfloat16)
    manager = OffloadManager(OffloadConfig(host_gib=4 * 2 * 2 * 4 * 8 * 2 / (1 << 30)), kv_cache, "ns")
    bm = BlockManager(1, 4, on_evict=manager.on_evict)
    first = Request("a", list(range(4)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(first, 4)
    first.num_computed_tokens = 4
    bm.cache_full_blocks(first)
    (old_hash,) = bm._req_hashes["a"]
    old_kv = kv_cache[:, :, 0].clone()
    bm.free(first)
    new_kv = torch.full_like(old_kv, 7.0)
    manager.tiers.offload(12345, new_kv)  # what the loader will bring in
    torch.cuda.synchronize()
    _sleep_compute_stream()
    second = Request("b", list(range(100, 104)), SamplingParams(max_tokens=1))
    if writer == "loader":
        assert bm.allocate_slots(second, 4, out_of_stream=True)  # evicts a's block
        manager.start_load(LoadJob("b", [12345], list(second.block_ids)))
        (job,) = manager.wait_all()
        assert job.num_loaded == 1
    else:
        assert bm.reserve(second, 4)
        manager.settle_evictions()
        landing = torch.cuda.Stream()
        with torch.cuda.stream(landing):
            kv_cache[:, :, second.block_ids[0]] = new_kv
        landing.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(kv_cache[:, :, second.block_ids[0]], new_kv)
    back = torch.empty_like(old_kv)
    assert manager.tiers.load(old_hash, back)
    torch.cuda.synchronize()
    assert torch.equal(back, old_kv)
    manager.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_host_tier_pins_exactly_its_size_and_copies_both_ways():
    """A GPU's host tier is pinned at its own size (torch's pinned allocator would round 96 MiB up to 128), takes
    non-blocking copies in and out, and lets its pinning go when closed."""
    block_shape = (2, 2, 16, 8, 128)  # 64 KiB a block in bf16
    capacity = 96 * 1024 * 1024 // (2 * 2 * 16 * 8 * 128 * 2)
    def pinned_by_torch() -> int:  # torch's pinned allocator's bytes (its stats are newer than some torch builds)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        return stats().get("allocated_bytes.current", 0) if stats is not None else 0

    before = pinned_by_torch()
    host = HostTier(capacity, block_shape, torch.bfloat16, pin_memory=True)
    assert host.data.is_pinned()
    assert pinned_by_torch() - before < 1 << 20  # not torch's allocator: no 128 MiB block
    block = torch.randn(block_shape, device="cuda").to(torch.bfloat16)
    host.store(7, block)
    out = torch.empty_like(block)
    assert host.load(7, out) and torch.equal(out, block)
    host.close()
    assert not host.data.is_pinned()
