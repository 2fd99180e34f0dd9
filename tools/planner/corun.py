"""How much slower a worker's steps run beside another worker on the same host (part of `pdcluster
profile`), and how the bare engine runs now against the fits (``bare_drift``, for served.py's factors).
Both time the same fixed probe: two 256-token prompts, then a batch of 8 decoding."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

from pdcluster.tools.planner.costs import CostModel, attn_pairs
from pdcluster.tools.planner.cpu_meter import CpuMeter, others_cores
from pdcluster.tools.planner.steps import DecodeBatch, RandomPrompts, bare_engine, clear_requests, greedy, timed_step

CTX = mp.get_context("spawn")
CORUN_READY_TIMEOUT_S = 180.0
PROBE_KINDS = ("prefill", "prefill", "decode", "decode", "decode", "decode", "decode", "decode")


def probe_step_times(engine, prompts: RandomPrompts) -> list[float]:
    """Step times of a fixed probe (kinds in PROBE_KINDS): two 256-token prompts, then a batch of 8
    decoding at context 256."""
    times = []
    for _ in range(2):
        engine.add_request(prompts.make(256), greedy(1))
        times.append(timed_step(engine))
        clear_requests(engine)
    batch = DecodeBatch(engine, prompts, 256, max_tokens=32)
    batch.grow_to(8)
    times += [timed_step(engine) for _ in range(6)]
    clear_requests(engine)
    return times


CORUN_ROUNDS = 3  # alone / together pairs per partner kind


def bare_drift(engine, prompts: RandomPrompts, cost: CostModel) -> dict[str, float]:
    """How the bare engine runs now against the fits (``cost``), per step kind: the probe's prefill and
    decode steps over what the fits predict for them. The served probe divides by this, so the host's
    speed drifting between the grid and the served probe (minutes apart) does not count as serving cost."""
    times = probe_step_times(engine, prompts)
    ratios = {"prefill": [], "decode": []}
    for seconds, kind in zip(times, PROBE_KINDS):
        if kind == "prefill":
            predicted = cost.step_s(256, attn_pairs(256, 0))
        else:  # batch 8 over a 256-token prompt (probe steps 1-6 of it)
            predicted = cost.step_s(0, 0.0, 8, 8 * 260)
        ratios[kind].append(seconds / predicted)
    return {kind: statistics.median(r) for kind, r in ratios.items()}


def _corun_child(model: str, threads: int, dtype: str, partner: str, ready, run, stop, limit_s: float,
                 device: str = "cpu") -> None:
    """Another worker on this host, while ``run`` is set, until told to stop (or ``limit_s``):
    ``partner`` "decode" decodes at batch 8; "prefill" computes 256-token prompts back to back (a
    prefill worker under load). Paused (``run`` clear), it sleeps."""
    os.dup2(2, 1)
    engine = bare_engine(model, threads, 1024, 512, seed=1, dtype=dtype, device=device)
    prompts = RandomPrompts(engine.arch.vocab_size, 7)
    ready.set()
    deadline = time.monotonic() + limit_s
    while not stop.is_set() and time.monotonic() < deadline:
        if not run.wait(0.05):
            continue
        if partner == "prefill":
            engine.add_request(prompts.make(256), greedy(1))
            engine.step()
            clear_requests(engine)
            continue
        if not engine.has_unfinished():
            batch = DecodeBatch(engine, prompts, 256, max_tokens=4096 // 8)
            batch.grow_to(8)
        engine.step()


def _corun_beside(engine, prompts: RandomPrompts, model: str, threads: int, partner: str, log) -> dict | None:
    """The probe alone and beside a ``partner`` engine in another process, CORUN_ROUNDS times in turn
    (the partner paused in between), so a host whose speed drifts over minutes (a shared VM: 20-30%
    here) biases neither side: each together-probe is compared with the alone-probe just before it.
    Slowdown per probe kind, the CPU-share effect of other work measured meanwhile taken out (what is
    left is memory bandwidth, caches and the host's own contention between busy cores)."""
    ready, run, stop = CTX.Event(), CTX.Event(), CTX.Event()
    child = CTX.Process(target=_corun_child,
                        args=(model, threads, engine.config.dtype, partner, ready, run, stop, 600.0,
                              engine.config.device), daemon=True)
    child.start()
    alone_all, together_all, ratios = [], [], {"prefill": [], "decode": []}
    cores = os.cpu_count() or 1
    try:
        if not ready.wait(CORUN_READY_TIMEOUT_S):
            log(f"profile: the co-run {partner} engine did not start in time; its slowdown not measured")
            return None
        for _ in range(CORUN_ROUNDS):
            meter = CpuMeter()
            alone = probe_step_times(engine, prompts)
            alone_cpu = meter.read()
            run.set()
            time.sleep(0.2)  # the partner is into its steps
            meter = CpuMeter()
            together = probe_step_times(engine, prompts)
            together_cpu = meter.read()
            run.clear()
            time.sleep(0.2)
            share_alone = min(1.0, cores / (threads + others_cores(alone_cpu)))
            share_together = min(1.0, cores / (2 * threads + others_cores(together_cpu)))
            cpu_effect = share_alone / share_together
            for a, b, kind in zip(alone, together, PROBE_KINDS):
                if a > 0:
                    ratios[kind].append(b / a / cpu_effect)
            alone_all.append(alone)
            together_all.append(together)
    finally:
        stop.set()
        run.set()
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(5)
    by_kind = {kind: max(1.0, statistics.median(r)) for kind, r in ratios.items()}
    every = ratios["prefill"] + ratios["decode"]
    return {"slowdown": max(1.0, statistics.median(every)), "by_probe_kind": by_kind, "rounds": CORUN_ROUNDS,
            "alone_s": alone_all, "together_s": together_all}


def measure_corun(engine, prompts: RandomPrompts, model: str, threads: int, log) -> dict:
    """Slowdowns beside a second engine: ``beside[partner][kind]`` is how much slower a ``kind`` step
    ("prefill" / "decode") runs while the partner runs ``partner`` steps (a decode worker runs beside a
    prefill worker in every disaggregated pair). ``slowdown`` (beside a decoding partner, all probes)
    is kept for older readers."""
    beside = {}
    out = {"slowdown": 1.0, "measured": False, "probe_kinds": list(PROBE_KINDS)}
    for partner in ("decode", "prefill"):
        result = _corun_beside(engine, prompts, model, threads, partner, log)
        if result is None:
            continue
        beside[partner] = result["by_probe_kind"]
        out[f"with_{partner}"] = result
        if partner == "decode":
            out["slowdown"] = result["slowdown"]
            out["measured"] = True
    out["beside"] = beside
    return out
