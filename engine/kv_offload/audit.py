"""An audit of the offload tiers: is every block accounted for exactly once? (the soak's "0 leaked blocks
in any tier", issue 27).

- host: every slot is used by exactly one indexed block or free, never both, and used + free = capacity
  (a slot in neither list is a leak: the tier shrinks for good);
- disk: the folder's block files are the index (plus blocks whose write is queued): a file nobody indexes
  is disk space leaked, an indexed block without a file is one deleted behind the tier's back (a miss
  when read: harmless, but not what the index says); no temporary file outside a write; never more
  blocks than the capacity.
``problems`` says, in words, each of these that does not hold. ``in_flight`` counts what is normal
under load and must be zero at rest: writes queued, load jobs, requests waiting for a load.

The disk writer unlinks an evicted block's file just after it leaves the index, and a failed read
unlinks the file just after dropping it: an audit landing in that instant sees an unindexed file, so
read a clean audit at rest (and read again before calling a problem a leak). The audit walks every
slot and file, so ``offload_audit`` (which engine_stats reports, and the local server publishes every
turn of its engine loop) reuses one for ``AUDIT_INTERVAL_S``; ``at_unix_s`` says when it was taken."""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import asdict

from pdcluster.engine.kv_offload.disk_tier import SUFFIX, DiskTier
from pdcluster.engine.kv_offload.host_tier import HostTier
from pdcluster.engine.kv_offload.tiers import OffloadTiers
from pdcluster.engine.request import RequestStatus

AUDIT_INTERVAL_S = 1.0
MAX_LISTED = 5  # hashes or slots quoted in one problem

_recent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # OffloadTiers -> its last audit
_recent_lock = threading.Lock()


def audit_tiers(tiers: OffloadTiers) -> dict:
    """Per tier, what it holds, and every inconsistency found (``problems``). Safe beside the loader and
    writer threads (it takes the tiers' locks)."""
    problems: list[str] = []
    report: dict = {"at_unix_s": time.time(), "tiers": {}, "problems": problems}
    if tiers.host is not None:
        with tiers._lock:  # the loader reads host slots under it (and moves them to the LRU end)
            report["tiers"]["host"] = _audit_host(tiers.host, problems)
    if tiers.disk is not None:
        report["tiers"]["disk"] = _audit_disk(tiers.disk, problems)
    return report


def offload_audit(engine, max_age_s: float = AUDIT_INTERVAL_S) -> dict:
    """An engine's tiers audited (at most ``max_age_s`` old), with the in-flight counts and the tiers'
    counters as they are now; {} without tiers. On the engine thread (it reads the scheduler)."""
    if engine.offload is None:
        return {}
    tiers = engine.offload.tiers
    now = time.time()
    with _recent_lock:
        report = _recent.get(tiers)
    if report is None or now - report["at_unix_s"] >= max_age_s:
        report = audit_tiers(tiers)
        with _recent_lock:
            _recent[tiers] = report
    sched = engine.scheduler
    counters = {name: asdict(c) for name, c in tiers.counters.items()}
    if tiers.disk is not None:
        counters["disk"].update(failed_reads=tiers.disk.num_failed_reads, dropped_writes=tiers.disk.num_dropped_writes)
    in_flight = {
        "pending_writes": len(tiers.disk._pending) if tiers.disk is not None else 0,
        "load_jobs": engine.offload.num_loading,
        "requests_loading": sched.offload.num_loading,
        "requests_waiting_for_offload": sum(r.status == RequestStatus.WAITING_FOR_OFFLOAD
                                            for r in sched.requests.values()),
    }
    return {**report, "in_flight": in_flight, "counters": counters}


def _audit_host(host: HostTier, problems: list[str]) -> dict:
    used, free = list(host._slot_of.values()), list(host._free_slots)
    cap = host.capacity_blocks
    used_set, free_set = set(used), set(free)
    if len(used_set) != len(used):
        problems.append(f"host: {len(used) - len(used_set)} slots hold two blocks at once")
    if len(free_set) != len(free):
        problems.append(f"host: {len(free) - len(free_set)} slots are on the free list twice")
    both = used_set & free_set
    if both:
        problems.append(f"host: slots both used and free: {sorted(both)[:MAX_LISTED]}")
    outside = sorted(s for s in used_set | free_set if not 0 <= s < cap)
    if outside:
        problems.append(f"host: slots outside 0..{cap - 1}: {outside[:MAX_LISTED]}")
    lost = set(range(cap)) - used_set - free_set
    if lost:
        problems.append(f"host: {len(lost)} of {cap} slots neither used nor free (leaked): {sorted(lost)[:MAX_LISTED]}")
    return {"blocks": len(used), "free_slots": len(free), "capacity_blocks": cap}


def _audit_disk(disk: DiskTier, problems: list[str]) -> dict:
    # Under the tier's lock: the writer cannot move a block from queued to indexed while the folder is read.
    with disk._lock:
        indexed, pending = list(disk._files), set(disk._pending)
        with os.scandir(disk.directory) as entries:
            names = [e.name for e in entries]
    block_files = {n for n in names if n.endswith(SUFFIX)}
    tmp_files = [n for n in names if n.endswith(".tmp")]
    expected = {disk.path_of(h).name: h for h in indexed}
    queued = {disk.path_of(h).name for h in pending}
    missing = [h for name, h in expected.items() if name not in block_files]
    orphans = sorted(block_files - expected.keys() - queued)
    if missing:
        problems.append(f"disk: {len(missing)} indexed blocks have no file: "
                        f"{[f'{h & 0xFFFFFFFFFFFFFFFF:016x}' for h in missing[:MAX_LISTED]]}")
    if orphans:
        problems.append(f"disk: {len(orphans)} block files nobody indexes (leaked): {orphans[:MAX_LISTED]}")
    if tmp_files and not pending:
        problems.append(f"disk: {len(tmp_files)} temporary files left with no write queued: {tmp_files[:MAX_LISTED]}")
    if len(indexed) > disk.capacity_blocks:
        problems.append(f"disk: {len(indexed)} blocks indexed, over the capacity of {disk.capacity_blocks}")
    return {"blocks": len(indexed), "files": len(block_files), "tmp_files": len(tmp_files),
            "pending_writes": len(pending), "capacity_blocks": disk.capacity_blocks}
