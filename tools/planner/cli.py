"""`pdcluster profile` and `pdcluster plan`.

    pdcluster profile --model smollm2 --threads 1 --out profile.json
    pdcluster plan --profile profile.json --config 1P1D --config colocatedx2 --rate 2 --num-prompts 60 \\
        --dataset random --input-len 256 --output-len 64 --shared-cores 2 --slo-ttft-ms 2000 --slo-tpot-ms 200
    pdcluster plan --profile profile.json --search --gpus 64 --rate 40 --slo-ttft-ms 1000 --slo-tpot-ms 100

cli/main.py registers both with ``add_planner_parsers(sub)``. Mistakes in the arguments raise ValueErrors
(ProfileError, ShapeError, WorkloadError, PlanError) that the top-level CLI prints as one line, exit 2.
profile.py (the engine, torch: 1.5 s) is imported by `profile` alone, not by every `pdcluster` start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from pdcluster.engine.config import DETERMINISTIC_ENV, DTYPES, ConfigError, EngineConfig
from pdcluster.tools.loadtest.arrivals import ARRIVALS
from pdcluster.tools.planner import workload as wl
from pdcluster.tools.planner.costs import load_cost_model
from pdcluster.tools.planner.grid import ProfileGrid
from pdcluster.tools.planner.search import Searcher, Target, search
from pdcluster.tools.planner.shape import parse_shape
from pdcluster.tools.planner.simulate import SimConfig, simulate
from pdcluster.tools.planner.summary import summarize


class PlanError(ValueError):
    pass


def add_planner_parsers(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure a worker's step and transfer costs for `pdcluster plan`",
                              description="Measure prefill, decode and mixed step times, KV bytes, transfer times "
                                          "and the co-run slowdown on the real engine; write the fits and points.")
    p.add_argument("--model", default="smollm2", help="built-in name (smollm2, tiny-random) or an HF model directory")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="as `pdcluster serve --dtype` (auto: the checkpoint's; bf16 is slow on CPUs without avx512_bf16)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, as one worker gets them (serve on 2 cores: 1 each with 2+ workers)")
    p.add_argument("--device", default="auto",
                   help="as `pdcluster serve --device`: auto (CUDA where torch sees a GPU), cpu, cuda or cuda:N. "
                        "Steps are timed synchronously (no async scheduling): one step's cost, not an overlap")
    p.add_argument("--transport", default="tcp", choices=("tcp", "shm", "ucx", "nccl", "none"),
                   help="KV transport to time (none: no transfer cost)")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds; for tests and tiny models)")
    p.add_argument("--no-corun", action="store_true", help="skip the co-run slowdown (a second engine process)")
    p.add_argument("--no-served", action="store_true",
                   help="skip timing a real prefill/decode worker pair (served over bare step factors)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="profile the engine with batch-invariant kernels (default: the engine's default, see README)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.set_defaults(func=profile_main)

    q = subparsers.add_parser("plan", help="simulate xPyD / colocated deployments from a profile",
                              description="Predict TTFT/TPOT percentiles, throughput and goodput of cluster shapes "
                                          "under a workload, from a `pdcluster profile` JSON; --search finds the "
                                          "shape with the most goodput per device at the SLOs.")
    q.add_argument("--profile", required=True, help="JSON written by `pdcluster profile`")
    q.add_argument("--config", action="append", default=None,
                   help="xPyD (1P1D, 4P12D) or colocatedxN (colocatedx2); repeat to compare (default 1P1D)")
    w = q.add_argument_group("workload")
    w.add_argument("--dataset", default="random", help="random, sharegpt, humaneval or a JSONL file of prompts")
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--input-len", default="256", help="random: N, LOW:HIGH or normal:MEAN:STD")
    w.add_argument("--output-len", default="64", help="random: same forms; other datasets: a fixed N or per dataset")
    w.add_argument("--rate", type=float, default=None, help="requests/s (Poisson by default)")
    w.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    w.add_argument("--burst-size", type=int, default=8)
    w.add_argument("--seed", type=int, default=0, help="as `pdcluster loadtest --seed`: the same requests and times")
    w.add_argument("--trace", default=None, help='JSONL of {"arrival_s", "input_len", "output_len"} instead')
    m = q.add_argument_group("model of the deployment")
    m.add_argument("--shared-cores", type=float, default=0.0,
                   help="all workers share this many CPU cores on one host (this box: 2); 0 = a device each")
    m.add_argument("--overhead-ms", type=float, default=0.0,
                   help="fixed serving cost added to every TTFT (HTTP, router, control plane)")
    m.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="a decode worker's KV pool in tokens (default: the profile's, serve's 1 GiB; 0 = unlimited)")
    s = q.add_argument_group("SLOs and search")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--search", action="store_true",
                   help="find the xPyD (x + y <= --gpus) meeting both SLOs at --rate with the most goodput per device")
    s.add_argument("--gpus", type=int, default=64)
    s.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    s.add_argument("--out", default=None, help="also write the JSON here")
    q.set_defaults(func=plan_main)


def profile_main(args: argparse.Namespace) -> int:
    from pdcluster.tools.planner.profile import run_profile  # torch: see the docstring

    if args.threads < 1:
        raise PlanError(f"--threads: must be at least 1, got {args.threads}")
    try:  # a device torch cannot see is refused here, before anything is measured
        device = EngineConfig(device=args.device).resolve_device()
    except ConfigError as e:
        raise PlanError(f"--device: {str(e).removeprefix('device: ')}") from None
    out = Path(args.out)
    if not out.parent.exists():
        raise PlanError(f"--out: directory {out.parent} does not exist")
    if args.deterministic is not None:
        # Through the environment: it reaches every engine the profile builds, the co-run child process too.
        os.environ[DETERMINISTIC_ENV] = "1" if args.deterministic else "0"
    grid = ProfileGrid.quick() if args.quick else ProfileGrid()
    if args.no_corun:
        grid = ProfileGrid(**{**grid.__dict__, "corun": False})
    if args.no_served:
        grid = ProfileGrid(**{**grid.__dict__, "served": False})
    profile = run_profile(args.model, args.threads, grid, args.transport, args.seed, args.dtype, device=device)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    fits = profile["fits"]
    print(json.dumps({"out": str(out), "seconds": profile["seconds"], "fits": fits,
                      "corun_slowdown": profile["corun"]["slowdown"],
                      "corun_beside": profile["corun"].get("beside"),
                      "served": {k: v for k, v in profile.get("served", {}).items() if not k.endswith("_steps")}},
                     indent=2))
    return 0


def _workload(args: argparse.Namespace, model: str):
    if args.trace:
        if args.search:
            raise PlanError("--search: needs a dataset and --rate (it varies the rate), not --trace")
        return lambda rate: wl.trace_workload(args.trace)
    if args.rate is None or not (args.rate > 0):
        raise PlanError(f"--rate: give a request rate > 0 requests/s (or --trace FILE), got {args.rate}")
    if args.num_prompts < 1:
        raise PlanError(f"--num-prompts: must be at least 1, got {args.num_prompts}")

    def make(rate: float):
        # A search simulates at rates far above --rate: keep at least a minute of arrivals there.
        n = args.num_prompts if not args.search else min(20_000, max(args.num_prompts, math.ceil(rate * 60)))
        if args.dataset == "random":
            return wl.random_workload(n, rate, args.input_len, args.output_len, args.seed, args.arrival, args.burst_size)
        out_len = int(args.output_len) if str(args.output_len).isdigit() else None
        return wl.dataset_workload(args.dataset, n, rate, model, args.seed, out_len, args.arrival, args.burst_size)

    return make


def plan_main(args: argparse.Namespace) -> int:
    shapes = [parse_shape(c) for c in (args.config or ["1P1D"])]  # bad strings fail before any work
    for flag, value in (("--shared-cores", args.shared_cores), ("--overhead-ms", args.overhead_ms)):
        if value < 0:
            raise PlanError(f"{flag}: must be >= 0, got {value}")
    if not 0 < args.attainment <= 1:
        raise PlanError(f"--attainment: must be in (0, 1], got {args.attainment}")
    cost = load_cost_model(args.profile)
    make = _workload(args, cost.model or "smollm2")
    overhead_s = args.overhead_ms / 1e3
    if args.search:
        out = _search(args, cost, make, overhead_s)
    else:
        requests = make(args.rate)
        out = {"profile": str(args.profile), "model": cost.model, "threads_per_worker": cost.threads,
               "shared_cores": args.shared_cores, "overhead_ms": args.overhead_ms,
               "workload": {"dataset": args.dataset if not args.trace else None, "trace": args.trace,
                            "num_prompts": len(requests), "request_rate": args.rate, "arrival": args.arrival,
                            "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed},
               "results": {}}
        for shape in shapes:
            config = SimConfig(shape, args.shared_cores, overhead_s, args.kv_capacity_tokens)
            results, workers = simulate(cost, config, requests)
            out["results"][shape.name] = {**summarize(results, overhead_s, args.slo_ttft_ms, args.slo_tpot_ms),
                                          "workers": workers}
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _search(args: argparse.Namespace, cost, make, overhead_s: float) -> dict:
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise PlanError("--search: give both --slo-ttft-ms and --slo-tpot-ms")
    if args.gpus < 2:
        raise PlanError(f"--gpus: must be at least 2 (one prefill, one decode), got {args.gpus}")
    if args.shared_cores:
        raise PlanError("--search: sizes deployments of one device per worker; drop --shared-cores")
    searcher = Searcher(cost, make, Target(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment), overhead_s,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    return {"profile": str(args.profile), "model": cost.model, **search(searcher, args.rate, args.gpus)}
