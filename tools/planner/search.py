"""Which xPyD (x + y <= gpus) meets the SLOs at a request rate with the most goodput per device, and
how colocated compares. DistServe's method, on the simulator:

1. Per-worker capacity: the highest rate one prefill worker sustains with its TTFT SLO met (decode
   not a bottleneck), one decode worker with its TPOT SLO met (prefill not a bottleneck), and one
   colocated worker with both met. "Met" means at least ``attainment`` of the requests meet it.
2. A first guess: x = ceil(rate / prefill capacity), y = ceil(rate / decode capacity) (colocated:
   n = ceil(rate / colocated capacity)).
3. Check the guess by simulating the whole cluster: while it misses the SLOs, add a worker where the
   misses are (TTFT: prefill, TPOT: decode); once it meets them, take workers away while it still does.
   Fewest devices at the same goodput is the most goodput per device.
4. At exactly ``gpus`` devices: the highest rate a few splits sustain (the ratio of the fewest-device
   answer scaled up, its neighbours, and the per-worker capacity ratio), and colocated x ``gpus``.

Every loop here is bounded (MAX_ADJUST, BISECT_STEPS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from pdcluster.tools.planner.costs import CostModel
from pdcluster.tools.planner.shape import ClusterShape
from pdcluster.tools.planner.simulate import SimConfig, simulate
from pdcluster.tools.planner.summary import meets, summarize
from pdcluster.tools.planner.workload import SimRequest

MAX_ADJUST = 24
BISECT_STEPS = 10
HELPERS = 8  # workers of the other role when measuring one worker's capacity


@dataclass(frozen=True)
class Target:
    slo_ttft_ms: float
    slo_tpot_ms: float
    attainment: float = 0.9


Workload = Callable[[float], list[SimRequest]]  # rate -> requests


class Searcher:
    def __init__(self, cost: CostModel, workload: Workload, target: Target, overhead_s: float = 0.0,
                 log: Callable[[str], None] = lambda msg: None):
        self.cost = cost
        self.workload = workload
        self.target = target
        self.overhead_s = overhead_s
        self.log = log
        self.num_simulations = 0

    # ---- one simulation ------------------------------------------------------------------------
    def run(self, shape: ClusterShape, rate: float, ttft: bool = True, tpot: bool = True) -> dict:
        """Summary of ``shape`` at ``rate``, plus the share of requests meeting each SLO alone."""
        self.num_simulations += 1
        requests = self.workload(rate)
        results, _ = simulate(self.cost, SimConfig(shape, overhead_s=self.overhead_s), requests)
        t = self.target
        out = summarize(results, self.overhead_s, t.slo_ttft_ms if ttft else None, t.slo_tpot_ms if tpot else None)
        n = max(1, len(results))
        out["ttft_attainment"] = sum(meets(r, self.overhead_s, t.slo_ttft_ms, None) for r in results) / n
        out["tpot_attainment"] = sum(meets(r, self.overhead_s, None, t.slo_tpot_ms) for r in results) / n
        out["config"] = shape.name
        out["num_gpus"] = shape.num_workers
        out["request_rate"] = rate
        return out

    def ok(self, summary: dict) -> bool:
        return (summary["slo_attainment"] or 0.0) >= self.target.attainment

    # ---- step 1 ----------------------------------------------------------------------------------
    def capacity(self, shape: ClusterShape, ttft: bool, tpot: bool) -> float:
        """Highest rate (req/s) at which ``shape`` meets the SLOs asked for (bisection)."""
        lo, hi = 0.0, self._rate_guess()
        for _ in range(BISECT_STEPS):  # grow hi until it fails
            if not self.ok(self.run(shape, hi, ttft, tpot)):
                break
            lo, hi = hi, hi * 2
        for _ in range(BISECT_STEPS):
            mid = (lo + hi) / 2
            if self.ok(self.run(shape, mid, ttft, tpot)):
                lo = mid
            else:
                hi = mid
        return lo

    def _rate_guess(self) -> float:
        sample = self.workload(1.0)
        mean_in = sum(r.input_len for r in sample) / len(sample)
        return max(0.05, 1.0 / max(1e-6, self.cost.prefill_s(int(mean_in))))

    def capacities(self) -> dict:
        caps = {
            "prefill": self.capacity(ClusterShape("disagg", 1, HELPERS), ttft=True, tpot=False),
            "decode": self.capacity(ClusterShape("disagg", HELPERS, 1), ttft=False, tpot=True),
            "colocated": self.capacity(ClusterShape("colocated", 0, 1), ttft=True, tpot=True),
        }
        self.log(f"plan: per-worker capacity (req/s): prefill {caps['prefill']:.3g}, decode {caps['decode']:.3g}, "
                 f"colocated {caps['colocated']:.3g}")
        return caps

    # ---- steps 2-3 -------------------------------------------------------------------------------
    def fewest_disagg(self, rate: float, caps: dict, gpus: int) -> dict | None:
        x = max(1, math.ceil(rate / max(caps["prefill"], 1e-9)))
        y = max(1, math.ceil(rate / max(caps["decode"], 1e-9)))
        return self._adjust(rate, gpus, x, y, colocated=False)

    def fewest_colocated(self, rate: float, caps: dict, gpus: int) -> dict | None:
        n = max(1, math.ceil(rate / max(caps["colocated"], 1e-9)))
        return self._adjust(rate, gpus, 0, n, colocated=True)

    def _shape(self, x: int, y: int, colocated: bool) -> ClusterShape:
        return ClusterShape("colocated", 0, y) if colocated else ClusterShape("disagg", x, y)

    def _adjust(self, rate: float, gpus: int, x: int, y: int, colocated: bool) -> dict | None:
        tried: dict[tuple[int, int], dict] = {}

        def trial(a: int, b: int) -> dict:
            if (a, b) not in tried:
                tried[(a, b)] = self.run(self._shape(a, b, colocated), rate)
            return tried[(a, b)]

        best = None
        for _ in range(MAX_ADJUST):  # grow until it meets the SLOs
            if x + y > gpus:
                break
            s = trial(x, y)
            if self.ok(s):
                best = (x, y)
                break
            if colocated:
                y += 1
            elif s["ttft_attainment"] < s["tpot_attainment"]:
                x += 1
            else:
                y += 1
        if best is None:
            return None
        for _ in range(MAX_ADJUST):  # shrink while it still meets them
            x, y = best
            options = [(x, y - 1)] if colocated else [(x - 1, y), (x, y - 1)]
            smaller = [(a, b) for a, b in options if b >= 1 and (colocated or a >= 1) and self.ok(trial(a, b))]
            if not smaller:
                break
            best = max(smaller, key=lambda ab: tried[ab]["request_goodput"])
        out = dict(tried[best])
        out["shape"] = self._shape(*best, colocated)
        out["goodput_per_gpu"] = out["request_goodput"] / out["num_gpus"]
        out["tried"] = [{"config": self._shape(a, b, colocated).name, "slo_attainment": s["slo_attainment"],
                         "ttft_attainment": s["ttft_attainment"], "tpot_attainment": s["tpot_attainment"]}
                        for (a, b), s in tried.items()]
        return out

    # ---- step 4 ----------------------------------------------------------------------------------
    def max_rate(self, shape: ClusterShape, guess: float) -> dict:
        """The highest rate ``shape`` sustains (bisection from ``guess``) and its summary there."""
        lo, hi, best = 0.0, max(guess, 1e-3), None
        for _ in range(BISECT_STEPS):
            s = self.run(shape, hi)
            if not self.ok(s):
                break
            lo, best, hi = hi, s, hi * 1.5
        for _ in range(BISECT_STEPS // 2 + 2):
            mid = (lo + hi) / 2
            s = self.run(shape, mid)
            if self.ok(s):
                lo, best = mid, s
            else:
                hi = mid
        return {"config": shape.name, "max_rate": lo, "at_max_rate": best}


def split_for(gpus: int, caps: dict) -> tuple[int, int]:
    """x prefill + y decode = gpus in the ratio of the per-worker capacities (each at least 1)."""
    p, d = max(caps["prefill"], 1e-9), max(caps["decode"], 1e-9)
    return _split(gpus, d / (p + d))


def _split(gpus: int, prefill_share: float) -> tuple[int, int]:
    x = min(max(1, round(gpus * prefill_share)), gpus - 1)
    return x, gpus - x


def full_size_splits(gpus: int, caps: dict, fewest: dict | None, spread: int = 3) -> list[tuple[int, int]]:
    """Splits of ``gpus`` worth simulating: the fewest-device answer's ratio and its neighbours, and
    the per-worker capacity ratio."""
    splits = [split_for(gpus, caps)]
    if fewest is not None:
        shape = fewest["shape"]
        x, _ = _split(gpus, shape.num_prefill / shape.num_workers)
        splits = [(x, gpus - x), *[(x + d, gpus - x - d) for d in (-spread, spread)], *splits]
    return list(dict.fromkeys((x, y) for x, y in splits if x >= 1 and y >= 1))


def search(searcher: Searcher, rate: float, gpus: int) -> dict:
    caps = searcher.capacities()
    disagg = searcher.fewest_disagg(rate, caps, gpus)
    colocated = searcher.fewest_colocated(rate, caps, gpus)
    p, d = max(caps["prefill"], 1e-9), max(caps["decode"], 1e-9)
    splits = [searcher.max_rate(ClusterShape("disagg", x, y), min(x * p, y * d))
              for x, y in full_size_splits(gpus, caps, disagg)]
    full_disagg = max(splits, key=lambda s: s["max_rate"])
    full_colocated = searcher.max_rate(ClusterShape("colocated", 0, gpus), gpus * caps["colocated"])
    candidates = [c for c in (disagg, colocated) if c is not None]
    best = max(candidates, key=lambda c: c["goodput_per_gpu"]) if candidates else None
    for c in candidates:
        c.pop("shape")
    return {
        "request_rate": rate,
        "gpus": gpus,
        "slo_ttft_ms": searcher.target.slo_ttft_ms,
        "slo_tpot_ms": searcher.target.slo_tpot_ms,
        "attainment_target": searcher.target.attainment,
        "per_worker_capacity": caps,
        "fewest_gpus": {"disagg": disagg, "colocated": colocated},
        "best": None if best is None else {"config": best["config"], "num_gpus": best["num_gpus"],
                                           "goodput_per_gpu": best["goodput_per_gpu"],
                                           "slo_attainment": best["slo_attainment"]},
        "at_gpus": {"disagg": full_disagg, "colocated": full_colocated,
                    "disagg_splits_tried": {s["config"]: s["max_rate"] for s in splits}},
        "num_simulations": searcher.num_simulations,
    }
