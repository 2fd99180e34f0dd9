"""When each request is sent, as offsets in seconds from the start of a run.

- ``poisson``: exponential gaps with mean ``1 / request_rate`` (open-loop traffic, as vLLM's default)
- ``constant``: one request every ``1 / request_rate`` seconds
- ``burst``: ``burst_size`` requests at once, bursts spaced so the mean rate is still ``request_rate``

A rate of ``inf`` sends everything at time 0 (then only ``--max-concurrency`` paces the run). The first
request always goes at 0, so a run's duration is not padded by an initial gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "constant", "burst")


class ArrivalError(ValueError):
    pass


@dataclass(frozen=True)
class ArrivalProcess:
    kind: str  # one of ARRIVALS
    request_rate: float  # requests/s; inf = all at once
    burst_size: int = 8  # requests per burst (kind "burst")

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ArrivalError(f"--arrival: must be one of {', '.join(ARRIVALS)}, got {self.kind!r}")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise ArrivalError(f"--request-rate: must be > 0 requests/s (or inf), got {self.request_rate}")
        if self.burst_size < 1:
            raise ArrivalError(f"--burst-size: must be at least 1, got {self.burst_size}")

    def send_times_s(self, num_requests: int, seed: int) -> np.ndarray:
        """Non-decreasing offsets (float64 seconds) of ``num_requests`` sends."""
        n = num_requests
        if n == 0 or math.isinf(self.request_rate):
            return np.zeros(n)
        if self.kind == "constant":
            return np.arange(n) / self.request_rate
        if self.kind == "burst":
            return (np.arange(n) // self.burst_size) * (self.burst_size / self.request_rate)
        gaps_s = np.random.default_rng(seed).exponential(1.0 / self.request_rate, size=n - 1)
        return np.concatenate([[0.0], np.cumsum(gaps_s)])


def within_duration(send_times_s: np.ndarray, duration_s: float | None) -> int:
    """How many of the sends fall inside ``duration_s`` (all of them when it is None)."""
    if duration_s is None:
        return len(send_times_s)
    return int(np.searchsorted(send_times_s, duration_s, side="right"))
