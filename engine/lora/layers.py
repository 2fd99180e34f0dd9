"""Serving many LoRA adapters from one copy of the base weights: each projection of a decoder layer that some
adapter targets is wrapped in a ``LoraLinear``, which runs the base matmul for the whole batch and then adds each
row's adapter update to that row only (``LoraSet.step`` says which rows have which adapter). The base weights are
never merged, so requests of different adapters and of the base model share one batch (vLLM's and S-LoRA's
multi-LoRA batching), and a step without adapter rows costs nothing more.

A fused projection (q/k/v, gate/up: engine/models/llama.py) has one update per adapter: its targeted modules' A
matrices stacked (one low-rank product for all of them) and each module's B on its slice of the output, with the
lora_alpha / r scale folded in.

Two ways to run the updates:
- grouped (CPU with the C kernels): one call per projection whatever the number of adapters in the step
  (kernels/cpu_lora.py: the rows sorted by adapter, punica's SGMV shape, over every adapter's stacked A and B),
  an adapter with no rows not read. Its GEMMs are the batch-invariant ones, so a row's update is a function of
  that row alone;
- stacked (CUDA, or without the C kernels): every slot's A stacked into one ``Linear`` and its B (block-diagonal
  over the slices) beside the others' into another; a token's product with A keeps only its own adapter's
  columns (the others zeroed by comparing each column's slot with the token's), so the update is two matmuls
  and a mask whatever adapters the step's rows have. Every shape follows the number of tokens alone, so decode
  steps with adapter rows replay through the CUDA graphs (engine/cuda_graphs.py: the tokens' slots are a static
  buffer there), where the per-adapter matmuls over each adapter's rows ran eagerly: 17-21 ms a step of a 1.1B
  model on an H200 against 2.2 ms in graphs. The cost: every held adapter's A and B are read each step (for
  rank 16 a few percent of a projection's weight per adapter). With deterministic mode the two matmuls are
  the batch-invariant ones, and the zeroed columns add exact zeros: a row's update is its own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from pdcluster.engine.linear import Linear
from pdcluster.engine.lora.adapter import LoraAdapter, LoraWeights
from pdcluster.engine.step_inputs import host_to_device
from pdcluster.kernels import cpu_lora

def grouped_way(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the updates run the grouped way (the C kernel) for a model on ``device`` in ``dtype``."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and cpu_lora.available()


class LoraSet:
    """The adapters installed on one model, by slot, and the running step's rows of each.

    A slot is an adapter's index in every ``LoraLinear``'s updates. Adapters come and go while serving
    (``add`` / ``remove``): a removed adapter's slot is empty (None) until a later one takes it, so the
    slots of the adapters still held never move under the requests that run with them."""

    def __init__(self, adapters: Sequence[LoraAdapter], grouped: bool):
        """``grouped``: the updates run the grouped way (``grouped_way``), else the stacked way."""
        self.adapters: list[LoraAdapter | None] = list(adapters)
        self.index = {a.name: i for i, a in enumerate(self.adapters)}  # the adapters requests may name now
        self.grouped = grouped
        # Adapters come and go while serving (EngineConfig.enable_lora): workers then check each request's adapter
        # content (SamplingParams.lora_digest) instead of comparing a fixed set in the fingerprint.
        self.runtime = False
        # Every wrapped projection and MoE layer's experts (each takes updates when an adapter comes).
        self.layers: list = []  # LoraLinear, engine/lora/experts.py ExpertLora
        # Bumped when any projection's updates change (an adapter loaded or dropped): CUDA graphs captured
        # over the old stacked updates are recaptured.
        self.version = 0
        # Set by ``step`` for one forward, None outside it:
        self.token_slot: torch.Tensor | None = None  # each token's adapter slot, -1 for none
        self.step_slots: frozenset[int] = frozenset()  # the slots with rows in the step
        self.sorted_rows: cpu_lora.LoraRows | None = None  # every adapter row, sorted by adapter (the grouped way)
        # The step's own arguments while it has adapter rows: what a split model's other ranks run the step's
        # rows with (engine/tensor_parallel/driver.py forward).
        self.step_rows: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.index)

    @property
    def num_slots(self) -> int:
        return len(self.adapters)

    def slot_of(self, name: str, digest: str | None = None) -> int | None:
        """The slot holding adapter ``name`` (with content ``digest`` when given), named or already removed
        from the names but still held for the requests that run with it; None if no slot holds it."""
        for i, a in enumerate(self.adapters):
            if a is not None and a.name == name and (digest is None or a.digest == digest):
                return i
        return None

    def free_slot(self) -> int:
        """The slot a new adapter takes: the first empty one, else a new one at the end."""
        return next((i for i, a in enumerate(self.adapters) if a is None), len(self.adapters))

    def put(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Hold ``adapter`` in ``slot`` (None: empty it); the caller updates the layers and ``index``."""
        if slot == len(self.adapters):
            self.adapters.append(adapter)
        else:
            self.adapters[slot] = adapter

    @property
    def fingerprint(self) -> str:
        """Each adapter's name and content digest: part of the model fingerprint two workers compare before
        they exchange KV, and of the disk tier's namespace. With adapters loaded while serving: "runtime" (the
        set changes; each request's block hashes and admission carry its adapter's digest instead)."""
        if self.runtime:
            return "runtime"
        return ",".join(f"{a.name}:{a.digest}" for a in self.adapters if a is not None)

    @contextmanager
    def step(self, adapter_of_row: np.ndarray, query_start_loc_np: np.ndarray,
             device: torch.device) -> Iterator[bool]:
        """Within it, a forward over the step's tokens adds each row's adapter: row i (tokens
        ``query_start_loc_np[i]`` up to ``[i + 1]``) uses adapter ``adapter_of_row[i]`` (an index into
        ``adapters``; -1: the base model). Yields whether any row has an adapter."""
        runs: dict[int, list[tuple[int, int]]] = {}
        for i in np.flatnonzero(adapter_of_row >= 0).tolist():
            start, end = int(query_start_loc_np[i]), int(query_start_loc_np[i + 1])
            if end > start:
                spans = runs.setdefault(int(adapter_of_row[i]), [])
                if spans and spans[-1][1] == start:  # rows of one adapter next to each other: one run
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((start, end))
        if runs:  # the stacked way's masks, and the experts' in both ways (engine/lora/experts.py)
            token_slot_np = np.full(int(query_start_loc_np[len(adapter_of_row)]), -1, dtype=np.int64)
            for i, spans in runs.items():
                for start, end in spans:
                    token_slot_np[start:end] = i
            self.token_slot = host_to_device(token_slot_np, device)  # without waiting for the queued work
            self.step_slots = frozenset(runs)
        if runs and self.grouped:
            counts = np.zeros(self.num_slots + 1, dtype=np.int64)
            for i, spans in runs.items():
                counts[i + 1] = sum(e - s for s, e in spans)
            self.sorted_rows = cpu_lora.LoraRows.of(
                torch.from_numpy(np.concatenate([np.arange(s, e, dtype=np.int64) for i in sorted(runs)
                                                 for s, e in runs[i]])),
                torch.from_numpy(np.cumsum(counts)), int(query_start_loc_np[len(adapter_of_row)]))
        if runs:
            self.step_rows = (np.asarray(adapter_of_row), np.asarray(query_start_loc_np[: len(adapter_of_row) + 1]))
        try:
            yield bool(runs)
        finally:
            self.token_slot, self.sorted_rows, self.step_rows, self.step_slots = None, None, None, frozenset()

    def changed(self) -> None:
        """A projection's updates changed (called by its ``rebuild``)."""
        self.version += 1


