"""Engine throughput on CPU: prefill and decode tokens/s at batch 1, 8 and 32, ours beside
transformers' `generate` on the same prompts, in the same run. Prints JSON.

    python bench/engine.py [--model smollm2] [--dtypes float32 bfloat16] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    text = "The history of computing is a story of people, machines and ideas. " * 40
    ids = tokenizer.encode(text)
    return [ids[i : i + prompt_len] for i in range(batch)]


def bench_ours(model: str, dtype: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(model=model, dtype=dtype, num_kv_blocks=2048,
                                    max_num_batched_tokens=max(2048, batch * prompt_len),
                                    enable_prefix_caching=False), progress=False)
    prompts = _prompts(engine.tokenizer, batch, prompt_len)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm caches
    # One run: prefill ends when every request has its first token; decode is the rest.
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    t_prefill = None
    while engine.has_unfinished():
        engine.step()
        if t_prefill is None and all(r.output_token_ids for r in engine.scheduler.running) and not engine.scheduler.waiting:
            t_prefill = time.perf_counter()
    t_end = time.perf_counter()
    prefill_s = t_prefill - t0
    decode_s = t_end - t_prefill
    return {"prefill_tok_s": batch * prompt_len / prefill_s, "decode_tok_s": batch * (new_tokens - 1) / decode_s}


def bench_transformers(model_dir, dtype: str, batch: int, prompt_len: int, new_tokens: int, tokenizer) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(_prompts(tokenizer, batch, prompt_len))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        m.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        m(ids, attention_mask=mask)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total_s = time.perf_counter() - t0
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"prefill_tok_s": batch * prompt_len / prefill_s, "decode_tok_s": batch * (new_tokens - 1) / decode_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = resolve_model(args.model, progress=False)
    tokenizer = Tokenizer(model_dir)
    results = []
    for dtype in args.dtypes:
        for batch in args.batches:
            row = {"dtype": dtype, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
            ours = bench_ours(args.model, dtype, batch, args.prompt_len, args.new_tokens)
            row.update({f"ours_{k}": round(v, 1) for k, v in ours.items()})
            if not args.no_transformers:
                hf = bench_transformers(model_dir, dtype, batch, args.prompt_len, args.new_tokens, tokenizer)
                row.update({f"transformers_{k}": round(v, 1) for k, v in hf.items()})
                row["prefill_ratio"] = round(ours["prefill_tok_s"] / hf["prefill_tok_s"], 2)
                row["decode_ratio"] = round(ours["decode_tok_s"] / hf["decode_tok_s"], 2)
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"model": args.model, "threads": torch.get_num_threads(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
