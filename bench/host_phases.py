"""Where a decode step's host time goes: the engine's phases timed one by one, and the torch calls a step makes.

Used by bench/host_overhead.py (``--phases``: this machine, the model stubbed) and by bench/gpu_check.py (the real
CUDA path, on the GPU machine), so the two breakdowns line up phase for phase. Each step runs after a device
synchronisation: the GPU has nothing queued, so every phase's time is the host's own (a launched-ahead step's
finish then finds its ids copied already). The phases (wrapped methods; a wrapper costs ~1 us, counted in):

- ``schedule``: Scheduler.schedule (the rows of step n + 1);
- ``mirror``: ModelRunner.update_requests (the runner's per-slot arrays from the schedule, S1);
- ``step_rows``: placeholder rows made exact (S4);
- ``prepare_inputs``: the packed inputs, staged to the device (the graph's static buffers on the graph path);
- ``forward``: the CUDA graph's replay (its static copies; the emulated forward where there is no GPU);
- ``launch_sampling``: logits, sampling and the ids' copy to the host queued;
- ``finish``: the ids read, the mirror appended, the runner's output built;
- ``update``: Scheduler.update_from_output (counts committed, stops, step results);
- ``outputs``: the RequestOutputs (LLMEngine._output, per row);
- ``other``: the step's time outside those (the stepper, the engine's own loop).

``torch_calls_per_step`` counts the torch functions and tensor methods a step calls (each is host time, more on a
GPU, where many launch a kernel or a copy), by the engine file and line that made them.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time

PHASES = ("schedule", "mirror", "step_rows", "prepare_inputs", "forward", "launch_sampling", "finish", "update",
          "outputs")


def _wrap(owner, name: str, totals: collections.Counter, phase: str):
    """Replace ``owner.name`` with a timed call (an instance attribute or a module function); returns the undo."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[phase] += time.perf_counter() - t0

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original) if owner.__dict__.get(name) is timed else None


def host_phases(engine, num_steps: int, sync) -> dict:
    """Time ``num_steps`` steps of ``engine`` (a steady decode batch), each after ``sync()``, phase by phase; ms per
    step, and the median step."""
    import pdcluster.engine.model_runner as model_runner

    totals: collections.Counter = collections.Counter()
    runner = engine.runner
    targets = [(engine.scheduler, "schedule", "schedule"), (runner, "update_requests", "mirror"),
               (model_runner, "step_rows", "step_rows"), (model_runner, "prepare_inputs", "prepare_inputs"),
               (runner, "_launch_sampling", "launch_sampling"), (runner, "_finish", "finish"),
               (engine.scheduler, "update_from_output", "update"), (engine, "_output", "outputs")]
    if runner.graphs is not None:
        targets.append((runner.graphs, "run", "forward"))
    undo = [_wrap(owner, name, totals, phase) for owner, name, phase in targets]
    step_times = []
    try:
        for _ in range(num_steps):
            sync()
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
    finally:
        for u in reversed(undo):
            u()
    total = sum(step_times)
    phases = {p: round(totals[p] / num_steps * 1e3, 4) for p in PHASES if p in totals}
    # The timed methods never call one another (each is a leaf of the step), so their times add up: "other" is
    # the rest of the step (the stepper, the engine's loop, the wrappers' own bookkeeping).
    phases["other"] = round((total - sum(totals.values())) / num_steps * 1e3, 4)
    return {"step_ms_median": round(statistics.median(step_times) * 1e3, 4),
            "step_ms_mean": round(total / num_steps * 1e3, 4), "phases_ms": phases}


def torch_calls_per_step(engine, num_steps: int, top: int = 25) -> dict:
    """The torch calls ``num_steps`` steps make, per step, by the pdcluster source line that made each."""
    from torch.overrides import TorchFunctionMode

    counts: collections.Counter = collections.Counter()

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            frame = sys._getframe(1)
            for _ in range(40):  # the nearest engine frame (torch's own wrappers skipped)
                if frame is None or ("/torch/" not in frame.f_code.co_filename
                                     and "/bench/" not in frame.f_code.co_filename):
                    break
                frame = frame.f_back
            where = f"{'/'.join(frame.f_code.co_filename.split('/')[-2:])}:{frame.f_lineno}" if frame else "?"
            counts[f"{getattr(func, '__qualname__', str(func))} @ {where}"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for _ in range(num_steps):
            engine.step()
    total = sum(counts.values())
    return {"per_step": round(total / num_steps, 1),
            "top": {k: round(v / num_steps, 2) for k, v in counts.most_common(top)}}
