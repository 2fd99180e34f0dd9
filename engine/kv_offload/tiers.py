"""The tiers below the device pool, as one store: host memory, then disk, then the folder every worker shares.

``offload`` takes a block the device pool is about to reuse (its KV still in place) and keeps it in the
highest tier with room; a block pushed out of the host tier moves on to disk. The shared tier (shared_tier.py) is
written through (``write_through``): a block is written there as it enters the prefix cache (OffloadManager.on_cached)
and, where the folder has lost it since, again as it is evicted, whatever the worker's own tiers keep. ``match`` answers how many of a prompt's next blocks some tier holds, ``load`` copies one back (the worker's
own tiers first). Every change is reported to ``on_event`` (stored / removed, with the tier), which feeds the
router's global index (KV events)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdcluster.engine.kv_offload.config import GIB, OffloadConfig
from pdcluster.engine.kv_offload.disk_tier import DiskTier
from pdcluster.engine.kv_offload.host_tier import HostTier
from pdcluster.engine.kv_offload.shared_tier import SharedDiskTier



@dataclass
class TierCounters:
    stored: int = 0
    hits: int = 0
    failed_loads: int = 0


@dataclass
class OffloadEvent:
    kind: str  # "stored" | "removed"
    tier: str  # "host" | "disk" | "shared"
    block_hashes: list[int] = field(default_factory=list)


class OffloadTiers:
    def __init__(self, config: OffloadConfig, block_shape: tuple[int, ...], dtype: torch.dtype, namespace: str,
                 pin_memory: bool = False, on_event: Callable[[OffloadEvent], None] | None = None) -> None:
        config.validate()
        self.on_event = on_event or (lambda event: None)
        bytes_per_block = int(torch.Size(block_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        host_blocks = int(config.host_gib * GIB) // bytes_per_block
        if config.host_gib > 0 and host_blocks == 0:
            raise ValueError(f"kv_offload_host_gib {config.host_gib} holds no block of {bytes_per_block} bytes")
        self.host = HostTier(host_blocks, block_shape, dtype, pin_memory) if host_blocks else None
        self.disk = (DiskTier(config.disk_dir, int(config.disk_gib * GIB), block_shape, dtype, namespace)
                     if config.disk_dir else None)
        if self.disk is not None:
            self.disk.on_evicted = lambda hashes: self.on_event(OffloadEvent("removed", "disk", hashes))
        self.shared = (SharedDiskTier(config.shared_dir, int(config.shared_gib * GIB), block_shape, dtype, namespace)
                       if config.shared_dir else None)
        if self.shared is not None:
            self.shared.on_evicted = lambda hashes: self.on_event(OffloadEvent("removed", "shared", hashes))
        # The engine thread offloads and matches while the loader thread loads: one lock over the
        # tiers' indexes and the host tier's slots (a slot must not be reused while it is read).
        self._lock = threading.RLock()
        self.counters = {tier.name: TierCounters() for tier in self.tiers}

    @property
    def tiers(self) -> list:
        return [t for t in (self.host, self.disk, self.shared) if t is not None]

    def tier_of(self, block_hash: int) -> str | None:
        with self._lock:
            return self._tier_of(block_hash)

    def _tier_of(self, block_hash: int) -> str | None:
        for tier in self.tiers:
            if block_hash in tier:
                return tier.name
        return None

    def match(self, block_hashes: list[int]) -> int:
        """How many of ``block_hashes`` (a prompt's next blocks, in order) some tier holds, from the first."""
        n = 0
        for h in block_hashes:
            if self.tier_of(h) is None:
                break
            n += 1
        return n

    def offload(self, block_hash: int, block_kv: torch.Tensor) -> None:
        """Keep a block the device pool evicts. ``block_kv`` is read before this returns."""
        with self._lock:
            self._offload(block_hash, block_kv)

    def write_through(self, block_hash: int, block_kv: torch.Tensor) -> None:
        """A block into the shared folder unless it is there (for every worker). ``block_kv`` is read (copied)
        before this returns."""
        if self.shared is not None and block_hash not in self.shared:
            if self.shared.store(block_hash, *_host_copy(block_kv)):
                self._stored("shared", block_hash)

    def _offload(self, block_hash: int, block_kv: torch.Tensor) -> None:
        self.write_through(block_hash, block_kv)  # a block cached before the folder lost it (its sweep) goes back
        if any(block_hash in tier for tier in (self.host, self.disk) if tier is not None):
            return
        if self.host is not None:
            evicted = self.host.store(block_hash, block_kv)
            self._stored("host", block_hash)
            if evicted is not None:
                self.on_event(OffloadEvent("removed", "host", [evicted[0]]))
                if self.disk is not None and self.disk.store(evicted[0], evicted[1]):
                    self._stored("disk", evicted[0])
        elif self.disk is not None:
            if self.disk.store(block_hash, *_host_copy(block_kv)):
                self._stored("disk", block_hash)

    def load(self, block_hash: int, out: torch.Tensor) -> bool:
        """Copy one block into ``out`` (a device block's view). False: no tier has it intact (recompute)."""
        with self._lock:
            if self.host is not None and self.host.load(block_hash, out):
                self.counters["host"].hits += 1
                return True
        for tier in (self.disk, self.shared):
            if tier is None or block_hash not in tier:
                continue
            block_kv = tier.load(block_hash)  # a file read: outside the lock, a disk tier has its own
            if block_kv is None:
                self.counters[tier.name].failed_loads += 1
                self.on_event(OffloadEvent("removed", tier.name, [block_hash]))
                continue  # the shared folder may still have it
            out.copy_(block_kv)
            self.counters[tier.name].hits += 1
            return True
        return False

    def clear(self) -> None:
        """Forget every block of every tier (a prefix-cache reset), each tier's blocks told removed, so the router's
        index drops them too. The counters (stored, hits) are totals over the tiers' life: they stay."""
        with self._lock:  # the loader reads host slots under it
            for tier in self.tiers:
                block_hashes = tier.clear()
                if block_hashes:
                    self.on_event(OffloadEvent("removed", tier.name, block_hashes))

    def held_hashes(self) -> dict[str, list[int]]:
        """Per tier, the hashes of the blocks it holds."""
        with self._lock:
            return {tier.name: tier.hashes() for tier in self.tiers}

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: blocks held and capacity (for /metrics)."""
        return {t.name: {"blocks": t.num_blocks, "capacity_blocks": t.capacity_blocks} for t in self.tiers}

    def close(self) -> None:
        for tier in (self.disk, self.shared):
            if tier is not None:
                tier.close()
        if self.host is not None:
            self.host.close()

    def _stored(self, tier: str, block_hash: int) -> None:
        self.counters[tier].stored += 1
        self.on_event(OffloadEvent("stored", tier, [block_hash]))


def _host_copy(block_kv: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """A copy of a block for a disk tier to own, and the CUDA event its writer waits for (None on a CPU): from a GPU
    the copy is queued into pinned memory, not waited for."""
    if not block_kv.is_cuda:
        return block_kv.clone(), None
    host_kv = torch.empty(block_kv.shape, dtype=block_kv.dtype, pin_memory=True)
    host_kv.copy_(block_kv, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host_kv, copied