# One adapter's update of one projection: per output slice (offset, width, a [rank, in] or None, b [width, rank]
# with the scale folded in, or None), float32; the slices are q, k, v of a fused qkv, gate and up, or one.
SliceUpdates = list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]


class LoraLinear:
    """A base ``Linear`` plus, for each adapter row of the step, its adapter's update."""

    def __init__(self, base: Linear, lora: LoraSet, updates: dict[int, SliceUpdates], dtype: torch.dtype,
                 device: torch.device, deterministic: bool):
        """``updates``: adapter index -> its update, for the adapters that target this projection (none yet:
        a projection wrapped for adapters loaded later)."""
        self.base = base
        self.lora = lora
        self.out_features, self.in_features = base.out_features, base.in_features
        self.dtype, self.device, self.deterministic = dtype, device, deterministic
        self.slice_updates: dict[int, SliceUpdates] = dict(updates)  # float32, on the CPU: what ``rebuild`` packs
        self.grouped = None
        self.stacked: StackedUpdates | None = None
        self.rebuild()
        lora.layers.append(self)

    def set_update(self, slot: int, update: SliceUpdates | None) -> None:
        """Adapter ``slot``'s update of this projection from now on (None: it has none); called between steps."""
        if update is None and slot not in self.slice_updates:
            return
        if update is None:
            del self.slice_updates[slot]
        else:
            self.slice_updates[slot] = update
        self.rebuild()

    def rebuild(self) -> None:
        """Pack (grouped) or stack every slot's update, for the current number of slots."""
        self.grouped, self.stacked = None, None
        self.lora.changed()
        if not self.slice_updates:
            return
        if self.lora.grouped:
            self.grouped = cpu_lora.pack_lora(self.slice_updates, self.lora.num_slots, self.out_features, self.dtype)
            if self.grouped is None:
                raise ValueError(f"LoRA: the grouped layout refused {self.dtype} (expected bfloat16 or float32)")
            return
        self.stacked = StackedUpdates.of(self.slice_updates, self.out_features, self.dtype, self.device,
                                         self.deterministic)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        lora = self.lora
        if self.grouped is not None:
            if lora.sorted_rows is None:
                return y
            if not cpu_lora.lora_update_bi(y, x, lora.sorted_rows, self.grouped):  # never silently without it
                raise RuntimeError(f"LoRA update refused for x {tuple(x.shape)} {x.dtype} -> y {tuple(y.shape)} "
                                   f"{y.dtype} over {lora.sorted_rows.num_rows} step rows")
            return y
        if self.stacked is not None and lora.token_slot is not None:
            y += self.stacked(x, lora.token_slot).to(y.dtype)
        return y


