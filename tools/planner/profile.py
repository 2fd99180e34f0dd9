"""`pdcluster profile`: measure one worker's costs on the real engine and fit them (costs.py).

Every figure is a real ``LLMEngine.step()`` (scheduler, forward pass, sampler: what a worker's engine
thread runs) at the thread count a worker gets, or a real KV transport moving a request's KV:

- prefill: one prompt of each size alone (chunked as the engine chunks), and a few batches of prompts
  in one step;
- decode: a grid of batch sizes x context lengths. A batch is built cheaply from the prefix cache: one
  request computes the prompt, the others share it and compute only its last block;
- mixed: a decode batch plus a new prompt in one step (colocated workers run these), to check the
  mixed-step model;
- transfer: a request's KV, layer by layer, through the real transport (default tcp) between two
  endpoints in this process, end to end (send to the receiver's acknowledgement);
- co-run: the same probe steps while a second engine decodes in another process: the slowdown workers
  sharing a host see even with a core each. Other work on the machine slows both probes too: the CPU
  the rest of the machine used during each is measured (cpu_meter.py) and its share taken out, so what
  is recorded is the memory/cache contention alone (``corun.slowdown``).

The CPU other work used while the step times were measured is recorded as ``host.background_cores``:
the planner treats the fits as a worker's speed beside that much background load.

The JSON keeps the raw points next to the fits, so a profile can be re-fitted or plotted later.

The measuring is split by job: grid.py (what to measure), steps.py (step times), transfer.py, corun.py
(co-run slowdown and the drift probe) and served.py (a real worker pair); this module runs them in
order and fits the points.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict

import numpy as np

from pdcluster.engine.kv_cache import num_blocks_for_budget
from pdcluster.tools.planner.corun import bare_drift, measure_corun
from pdcluster.tools.planner.costs import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    CostModel,
    fit_batch_table,
    fit_linear,
)
from pdcluster.tools.planner.cpu_meter import CpuMeter, others_cores
from pdcluster.tools.planner.grid import ProfileGrid
from pdcluster.tools.planner.served import measure_served
from pdcluster.tools.planner.steps import (RandomPrompts, bare_engine, decode_max_tokens, least_disturbed,
                                           measure_decode, measure_prefill, warm_up)
from pdcluster.tools.planner.transfer import measure_transfer


def run_profile(model: str = "smollm2", threads: int = 1, grid: ProfileGrid | None = None,
                transport: str = "tcp", seed: int = 0, dtype: str = "auto",
                log=lambda msg: print(msg, file=sys.stderr, flush=True), device: str = "cpu") -> dict:
    """Measure, fit and return the profile (a JSON-able dict; costs.CostModel.from_profile reads it)."""
    grid = grid or ProfileGrid()
    started = time.monotonic()
    load_at_start = os.getloadavg()[0]
    longest = max([*grid.prefill_sizes, *grid.decode_contexts, *(n for _, n in grid.prefill_batches)])
    max_batch = max(grid.decode_batches + tuple(b for b, _, _ in grid.mixed))
    steps = decode_max_tokens(grid)
    max_model_len = longest + steps + 64
    # The largest prompt batch, or the largest decode batch (its own blocks past the shared prompt)
    # plus the mixed prompts that join it; with room, and never less than the probe needs.
    prompt_blocks = max(-(-longest // 16) * 2, max(k * -(-n // 16) for k, n in grid.prefill_batches))
    pool = prompt_blocks + (max_batch + len(grid.mixed) + 2) * (-(-(steps + 64) // 16) + 2) + 256
    engine = bare_engine(model, threads, max_model_len, pool, seed, dtype, device)
    spec = engine.kv_spec
    meter = CpuMeter()
    prompts = RandomPrompts(engine.arch.vocab_size, seed)
    log(f"profile: {model} ({engine.dtype_name}) on {engine.config.device}, {threads} thread(s), loaded in "
        f"{time.monotonic() - started:.1f} s")
    warm_up(engine, prompts, grid)
    t = time.monotonic()
    prefill = measure_prefill(engine, prompts, grid)
    log(f"profile: prefill, {len(prefill)} steps in {time.monotonic() - t:.1f} s")
    t = time.monotonic()
    decode, mixed = measure_decode(engine, prompts, grid)
    log(f"profile: decode grid, {len(decode)} points ({len(mixed)} mixed) in {time.monotonic() - t:.1f} s")
    background = meter.read()
    log(f"profile: other work used {others_cores(background):.2f} cores meanwhile")
    t = time.monotonic()
    transfer = measure_transfer(spec, transport, grid) if transport != "none" else []
    log(f"profile: {transport} transfer, {len(transfer)} points in {time.monotonic() - t:.1f} s")
    corun = {"slowdown": 1.0, "measured": False}
    if grid.corun:
        t = time.monotonic()
        corun = measure_corun(engine, prompts, model, threads, log)
        log(f"profile: co-run slowdowns {corun.get('beside')} in {time.monotonic() - t:.1f} s")
    fits = {
        "prefill": fit_linear(least_disturbed(prefill, ("tokens", "attn", "num_requests")), PREFILL_FEATURES).__dict__,
        "decode": fit_linear(decode, DECODE_FEATURES).__dict__,
        "decode_table": asdict(fit_batch_table(decode)),
        "transfer": (fit_linear(least_disturbed(transfer, ("bytes",)), TRANSFER_FEATURES).__dict__ if transfer
                     else {"intercept": 0.0, "coef": {"bytes": 0.0}, "mean_rel_err": 0.0, "max_rel_err": 0.0,
                           "num_points": 0}),
    }
    serve_pool = num_blocks_for_budget(spec.bytes_per_block, 1.0)  # `pdcluster serve`'s default KV budget
    cfg = engine.config
    profile = {
        "version": 1,
        "model": model,
        "dtype": engine.dtype_name,
        "device": engine.config.device,
        "threads": threads,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
                 "load_avg_at_start": load_at_start, "background_cores": others_cores(background),
                 "background_cpu": background},
        "engine": {"block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                   "prefill_chunk_size": cfg.prefill_chunk_tokens, "max_num_seqs": cfg.max_num_seqs,
                   "kv_capacity_tokens": serve_pool * cfg.block_size},
        "kv_bytes_per_token": spec.bytes_per_token,
        "num_layers": spec.num_layers,
        "transport": transport,
        "fits": fits,
        "corun": corun,
        "points": {"prefill": prefill, "decode": decode, "mixed": mixed, "transfer": transfer},
    }
    model_check = CostModel.from_profile(profile)
    if grid.served and transport != "none":
        t = time.monotonic()
        before = bare_drift(engine, prompts, model_check)
        served = measure_served(model_check, model, dtype, threads, transport, seed, log, engine.config.device)
        after = bare_drift(engine, prompts, model_check)
        if served["measured"]:
            drift = {kind: (before[kind] + after[kind]) / 2.0 for kind in before}
            served["raw_prefill_factor"], served["raw_decode_factor"] = served["prefill_factor"], served["decode_factor"]
            served["bare_drift"] = {"before": before, "after": after}
            served["prefill_factor"] = max(1.0, served["raw_prefill_factor"] / drift["prefill"])
            served["decode_factor"] = max(1.0, served["raw_decode_factor"] / drift["decode"])
        profile["served"] = served
        log(f"profile: served over bare steps: prefill x{profile['served']['prefill_factor']:.2f}, "
            f"decode x{profile['served']['decode_factor']:.2f} in {time.monotonic() - t:.1f} s")
    for p in mixed:  # how well "decode model + prefill terms" predicts a measured mixed step
        p["predicted_s"] = model_check.step_s(p["tokens"], p["attn"], p["batch"], p["context"])
    if mixed:
        errs = [abs(p["predicted_s"] - p["seconds"]) / p["seconds"] for p in mixed]
        fits["mixed_check"] = {"mean_rel_err": float(np.mean(errs)), "max_rel_err": float(np.max(errs))}
    profile["host"]["load_avg_at_end"] = os.getloadavg()[0]
    profile["seconds"] = round(time.monotonic() - started, 1)
    return profile
