"""Saturated offline throughput on a CPU at several ``max_num_seqs`` caps: why the CPU default stays 64 (vLLM's CPU
serving default is 128; engine/batch_limits.py). Every prompt is queued at once (random ids, prefix cache off), so
the cap is the decode batch; the figure is output tokens over the whole run (prefill included). Prints JSON.

    python bench/cpu_max_num_seqs.py [--caps 64 128 256 64] [--num-prompts 256] [--prompt-len 256] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import random
import time


def run(cap: int, args) -> dict:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
                                                max_num_seqs=cap, num_threads=args.threads), progress=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    engine.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0))
    seconds = time.perf_counter() - t0
    return {"max_num_seqs": cap, "seconds": round(seconds, 2),
            "output_tok_s": round(args.num_prompts * args.output_len / seconds, 1),
            "num_kv_blocks": engine.kv_spec.num_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="0 = torch's default (every core)")
    ap.add_argument("--caps", type=int, nargs="+", default=[64, 128, 256, 64])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    results = [run(cap, args) for cap in args.caps]
    print(json.dumps({"settings": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
