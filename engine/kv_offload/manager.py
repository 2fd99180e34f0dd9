"""The engine's side of the offload tiers: blocks leave the device pool into the tiers, and come back
into fresh device blocks on a loader thread while the engine keeps stepping.

``on_evict`` is the block manager's eviction hook: the block's KV is still in place (nobody writes a
free block), so it is copied out before the block is handed to its next owner. On a GPU the copy is
queued on the compute stream, which orders it before any later write to the block by a step, and the
engine thread does not wait for it: each tier records a CUDA event after the copy and its readers wait
for that (host_tier.py, and the disk tier's writer). A block whose next owner writes it *outside* the
steps' queue (a load on the loader's stream, a KV transfer's landing stream, a peer's CUDA IPC copy) is
copied out on a stream of its own instead: queued behind the step in flight, the copy would run after
that writer and keep the new bytes under the old hash. The block's KV is final when it is taken that
way (out-of-stream allocations skip blocks that steps in flight may still write, BlockManager's
fences), so the copy runs at once; the loader's stream waits for it on the device, and a transfer's
reservation waits for it on the host (``settle_evictions``) before its blocks are named to a sender.

``start_load`` hands a request's lower-tier blocks to the loader thread; ``poll`` returns the loads
that ended, each with how many of its blocks arrived intact *from the first*: a block that could not be
read (deleted or corrupt disk file) ends the prefix there, and the tokens from it on are recomputed."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from pdcluster.engine.kv_offload.block_columns import BlockColumns
from pdcluster.engine.kv_offload.config import OffloadConfig
from pdcluster.engine.kv_offload.tiers import OffloadEvent, OffloadTiers

log = logging.getLogger(__name__)


@dataclass
class LoadJob:
    request_id: str
    block_hashes: list[int]
    block_ids: list[int]  # device blocks reserved for them, same order
    num_loaded: int = 0  # blocks that arrived intact, from the first
    # Where the blocks come from instead of the tiers: another instance (kv_transfer/external/pull.py), which
    # answers the hashes it holds from ``first_block`` (the request's block index of the job's first block).
    source: object = None
    first_block: int = 0


class OffloadManager:
    def __init__(self, config: OffloadConfig, kv_cache: torch.Tensor | Sequence[torch.Tensor], namespace: str,
                 on_event=None) -> None:
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; or, for a model split over
        # tensor-parallel ranks, every rank's (rank 0's first): block_columns.py
        self.columns = BlockColumns([kv_cache] if isinstance(kv_cache, torch.Tensor) else kv_cache)
        self.on_gpu = self.columns.device.type == "cuda"
        self.tiers = OffloadTiers(config, self.columns.block_shape, self.columns.dtype, namespace,
                                  pin_memory=self.on_gpu, on_event=on_event)
        self._has_tiers = bool(self.tiers.tiers)
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._done_event = threading.Event()  # set when a load ends, cleared by poll
        self.num_loading = 0
        self._stream = torch.cuda.Stream(self.columns.device) if self.on_gpu else None
        self._evict_stream = torch.cuda.Stream(self.columns.device) if self.on_gpu else None
        self._thread = threading.Thread(target=self._load_loop, name="kv-offload-loader", daemon=True)
        self._thread.start()

    # ---- eviction (engine thread) -----------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: int, out_of_stream: bool = False) -> None:
        if not self._has_tiers:  # a loader for another instance's KV only (kv_transfer/external/): nothing to keep
            return
        apart = out_of_stream and self._evict_stream is not None
        with torch.cuda.stream(self._evict_stream) if apart else contextlib.nullcontext():
            self.tiers.offload(block_hash, self.columns.read(block_id))

    @property
    def writes_through(self) -> bool:
        """Blocks entering the prefix cache are written to the shared tier at once (on_cached)."""
        return self.tiers.shared is not None

    def on_cached(self, block_ids: list[int], block_hashes: list[int]) -> None:
        """Blocks just cached (their KV written by the steps before): into the shared folder, for every worker,
        where it lacks them. On a GPU the copies are queued on the compute stream, after the steps that wrote the
        blocks and before any later write of them; the folder's writer waits for them (its own thread)."""
        for block_id, block_hash in zip(block_ids, block_hashes):
            self.tiers.write_through(block_hash, self.columns.read(block_id))

    def settle_evictions(self) -> None:
        """Return once the copies out of blocks taken for writers outside the steps' queue have run (a few
        blocks on an idle stream: microseconds), so such a writer may be told the blocks."""
        if self._evict_stream is not None:
            self._evict_stream.synchronize()

    # ---- matching and loading ----------------------------------------------------------------
    def match(self, block_hashes: list[int]) -> int:
        return self.tiers.match(block_hashes)

    def start_load(self, job: LoadJob) -> None:
        assert len(job.block_hashes) == len(job.block_ids) > 0
        self.num_loading += 1
        self._jobs.put(job)

    def discard_source(self, source) -> None:
        """Tell another instance, off the engine thread, that the blocks it holds for us are not wanted."""
        self._jobs.put(source)

    def wait_done(self, timeout_s: float) -> None:
        """Return when a load ended since the last ``poll`` (at once if one did), or after ``timeout_s``."""
        self._done_event.wait(timeout_s)

    def poll(self) -> list[LoadJob]:
        self._done_event.clear()  # a load ending from here on sets it again (at worst a wait runs its timeout)
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.num_loading -= len(done)
        return done

    def wait_all(self, timeout_s: float = 30.0) -> list[LoadJob]:
        """Block until every started load ended (shutdown, tests)."""
        done = []
        try:
            while self.num_loading > len(done):
                done.append(self._done.get(timeout=timeout_s))
        except queue.Empty:
            pass
        self.num_loading -= len(done)
        return done

    def clear(self) -> None:
        """Forget every block the tiers hold (LLMEngine.reset_prefix_cache: no load is under way then)."""
        assert not self.num_loading, "the tiers are cleared only while nothing loads from them"
        self.tiers.clear()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
        self.tiers.close()

    # ---- the loader thread -----------------------------------------------------------------------
    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not isinstance(job, LoadJob):  # a source to release (discard_source)
                try:
                    job.release()
                except Exception:  # noqa: BLE001  the holder's deadline frees its blocks anyway
                    log.exception("KV offload: releasing a remote hold failed")
                continue
            try:
                self._load(job) if job.source is None else self._pull(job)
            except Exception:  # noqa: BLE001  a failed load is a miss: the request recomputes
                log.exception("KV offload: loading %d blocks for %s failed", len(job.block_ids), job.request_id)
            self._done.put(job)
            self._done_event.set()

    def _pull(self, job: LoadJob) -> None:
        """A job whose blocks another instance holds: one pull for all of them, then each written in place."""
        blocks_kv = job.source.fetch(job.first_block, job.block_hashes)  # [n, *column shape] on the host
        if not len(blocks_kv):
            return
        if self._stream is not None:
            self._stream.wait_stream(self._evict_stream)
        # One copy per cache for all the blocks: a copy per block would take the GIL twice a block from an engine
        # thread that steps meanwhile (at 2,048 tokens that cost seconds).
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            self.columns.write_many(job.block_ids[:len(blocks_kv)], blocks_kv)
        if self._stream is not None:
            self._stream.synchronize()
        job.num_loaded = len(blocks_kv)

    def _load(self, job: LoadJob) -> None:
        if self._stream is not None:
            # The job's blocks were copied out (evicted) when the engine thread took them, before it queued the
            # job: the writes below come after those copies.
            self._stream.wait_stream(self._evict_stream)
        for block_hash, block_id in zip(job.block_hashes, job.block_ids):
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                ok = self.columns.write(block_id, lambda column: self.tiers.load(block_hash, column))
            if self._stream is not None:
                self._stream.synchronize()
            if not ok:
                return
            job.num_loaded += 1


__all__ = ["LoadJob", "OffloadConfig", "OffloadEvent", "OffloadManager"]
