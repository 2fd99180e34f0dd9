"""The engine's host work per decode step, without the model: what a GPU waits on between steps.

On a GPU a decode step is the model's kernels plus the Python around them (scheduling, the mirror
update, input preparation, sampling bookkeeping, outputs); on the H100 that Python was 0.4 ms of a
2.1 ms batch-1 step and ~2.7 ms of a 5.2 ms batch-128 step (bench/results/gpu_check_h100.json). This
script measures that Python on this machine: the tiny-random model's forward is replaced by a function
that returns zeros and its LM head by one over 256 token ids, so each step is the engine's own host work
(with greedy argmax over 256 logits a row). Decode batches of 1, 32, 128 and 256 requests after a prompt
of --context tokens; median of --steps steps. Prints JSON (and writes it with --out).

With --async-scheduling the engine launches each step before finishing the previous one (launch-ahead,
engine/async_scheduler.py): the runner's half of the host work runs on its own thread beside the
scheduler's, and the step time is what the two leave between launches (the GIL lets them overlap only
where numpy and torch release it).

    python bench/host_overhead.py [--context 512] [--steps 50] [--async-scheduling] [--streaming-outputs] [--out F.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stubbed_engine(batch: int, context: int, steps: int, async_scheduling: bool = False, streaming: bool = False,
                   graph_path: bool = False, prefix_caching: bool = False):
    """The tiny-random engine with its forward and LM head stubbed (zeros; a 256-id head), ``batch``
    requests of ``context`` prompt tokens past their prefill, each with room for 2 x ``steps`` more
    decode steps: a decode step is then the engine's own host work."""
    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.sampling_params import SamplingParams

    prefill_steps = batch * context // max(2048, batch) + 8  # the first requests decode meanwhile
    max_tokens = 3 * steps + 32 + prefill_steps  # the timed, the profiled and the phase-timed steps
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    max_model_len = context + max_tokens + 16
    engine = LLMEngine.from_config(EngineConfig(
        model=str(resolve_model("tiny-random", progress=False)), device="cpu", dtype="float32", max_num_seqs=batch,
        num_kv_blocks=batch * (-(-max_model_len // 16)) + 16, max_model_len=max_model_len,
        max_num_batched_tokens=max(2048, batch), enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling),
        progress=False)
    engine.cumulative_outputs = not streaming  # streaming: new tokens only, as the serving workers ask
    model = engine.runner.model
    hidden_size = model.embed_tokens.shape[1]
    model.forward = lambda ids, *args, **kwargs: torch.zeros(ids.shape[0], hidden_size)
    model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], 256)
    if graph_path:  # a GPU's decode path: inputs staged through the arenas, steps through the (emulated) graphs
        from pdcluster.engine.step_inputs import StepInputs

        engine.runner.inputs = StepInputs("cpu", staged=True)
        engine.runner.use_decode_graphs(emulate=True)
    for i in range(batch):
        engine.add_request([5 + (i * 7 + j) % 200 for j in range(context)], params)
    for _ in range(10_000):  # prefill done: every request running with a token out
        engine.step()
        running = engine.scheduler.running
        if len(running) == batch and all(r.output_token_ids for r in running):
            break
    return engine


def host_step_ms(batch: int, context: int, steps: int, profile: str | None = None, async_scheduling: bool = False,
                 streaming: bool = False, graph_path: bool = False, gc_freeze: bool = True, phases: bool = False,
                 worker_events: bool = False) -> dict:
    from pdcluster.engine.gc_heap import frozen

    engine = stubbed_engine(batch, context, steps, async_scheduling, streaming, graph_path,
                            prefix_caching=worker_events)  # as `serve` runs its workers
    step = _with_worker_events(engine) if worker_events else engine.step
    if not gc_freeze:
        return _timed_steps(engine, batch, steps, profile, phases, step)
    with frozen():  # as a serving process does once its engine is built (engine/gc_heap.py)
        return _timed_steps(engine, batch, steps, profile, phases, step)


