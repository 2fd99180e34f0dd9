"""Cluster shapes the planner simulates, written as on the command line:

- ``1P1D``, ``4P12D`` (``xPyD``): x prefill and y decode workers, disaggregated;
- ``colocated``, ``colocatedx2`` (``colocatedxN``): N workers that each prefill and decode.

One worker is one device (a GPU, or a share of a CPU host: see simulate.py's ``shared_cores``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DISAGG = re.compile(r"^(\d+)p(\d+)d$")
_COLOCATED = re.compile(r"^colocated(?:x(\d+))?$")


class ShapeError(ValueError):
    pass


@dataclass(frozen=True)
class ClusterShape:
    mode: str  # "disagg" | "colocated"
    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated"):
            raise ShapeError(f"mode must be disagg or colocated, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == "disagg" and self.num_prefill < 1):
            raise ShapeError(f"need at least one decode worker and, disaggregated, one prefill worker: {self}")
        if self.mode == "colocated" and self.num_prefill:
            raise ShapeError("a colocated shape has no prefill workers")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def name(self) -> str:
        if self.mode == "colocated":
            return f"colocatedx{self.num_decode}"
        return f"{self.num_prefill}P{self.num_decode}D"


def parse_shape(text: str) -> ClusterShape:
    s = text.strip().lower()
    m = _DISAGG.match(s)
    if m:
        shape = ClusterShape("disagg", int(m.group(1)), int(m.group(2)))
        return shape
    m = _COLOCATED.match(s)
    if m:
        return ClusterShape("colocated", 0, int(m.group(1) or 1))
    raise ShapeError(f"--config: cannot read {text!r}: write xPyD (e.g. 1P1D, 4P12D) or colocatedxN (e.g. colocatedx2)")
