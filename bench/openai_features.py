"""What the OpenAI features cost on the offline engine (SmolLM2): decode tokens/s of a batch with
logprobs, with penalties, with a JSON schema, with a thinking budget (each prompt ends in <think>, the budget
closes the section halfway: engine/thinking_budget.py), against the same batch plain; and n=4 parallel sampling
with the prompt forked (engine/forks.py) against four independent requests (prompt tokens computed,
wall time). Medians of --repeats runs, in one process. Prints JSON.

    python bench/openai_features.py [--model smollm2] [--batch 16] [--prompt-len 200] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _engine(model: str, prefix_caching: bool):
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(EngineConfig(model=model, num_kv_blocks=2048, enable_prefix_caching=prefix_caching),
                     progress=False)


def _prompts(engine, batch: int, prompt_len: int, suffix: str = "") -> list[list[int]]:
    ids = engine.tokenizer.encode("The history of computing is a story of people, machines and ideas. " * 60)
    return [ids[i : i + prompt_len] + engine.tokenizer.encode(suffix) for i in range(batch)]


def _decode_tok_s(engine, prompts, params) -> float:
    """Output tokens/s after every request has its first token (the decode phase)."""
    for p in prompts:
        engine.add_request(p, params)
    t_decode, num_at_start, num_out = None, 0, 0
    for _ in range(100_000):
        if not engine.has_unfinished():
            break
        outs = engine.step()
        num_out += sum(len(o.new_token_ids) for o in outs)
        if t_decode is None and all(r.output_token_ids for r in engine.scheduler.running) and not engine.scheduler.waiting:
            t_decode, num_at_start = time.perf_counter(), num_out
    return (num_out - num_at_start) / (time.perf_counter() - t_decode)


def _n4(engine, prompt, params, fork: bool) -> dict:
    before = engine.scheduler.num_prompt_tokens_computed
    t0 = time.perf_counter()
    leader = engine.add_request(prompt, replace(params, seed=1))
    for j in range(1, 4):
        engine.add_request(prompt, replace(params, seed=1 + j), follow=leader if fork else None)
    for _ in range(100_000):
        if not engine.has_unfinished():
            break
        engine.step()
    return {"seconds": time.perf_counter() - t0,
            "prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed - before}


def main() -> None:
    from pdcluster.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    engine = _engine(args.model, prefix_caching=False)
    prompts = _prompts(engine, args.batch, args.prompt_len, "<think>")
    base = SamplingParams(max_tokens=args.new_tokens, temperature=0.8, seed=0)
    variants = {
        "plain": replace(base, ignore_eos=True),
        "logprobs_5": replace(base, ignore_eos=True, logprobs=5),
        "penalties": replace(base, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5,
                             repetition_penalty=1.1, logit_bias=[[28, 1.0]]),
        "json_schema": replace(base, structured_output=json.dumps({"type": "json_schema", "schema": SCHEMA})),
        "thinking_budget": replace(base, ignore_eos=True, thinking_token_budget=args.new_tokens // 2,
                                   reasoning_start_token_ids=engine.tokenizer.encode("<think>"),
                                   reasoning_end_token_ids=engine.tokenizer.encode("</think>")),
    }
    engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm up
    engine.prepare_grammar(variants["json_schema"])  # compiled once per engine, as when serving
    decode = {}
    for name, params in variants.items():
        runs = [_decode_tok_s(engine, prompts, params) for _ in range(args.repeats)]
        decode[name] = {"decode_tok_s": round(statistics.median(runs), 1), "runs": [round(r, 1) for r in runs]}
    for name in variants:
        decode[name]["vs_plain"] = round(decode[name]["decode_tok_s"] / decode["plain"]["decode_tok_s"], 3)

    forked = _engine(args.model, prefix_caching=True)
    long_prompt = _prompts(forked, 1, args.prompt_len)[0]
    n4_params = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)
    _n4(forked, long_prompt[:32], n4_params, fork=True)  # warm up
    n4 = {}
    for fork in (False, True):
        runs = []
        for r in range(args.repeats):
            # A fresh prompt each run so the prefix cache holds nothing of it beforehand.
            runs.append(_n4(forked, [t + 1 + r + 10 * fork for t in long_prompt], n4_params, fork))
        n4["forked" if fork else "independent"] = {
            "seconds": round(statistics.median(x["seconds"] for x in runs), 3),
            "prompt_tokens_computed": runs[0]["prompt_tokens_computed"],
        }
    print(json.dumps({"model": args.model, "dtype": engine.dtype_name, "batch": args.batch,
                      "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "decode": decode,
                      "n4_prompt_len": len(long_prompt), "n4": n4}, indent=2))


if __name__ == "__main__":
    main()
