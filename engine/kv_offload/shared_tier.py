"""The shared tier: one folder of block files that every worker of a cluster reads and writes (a node's disk for
the workers on it, or an NFS export / a volume every pod mounts), so a prefix any worker computed and evicted is a hit
for all of them, and a worker that starts (a restart, a scale-up) starts warm. vLLM's offloading keeps a worker's KV
to itself; this is what LMCache's shared storage and SGLang's HiCache file backend give their servers.

It is the disk tier (disk_tier.py: a file a block, a header with the block's hash and CRC, written under a temporary
name and renamed into place, read back checked) with three differences, because other processes write and delete
the same files:

- what it holds is the folder, not an index: a block another worker wrote is found by its file (``__contains__``
  looks the file up where its own index does not know it) and read like one of its own;
- blocks are content-addressed (the chained hash, rooted in the weight version, the adapter, the cache salt), and the
  folder is named by the KV layout as the disk tier's is, so whoever wrote a file, it holds the KV those tokens have
  under this model; a worker never writes a block whose file is there already;
- the size is the folder's, for every worker together: each worker, after every ``SWEEP_EVERY_WRITES`` of its writes,
  lists the folder and deletes the least recently used files (by modification time, which a read refreshes) past the
  capacity. Two workers sweeping at once may delete a few more than needed; a file deleted while another worker
  reads it is a miss there (the CRC or the missing file), and those tokens are recomputed, never wrong.

Where it sits: below the worker's own tiers. A block the device pool evicts goes to the host (or disk) tier as
before and, when the shared folder lacks it, to the shared folder too (write-through), so the local tiers keep their
speed and the folder gets every evicted prefix. The router counts a block in the shared folder as held by every
worker (cluster/router/kv_index.py), at a read's worth.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from pdcluster.engine.kv_offload.disk_tier import SUFFIX, DiskTier, block_hash_of

log = logging.getLogger(__name__)

SWEEP_EVERY_WRITES = 64  # a worker's writes between two looks at the folder's size (fewer when the capacity is small)
COUNT_EVERY_S = 2.0  # how stale the folder's block count (for /metrics) may be


class SharedDiskTier(DiskTier):
    name = "shared"
    STALE_TMP_AGE_S = 600.0  # another worker's write in progress is not a leftover

    def __init__(self, directory: str | Path, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 namespace: str) -> None:
        super().__init__(directory, capacity_bytes, block_shape, dtype, namespace)
        self.sweep_every_writes = max(1, min(SWEEP_EVERY_WRITES, self.capacity_blocks // 8))
        self._writes_since_sweep = 0
        self._sweep_lock = threading.Lock()
        self._folder_blocks = len(self._files)  # the folder's files at the last listing, plus this worker's writes
        self._counted_at = time.monotonic()
        self.num_swept = 0  # files this worker deleted to keep the folder within its size

    @property
    def num_blocks(self) -> int:
        """The folder's blocks (every worker's): counted again when the last count is ``COUNT_EVERY_S`` old (the
        metrics ask often), else that count plus this worker's writes since."""
        now = time.monotonic()
        if now - self._counted_at >= COUNT_EVERY_S:
            self._counted_at = now
            try:
                with os.scandir(self.directory) as it:
                    self._folder_blocks = sum(1 for entry in it if entry.name.endswith(SUFFIX))
            except OSError:
                pass
        return self._folder_blocks + len(self._pending)

    def __contains__(self, block_hash: int) -> bool:
        """The block's file is there (whoever wrote it), or this worker's write of it is queued. The file, not the
        index, is the truth: another worker may have written or deleted it since; the index follows what is seen."""
        with self._lock:
            if block_hash in self._pending:
                return True
        there = self.path_of(block_hash).is_file()
        with self._lock:
            if there:
                self._files[block_hash] = None
            else:
                self._files.pop(block_hash, None)
        return there

    def load(self, block_hash: int) -> torch.Tensor | None:
        if block_hash not in self:  # (learns another worker's block from its file)
            return None
        with self._lock:
            from_memory = block_hash in self._pending
        block_kv = super().load(block_hash)
        if block_kv is not None and not from_memory:
            try:  # a read is a use: the least recently used files go first, whichever worker reads them
                os.utime(self.path_of(block_hash))
            except OSError:
                pass
        return block_kv

    def store(self, block_hash: int, block_kv: torch.Tensor, copied: "torch.cuda.Event | None" = None) -> bool:
        if block_hash in self:  # another worker wrote it (or this one, before a restart): nothing to write
            return False
        return super().store(block_hash, block_kv, copied)

    def _evict_past_capacity(self) -> list[int]:
        # The folder is every worker's: its size is kept by looking at it, every few of this worker's writes.
        self._folder_blocks += 1
        self._writes_since_sweep += 1
        if self._writes_since_sweep < self.sweep_every_writes:
            return []
        self._writes_since_sweep = 0
        return self.sweep()

    def sweep(self) -> list[int]:
        """List the folder: delete the least recently used files past the capacity, and forget the blocks this
        worker knew whose files another deleted. Returns the hashes gone (announced removed: for every worker)."""
        with self._sweep_lock:
            listed: dict[int, int] = {}  # block hash -> mtime
            try:
                with os.scandir(self.directory) as it:
                    for entry in it:
                        if not entry.name.endswith(SUFFIX):
                            continue
                        try:
                            listed[block_hash_of(entry.name)] = entry.stat().st_mtime_ns
                        except (OSError, ValueError):  # deleted meanwhile, or not a block file's name
                            continue
            except OSError as e:
                log.warning("shared KV tier: cannot list %s: %s", self.directory, e)
                return []
            excess = len(listed) - self.capacity_blocks
            deleted = []
            for block_hash in sorted(listed, key=listed.__getitem__)[:max(0, excess)]:
                try:
                    os.unlink(self.path_of(block_hash))
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                deleted.append(block_hash)
                del listed[block_hash]
            with self._lock:
                gone = [h for h in self._files if h not in listed and h not in self._pending]
                for block_hash in gone:
                    del self._files[block_hash]
            self._folder_blocks = len(listed)
            self.num_swept += len(deleted)
        return sorted(set(gone) | set(deleted))

