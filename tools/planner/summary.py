"""A simulated run's figures, under the load tester's field names (tools/loadtest/metrics.py), so a
plan and a measured run read the same: TTFT as the client sees it, TPOT per request as
``(e2e - ttft) / (output tokens - 1)``, goodput = completed requests per second meeting both SLOs, SLO
attainment = their share of all requests.
"""

from __future__ import annotations

import numpy as np

from pdcluster.tools.planner.simulate import RequestResult

PERCENTILES = (50, 90, 99)


def _stats(name: str, values_s: list[float]) -> dict:
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    if a.size == 0:
        return {f"mean_{name}_ms": None, **{f"p{p}_{name}_ms": None for p in PERCENTILES}}
    return {f"mean_{name}_ms": float(a.mean()), "median_" + name + "_ms": float(np.median(a)),
            **{f"p{p}_{name}_ms": float(np.percentile(a, p)) for p in PERCENTILES}}


def ttft_s(r: RequestResult, overhead_s: float) -> float:
    return r.t_first_token - r.arrival_s + overhead_s


def tpot_s(r: RequestResult) -> float | None:
    return (r.t_done - r.t_first_token) / (r.output_len - 1) if r.output_len > 1 else None


def meets(r: RequestResult, overhead_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.finished:
        return False
    if slo_ttft_ms is not None and ttft_s(r, overhead_s) * 1e3 > slo_ttft_ms:
        return False
    t = tpot_s(r)
    return slo_tpot_ms is None or t is None or t * 1e3 <= slo_tpot_ms


def summarize(results: list[RequestResult], overhead_s: float = 0.0, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    done = [r for r in results if r.finished]
    duration = max((r.t_done + overhead_s for r in done), default=0.0)
    per_s = 1.0 / duration if duration > 0 else 0.0
    good = [r for r in done if meets(r, overhead_s, slo_ttft_ms, slo_tpot_ms)]
    disagg = [r for r in done if r.prefill_worker is not None and r.t_kv_ready >= 0]
    breakdown = {
        "queue_ms": _mean_ms([(r.t_prefill_start - r.arrival_s) for r in done]),
        "prefill_ms": _mean_ms([(r.t_first_token - r.t_prefill_start) for r in done]),
        "kv_transfer_ms": _mean_ms([(r.t_kv_ready - r.t_first_token) for r in disagg]),
        "first_decode_ms": _mean_ms([(r.t_second_token - r.t_kv_ready) for r in disagg if r.t_second_token >= 0]),
        "overhead_ms": overhead_s * 1e3,
    }
    out_tokens = sum(r.output_len for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "request_throughput": len(done) * per_s,
        "output_throughput": out_tokens * per_s,
        "request_goodput": len(good) * per_s,
        "output_goodput": sum(r.output_len for r in good) * per_s,
        "slo_attainment": len(good) / len(results) if results else None,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        **_stats("ttft", [ttft_s(r, overhead_s) for r in done]),
        **_stats("tpot", [t for t in (tpot_s(r) for r in done) if t is not None]),
        **_stats("e2el", [r.t_done + overhead_s - r.arrival_s for r in done]),
        "ttft_breakdown": breakdown,
    }


def _mean_ms(values_s: list[float]) -> float | None:
    return float(np.mean(values_s)) * 1e3 if values_s else None
