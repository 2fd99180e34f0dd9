"""Statistics of one run, under ``vllm bench serve``'s field names where the meaning is the same.

- TTFT, TPOT, ITL, E2E (``e2el``): mean, median, std, p50, p90, p99, in ms. TPOT is per request,
  ``(e2e - ttft) / (output tokens - 1)``; ITL pools every chunk gap of every request (client.py).
- Throughput: ``completed / duration`` requests/s, output and total tokens/s.
- Goodput (DistServe): completed requests per second that meet both ``slo_ttft_ms`` and
  ``slo_tpot_ms``; a one-token answer has no TPOT and meets any TPOT target; an SLO not given is no
  constraint. ``output_goodput`` is those requests' output tokens per second. ``slo_attainment`` is
  the share of all sent requests (failures included) that meet it.

A statistic with no samples is None (vLLM writes 0, which reads like a real latency).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from pdcluster.tools.loadtest.client import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot_s = record.tpot_s
        return self.tpot_ms is None or tpot_s is None or tpot_s * 1e3 <= self.tpot_ms


def latency_stats(name: str, values_ms: list[float]) -> dict[str, float | None]:
    """``mean_<name>_ms``, ``median_...``, ``std_...`` and ``p<P>_...`` for PERCENTILES."""
    a = np.asarray(values_ms, dtype=np.float64)
    some = a.size > 0
    stats = {f"mean_{name}_ms": float(a.mean()) if some else None,
             f"median_{name}_ms": float(np.median(a)) if some else None,
             f"std_{name}_ms": float(a.std()) if some else None}
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(a, p)) if some else None
    return stats


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    done = [r for r in records if r.ok]
    good = [r for r in done if slo.met_by(r)]
    input_lens = [r.server_prompt_len if r.server_prompt_len is not None else r.prompt_len for r in done]
    output_lens = [r.output_len for r in done]
    ttfts_s = [r.ttft_s for r in done]
    tpots_s = [t for t in (r.tpot_s for r in done) if t is not None]
    itls_s = [r.itls_s for r in done]
    e2els_s = [r.e2e_s for r in done]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    total_in, total_out = sum(input_lens), sum(output_lens)
    errors = Counter(r.error_kind for r in records if not r.ok)
    examples = {}
    for r in records:
        if not r.ok and r.error_kind not in examples:
            examples[r.error_kind] = r.error
    result = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) * per_s,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
        "request_goodput": len(good) * per_s,
        "output_goodput": sum(r.output_len for r in good) * per_s,
        "slo_attainment": len(good) / len(records) if records else None,
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        **latency_stats("ttft", [t * 1e3 for t in ttfts_s]),
        **latency_stats("tpot", [t * 1e3 for t in tpots_s]),
        **latency_stats("itl", [t * 1e3 for rs in itls_s for t in rs]),
        **latency_stats("e2el", [t * 1e3 for t in e2els_s]),
        "errors": dict(errors),
        "error_examples": examples,
        # Prompts the server counted differently from our tokenizer (a wrong --tokenizer shows here).
        "prompt_len_mismatches": sum(1 for r in done if r.server_prompt_len is not None and r.prompt_len
                                     and r.server_prompt_len != r.prompt_len),
        # Per completed request, in seconds, as vLLM's ttfts/itls: what the plots are drawn from.
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": ttfts_s,
        "tpots": tpots_s,
        "itls": itls_s,
        "e2els": e2els_s,
    }
    return result
