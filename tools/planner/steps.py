"""Step times of the bare engine (part of `pdcluster profile`, see profile.py): one prompt of each size
alone and a few prompt batches (prefill), a grid of decode batch sizes x contexts, and decode batches
with a new prompt in the same step (mixed). Each figure is one real ``LLMEngine.step()``."""

from __future__ import annotations

import time

import numpy as np
import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.tools.planner.costs import attn_pairs
from pdcluster.tools.planner.grid import ProfileGrid

MAX_STEPS_PER_PHASE = 64  # every stepping loop below is bounded by this


class RandomPrompts:
    """Random prompts with distinct tokens (no prefix-cache hits between them)."""

    def __init__(self, vocab_size: int, seed: int):
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab_size

    def make(self, n: int) -> list[int]:
        low = min(100, self._vocab // 4)
        return self._rng.integers(low, self._vocab - 1, size=n).tolist()


def bare_engine(model: str, threads: int, max_model_len: int, num_kv_blocks: int, seed: int,
                dtype: str = "auto", device: str = "cpu") -> LLMEngine:
    """An engine whose steps are timed one at a time: synchronous scheduling (on CUDA async is the
    default, and a step launched ahead would overlap the one being timed)."""
    config = EngineConfig(model=model, dtype=dtype, num_threads=threads, max_model_len=max_model_len,
                          num_kv_blocks=num_kv_blocks, seed=seed, device=device, async_scheduling=False)
    return LLMEngine.from_config(config, progress=False)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed_step(engine) -> float:
    """One engine step's wall time; on a GPU up to its last kernel (a step that samples nothing, e.g. a
    prompt's middle chunk, returns once its kernels are queued)."""
    on_gpu = engine.config.device.startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize(engine.config.device)
    t0 = time.perf_counter()
    engine.step()
    if on_gpu:
        torch.cuda.synchronize(engine.config.device)
    return time.perf_counter() - t0


def clear_requests(engine) -> None:
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    for _ in range(4):  # the runner and scheduler drop aborted state on the next step
        if not engine.has_pending():
            break
        engine.step()


def warm_up(engine, prompts: RandomPrompts, grid: ProfileGrid) -> None:
    """A prompt of the largest size and a few decode steps, not timed: the first steps of a fresh
    engine also pay one-off costs (thread pools, the C kernels' library, allocator growth) that
    would land on the first measured point, the smallest prompt, and tilt the prefill fit."""
    engine.add_request(prompts.make(max(grid.prefill_sizes)), greedy(4))
    for _ in range(MAX_STEPS_PER_PHASE):
        if not engine.has_unfinished():
            break
        engine.step()
    clear_requests(engine)


def measure_prefill(engine, prompts: RandomPrompts, grid: ProfileGrid) -> list[dict]:
    """One point per step: prompt tokens computed, attention pairs, seconds."""
    chunk_size = engine.config.prefill_chunk_tokens
    points = []
    for n in grid.prefill_sizes:
        for _ in range(grid.reps):
            engine.add_request(prompts.make(n), greedy(1))
            done = 0
            for _ in range(MAX_STEPS_PER_PHASE):
                if not engine.has_unfinished():
                    break
                chunk = min(chunk_size, n - done)
                seconds = timed_step(engine)
                points.append({"tokens": chunk, "attn": attn_pairs(chunk, done), "num_requests": 1,
                               "prompt_tokens": n, "seconds": seconds})
                done += chunk
            clear_requests(engine)
    for k, n in grid.prefill_batches:
        for _ in range(grid.reps):
            for _ in range(k):
                engine.add_request(prompts.make(n), greedy(1))
            seconds = timed_step(engine)
            points.append({"tokens": k * n, "attn": k * attn_pairs(n, 0), "num_requests": k, "prompt_tokens": n,
                           "seconds": seconds})
            clear_requests(engine)
    return points


class DecodeBatch:
    """Requests decoding over one shared prompt of ``context`` tokens (built from the prefix cache)."""

    def __init__(self, engine, prompts: RandomPrompts, context: int, max_tokens: int):
        self.engine = engine
        self.prompt = prompts.make(context)
        self.max_tokens = max_tokens
        self.engine.add_request(self.prompt, greedy(max_tokens))
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
            self.engine.add_request(self.prompt, greedy(self.max_tokens))
        self._settle()

    def features(self) -> dict:
        running = self.engine.scheduler.running
        return {"batch": len(running), "context": sum(r.num_computed_tokens + 1 for r in running)}

    def time_steps(self, n: int) -> dict:
        point = self.features()
        point["seconds"] = min(timed_step(self.engine) for _ in range(n))
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


def measure_decode(engine, prompts: RandomPrompts, grid: ProfileGrid) -> tuple[list[dict], list[dict]]:
    """(decode points, mixed points). A mixed point: a decode batch plus one new prompt in one step."""
    decode, mixed = [], []
    for context in grid.decode_contexts:
        batch = DecodeBatch(engine, prompts, context, max_tokens=decode_max_tokens(grid))
        for b in grid.decode_batches:
            batch.grow_to(b)
            decode.append(batch.time_steps(grid.decode_steps))
            for mb, mctx, n in grid.mixed:
                if (mb, mctx) != (b, context):
                    continue
                point = batch.features()
                engine.add_request(prompts.make(n), greedy(4))
                seconds = timed_step(engine)  # running decodes first, then the new prompt's chunk
                chunk = min(n, engine.config.prefill_chunk_tokens)
                mixed.append({"batch": point["batch"], "context": point["context"], "tokens": chunk,
                              "attn": attn_pairs(chunk, 0), "seconds": seconds})
        clear_requests(engine)
    return decode, mixed
