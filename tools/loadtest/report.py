"""What a person reads: the end-of-run table, the sweep table, the side-by-side comparison (all on
stderr, so stdout stays free for pipes), and the result JSON on disk."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

# (label, result key, format) of the end-of-run table and the comparison.
SUMMARY_ROWS = (
    ("completed requests", "completed", "d"),
    ("failed requests", "failed", "d"),
    ("duration (s)", "duration", ".2f"),
    ("total input tokens", "total_input_tokens", "d"),
    ("total output tokens", "total_output_tokens", "d"),
    ("request throughput (req/s)", "request_throughput", ".3f"),
    ("request goodput (req/s)", "request_goodput", ".3f"),
    ("output goodput (tok/s)", "output_goodput", ".1f"),
    ("SLO attainment", "slo_attainment", ".1%"),
    ("output throughput (tok/s)", "output_throughput", ".1f"),
    ("total token throughput (tok/s)", "total_token_throughput", ".1f"),
    ("mean TTFT (ms)", "mean_ttft_ms", ".1f"),
    ("median TTFT (ms)", "median_ttft_ms", ".1f"),
    ("p90 TTFT (ms)", "p90_ttft_ms", ".1f"),
    ("p99 TTFT (ms)", "p99_ttft_ms", ".1f"),
    ("mean TPOT (ms)", "mean_tpot_ms", ".1f"),
    ("median TPOT (ms)", "median_tpot_ms", ".1f"),
    ("p90 TPOT (ms)", "p90_tpot_ms", ".1f"),
    ("p99 TPOT (ms)", "p99_tpot_ms", ".1f"),
    ("mean ITL (ms)", "mean_itl_ms", ".1f"),
    ("p99 ITL (ms)", "p99_itl_ms", ".1f"),
    ("mean E2E (ms)", "mean_e2el_ms", ".1f"),
    ("p99 E2E (ms)", "p99_e2el_ms", ".1f"),
)
BREAKDOWN_ROWS = (("queue", "queue_ms"), ("prefill", "prefill_ms"), ("KV transfer", "kv_transfer_ms"),
                  ("first decode step", "first_decode_ms"), ("total (server)", "total_ms"))
SWEEP_COLUMNS = (("rate", "request_rate", ".2f"), ("done", "completed", "d"), ("fail", "failed", "d"),
                 ("req/s", "request_throughput", ".2f"), ("goodput", "request_goodput", ".2f"),
                 ("SLO%", "slo_attainment", ".0%"), ("TTFT", "mean_ttft_ms", ".0f"),
                 ("p99 TTFT", "p99_ttft_ms", ".0f"), ("TPOT", "mean_tpot_ms", ".1f"),
                 ("p99 TPOT", "p99_tpot_ms", ".1f"), ("p99 E2E", "p99_e2el_ms", ".0f"))


class ResultFileError(ValueError):
    pass


def fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    if not isinstance(value, (int, float)) or value == float("inf"):
        return str(value)  # e.g. request_rate "inf"
    return format(int(value) if spec == "d" else value, spec)


def print_summary(result: dict, out: TextIO | None = None) -> None:
    out = out or sys.stderr  # looked up per call: the stream may have been swapped since import
    name = result.get("label") or result.get("model_id", "")
    title = f" loadtest: {name} at {fmt(result.get('request_rate'), 'g')} req/s "
    width = 52
    print(title.center(width, "="), file=out)
    for label, key, spec in SUMMARY_ROWS:
        print(f"{label:<36}{fmt(result.get(key), spec):>16}", file=out)
    if result.get("errors"):
        print("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(result["errors"].items())), file=out)
        for kind, message in result.get("error_examples", {}).items():
            print(f"  {kind}: {message}", file=out)
    print_cache(result.get("server_metrics") or {}, out, width)
    breakdown = result.get("ttft_breakdown")
    if breakdown:
        print(" server TTFT breakdown (mean ms) ".center(width, "-"), file=out)
        for label, key in BREAKDOWN_ROWS:
            print(f"{label:<36}{fmt(breakdown.get(key), '.1f'):>16}", file=out)
    print("=" * width, file=out)


def print_cache(server: dict, out: TextIO, width: int) -> None:
    """Prompt tokens the server served from a cache, by tier, and those it computed (when it counts them)."""
    cached = server.get("prompt_tokens_cached")
    if not isinstance(cached, dict):
        return
    total, computed = server.get("prompt_tokens_total"), server.get("prompt_tokens_computed")
    print(" server prompt tokens ".center(width, "-"), file=out)
    for tier, tokens in cached.items():
        print(f"{'cached (' + tier + ')':<36}{fmt(tokens, 'd'):>16}", file=out)
    print(f"{'computed':<36}{fmt(computed, 'd'):>16}", file=out)
    print(f"{'total':<36}{fmt(total, 'd'):>16}", file=out)
    if total:
        print(f"{'computed / total':<36}{fmt(computed / total, '.1%'):>16}", file=out)


def print_sweep(results: list[dict], out: TextIO | None = None) -> None:
    out = out or sys.stderr  # looked up per call: the stream may have been swapped since import
    widths = [max(len(h), 8) for h, _, _ in SWEEP_COLUMNS]
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(SWEEP_COLUMNS, widths)), file=out)
    for r in results:
        print("  ".join(fmt(r.get(k), s).rjust(w) for (_, k, s), w in zip(SWEEP_COLUMNS, widths)), file=out)


def compare_rows(a: dict, b: dict) -> list[tuple[str, str, str, str]]:
    """(metric, A, B, B/A) for every summary row."""
    rows = []
    for label, key, spec in SUMMARY_ROWS:
        va, vb = a.get(key), b.get(key)
        ratio = f"{vb / va:.2f}x" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        rows.append((label, fmt(va, spec), fmt(vb, spec), ratio))
    return rows


def print_compare(a: dict, b: dict, names: tuple[str, str], out: TextIO | None = None) -> None:
    out = out or sys.stderr  # looked up per call: the stream may have been swapped since import
    head = ("metric", names[0][:16], names[1][:16], "B/A")
    print(f"{head[0]:<32}{head[1]:>17}{head[2]:>17}{head[3]:>9}", file=out)
    for metric, va, vb, ratio in compare_rows(a, b):
        print(f"{metric:<32}{va:>17}{vb:>17}{ratio:>9}", file=out)


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def read_result(path: str | Path) -> dict:
    """A result JSON; a sweep file gives its highest-goodput run (what a comparison wants)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ResultFileError(f"--compare: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ResultFileError(f"--compare: {path} is not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("sweep"), list) and data["sweep"]:
        data = max(data["sweep"], key=lambda r: r.get("request_goodput") or 0)
    if not isinstance(data, dict) or "completed" not in data:
        raise ResultFileError(f"--compare: {path} is not a `pdcluster loadtest` result (no 'completed' field)")
    return data


def result_name(result: dict, path: str | Path) -> str:
    return result.get("label") or Path(path).stem
