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
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from pdcluster.tools.planner.costs import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    CostModel,
    attn_pairs,
    fit_batch_table,
    fit_linear,
)
from pdcluster.tools.planner.cpu_meter import CpuMeter, others_cores

CTX = mp.get_context("spawn")
MAX_STEPS_PER_PHASE = 64  # every stepping loop below is bounded by this
CORUN_READY_TIMEOUT_S = 180.0
TRANSFER_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure. The default takes about a minute and a half for smollm2 (float32, one thread,
    a quiet 2-core box); several times that when other work shares the cores."""

    prefill_sizes: tuple[int, ...] = (32, 128, 256, 512, 1024)
    prefill_batches: tuple[tuple[int, int], ...] = ((4, 128),)  # (prompts, tokens each)
    decode_contexts: tuple[int, ...] = (128, 512, 1024)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_steps: int = 4  # timed steps per grid point (the fastest counts: see least_disturbed)
    mixed: tuple[tuple[int, int, int], ...] = ((4, 512, 256), (16, 512, 128))  # (batch, context, prompt)
    transfer_blocks: tuple[int, ...] = (64, 16, 4, 1)
    reps: int = 2
    corun: bool = True
    served: bool = True  # time a real prefill/decode pair's steps too (served.py)

    @classmethod
    def quick(cls) -> "ProfileGrid":
        """A small grid (tests, tiny models): seconds, not minutes."""
        return cls(prefill_sizes=(16, 64, 128), prefill_batches=((2, 64),), decode_contexts=(64, 256),
                   decode_batches=(1, 4, 8), decode_steps=2, mixed=((4, 64, 64),), transfer_blocks=(8, 2),
                   reps=2, corun=False, served=False)


class _Prompts:
    """Random prompts with distinct tokens (no prefix-cache hits between them)."""

    def __init__(self, vocab_size: int, seed: int):
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab_size

    def make(self, n: int) -> list[int]:
        low = min(100, self._vocab // 4)
        return self._rng.integers(low, self._vocab - 1, size=n).tolist()


def _engine(model: str, threads: int, max_model_len: int, num_kv_blocks: int, seed: int, dtype: str = "auto"):
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    config = EngineConfig(model=model, dtype=dtype, num_threads=threads, max_model_len=max_model_len,
                          num_kv_blocks=num_kv_blocks, seed=seed)
    return LLMEngine(config, progress=False)


def _params(max_tokens: int):
    from pdcluster.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def _clear(engine) -> None:
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    for _ in range(4):  # the runner and scheduler drop aborted state on the next step
        if not engine.has_pending():
            break
        engine.step()


def warm_up(engine, prompts: _Prompts, grid: ProfileGrid) -> None:
    """A prompt of the largest size and a few decode steps, not timed: the first steps of a fresh
    engine also pay one-off costs (thread pools, the C kernels' library, allocator growth) that
    would land on the first measured point, the smallest prompt, and tilt the prefill fit."""
    engine.add_request(prompts.make(max(grid.prefill_sizes)), _params(4))
    for _ in range(MAX_STEPS_PER_PHASE):
        if not engine.has_unfinished():
            break
        engine.step()
    _clear(engine)


def measure_prefill(engine, prompts: _Prompts, grid: ProfileGrid) -> list[dict]:
    """One point per step: prompt tokens computed, attention pairs, seconds."""
    chunk_size = engine.config.prefill_chunk_size
    points = []
    for n in grid.prefill_sizes:
        for _ in range(grid.reps):
            engine.add_request(prompts.make(n), _params(1))
            done = 0
            for _ in range(MAX_STEPS_PER_PHASE):
                if not engine.has_unfinished():
                    break
                chunk = min(chunk_size, n - done)
                seconds = _timed_step(engine)
                points.append({"tokens": chunk, "attn": attn_pairs(chunk, done), "num_requests": 1,
                               "prompt_tokens": n, "seconds": seconds})
                done += chunk
            _clear(engine)
    for k, n in grid.prefill_batches:
        for _ in range(grid.reps):
            for _ in range(k):
                engine.add_request(prompts.make(n), _params(1))
            seconds = _timed_step(engine)
            points.append({"tokens": k * n, "attn": k * attn_pairs(n, 0), "num_requests": k, "prompt_tokens": n,
                           "seconds": seconds})
            _clear(engine)
    return points


class _DecodeBatch:
    """Requests decoding over one shared prompt of ``context`` tokens (built from the prefix cache)."""

    def __init__(self, engine, prompts: _Prompts, context: int, max_tokens: int):
        self.engine = engine
        self.prompt = prompts.make(context)
        self.max_tokens = max_tokens
        self.engine.add_request(self.prompt, _params(max_tokens))
        self._settle()

    def _settle(self) -> None:
        """Step until every request is decoding (no prompt left to compute)."""
        sched = self.engine.scheduler
        for _ in range(MAX_STEPS_PER_PHASE):
            if not sched.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running):
                return
            self.engine.step()
        raise RuntimeError("profile: a decode batch did not settle within the step bound")

    def grow_to(self, batch: int) -> None:
        for _ in range(batch - len(self.engine.scheduler.running)):
            self.engine.add_request(self.prompt, _params(self.max_tokens))
        self._settle()

    def features(self) -> dict:
        running = self.engine.scheduler.running
        return {"batch": len(running), "context": sum(r.num_computed_tokens + 1 for r in running)}

    def time_steps(self, n: int) -> dict:
        point = self.features()
        point["seconds"] = min(_timed_step(self.engine) for _ in range(n))
        return point


def decode_max_tokens(grid: ProfileGrid) -> int:
    """Output tokens a decode-grid request may need: every step of its context's phase, with room."""
    return 2 * (len(grid.decode_batches) * (grid.decode_steps + 4) + 4 * len(grid.mixed) + 8)


def least_disturbed(points: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One point per configuration: the fastest of its repetitions. Other work on the machine only
    ever makes a step slower, so the minimum is the best estimate of the engine's own cost; the
    planner adds contention back from the load it is told about (simulate.py)."""
    best: dict[tuple, dict] = {}
    for p in points:
        key = tuple(p[k] for k in keys)
        if key not in best or p["seconds"] < best[key]["seconds"]:
            best[key] = p
    return list(best.values())


def measure_decode(engine, prompts: _Prompts, grid: ProfileGrid) -> tuple[list[dict], list[dict]]:
    """(decode points, mixed points). A mixed point: a decode batch plus one new prompt in one step."""
    decode, mixed = [], []
    for context in grid.decode_contexts:
        batch = _DecodeBatch(engine, prompts, context, max_tokens=decode_max_tokens(grid))
        for b in grid.decode_batches:
            batch.grow_to(b)
            decode.append(batch.time_steps(grid.decode_steps))
            for mb, mctx, n in grid.mixed:
                if (mb, mctx) != (b, context):
                    continue
                point = batch.features()
                engine.add_request(prompts.make(n), _params(4))
                seconds = _timed_step(engine)  # running decodes first, then the new prompt's chunk
                chunk = min(n, engine.config.prefill_chunk_size)
                mixed.append({"batch": point["batch"], "context": point["context"], "tokens": chunk,
                              "attn": attn_pairs(chunk, 0), "seconds": seconds})
        _clear(engine)
    return decode, mixed


def _measure_transfer(kv_spec, transport: str, grid: ProfileGrid) -> list[dict]:
    """A request's KV, one send per layer as the prefill worker streams it, until acknowledged.

    Each size gets its own sender/receiver pair: the tcp sender's staging pool
    (kv_transfer/transports/common/staging.py) looks buffers up by tensor comparison and fails once it
    holds buffers of two sizes, which one pair moving several sizes would provoke."""
    points = []
    for blocks in grid.transfer_blocks:
        points += _transfer_points(kv_spec, transport, blocks, grid.reps + 1)
    return points


def _transfer_points(kv_spec, transport: str, blocks: int, reps: int) -> list[dict]:
    import torch

    from pdcluster.kv_transfer.transports import TransportConfig, get_transport_class

    cls = get_transport_class(transport)
    shape = (kv_spec.num_layers, 2, blocks, kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)
    config = TransportConfig(timeout_s=TRANSFER_TIMEOUT_S, secret="pdcluster-profile", admit_unexpected=True)
    src = cls.allocate_kv_cache(shape, kv_spec.dtype)
    dst = cls.allocate_kv_cache(shape, kv_spec.dtype)
    src.view(torch.uint8).random_(0, 255)
    receiver = cls(dst, "receiver", config)
    sender = cls(src, "sender", config)
    points = []
    try:
        sender.connect("decode", receiver.local_descriptor())
        ids = np.arange(blocks)
        for i in range(reps + 1):  # the first one only warms the buffers up
            t0 = time.perf_counter()
            for layer in range(kv_spec.num_layers):
                sender.send("decode", f"t{i}", [layer], ids, ids)
            delivered, failed = _wait_delivered(sender, f"t{i}")
            seconds = time.perf_counter() - t0
            receiver.poll_received()
            if failed or not delivered:
                raise RuntimeError(f"profile: {transport} transfer of {blocks} blocks failed: {failed}")
            if i:
                points.append({"bytes": blocks * kv_spec.bytes_per_block, "blocks": blocks, "seconds": seconds})
    finally:
        sender.close()
        receiver.close()
    return points


def _wait_delivered(sender, transfer_id: str) -> tuple[bool, list]:
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S + 5
    while time.monotonic() < deadline:
        delivered, failed = sender.poll_sent()
        if transfer_id in delivered or failed:
            return transfer_id in delivered, failed
        time.sleep(0.0002)
    return False, [(transfer_id, "no answer within the bound")]


PROBE_KINDS = ("prefill", "prefill", "decode", "decode", "decode", "decode", "decode", "decode")


def _probe(engine, prompts: _Prompts) -> list[float]:
    """Step times of a fixed probe (kinds in PROBE_KINDS): two 256-token prompts, then a batch of 8
    decoding at context 256."""
    times = []
    for _ in range(2):
        engine.add_request(prompts.make(256), _params(1))
        times.append(_timed_step(engine))
        _clear(engine)
    batch = _DecodeBatch(engine, prompts, 256, max_tokens=32)
    batch.grow_to(8)
    times += [_timed_step(engine) for _ in range(6)]
    _clear(engine)
    return times


CORUN_ROUNDS = 3  # alone / together pairs per partner kind


def bare_drift(engine, prompts: _Prompts, cost: CostModel) -> dict[str, float]:
    """How the bare engine runs now against the fits (``cost``), per step kind: the probe's prefill and
    decode steps over what the fits predict for them. The served probe divides by this, so the host's
    speed drifting between the grid and the served probe (minutes apart) does not count as serving cost."""
    times = _probe(engine, prompts)
    ratios = {"prefill": [], "decode": []}
    for seconds, kind in zip(times, PROBE_KINDS):
        if kind == "prefill":
            predicted = cost.step_s(256, attn_pairs(256, 0))
        else:  # batch 8 over a 256-token prompt (probe steps 1-6 of it)
            predicted = cost.step_s(0, 0.0, 8, 8 * 260)
        ratios[kind].append(seconds / predicted)
    return {kind: statistics.median(r) for kind, r in ratios.items()}


def _corun_child(model: str, threads: int, dtype: str, partner: str, ready, run, stop, limit_s: float) -> None:
    """Another worker on this host, while ``run`` is set, until told to stop (or ``limit_s``):
    ``partner`` "decode" decodes at batch 8; "prefill" computes 256-token prompts back to back (a
    prefill worker under load). Paused (``run`` clear), it sleeps."""
    os.dup2(2, 1)
    engine = _engine(model, threads, 1024, 512, seed=1, dtype=dtype)
    prompts = _Prompts(engine.arch.vocab_size, 7)
    ready.set()
    deadline = time.monotonic() + limit_s
    while not stop.is_set() and time.monotonic() < deadline:
        if not run.wait(0.05):
            continue
        if partner == "prefill":
            engine.add_request(prompts.make(256), _params(1))
            engine.step()
            _clear(engine)
            continue
        if not engine.has_unfinished():
            batch = _DecodeBatch(engine, prompts, 256, max_tokens=4096 // 8)
            batch.grow_to(8)
        engine.step()


def _corun_beside(engine, prompts: _Prompts, model: str, threads: int, partner: str, log) -> dict | None:
    """The probe alone and beside a ``partner`` engine in another process, CORUN_ROUNDS times in turn
    (the partner paused in between), so a host whose speed drifts over minutes (a shared VM: 20-30%
    here) biases neither side: each together-probe is compared with the alone-probe just before it.
    Slowdown per probe kind, the CPU-share effect of other work measured meanwhile taken out (what is
    left is memory bandwidth, caches and the host's own contention between busy cores)."""
    ready, run, stop = CTX.Event(), CTX.Event(), CTX.Event()
    child = CTX.Process(target=_corun_child,
                        args=(model, threads, engine.config.dtype, partner, ready, run, stop, 600.0), daemon=True)
    child.start()
    alone_all, together_all, ratios = [], [], {"prefill": [], "decode": []}
    cores = os.cpu_count() or 1
    try:
        if not ready.wait(CORUN_READY_TIMEOUT_S):
            log(f"profile: the co-run {partner} engine did not start in time; its slowdown not measured")
            return None
        for _ in range(CORUN_ROUNDS):
            meter = CpuMeter()
            alone = _probe(engine, prompts)
            alone_cpu = meter.read()
            run.set()
            time.sleep(0.2)  # the partner is into its steps
            meter = CpuMeter()
            together = _probe(engine, prompts)
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


def measure_corun(engine, prompts: _Prompts, model: str, threads: int, log) -> dict:
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


def run_profile(model: str = "smollm2", threads: int = 1, grid: ProfileGrid | None = None,
                transport: str = "tcp", seed: int = 0, dtype: str = "auto",
                log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Measure, fit and return the profile (a JSON-able dict; costs.CostModel.from_profile reads it)."""
    from pdcluster.engine.kv_cache import num_blocks_for_budget

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
    engine = _engine(model, threads, max_model_len, pool, seed, dtype)
    spec = engine.kv_spec
    meter = CpuMeter()
    prompts = _Prompts(engine.arch.vocab_size, seed)
    log(f"profile: {model} ({engine.dtype_name}), {threads} thread(s), loaded in {time.monotonic() - started:.1f} s")
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
    transfer = _measure_transfer(spec, transport, grid) if transport != "none" else []
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
        "threads": threads,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
                 "load_avg_at_start": load_at_start, "background_cores": others_cores(background),
                 "background_cpu": background},
        "engine": {"block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                   "prefill_chunk_size": cfg.prefill_chunk_size, "max_num_seqs": cfg.max_num_seqs,
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
        from pdcluster.tools.planner.served import measure_served

        t = time.monotonic()
        before = bare_drift(engine, prompts, model_check)
        served = measure_served(model_check, model, dtype, threads, transport, seed, log)
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


def with_grid_overrides(grid: ProfileGrid, **overrides) -> ProfileGrid:
    return replace(grid, **{k: v for k, v in overrides.items() if v is not None})
