"""The disk tier: one file per block in a local directory, written by a background thread.

A file is a 32-byte header (magic, block hash, payload size, CRC-32 of the payload) and the block's KV
bytes. Reads check all four, so a file that was deleted, truncated or corrupted under load is a miss
and the tokens are recomputed, never wrong KV. Writes go to a temporary name and are renamed into
place, so a reader never sees half a file. The directory is namespaced by the KV layout (model, dtype,
block shape): another model's files are never read as ours, and a restarted worker finds its blocks."""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

MAGIC = b"PDKVBLK1"
HEADER = struct.Struct("<8sqQI4x")  # magic, block hash, payload bytes, crc32, pad to 32
SUFFIX = ".kvb"
WRITE_QUEUE_BLOCKS = 256  # a slow disk drops blocks past this (it is a cache) instead of growing memory


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 namespace: str) -> None:
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.bytes_per_block = int(torch.Size(block_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self.capacity_blocks = max(0, capacity_bytes // (self.bytes_per_block + HEADER.size))
        if self.capacity_blocks == 0:
            raise ValueError(f"disk tier capacity {capacity_bytes} bytes holds no block of {self.bytes_per_block} bytes")
        self.directory = Path(directory) / namespace
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: OrderedDict[int, None] = OrderedDict()  # block hashes on disk, least recently used first
        self._pending: dict[int, torch.Tensor] = {}  # queued for writing: readable from memory meanwhile
        self._copied: dict[int, torch.cuda.Event] = {}  # of those, copies from a GPU still queued
        self.on_evicted: Callable[[list[int]], None] = lambda block_hashes: None  # called from the writer thread
        self.num_dropped_writes = 0
        self.num_failed_reads = 0
        self._recover_index()
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- questions ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._files) + len(self._pending)

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._files or block_hash in self._pending

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._files) + list(self._pending)

    def path_of(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"

    # ---- actions ------------------------------------------------------------------------------
    def store(self, block_hash: int, block_kv: torch.Tensor, copied: "torch.cuda.Event | None" = None) -> bool:
        """Queue one block (a CPU tensor this tier now owns) for writing; returns at once, True when this
        tier now holds it (False: held already, or the write queue is full and the block is dropped).
        ``copied``: a CUDA event recorded after a still-queued copy into ``block_kv`` (readers wait for it)."""
        with self._lock:
            if block_hash in self._files or block_hash in self._pending:
                return False
            self._pending[block_hash] = block_kv
            if copied is not None:
                self._copied[block_hash] = copied
        try:
            self._queue.put_nowait(block_hash)
        except queue.Full:
            with self._lock:
                self._pending.pop(block_hash, None)
                self._copied.pop(block_hash, None)
            self.num_dropped_writes += 1
            return False
        return True

    def load(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV, or None when it is not here or its file does not read back intact."""
        with self._lock:
            pending = self._pending.get(block_hash)
            copied = self._copied.get(block_hash)
            if pending is None:
                if block_hash not in self._files:
                    return None
                self._files.move_to_end(block_hash)
        if pending is not None:
            if copied is not None:
                copied.synchronize()
            return pending
        payload = self._read(block_hash)
        if payload is None:
            self.num_failed_reads += 1
            self.drop(block_hash)
            return None
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.block_shape)

    def drop(self, block_hash: int) -> None:
        with self._lock:
            self._files.pop(block_hash, None)
            self._pending.pop(block_hash, None)
            self._copied.pop(block_hash, None)
        self.path_of(block_hash).unlink(missing_ok=True)

    def clear(self) -> list[int]:
        """Forget every block and delete its file (a prefix-cache reset); returns their hashes. Writes still queued
        are skipped by the writer (their block left ``_pending``); the one it may be writing now lands its file
        after the index was emptied, so the folder is emptied only once the writer is past it (``flush``): a file
        left behind would be found again by a restarted worker (``_recover_index``). Call it from the thread that
        stores (the engine's): nothing may be stored meanwhile."""
        with self._lock:
            block_hashes = list(self._files) + list(self._pending)
            self._files.clear()
            self._pending.clear()
            self._copied.clear()
        if not self.flush():
            log.warning("disk tier: the writer did not catch up within its timeout while clearing %s; a block it "
                        "writes later may stay on disk", self.directory)
        for path in self.directory.glob(f"*{SUFFIX}"):
            path.unlink(missing_ok=True)
        return block_hashes

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write has landed (tests, shutdown). True when it did in time."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=30)

    # ---- the writer thread --------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            with self._lock:
                block_kv = self._pending.get(item)
                copied = self._copied.pop(item, None)
            if block_kv is None:
                continue  # dropped while queued
            if copied is not None:
                copied.synchronize()  # the copy from the GPU was queued, not waited for, on eviction
            try:
                self._write(item, block_kv)
            except OSError as e:  # a full or failing disk loses a cached block, nothing else
                log.warning("disk tier: writing block %016x failed: %s", item & 0xFFFFFFFFFFFFFFFF, e)
                with self._lock:
                    self._pending.pop(item, None)
                self._tmp_path(self.path_of(item)).unlink(missing_ok=True)
                self.on_evicted([item])  # announced as stored when queued: the router forgets it
                continue
            with self._lock:
                if self._pending.pop(item, None) is not None:
                    self._files[item] = None
            evicted = self._evict_past_capacity()
            if evicted:
                self.on_evicted(evicted)

    def _evict_past_capacity(self) -> list[int]:
        """After a write (the writer thread): the least recently used blocks past the capacity, deleted."""
        evicted = []
        with self._lock:
            while len(self._files) > self.capacity_blocks:
                evicted.append(self._files.popitem(last=False)[0])
        for block_hash in evicted:
            self.path_of(block_hash).unlink(missing_ok=True)
        return evicted

    def _write(self, block_hash: int, block_kv: torch.Tensor) -> None:
        payload = block_kv.contiguous().view(torch.uint8).numpy().tobytes()
        header = HEADER.pack(MAGIC, block_hash, len(payload), zlib.crc32(payload))
        path = self.path_of(block_hash)
        tmp = self._tmp_path(path)
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)

    @staticmethod
    def _tmp_path(path: Path) -> Path:
        """Where a block is written before it is renamed into place: this process's own name (two writers of one
        folder, the shared tier's, never write into each other's file)."""
        return path.with_name(f"{path.stem}.{os.getpid()}.tmp")

    def _read(self, block_hash: int) -> bytes | None:
        try:
            data = self.path_of(block_hash).read_bytes()
        except OSError:
            return None
        if len(data) < HEADER.size:
            return None
        magic, stored_hash, size, crc = HEADER.unpack_from(data)
        payload = data[HEADER.size:]
        if magic != MAGIC or stored_hash != block_hash or size != self.bytes_per_block or len(payload) != size:
            return None
        if zlib.crc32(payload) != crc:
            return None
        return payload

    # A temporary file older than this is a dead writer's (the shared tier's folder has live writers beside ours).
    STALE_TMP_AGE_S = 0.0

    def _recover_index(self) -> None:
        """Files left by an earlier run of the same layout count as stored (checked when read)."""
        files = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                files.append((path.stat().st_mtime, path))
            except OSError:  # deleted meanwhile (another worker of a shared folder)
                continue
        for _, path in sorted(files):
            try:
                self._files[block_hash_of(path.name)] = None
            except ValueError:
                continue
        now = time.time()
        for stale in self.directory.glob("*.tmp"):
            try:
                if now - stale.stat().st_mtime >= self.STALE_TMP_AGE_S:
                    stale.unlink(missing_ok=True)
            except OSError:
                continue


def block_hash_of(file_name: str) -> int:
    """The block hash a block file's name spells (``DiskTier.path_of``'s inverse); ValueError for another name."""
    return int.from_bytes(bytes.fromhex(file_name.removesuffix(SUFFIX)), "big", signed=True)
