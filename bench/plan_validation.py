"""How well `pdcluster plan` predicts real runs on this box: 1P1D, 1P2D and colocated x2 at three
request rates, each measured with `pdcluster loadtest` against a real `pdcluster serve`, and each
predicted from a `pdcluster profile` of the same engine settings on the same workload (same seed:
same prompt lengths and arrival times). Prints and writes one JSON object.

    python bench/plan_validation.py --profile profile.json [--configs 1P1D 1P2D colocatedx2]
        [--rates 0.3,0.5,0.7] [--num-prompts 40] [--input-len 128] [--output-len 32] [--dtype float32]
        [--overhead-ms 0] [--out bench/results/plan_validation.json] [--out-dir DIR]
    python bench/plan_validation.py --profile profile.json --measured-from bench/results/plan_validation.json
        (predict again for the runs recorded there, without serving anything)

Every configuration is a fresh server (Ray on 127.0.0.1, CPU, `--num-threads` left to the launcher: one
thread per worker on 2 cores); the rates of one configuration run one after another on it, rate i with
seed 7919 * i (new prompts, so the prefix cache does not carry one rate's prompts into the next). The
planner simulates every worker on one host with ``os.cpu_count()`` shared cores.

Other work on the machine changes the measured figures, so each run records the 1-minute load average
before and after and the CPU used while it ran (tools/planner/cpu_meter.py): by the workers, by our
other processes (HTTP server, router, Ray, this load-test client) and by everything else. Two
predictions per run: "as_profiled" (the background load the profile saw) and "load_aware" (told the
CPU everything but the workers used during that run: an input about the machine, not the outcome).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pdcluster.cli.main import main as pdcluster_main
from pdcluster.tools.planner.costs import load_cost_model
from pdcluster.tools.planner.cpu_meter import CpuMeter
from pdcluster.tools.planner.shape import parse_shape
from pdcluster.tools.planner.simulate import SimConfig, simulate
from pdcluster.tools.planner.summary import summarize
from pdcluster.tools.planner.workload import random_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)

SEED_STRIDE = 7919
SERVE_FLAGS = {
    "disagg": ["--mode", "disagg", "--transport", "tcp"],
    "colocated": ["--mode", "colocated"],
}
COMPARED = ("mean_ttft_ms", "mean_tpot_ms", "p90_ttft_ms", "p90_tpot_ms", "request_throughput")


def measure(config: str, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    from pdcluster.tools.server_process import ServeProcess

    shape = parse_shape(config)
    flags = ["--model", "smollm2", "--dtype", args.dtype, "--max-model-len", "2048", *SERVE_FLAGS[shape.mode],
             "--num-decode", str(shape.num_decode)]
    if shape.mode == "disagg":
        flags += ["--num-prefill", str(shape.num_prefill)]
    started = time.monotonic()
    server = ServeProcess(flags, log_path=out_dir / f"{config}.serve.log", timeout_s=600, stop_timeout_s=60)
    print(f"plan_validation: {config} ready in {time.monotonic() - started:.0f} s at {server.base_url}",
          file=sys.stderr, flush=True)
    runs = []
    try:
        for i, rate in enumerate(args.rates):
            seed = i * SEED_STRIDE
            path = out_dir / f"{config}-{rate:g}.json"
            load_before = os.getloadavg()[0]
            meter = CpuMeter(os.getpid(), server.proc.pid)
            rc = pdcluster_main(["loadtest", "--base-url", server.base_url, "--model", "smollm2", "--dataset", "random",
                                 "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                                 "--num-prompts", str(args.num_prompts), "--request-rate", str(rate), "--seed", str(seed),
                                 "--num-warmups", "2" if i == 0 else "1", "--label", f"{config}@{rate:g}",
                                 "--result-json", str(path), "--no-progress"])
            cpu = meter.read()
            if rc not in (0, 1):
                raise RuntimeError(f"loadtest against {config} at {rate} req/s failed with status {rc}")
            result = json.loads(path.read_text())
            runs.append({"config": config, "request_rate": rate, "seed": seed,
                         "load_avg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
                         "cpu": cpu, "completed": result["completed"], "failed": result["failed"],
                         "measured": {k: result.get(k) for k in COMPARED},
                         "measured_ttft_breakdown": result.get("ttft_breakdown")})
            print(f"plan_validation: {config} @ {rate:g} req/s: {json.dumps(runs[-1]['measured'])} cpu {cpu}",
                  file=sys.stderr, flush=True)
    finally:
        server.close()
    return runs


def background_of(run: dict) -> float | None:
    """CPU the workers did not get during the run: everything but the worker processes (other jobs on
    the machine, and our own HTTP server, router, Ray daemons and load-test client)."""
    cpu = run.get("cpu") or {}
    value = cpu.get("besides_workers_cores", cpu.get("others_cores"))
    return None if value is None else float(value)


def predict(run: dict, args: argparse.Namespace, cost, background: float | None) -> dict:
    """``background`` None: as profiled (blind to the run's conditions)."""
    requests = random_workload(args.num_prompts, run["request_rate"], str(args.input_len), str(args.output_len),
                               run["seed"])
    config = SimConfig(parse_shape(run["config"]), shared_cores=float(os.cpu_count() or 1),
                       overhead_s=args.overhead_ms / 1e3, background_cores=background)
    results, workers = simulate(cost, config, requests)
    s = summarize(results, config.overhead_s)
    return {"background_cores": cost.profile_background_cores if background is None else background,
            **{k: s.get(k) for k in COMPARED}, "ttft_breakdown": s["ttft_breakdown"],
            "utilization": {w: v["utilization"] for w, v in workers.items()}}


def errors(measured: dict, predicted: dict) -> dict:
    out = {}
    for k in COMPARED:
        m, p = measured.get(k), predicted.get(k)
        out[k] = None if not m or p is None else round(100.0 * (p - m) / m, 1)
    return out


def mean_abs(runs: list[dict], which: str) -> dict:
    out = {}
    for k in ("mean_ttft_ms", "mean_tpot_ms"):
        errs = [abs(r["error_pct"][which][k]) for r in runs if r["error_pct"][which][k] is not None]
        out[k] = round(sum(errs) / len(errs), 1) if errs else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--configs", nargs="+", default=["1P1D", "1P2D", "colocatedx2"])
    p.add_argument("--rates", default="0.3,0.5,0.7")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="serve --dtype; the profile must use the same")
    p.add_argument("--overhead-ms", type=float, default=0.0, help="plan --overhead-ms")
    p.add_argument("--measured-from", default=None, help="a previous output: predict again, serve nothing")
    p.add_argument("--out", default="bench/results/plan_validation.json")
    p.add_argument("--out-dir", default=None, help="load-test results and server logs (default: a temp dir)")
    args = p.parse_args()
    args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    cost = load_cost_model(args.profile)
    if args.measured_from:
        previous = json.loads(Path(args.measured_from).read_text())
        w = previous["workload"]
        args.num_prompts, args.input_len, args.output_len = w["num_prompts"], w["input_len"], w["output_len"]
        runs = [{k: v for k, v in r.items() if k not in ("predicted", "error_pct")} for r in previous["runs"]]
        out_dir = None
    else:
        out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pdcluster-plan-validation-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        runs = [r for config in args.configs for r in measure(config, args, out_dir)]
    for run in runs:
        run["predicted"] = {"as_profiled": predict(run, args, cost, None),
                            "load_aware": predict(run, args, cost, background_of(run))}
        run["error_pct"] = {which: errors(run["measured"], p) for which, p in run["predicted"].items()}
    profile = json.loads(Path(args.profile).read_text())
    summary = {
        "what": "pdcluster plan predictions vs pdcluster loadtest against pdcluster serve on this box",
        "machine": {"cpus": os.cpu_count()},
        "profile": {"path": str(args.profile), "model": profile.get("model"), "dtype": profile.get("dtype"),
                    "threads": profile.get("threads"), "corun_slowdown": profile.get("corun", {}).get("slowdown"),
                    "load_avg_during_profile": [profile.get("host", {}).get("load_avg_at_start"),
                                                profile.get("host", {}).get("load_avg_at_end")],
                    "fits": profile.get("fits")},
        "workload": {"dataset": "random", "num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "arrival": "poisson", "ignore_eos": True},
        "plan_settings": {"shared_cores": os.cpu_count(), "overhead_ms": args.overhead_ms,
                          "as_profiled": "background CPU load as during the profile (host.background_cores)",
                          "load_aware": "background = the CPU everything but the workers used during the run"},
        "mean_abs_error_pct": {which: mean_abs(runs, which) for which in ("as_profiled", "load_aware")},
        "out_dir": str(out_dir) if out_dir else None,
        "runs": runs,
    }
    emit_json(summary, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
