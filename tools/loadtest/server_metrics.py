"""The server's own view of a run: its Prometheus /metrics scraped before and after, differenced.

When the target is pdcluster this yields the request count the server saw (a cross-check of the
client's), its mean TTFT, and TTFT broken into queue, prefill, KV transfer and first decode step
(histogram ``_sum``/``_count`` deltas: means over the run), and where a server counts them, the prompt
tokens served from a cache by tier (device pool, offload tiers) and so the prompt tokens it computed.
Any other server (or none at /metrics) gives None and the run goes on: scraping is optional.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "pdcluster:"
TTFT_PARTS = ("queue", "prefill", "kv_transfer", "first_decode")
CACHED = "prompt_tokens_cached_total"  # labelled by tier (cluster/metrics.py CACHE_TIERS)
TIER_LABEL = "tier"


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name (labels dropped) -> value summed over label sets (prometheus_client's parser);
    text that does not parse gives what parsed before it."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except ValueError:
        pass
    return values


def parse_by_label(text: str, label: str) -> dict[str, float]:
    """``name{label="value"}`` -> value summed over the other labels, for the samples that have ``label``."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if label in sample.labels:
                    key = f'{sample.name}{{{label}="{sample.labels[label]}"}}'
                    values[key] = values.get(key, 0.0) + sample.value
    except ValueError:
        pass
    return values


async def scrape(http: httpx.AsyncClient, base_url: str, headers: dict | None = None) -> dict[str, float] | None:
    """pdcluster's samples at ``base_url/metrics``, or None (not there, not pdcluster, unreachable)."""
    try:
        response = await http.get(base_url + "/metrics", headers=headers or {})
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    parsed = {**parse_prometheus(response.text), **parse_by_label(response.text, TIER_LABEL)}
    samples = {k: v for k, v in parsed.items() if k.startswith(PREFIX)}
    return samples or None


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(PREFIX + name, 0.0) - before.get(PREFIX + name, 0.0)


def _mean_ms(before: dict, after: dict, histogram: str) -> float | None:
    count = _delta(before, after, histogram + "_count")
    return _delta(before, after, histogram + "_sum") / count * 1e3 if count > 0 else None


def server_delta(before: dict | None, after: dict | None) -> tuple[dict | None, dict | None]:
    """(``server_metrics``, ``ttft_breakdown``) of the run, or (None, None) without both scrapes."""
    if before is None or after is None:
        return None, None
    draft = _delta(before, after, "spec_decode_num_draft_tokens_total")
    accepted = _delta(before, after, "spec_decode_num_accepted_tokens_total")
    server = {
        "request_success": int(round(_delta(before, after, "request_success_total"))),
        "prompt_tokens": int(round(_delta(before, after, "prompt_tokens_total"))),
        "generation_tokens": int(round(_delta(before, after, "generation_tokens_total"))),
        "mean_ttft_ms": _mean_ms(before, after, "time_to_first_token_seconds"),
        "mean_itl_ms": _mean_ms(before, after, "inter_token_latency_seconds"),
        "mean_e2el_ms": _mean_ms(before, after, "e2e_request_latency_seconds"),
        "spec_decode_acceptance_rate": accepted / draft if draft > 0 else None,
    }
    server.update(cache_delta(before, after, server["prompt_tokens"]))
    breakdown = {"count": int(round(_delta(before, after, "time_to_first_token_seconds_count"))),
                 "total_ms": server["mean_ttft_ms"]}
    for part in TTFT_PARTS:
        breakdown[f"{part}_ms"] = _mean_ms(before, after, f"ttft_{part}_seconds")
    return server, breakdown


def cache_delta(before: dict, after: dict, prompt_tokens: int) -> dict:
    """``prompt_tokens_cached`` (tier -> prompt tokens served from that cache tier during the run),
    ``prompt_tokens_total`` and ``prompt_tokens_computed`` (total - cached); empty when the server
    does not count cached tokens."""
    prefix = f"{PREFIX}{CACHED}{{{TIER_LABEL}=\""
    tiers = sorted(k[len(prefix):-2] for k in after if k.startswith(prefix) and k.endswith('"}'))
    if not tiers:
        return {}
    cached = {t: int(round(_delta(before, after, f'{CACHED}{{{TIER_LABEL}="{t}"}}'))) for t in tiers}
    return {"prompt_tokens_cached": cached, "prompt_tokens_total": prompt_tokens,
            "prompt_tokens_computed": prompt_tokens - sum(cached.values())}
