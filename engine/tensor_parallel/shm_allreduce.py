"""The CPU ranks' all-reduce through shared memory (vLLM's CPU tensor parallelism does the same): one file in /dev/shm
mapped by every rank, a slot per rank for its partial sums and a pair of sequence numbers per rank to say when its
slot is written and when it has read everyone's.

gloo over loopback TCP took 1.5-1.9 ms for one all-reduce of a decode step's hidden states on this 2-core box
(bench/results/tensor_parallel_cpu_s65.json), and a Llama step needs two a layer; here a rank copies its part in,
waits for the others' flags, and adds the slots up itself. The sum runs in float32 in rank order on every rank, so
every rank gets the same bits and the result does not depend on the batch (deterministic mode holds for any size).

Waiting spins on the flags, yielding the core each turn (ranks may share cores); a peer gone quiet for
COLLECTIVE_TIMEOUT, or gone (``check_peers``, asked every CHECK_EVERY_S), fails the call instead of hanging."""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

FLAG_STRIDE = 16  # int64s a rank's flags take: its own 128-byte line, no false sharing between writers
SLOT_BYTES = 8 << 20  # a rank's slot; larger tensors go through in slot-sized chunks
CHECK_EVERY_S = 0.5
SHM_DIR = "/dev/shm"


def segment_bytes(world_size: int) -> int:
    return world_size * FLAG_STRIDE * 8 + world_size * SLOT_BYTES


def create_segment(world_size: int) -> str:
    """Rank 0 makes the file (zeroed: every flag at 0) and returns its path for the others."""
    directory = SHM_DIR if os.path.isdir(SHM_DIR) else None
    fd, path = tempfile.mkstemp(prefix="pdcluster-tp-", dir=directory)
    try:
        os.ftruncate(fd, segment_bytes(world_size))
    finally:
        os.close(fd)
    return path


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world_size: int, timeout_s: float,
                 check_peers: Callable[[], None] | None = None) -> None:
        """Maps ``path`` (create_segment's). ``check_peers`` raises when a peer is known gone."""
        self.rank, self.world_size, self.timeout_s, self.check_peers = rank, world_size, timeout_s, check_peers
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), segment_bytes(world_size))
        flags_len = world_size * FLAG_STRIDE
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=flags_len).reshape(world_size, FLAG_STRIDE)
        self._written = self._flags[:, 0]  # views: a rank's column entries, re-read from memory on every access
        self._done = self._flags[:, 1]
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=flags_len * 8)
        self._slots = [data[r * SLOT_BYTES : (r + 1) * SLOT_BYTES] for r in range(world_size)]
        self._seq = 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (contiguous, on the host) summed over the ranks in place."""
        flat = x.view(-1)
        per_chunk = SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start : start + per_chunk])
        return x

    def _reduce_chunk(self, chunk: torch.Tensor) -> None:
        self._seq += 1
        seq, n, dtype = self._seq, chunk.numel(), chunk.dtype
        self._wait(self._done, seq - 1)  # everyone has read the last round's slots: this one may be overwritten
        self._slots[self.rank].view(dtype)[:n].copy_(chunk)
        self._written[self.rank] = seq  # after the copy (x86 keeps stores in order; a peer sees data, then flag)
        self._wait(self._written, seq)
        total = self._slots[0].view(dtype)[:n].to(torch.float32, copy=True)  # never an alias of a shared slot
        for r in range(1, self.world_size):
            total += self._slots[r].view(dtype)[:n]
        chunk.copy_(total)
        self._done[self.rank] = seq

    def _wait(self, flags: np.ndarray, seq: int) -> None:
        if flags.min() >= seq:
            return
        start = last_check = time.monotonic()
        while flags.min() < seq:
            os.sched_yield()
            now = time.monotonic()
            if now - last_check > CHECK_EVERY_S:
                last_check = now
                if self.check_peers is not None:
                    self.check_peers()
                if now - start > self.timeout_s:
                    behind = [r for r in range(self.world_size) if flags[r] < seq]
                    raise RuntimeError(f"ranks {behind} did not reach all-reduce {seq} in {self.timeout_s:.0f} s")


def remove_segment(path: str) -> None:
    """Once every rank has mapped it the file's name is not needed: the mappings keep the memory."""
    Path(path).unlink(missing_ok=True)
