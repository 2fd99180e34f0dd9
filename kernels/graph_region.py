"""Whether this thread's calls are a CUDA graph's forward: its warm-up, its capture or (on a CPU) its emulated
replay. engine/cuda_graphs.py and engine/piecewise_graphs.py wrap their forward in ``graph_region``.

What may run differently there, because a replay costs the host nothing a launch: a few-row matmul may take the
weight-streaming Triton kernel (engine/skinny_linear.py: eager, Triton's launch from Python and split-K's second
launch would cost host time a decode step of a few rows has less of than GPU time), and the Triton kernels launch
with programmatic dependent launch on Hopper and later (kernels/launch_pdl.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_region = threading.local()


@contextlib.contextmanager
def graph_region() -> Iterator[None]:
    depth = getattr(_region, "depth", 0)
    _region.depth = depth + 1
    try:
        yield
    finally:
        _region.depth = depth


def in_graph_region() -> bool:
    return getattr(_region, "depth", 0) > 0
