"""Embeddings throughput: pdcluster's ``LLMEngine.embed`` against vLLM's pooling runner (``LLM(runner="pooling")
.embed``), same model, same token-id prompts, same machine, one after the other. Prints JSON.

    python bench/embeddings.py [--vllm-python /work/vllmenv/bin/python] [--threads 1] [--dtype bfloat16]
                               [--num-prompts 32] [--prompt-len 200] [--out FILE]

SmolLM2-135M, last-token pooling, normalised (vLLM's default for a decoder model), prefix caching off in both. vLLM
needs an instance started as a pooling model for this; pdcluster embeds with the engine that generates.
  batch emb/s      num_prompts / T (T: the wall time of one embed call over every prompt; median of 3, and best)
  batch tok/s      num_prompts x prompt_len / T
  single ms        one prompt's embed call (median of 5, and best)
  agreement        cosine similarity of the two engines' vectors, prompt by prompt (min and mean): both pool the
                   same hidden state, so it shows the two engines' bf16 rounding, not a different definition
Ratios: ours / vLLM for throughputs, vLLM / ours for latencies: > 1.0 means pdcluster is better. Each engine runs in a
process of its own, warmed up first, with ``--threads`` threads (vLLM pinned to cores 0..N-1). "other_processes_cpu_s"
is the noise gauge (the CPU the rest of the machine used meanwhile: ~0 on a quiet box).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from json_report import emit_json  # noqa: E402
from vs_vllm import VLLM_ENV, make_prompts, run_child, vllm_bind  # noqa: E402

NUM_VECTORS_KEPT = 8  # per engine, for the agreement


def timed_embed(embed, prompts: list[list[int]], batch_repeats: int = 3, single_repeats: int = 5) -> dict:
    """``embed(prompts) -> list of vectors``: the figures above, and the vectors of the first prompts. Shared by both
    sides (bench/vllm_embed_side.py imports it) so that both are timed by the same code."""
    embed(prompts[:2])  # warm-up
    batch_s, vectors = [], None
    for _ in range(batch_repeats):
        t0 = time.perf_counter()
        vectors = embed(prompts)
        batch_s.append(time.perf_counter() - t0)
    single_s = []
    for _ in range(single_repeats):
        t0 = time.perf_counter()
        embed(prompts[:1])
        single_s.append(time.perf_counter() - t0)
    n, tokens = len(prompts), sum(len(p) for p in prompts)

    def figures(pick) -> dict:
        return {"batch_emb_s": n / pick(batch_s), "batch_tok_s": tokens / pick(batch_s),
                "single_ms": 1e3 * pick(single_s)}

    return {"median": figures(statistics.median), "best": figures(min),
            "dim": len(vectors[0]), "vectors": [[float(x) for x in v] for v in vectors[:NUM_VECTORS_KEPT]]}


def ours_child(spec_file: str) -> int:
    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    spec = json.loads(Path(spec_file).read_text())
    config = EngineConfig(model="smollm2", dtype=spec["dtype"], enable_prefix_caching=False, num_threads=spec["threads"],
                          max_num_batched_tokens=8192, max_num_seqs=64, num_kv_blocks=2048, seed=0)
    engine = LLMEngine.from_config(config, progress=False)
    result = timed_embed(lambda batch: engine.embed(batch, pooling="last"), spec["prompts"])
    result["torch_threads"] = torch.get_num_threads()
    print("OURS_RESULT " + json.dumps(result), flush=True)
    return 0


def agreement(a: list[list[float]], b: list[list[float]]) -> dict:
    import numpy as np

    cos = [float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y))) for x, y in zip(a, b)]
    return {"cosine_min": min(cos), "cosine_mean": sum(cos) / len(cos), "num_prompts": len(cos)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    p.add_argument("--_ours", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._ours:
        return ours_child(args._ours)
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = resolve_model("smollm2", progress=False)
    prompts = make_prompts(Tokenizer(model_dir), args.num_prompts, args.prompt_len)
    result: dict = {"model": "smollm2", "dtype": args.dtype, "threads": args.threads, "num_prompts": args.num_prompts,
                    "prompt_len": args.prompt_len, "pooling": "last, normalised", "prefix_caching": False}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "dtype": args.dtype, "threads": args.threads}, f)
    try:
        result["pdcluster"] = ours = run_child([sys.executable, str(Path(__file__).resolve()), "--_ours", f.name],
                                               "OURS_RESULT", {}, args.timeout)
        if args.vllm_python:
            env = {**VLLM_ENV, **vllm_bind(args.threads)}
            result["vllm"] = theirs = run_child([args.vllm_python, str(BENCH_DIR / "vllm_embed_side.py"), f.name,
                                                 str(model_dir)], "VLLM_EMBED_RESULT", env, args.timeout)
            result["ratios"] = {
                pick: {"batch_emb_s": ours[pick]["batch_emb_s"] / theirs[pick]["batch_emb_s"],
                       "single_ms": theirs[pick]["single_ms"] / ours[pick]["single_ms"]}
                for pick in ("median", "best")}
            result["agreement"] = agreement(ours["vectors"], theirs["vectors"])
            theirs.pop("vectors")
        ours.pop("vectors")
    finally:
        os.unlink(f.name)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
