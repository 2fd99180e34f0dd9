"""Async scheduling's host time per decode step, in one process: launch-ahead on the caller's thread (the
engine as it is) against the same job on the runner's worker thread (as before 2026-11-27, monkeypatched
back), and the synchronous engine. The model is stubbed by bench/host_overhead.py's stubbed_engine (a
forward of zeros, a 256-id head), so a step is the engine's own host work, what a GPU waits on. Blocks of
10 steps alternate between the three engines, so the box's drift hits all alike; medians. Prints JSON (and
writes it with --out).

    python bench/async_launch_thread.py [--context 512] [--steps 240] [--out bench/results/async_launch_thread.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(batch: int, context: int, steps: int) -> dict:
    from host_overhead import stubbed_engine

    engines = {"caller_thread": stubbed_engine(batch, context, steps, True),
               "worker_thread": stubbed_engine(batch, context, steps, True),
               "sync": stubbed_engine(batch, context, steps, False)}
    stepper = engines["worker_thread"]._stepper
    # The earlier AsyncStepper: the launch-ahead job queued on the worker thread, the caller waiting on it.
    stepper._launch_ahead_here = lambda sched, prev_done: stepper._submit_launch(sched, ahead=True, prev_done=prev_done)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps // 10):
        for name, engine in engines.items():
            for _ in range(10):
                t0 = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t0)
    out = {f"{name}_ms": round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
    out["worker_over_caller"] = round(out["worker_thread_ms"] / out["caller_thread_ms"], 2)
    out["launched_ahead"] = {name: e.num_steps_launched_ahead for name, e in engines.items() if e._stepper is not None}
    for engine in engines.values():
        for request_id in list(engine.scheduler.requests):
            engine.abort_request(request_id)
        while engine.has_unfinished():
            engine.step()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import import_pdcluster
    from json_report import emit_json

    import_pdcluster()
    import torch

    torch.set_num_threads(1)
    result = {"context_tokens": args.context, "steps_per_engine": args.steps, "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        result["batches"][str(batch)] = measure(batch, args.context, args.steps)
        print(batch, result["batches"][str(batch)], file=sys.stderr, flush=True)
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
