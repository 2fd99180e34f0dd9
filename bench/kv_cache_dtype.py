"""What an fp8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2) gives and costs, against the model's own dtype, on this
machine. Prints JSON (and writes --out).

    python bench/kv_cache_dtype.py [--model smollm2] [--dtype bfloat16] [--threads 1] [--out FILE]

- ``pool``: bytes a token and tokens a GiB of pool hold; a KV transfer moves bytes_per_token per prompt token.
- ``decode``: decode step time at ``--batch`` requests of ``--context`` tokens, each dtype's engine timed in turn, A B
  A B (``--repeats`` rounds), the median of each; ratios > 1 mean fp8 is faster.
- ``quality``: for ``--num-prompts`` prompts, each model-dtype greedy continuation (``--num-new`` tokens) is scored
  teacher-forced through an engine over each cache dtype (prompt logprobs): how often the reference token is still
  the top-1 (``top1_agreement``), the mean and max |logprob difference| of the reference tokens, and where each
  cache dtype's own greedy output first leaves the reference (``mean_first_divergence``, ``identical_outputs``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_report import emit_json  # noqa: E402

PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,",
    "List three primary colors:", "Translate to French: Good morning, my friend.", "The quick brown fox",
    "Q: What is 12 times 7?\nA:", "In 1969, the first humans landed on", "The theory of relativity says that",
    "import numpy as np\n\ndef normalize(x):", "My favourite recipe for pancakes is", "The three laws of motion are",
    "SELECT name, age FROM users WHERE", "Photosynthesis is the process by which", "Dear hiring manager,",
    "The history of the Roman Empire begins",
]


def _engine(args, kv: str, **kw):
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    cfg = dict(model=args.model, dtype=args.dtype, kv_cache_dtype=kv, num_threads=args.threads,
               enable_prefix_caching=False, max_num_seqs=max(args.batch, 16), cache_dir=args.cache_dir)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg), progress=False)


def decode_step_ms(engine, batch: int, context: int, num_steps: int) -> float:
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([10 + (i * 13 + j) % 30000 for j in range(context)], params)
    started: set[str] = set()
    for _ in range(10_000):
        started.update(o.request_id for o in engine.step() if o.num_output_tokens)
        if len(started) == batch:
            break
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished() and steps < 10 * num_steps:
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / max(steps, 1) * 1e3


def quality(args, kv_names: list[str]) -> dict:
    from pdcluster.engine.sampling_params import SamplingParams

    prompts = (PROMPTS * (1 + args.num_prompts // len(PROMPTS)))[: args.num_prompts]
    greedy = SamplingParams(max_tokens=args.num_new, temperature=0.0, ignore_eos=True)
    ref_engine = _engine(args, "auto", num_kv_blocks=2048)
    refs = ref_engine.generate(prompts, greedy)
    seqs = [list(o.prompt_token_ids) + list(o.token_ids) for o in refs]
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    ref_scores = [o.prompt_logprobs for o in ref_engine.generate(seqs, score)]
    del ref_engine
    out: dict = {}
    for kv in kv_names:
        engine = _engine(args, kv, num_kv_blocks=2048)
        scored = [o.prompt_logprobs for o in engine.generate(seqs, score)]
        own = engine.generate(prompts, greedy)
        top1, diffs = [], []
        for ref_out, ref_lp, lp in zip(refs, ref_scores, scored):
            start = len(ref_out.prompt_token_ids) - 1  # prompt_logprobs[i]: token i + 1 given the ones before
            for a, b in zip(ref_lp[start:], lp[start:]):
                top1.append(b.rank == 1)
                diffs.append(abs(a.logprob - b.logprob))
        divergence = []
        for ref_out, o in zip(refs, own):
            first = next((i for i, (a, b) in enumerate(zip(ref_out.token_ids, o.token_ids)) if a != b), args.num_new)
            divergence.append(first)
        out[kv] = {"top1_agreement": round(sum(top1) / len(top1), 4),
                   "mean_abs_logprob_diff": round(statistics.fmean(diffs), 5),
                   "max_abs_logprob_diff": round(max(diffs), 4),
                   "identical_outputs": sum(d == args.num_new for d in divergence), "of": len(prompts),
                   "mean_first_divergence": round(statistics.fmean(divergence), 1)}
        del engine
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=480)
    p.add_argument("--num-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--num-new", type=int, default=64)
    p.add_argument("--kv", nargs="+", default=["fp8", "fp8_e5m2"])
    p.add_argument("--cache-dir", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()

    import torch

    result: dict = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                    "torch_threads": torch.get_num_threads() if not args.threads else args.threads}
    pool = {}
    for kv in ["auto", *args.kv]:
        e = _engine(args, kv, num_kv_blocks=16)
        pool[kv] = {"cache_dtype": str(e.kv_cache.dtype).removeprefix("torch."),
                    "bytes_per_token": e.kv_spec.bytes_per_token,
                    "tokens_per_gib": (1 << 30) // e.kv_spec.bytes_per_token}
        del e
    result["pool"] = pool

    times: dict[str, list[float]] = {kv: [] for kv in ["auto", *args.kv]}
    engines = {kv: _engine(args, kv, num_kv_blocks=args.batch * (-(-(args.context + 2 * args.num_steps) // 16)) + 16)
               for kv in times}
    for _ in range(args.repeats):
        for kv, engine in engines.items():
            times[kv].append(decode_step_ms(engine, args.batch, args.context, args.num_steps))
    del engines
    median = {kv: statistics.median(t) for kv, t in times.items()}
    result["decode"] = {"batch": args.batch, "context_tokens": args.context, "num_steps": args.num_steps,
                        "step_ms": {kv: [round(x, 2) for x in t] for kv, t in times.items()},
                        "median_step_ms": {kv: round(m, 2) for kv, m in median.items()},
                        "speed_vs_auto": {kv: round(median["auto"] / median[kv], 3) for kv in args.kv}}
    result["quality"] = quality(args, ["auto", *args.kv])
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
