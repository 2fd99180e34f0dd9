"""Serving under load: colocated vs disagg vs disagg + speculative decoding, same workload, same
request rate(s), measured with `pdcluster loadtest`. Prints one JSON object (stdout).

    python bench/serve.py [--model smollm2] [--rates 1] [--num-prompts 24] [--input-len 128]
                          [--output-len 32] [--slo-ttft-ms 2000] [--slo-tpot-ms 250]
                          [--configs colocated disagg disagg+spec] [--spec ngram] [--out-dir DIR]

Each configuration is a fresh `pdcluster serve` subprocess on 127.0.0.1 (Ray, CPU), started, loaded
and stopped in turn, so they never share the cores. The workload is the random dataset (token-exact
lengths, fixed seed, ignore_eos): every configuration gets the same prompts at the same Poisson times.
Result files land in --out-dir, so `pdcluster loadtest --compare A.json B.json` works on them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from pdcluster.cli.main import main as pdcluster_main
from pdcluster.tools.server_process import ServeProcess

CONFIGS = {
    "colocated": ["--mode", "colocated"],
    "disagg": ["--mode", "disagg", "--transport", "tcp"],
    "disagg+spec": ["--mode", "disagg", "--transport", "tcp"],  # + --spec (below)
    "local": ["--mode", "local"],  # one in-process engine, no Ray: the floor of the others' overhead
}
KEPT = ("completed", "failed", "request_throughput", "request_goodput", "slo_attainment", "output_throughput",
        "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "p99_e2el_ms")


def run_config(name: str, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    flags = ["--model", args.model, "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "2048",
             *CONFIGS[name]]
    if name == "disagg+spec":
        flags += ["--spec", args.spec, "--num-spec-tokens", str(args.num_spec_tokens)]
    started = time.monotonic()
    server = ServeProcess(flags, log_path=out_dir / f"{name}.serve.log", timeout_s=600, stop_timeout_s=60)
    print(f"bench/serve.py: {name} ready in {time.monotonic() - started:.0f} s at {server.base_url}",
          file=sys.stderr, flush=True)
    result_path = out_dir / f"{name}.json"
    try:
        rates = ["--sweep", args.rates] if "," in args.rates else ["--request-rate", args.rates]
        rc = pdcluster_main(["loadtest", "--base-url", server.base_url, "--model", args.model, "--dataset", "random",
                             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                             "--num-prompts", str(args.num_prompts), *rates, "--seed", "0",
                             "--num-warmups", str(args.num_warmups),
                             "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
                             "--label", name, "--result-json", str(result_path),
                             "--plot", str(out_dir / f"{name}.png"), "--no-progress"])
    finally:
        server.close()
    if rc not in (0, 1):
        raise RuntimeError(f"loadtest against {name} failed with status {rc}")
    data = json.loads(result_path.read_text())
    return data["sweep"] if "sweep" in data else [data]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rates", default="1", help="request rate, or comma-separated rates (a sweep)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", default="128", help="random dataset prompt tokens (N, LOW:HIGH, normal:M:S)")
    p.add_argument("--output-len", default="32")
    p.add_argument("--slo-ttft-ms", type=float, default=2000)
    p.add_argument("--slo-tpot-ms", type=float, default=250)
    p.add_argument("--configs", nargs="+", default=["colocated", "disagg", "disagg+spec"], choices=tuple(CONFIGS))
    p.add_argument("--spec", default="ngram", choices=("ngram", "mtp"), help="speculative method of disagg+spec")
    p.add_argument("--num-spec-tokens", type=int, default=3)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--num-warmups", type=int, default=4, help="unmeasured requests before the first rate")
    p.add_argument("--out-dir", default=None, help="result JSONs, plots and server logs (default: a temp dir)")
    args = p.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pdcluster-bench-serve-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"model": args.model, "dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
               "num_prompts": args.num_prompts, "rates": args.rates, "slo_ttft_ms": args.slo_ttft_ms,
               "slo_tpot_ms": args.slo_tpot_ms, "spec": f"{args.spec} k={args.num_spec_tokens}",
               "out_dir": str(out_dir), "results": {}}
    for name in args.configs:
        runs = run_config(name, args, out_dir)
        summary["results"][name] = [
            {"request_rate": r["request_rate"], **{k: r.get(k) for k in KEPT},
             "ttft_breakdown_ms": {k: v for k, v in (r.get("ttft_breakdown") or {}).items() if k != "count"},
             "spec_decode_acceptance_rate": (r.get("server_metrics") or {}).get("spec_decode_acceptance_rate")}
            for r in runs]
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