def _with_worker_events(engine):
    """A turn of a decode worker's engine thread in a Ray cluster: the engine's step, then the step's events built
    from its outputs (``DecodeWorker._emit_step``) and the turn's KV events (``WorkerLoop.publish_kv_events``),
    each encoded for the router's socket (``EventPusher``; the send itself left out)."""
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.node.events import EVENT_CODEC
    from pdcluster.node.worker_loop import WorkerLoop

    class _Worker:  # what _emit_step and publish_kv_events read of their worker
        worker_id = "decode-0-3c6414"

        def __init__(self):
            self.engine = engine

        def emit(self, event) -> None:
            EVENT_CODEC.encode(event)

        def _emit_tokens(self, out) -> None:
            DecodeWorker._emit_tokens(self, out)

    worker = _Worker()

    def step():
        DecodeWorker._emit_step(worker, engine.step())
        WorkerLoop.publish_kv_events(worker)

    return step


def _timed_steps(engine, batch: int, steps: int, profile: str | None, phases: bool = False, step=None) -> dict:
    step = step or engine.step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats(profile).print_stats(30)
    breakdown = None
    if phases:  # bench/host_phases.py: the same breakdown gpu_check takes on the GPU machine
        from host_phases import host_phases, torch_calls_per_step

        breakdown = host_phases(engine, steps, lambda: None)
        breakdown["torch_calls"] = torch_calls_per_step(engine, 5)
    assert len(engine.scheduler.running) == batch, "requests finished during the timing"
    # The mean too: a collection's pause lands in a few steps, which the median leaves out and a decode's
    # throughput does not.
    out = {"step_ms": round(statistics.median(times) * 1e3, 3), "mean_step_ms": round(statistics.fmean(times) * 1e3, 3),
           "us_per_request": round(statistics.median(times) * 1e6 / batch, 2)}
    if engine._stepper is not None:
        out["steps_launched_ahead"] = engine.num_steps_launched_ahead
    if breakdown is not None:
        out["host_phases"] = breakdown
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", nargs="?", const="tottime", default=None, choices=("tottime", "cumulative"),
                    help="cProfile the steps too (printed to stderr), sorted by own (default) or cumulative time")
    ap.add_argument("--async-scheduling", action="store_true", help="launch each step before finishing the previous one")
    ap.add_argument("--streaming-outputs", action="store_true",
                    help="outputs carry each step's new tokens only (the serving workers' setting), not every "
                         "request's whole output (LLMEngine's default)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the start-up objects in the garbage collector's sight (engine/gc_heap.py: the serving "
                         "processes freeze them)")
    ap.add_argument("--graph-path", action="store_true",
                    help="the GPU's decode path: step inputs staged through the host/device arenas and decode steps "
                         "through CUDA graphs, emulated (the graph's forward is the stub)")
    ap.add_argument("--worker-events", action="store_true",
                    help="each step also builds the decode worker's events from its outputs and the turn's KV events, "
                         "and encodes them for the router (a Ray decode worker's engine thread does that between "
                         "steps); prefix caching on, as `serve` runs its workers")
    ap.add_argument("--phases", action="store_true",
                    help="then time the steps phase by phase and count their torch calls (bench/host_phases.py)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import import_pdcluster
    from json_report import emit_json

    import_pdcluster()
    import torch

    torch.set_num_threads(1)
    result = {"context_tokens": args.context, "steps": args.steps, "async_scheduling": args.async_scheduling,
              "streaming_outputs": args.streaming_outputs, "graph_path": args.graph_path,
              "gc_freeze": not args.no_gc_freeze, "worker_events": args.worker_events,
              "batches": {b: host_step_ms(int(b), args.context, args.steps, args.profile, args.async_scheduling,
                                          args.streaming_outputs, args.graph_path, not args.no_gc_freeze,
                                          args.phases, args.worker_events)
                          for b in args.batches.split(",")}}
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
