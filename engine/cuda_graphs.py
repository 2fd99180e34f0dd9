"""CUDA graphs for uniform decode batches (every row has ``q_len`` = 1 + k query tokens).

A decode step of a small model on a GPU is mostly kernel-launch overhead: hundreds of small kernels a
step, each launched from Python. Captured once per batch-size bucket, a step replays as one graph.

How (vLLM's recipe):
- buckets of batch sizes (1, 2, 4, 8, then every 16 up to ``max_num_seqs``, at most ``max_graph_batch``:
  EngineConfig.max_cuda_graph_batch, MAX_GRAPH_BATCH by default); a batch
  runs in the smallest bucket that holds it, the rows past it padded (a larger one runs eager);
- every input lives in a static buffer the graph was captured over (token ids, positions, slot
  mapping, block tables at full width, context lengths). The runner's step stages its per-token and
  per-row host arrays straight into them, padded, with one host-to-device copy (``stage``); the block
  table (a width per step) is one device copy in ``run``, which replays. Padded rows write no KV (slot
  -1: the write kernels skip it), have context length 1 and block table row 0: they read one cache slot,
  and their outputs are dropped. (``run`` also takes a step's inputs as device tensors and copies them
  in: direct callers);
- the hidden states come out of the bucket's static output, sliced to the batch; logits, sampling
  and the proposer run outside the graph (they depend on the rows' sampling parameters);
- captured at start-up, every bucket over padded rows only (``capture_all``, from engine/warmup.py, as vLLM
  captures its sizes), so a bucket's first step while serving replays instead of stalling on its capture (a
  device sync, two warm-up forwards, the skinny GEMM's timing); a bucket not captured then (a prefill worker's,
  or after its LoRA adapters changed) is captured at its first use. One memory pool serves all buckets.
Hybrids (Mamba layers): the rows' state slots are a static buffer too, and the layers take a row plan
built once per bucket over it (``MambaMetadata.plan``: position j of every row, its packed tokens and
slots; with speculation every row keeps its per-position states), so the one-token conv and SSM
updates replay inside the graph. Padded rows update a scratch state slot no request owns (the pool has
one slot more than ``max_num_seqs``). A batch with a row starting from token 0 (a one-token prompt
looks like decode) runs eager: its state must start from zeros.
LoRA (the stacked way, engine/lora/layers.py): each token's adapter slot is a static buffer too (-1 for the
base model and padded rows), so decode steps with adapter rows replay like the others; an adapter loaded or
dropped changes the stacked updates' shapes, and the buckets are captured again at their next use.
Not captured: batches with prefill rows, and steps whose KV connector sends layers as they finish (a
prefill worker's layer callbacks run Python between layers).

``emulate=True`` (the CPU tests) replays by calling the captured function again on the same static
buffers: every buffer, padding and slicing path runs; only the CUDA capture itself does not.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pdcluster.kernels.graph_region import graph_region
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.graph_capture import capture_or_eager
from pdcluster.engine.mamba_state import MambaMetadata, MambaStatePool
from pdcluster.engine.models.mamba_mixer import MambaStepPlan
from pdcluster.engine.step_inputs import MAX_CACHED_VIEWS, StepInputs

PAD_SLOT = -1  # write kernels skip negative slots


# The largest captured batch (vLLM's max_cudagraph_capture_size default is 512 too): an H100/H200's default of
# 1,024 running requests would otherwise be 68 captures at start-up; a larger batch runs eager, where launch
# overhead is a small share of its step.
MAX_GRAPH_BATCH = 512


def batch_buckets(max_num_seqs: int, max_graph_batch: int = MAX_GRAPH_BATCH) -> list[int]:
    top = min(max_num_seqs, max_graph_batch)
    small = [b for b in (1, 2, 4, 8) if b < top]
    return small + list(range(16, top, 16)) + [top]


class DecodeGraphs:
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 device: torch.device, max_num_seqs: int, q_len: int, max_blocks_per_req: int, scale: float,
                 emulate: bool = False, mamba_pool: MambaStatePool | None = None, lora=None,
                 max_graph_batch: int = MAX_GRAPH_BATCH):
        """``mamba_pool``: a hybrid's state pool, with a scratch slot past ``max_num_seqs`` rows'. ``lora``: the
        model's LoraSet when its updates run the stacked way (the graphs then take steps with adapter rows)."""
        self.forward = forward  # (input_ids, positions, meta) -> hidden [num_tokens, H]
        self.device, self.q_len, self.scale, self.emulate = device, q_len, scale, emulate
        self.mamba_pool = mamba_pool
        self.buckets = batch_buckets(max_num_seqs, max_graph_batch)
        max_rows, max_tokens = self.buckets[-1], self.buckets[-1] * q_len
        # The per-token and per-row inputs live in one device arena, so a step's host arrays land in them with one
        # copy (``stage``); each region is sized for the largest bucket, a bucket's graph reads its prefixes.
        self._offsets: dict[str, int] = {}
        num_bytes = 0
        for name, count, dtype in (("input_ids", max_tokens, torch.int64), ("positions", max_tokens, torch.int64),
                                   ("slot_mapping", max_tokens, torch.int64), ("state_slots", max_rows, torch.int64),
                                   ("ahead_dst", max_rows, torch.int64), ("ahead_src", max_rows, torch.int64),
                                   ("seq_lens", max_rows, torch.int32)):
            self._offsets[name] = num_bytes
            num_bytes += count * dtype.itemsize
        self._static = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.input_ids = self._region("input_ids", max_tokens, torch.int64)
        self.positions = self._region("positions", max_tokens, torch.int64)
        self.slot_mapping = self._region("slot_mapping", max_tokens, torch.int64).fill_(PAD_SLOT)
        self.ahead_dst = self._region("ahead_dst", max_rows, torch.int64)
        self.ahead_src = self._region("ahead_src", max_rows, torch.int64)
        self.seq_lens = self._region("seq_lens", max_rows, torch.int32).fill_(1)
        self._staged_views: dict[int, tuple[torch.Tensor, ...]] = {}  # num_rows -> its prefixes (see ``stage``)
        self.num_staged = 0  # steps whose inputs were staged straight into the static buffers
        self.num_copied = 0  # steps whose inputs ``run`` copied into them (device to device)
        self.block_tables = torch.zeros(max_rows, max_blocks_per_req, dtype=torch.int32, device=device)
        self._table_width = max_blocks_per_req
        # Rows of block_tables written since they were last zeroed: a padded row reads block 0, so rows past a
        # step's are zeroed, but only those an earlier, larger step wrote (a launch saved on most steps).
        self._num_table_rows_written = 0
        # Slices each step asks for again (a torch call each, host time): (rows, width) -> block_tables' window,
        # num_ahead -> the launch-ahead index prefixes, (bucket, tokens) -> the graph output's prefix.
        self._table_views: dict[tuple[int, int], torch.Tensor] = {}
        self._ahead_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._output_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.query_start_loc = torch.arange(0, (max_rows + 1) * q_len, q_len, dtype=torch.int32, device=device)
        if mamba_pool is not None:
            if mamba_pool.num_slots <= max_rows:
                raise ValueError(f"CUDA graphs for a hybrid: the state pool needs a scratch slot past the "
                                 f"{max_rows} rows' ({mamba_pool.num_slots} slots)")
            self.pad_state_slot = mamba_pool.num_slots - 1
            self.state_slots = self._region("state_slots", max_rows, torch.int64).fill_(self.pad_state_slot)
        self.lora = lora
        if lora is not None:
            self.lora_token_slot = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
            self._lora_version = lora.version
        self._mamba_meta: dict[int, MambaMetadata] = {}  # bucket -> its static row plan
        self._graphs: dict[int, object] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        self._failed: set[int] = set()  # buckets whose capture raised: eager from then on
        self.num_replays = 0
        self.num_captures = 0

    def _region(self, name: str, count: int, dtype: torch.dtype) -> torch.Tensor:
        offset = self._offsets[name]
        return self._static[offset : offset + count * dtype.itemsize].view(dtype)

    def bucket(self, num_rows: int) -> int | None:
        return next((b for b in self.buckets if b >= num_rows), None)

    def _taking_bucket(self, num_rows: int, table_width: int) -> int | None:
        """The bucket whose graph takes a batch of ``num_rows`` rows with block tables ``table_width`` wide (None:
        no bucket holds it, its capture failed, or the table is wider than the static one)."""
        bucket = self.bucket(num_rows)
        if bucket is None or bucket in self._failed or table_width > self._table_width:
            return None
        return bucket

    def stage(self, inputs: StepInputs, host: dict[str, np.ndarray]) -> dict[str, torch.Tensor] | None:
        """A uniform decode step's per-token and per-row host arrays (``input_ids``, ``positions``,
        ``slot_mapping``, ``seq_lens``; ``state_slots`` for a hybrid; ``ahead_dst`` and ``ahead_src`` for
        launch-ahead rows) straight into the static buffers, padded for the step's bucket, in one copy:
        ``run`` then replays without copying them again (on the H200 the seven device copies and fills were
        ~10% of a batch-1 step's host time). Returns the step's prefixes of those buffers, or None where no
        graph would take the step (``run`` could not either): no bucket holds it, its bucket's capture
        failed, or its block table is wider than the static one."""
        num_rows = host["seq_lens"].shape[0]
        bucket = self._taking_bucket(num_rows, host["block_tables"].shape[1])
        if bucket is None:
            return None
        n, padded = num_rows * self.q_len, bucket * self.q_len
        off = self._offsets

        def pad(a: np.ndarray, length: int, value: int) -> np.ndarray:
            if a.shape[0] == length:
                return a
            out = np.full(length, value, dtype=a.dtype)
            out[: a.shape[0]] = a
            return out

        # Every byte of the bucket's prefixes is written (the copy carries the host arena's stale bytes between
        # parts): padded rows take token 0 at position 0, slot -1 (no KV write) and length 1.
        parts = [(off["input_ids"], pad(host["input_ids"], padded, 0)), (off["positions"], pad(host["positions"], padded, 0)),
                 (off["slot_mapping"], pad(host["slot_mapping"], padded, PAD_SLOT)),
                 (off["seq_lens"], pad(host["seq_lens"], bucket, 1))]
        if self.mamba_pool is not None:
            parts.append((off["state_slots"], pad(host["state_slots"], bucket, self.pad_state_slot)))
        num_ahead = host["ahead_dst"].shape[0] if "ahead_dst" in host else 0
        if num_ahead:
            parts += [(off["ahead_dst"], host["ahead_dst"]), (off["ahead_src"], host["ahead_src"])]
        inputs.put_into(self._static, parts)
        self.num_staged += 1
        views = self._staged_views.get(num_rows)
        if views is None:  # slicing is a torch call each (host time): once per batch size
            views = self._staged_views[num_rows] = (
                self.input_ids[:n], self.positions[:n], self.slot_mapping[:n], self.seq_lens[:num_rows],
                self.state_slots[:num_rows] if self.mamba_pool is not None else None)
        out = dict(zip(("input_ids", "positions", "slot_mapping", "seq_lens", "state_slots"), views))
        if num_ahead:
            ahead = self._ahead_views.get(num_ahead)
            if ahead is None:
                ahead = self._ahead_views[num_ahead] = (self.ahead_dst[:num_ahead], self.ahead_src[:num_ahead])
            out["ahead_dst"], out["ahead_src"] = ahead
        return out

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states of this uniform batch through its bucket's graph (None: no bucket fits, or
        a hybrid's row starts from token 0)."""
        num_rows = meta.seq_lens.shape[0]
        bucket = self._taking_bucket(num_rows, meta.block_tables.shape[1])
        if bucket is None:
            return None
        if self.mamba_pool is not None:
            if meta.mamba is None or meta.mamba.state_slots is None or not meta.mamba.has_initial_state_np.all():
                return None
        n = num_rows * self.q_len
        # Staged (``stage``): the step's inputs already are the static buffers' prefixes, padded.
        if input_ids.data_ptr() != self.input_ids.data_ptr():
            # Inputs into the static buffers (device to device; padded rows reset to their padding values).
            self.num_copied += 1
            if self.mamba_pool is not None:
                self.state_slots[:num_rows].copy_(meta.mamba.state_slots)
                self.state_slots[num_rows:bucket].fill_(self.pad_state_slot)
            self.input_ids[:n].copy_(input_ids)
            self.positions[:n].copy_(positions)
            self.slot_mapping[:n].copy_(meta.slot_mapping)
            self.slot_mapping[n : bucket * self.q_len].fill_(PAD_SLOT)
            self.seq_lens[:num_rows].copy_(meta.seq_lens)
            self.seq_lens[num_rows:bucket].fill_(1)
        width = meta.block_tables.shape[1]
        table = self._table_views.get((num_rows, width))
        if table is None:
            if len(self._table_views) >= MAX_CACHED_VIEWS:
                self._table_views.clear()
            table = self._table_views[(num_rows, width)] = self.block_tables[:num_rows, :width]
        table.copy_(meta.block_tables)
        # Padded rows read block 0: zeroed where an earlier step wrote them (a torch call even over no rows).
        if num_rows < bucket and self._num_table_rows_written > num_rows:
            self.block_tables[num_rows : min(bucket, self._num_table_rows_written)].zero_()
            if self._num_table_rows_written <= bucket:  # else rows past the bucket stay written
                self._num_table_rows_written = num_rows
        else:
            self._num_table_rows_written = max(self._num_table_rows_written, num_rows)
        if self.lora is not None:
            if self.lora.version != self._lora_version:  # the stacked updates the graphs read were replaced
                self._drop_captures()
                self._lora_version = self.lora.version
            if self.lora.token_slot is not None:
                self.lora_token_slot[:n].copy_(self.lora.token_slot)
                if num_rows < bucket:
                    self.lora_token_slot[n : bucket * self.q_len].fill_(-1)
            else:  # no adapter row: every token of the bucket takes the base model
                self.lora_token_slot[: bucket * self.q_len].fill_(-1)
        if bucket not in self._outputs and not self._capture_or_eager(bucket):
            return None
        if self.emulate:
            self._outputs[bucket] = self._call(bucket)
        else:
            self._graphs[bucket].replay()
        self.num_replays += 1
        output = self._outputs[bucket]
        hit = self._output_views.get((bucket, n))
        if hit is None or hit[0] is not output:  # a bucket captured anew (or emulated) has a new output
            hit = self._output_views[(bucket, n)] = (output, output[:n])
        return hit[1]

    def _capture_or_eager(self, bucket: int) -> bool:
        """Capture ``bucket``; False: it runs eager from now on (engine/graph_capture.py)."""

        def undo() -> None:
            self._outputs.pop(bucket, None)
            self._pool = None  # a capture that raised may leave its pool marked as recording

        if capture_or_eager(self.device, lambda: self._capture_on_scratch(bucket), undo, f"batch bucket {bucket}"):
            return True
        self._failed.add(bucket)
        return False

    def capture_all(self) -> int:
        """Capture every bucket not captured yet, each over padded rows only: slot -1 (no KV written), context
        length 1 over block 0, the scratch state slot, the base model. Returns the number captured (a bucket whose
        capture fails runs eager, as at its first use)."""
        rows, tokens = self.buckets[-1], self.buckets[-1] * self.q_len
        self.input_ids[:tokens].zero_()
        self.positions[:tokens].zero_()
        self.slot_mapping[:tokens].fill_(PAD_SLOT)
        self.seq_lens[:rows].fill_(1)
        self.block_tables.zero_()
        self._num_table_rows_written = 0
        if self.mamba_pool is not None:
            self.state_slots[:rows].fill_(self.pad_state_slot)
        if self.lora is not None:
            self.lora_token_slot.fill_(-1)
        before = self.num_captures
        for bucket in self.buckets:
            if bucket not in self._outputs and bucket not in self._failed:
                self._capture_or_eager(bucket)
        return self.num_captures - before

    def _drop_captures(self) -> None:
        self._graphs.clear()
        self._outputs.clear()
        self._failed.clear()
        self._pool = None

    def _call(self, bucket: int) -> torch.Tensor:
        """The forward over the bucket's static buffers: its warm-up, its capture, and (emulated) its replay; the
        few-row matmuls in it may take the skinny Triton kernel and its Triton kernels launch with PDL
        (kernels/graph_region.py)."""
        with graph_region():
            return self._forward_bucket(bucket)

    def _forward_bucket(self, bucket: int) -> torch.Tensor:
        tokens = bucket * self.q_len
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], query_start_loc=self.query_start_loc[: bucket + 1],
            uniform_q_len=self.q_len, scale=self.scale, mamba=self._bucket_mamba(bucket))
        if self.lora is None:
            return self.forward(self.input_ids[:tokens], self.positions[:tokens], meta)
        step_token_slot, self.lora.token_slot = self.lora.token_slot, self.lora_token_slot[:tokens]
        try:  # the adapter layers read the static slots (a capture records that buffer, not the step's)
            return self.forward(self.input_ids[:tokens], self.positions[:tokens], meta)
        finally:
            self.lora.token_slot = step_token_slot

    def _bucket_mamba(self, bucket: int) -> MambaMetadata | None:
        """A hybrid bucket's Mamba rows over the static slots: position j of row r is packed token
        ``r * q_len + j``; every row continues its state; with speculation (q_len > 1) every row is a
        verification row and keeps its per-position states (the runner selects the accepted one)."""
        if self.mamba_pool is None:
            return None
        meta = self._mamba_meta.get(bucket)
        if meta is None:  # built before any capture: the plan's index tensors are static too
            q, slots = self.q_len, self.state_slots[:bucket]
            rows = torch.arange(bucket, dtype=torch.int64, device=self.device) * q
            positions = [(rows + j, slots, slots if q > 1 else None, j) for j in range(q)]
            meta = self._mamba_meta[bucket] = MambaMetadata(
                pool=self.mamba_pool, query_start_loc_np=np.arange(bucket + 1, dtype=np.int64) * q,
                state_slots_np=np.full(bucket, self.pad_state_slot, dtype=np.int64),
                has_initial_state_np=np.ones(bucket, dtype=bool), keep_positions_np=np.full(bucket, q > 1),
                plan=MambaStepPlan(None, [], positions))
        return meta

    def _capture_on_scratch(self, bucket: int) -> None:
        """Capture with every row's state slot pointed at the scratch slot: the warm-up runs (and the
        emulated capture's call) advance the states they touch, which a request's must not be twice.
        Their KV writes go to the rows' own slots and the replay right after writes them again."""
        if self.mamba_pool is None:
            self._capture(bucket)
            return
        real_slots = self.state_slots[:bucket].clone()
        self.state_slots[:bucket].fill_(self.pad_state_slot)
        try:
            self._capture(bucket)
        finally:
            self.state_slots[:bucket].copy_(real_slots)

    def _capture(self, bucket: int) -> None:
        self.num_captures += 1
        if self.emulate:
            self._outputs[bucket] = self._call(bucket)
            return
        # Warm the bucket's kernels (Triton compiles, cuBLAS picks) outside the capture, on a side stream.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._call(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: only this thread is held to capture's rules. In "global" mode (torch's default)
        # another thread's synchronisation (a KV transport's IO thread landing blocks) during the capture
        # fails there and invalidates the capture here.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._outputs[bucket] = self._call(bucket)
        self._graphs[bucket] = graph
