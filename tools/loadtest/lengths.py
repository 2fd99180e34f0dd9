"""Token-length distributions for the random dataset, written on the command line as

- ``128``              every request has 128 tokens
- ``64:256``           uniform over 64..256 (both included)
- ``normal:128:32``    normal with mean 128 and standard deviation 32, rounded, at least 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np


class LengthSpecError(ValueError):
    pass


@dataclass(frozen=True)
class LengthDist:
    kind: Literal["fixed", "uniform", "normal"]
    low: float  # fixed: the length; uniform: lowest; normal: mean
    high: float  # fixed: the length; uniform: highest; normal: standard deviation

    @classmethod
    def parse(cls, spec: str, flag: str = "length") -> "LengthDist":
        hint = "write N, LOW:HIGH or normal:MEAN:STD (e.g. 128, 64:256, normal:128:32)"
        parts = str(spec).strip().split(":")
        try:
            if len(parts) == 1:
                n = int(parts[0])
                dist = cls("fixed", n, n)
            elif len(parts) == 2:
                dist = cls("uniform", int(parts[0]), int(parts[1]))
            elif len(parts) == 3 and parts[0] == "normal":
                dist = cls("normal", float(parts[1]), float(parts[2]))
            else:
                raise LengthSpecError(f"{flag}: cannot read {spec!r}: {hint}")
        except ValueError as e:
            if isinstance(e, LengthSpecError):
                raise
            raise LengthSpecError(f"{flag}: cannot read {spec!r}: {hint}") from None
        dist.check(flag)
        return dist

    def check(self, flag: str) -> None:
        if self.kind == "normal":
            if self.low < 1 or self.high < 0:
                raise LengthSpecError(f"{flag}: normal needs mean >= 1 and std >= 0, got {self.low}, {self.high}")
        elif self.low < 1 or self.high < self.low:
            raise LengthSpecError(f"{flag}: lengths must be >= 1 with LOW <= HIGH, got {self.low}:{self.high}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths (int64, each >= 1)."""
        if self.kind == "fixed":
            return np.full(n, int(self.low), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.low), int(self.high), size=n, endpoint=True).astype(np.int64)
        return np.maximum(1, np.rint(rng.normal(self.low, self.high, size=n))).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.low))
        if self.kind == "uniform":
            return f"{int(self.low)}:{int(self.high)}"
        return f"normal:{self.low:g}:{self.high:g}"
