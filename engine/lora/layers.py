"""Serving many LoRA adapters from one copy of the base weights: each projection of a decoder layer that some
adapter targets is wrapped in a ``LoraLinear``, which runs the base matmul for the whole batch and then, for
each adapter in the step, adds that adapter's low-rank update to its rows only (``LoraSet.step`` says which
rows). The base weights are never merged, so requests of different adapters and of the base model share
one batch (vLLM's and S-LoRA's multi-LoRA batching), and a step without adapter rows costs nothing more.

A fused projection (q/k/v, gate/up: engine/models/llama.py) gets one update per adapter whose A stacks the
targeted modules' A matrices and whose B is block-diagonal over their output slices, with the
lora_alpha / r scale folded in: two matmuls per adapter whatever the number of targeted modules. Both are
``Linear``s like the base's, so in deterministic mode (EngineConfig.deterministic) each row's update, like its
base output, is a function of that row alone: an adapter request's tokens do not depend on its batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from pdcluster.engine.linear import Linear
from pdcluster.engine.lora.adapter import LoraAdapter, LoraWeights

# A step's rows per adapter: (adapter index, the rows as a slice when they are one run, else an index tensor).
Rows = slice | torch.Tensor


class LoraSet:
    """The adapters installed on one model, by name, and the running step's rows of each."""

    def __init__(self, adapters: Sequence[LoraAdapter]):
        self.adapters = list(adapters)
        self.index = {a.name: i for i, a in enumerate(self.adapters)}
        self.groups: list[tuple[int, Rows]] = []  # empty outside a forward with adapter rows

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.index)

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
        self.groups = [(i, _rows(spans, device)) for i, spans in runs.items()]
        try:
            yield bool(self.groups)
        finally:
            self.groups = []


def _rows(spans: list[tuple[int, int]], device: torch.device) -> Rows:
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in spans]).to(device)


class LoraLinear:
    """A base ``Linear`` plus, for the rows of each adapter in the step, ``b(a(x))`` (scale in b)."""

    def __init__(self, base: Linear, lora: LoraSet, updates: dict[int, tuple[Linear, Linear]]):
        self.base = base
        self.lora = lora
        self.updates = updates  # adapter index -> (a: [rank, in], b: [out, rank]); adapters that target it only
        self.out_features, self.in_features = base.out_features, base.in_features

    @property
    def weight(self):  # what other code reads of the base (the MTP head, the profiler's byte counts)
        return self.base.weight

    @property
    def deterministic(self) -> bool:
        return self.base.deterministic

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for index, rows in self.lora.groups:
            update = self.updates.get(index)
            if update is None:
                continue
            a, b = update
            if isinstance(rows, slice):
                y[rows] += b(a(x[rows])).to(y.dtype)
            else:
                y.index_add_(0, rows, b(a(x.index_select(0, rows))).to(y.dtype))
        return y


def fused_update(slices: Sequence[tuple[int, int, LoraWeights | None]], out_features: int,
                 dtype: torch.dtype, device: torch.device, deterministic: bool) -> tuple[Linear, Linear]:
    """One adapter's update of a fused projection: ``slices`` are (output offset, width, that module's weights
    or None where the adapter leaves it alone)."""
    present = [(offset, width, w) for offset, width, w in slices if w is not None]
    a = torch.cat([w.a for _, _, w in present])
    b = torch.zeros(out_features, a.shape[0], dtype=torch.float32)
    col = 0
    for offset, width, w in present:
        b[offset : offset + width, col : col + w.rank] = w.b * w.scale
        col += w.rank
    make = lambda t: Linear(t.to(dtype).to(device).contiguous(), deterministic=deterministic)  # noqa: E731
    return make(a), make(b)
