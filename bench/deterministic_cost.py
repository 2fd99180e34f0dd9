"""What deterministic mode (issue 24) costs: bench/vs_vllm.py's four offline measures, our side only
(SmolLM2-135M, bf16, 32 x 200 tokens in, 64 out, greedy, prefix caching off), fast mode against
deterministic mode, at 1 and 2 threads. Prints JSON (and writes it with --out).

    python bench/deterministic_cost.py [--threads 1 2] [--rounds 1] [--out bench/results/deterministic_cost.json]

Each run is bench/vs_vllm.py without --vllm-python (its engine in a child process, warmed up, every
figure from the median and the minimum of its repeats) with PDCLUSTER_DETERMINISTIC=0 or 1 (the default
of EngineConfig.deterministic). The modes alternate (fast, deterministic, fast, ...) so noise from
other jobs on this shared 2-core box spreads over both. Ratios: deterministic / fast for throughputs,
fast / deterministic for latencies, so 1.0 = free and 0.95 = 5% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)

MEASURES = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "tpot_ms")


def one_run(threads: int, deterministic: bool, timeout_s: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "PDCLUSTER_DETERMINISTIC": "1" if deterministic else "0"}
    try:
        subprocess.run([sys.executable, str(BENCH / "vs_vllm.py"), "--threads", str(threads), "--out", out],
                       env=env, check=True, capture_output=True, text=True, timeout=timeout_s)
        result = json.loads(Path(out).read_text())
    finally:
        os.unlink(out)
    ours = result["offline"]["pdcluster"]
    return {"median": ours["median"], "best": ours["best"], "times_s": ours["times_s"],
            "load_avg_1min": [result["machine"]["load_avg_1min_at_start"], result["machine"]["load_avg_1min_at_end"]],
            "other_processes_cpu_s": ours.get("other_processes_cpu_s"), "threads": ours.get("threads")}


def ratio(det: dict, fast: dict) -> dict:
    return {m: (det[m] / fast[m] if m.endswith("tok_s") else fast[m] / det[m]) for m in MEASURES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=1, help="fast/deterministic pairs per thread count")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"what": __doc__.split("\n\n")[0], "ratio": "deterministic / fast (throughputs), fast / "
              "deterministic (latencies): >= 0.95 means within 5%", "runs": {}}
    for threads in args.threads:
        runs = {"fast": [], "deterministic": []}
        for _ in range(args.rounds):
            for mode in ("fast", "deterministic"):
                runs[mode].append(one_run(threads, mode == "deterministic", args.timeout))
                print(f"threads {threads} {mode}: {runs[mode][-1]['median']}", file=sys.stderr, flush=True)
        entry = {"runs": runs}
        for pick in ("median", "best"):
            # per measure, the best figure over rounds of each mode (throughput max, latency min)
            best = {mode: {m: (max if m.endswith("tok_s") else min)(r[pick][m] for r in rs) for m in MEASURES}
                    for mode, rs in runs.items()}
            entry[pick] = {**best, "ratio": ratio(best["deterministic"], best["fast"])}
        result["runs"][f"threads_{threads}"] = entry
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