class StackedUpdates:
    """Every slot's update of one projection as two matmuls: ``a`` [sum of ranks, in] the slots' stacked A,
    ``b`` [out, sum of ranks] their block-diagonal B side by side, and ``column_slot`` the slot of each of the
    middle columns."""

    def __init__(self, a: Linear, b: Linear, column_slot: torch.Tensor):
        self.a, self.b, self.column_slot = a, b, column_slot

    @classmethod
    def of(cls, slice_updates: dict[int, SliceUpdates], out_features: int, dtype: torch.dtype,
           device: torch.device, deterministic: bool) -> "StackedUpdates":
        pairs = {slot: _block_diagonal(slices, out_features) for slot, slices in sorted(slice_updates.items())}
        a = torch.cat([a for a, _ in pairs.values()])
        b = torch.cat([b for _, b in pairs.values()], dim=1)
        column_slot = torch.cat([torch.full((a_s.shape[0],), slot, dtype=torch.int64)
                                 for slot, (a_s, _) in pairs.items()])
        make = lambda t: Linear(t.to(dtype).to(device).contiguous(), deterministic=deterministic)  # noqa: E731
        return cls(make(a), make(b), column_slot.to(device))

    def __call__(self, x: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
        """The update of each token of ``x`` by its slot's adapter (none where ``token_slot`` is -1)."""
        low_rank = self.a(x)
        low_rank = low_rank.masked_fill(self.column_slot[None, :] != token_slot[:, None], 0)
        return self.b(low_rank)


def _block_diagonal(slices: SliceUpdates, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's update as two matrices: a [rank, in] the slices' A stacked, b [out, rank] block-diagonal
    over the slices' outputs."""
    present = [(offset, width, a, b) for offset, width, a, b in slices if a is not None]
    a = torch.cat([a for _, _, a, _ in present])
    b = torch.zeros(out_features, a.shape[0], dtype=torch.float32)
    col = 0
    for offset, width, a_s, b_s in present:
        b[offset : offset + width, col : col + a_s.shape[0]] = b_s
        col += a_s.shape[0]
    return a, b


def slice_updates(slices: Sequence[tuple[int, int, LoraWeights | None]]) -> SliceUpdates:
    """One adapter's update of a projection from its modules' weights: ``slices`` are (output offset, width,
    that module's weights or None where the adapter leaves it alone)."""
    return [(offset, width, None, None) if w is None else (offset, width, w.a, w.b * w.scale)
            for offset, width, w in slices]
