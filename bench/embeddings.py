"""Embeddings throughput: pdcluster's ``LLMEngine.embed`` against vLLM's pooling runner (``LLM(runner="pooling")
.embed``), same model, same token-id prompts, same machine, one after the other. Prints JSON.

    python bench/embeddings.py [--vllm-python /work/vllmenv/bin/python] [--threads 1] [--dtype bfloat16]
                               [--num-prompts 32] [--prompt-len 200] [--task embed|classify] [--out FILE]
                               [--model smollm2|bge-small|modernbert-base]
                               [--served [--served-modes colocated local disagg] [--no-offline]]

``--task classify``: the same model served as a cross-encoder by both (``hf_overrides`` RERANKER_OVERRIDES: vLLM's
conversion of a causal reranker, the LM head's "yes" row less its "no" row), ``LLMEngine.classify`` against vLLM's
``LLM.classify``; "emb" in the figures is then one classification, and the agreement the largest difference of
the two engines' probabilities.

``--model bge-small``: an encoder of bge-small-en-v1.5's shape (BertModel, 12 layers, hidden 384; random weights made
by transformers, engine/models/tiny_bert.py BGE_SMALL), [CLS] pooling, normalised (vLLM's default for BERT); each
prompt is [CLS] + text + [SEP]. ``--model modernbert-base``: the same with ModernBERT-base's shape (ModernBertModel,
22 layers, hidden 768, a band of 64 tokens either side in two layers of three, rotary; tiny_bert MODERNBERT_BASE).

SmolLM2-135M, last-token pooling, normalised (vLLM's default for a decoder model), prefix caching off in both. vLLM
needs an instance started as a pooling model for this; pdcluster embeds with the engine that generates.
  batch emb/s      num_prompts / T (T: the wall time of one embed call over every prompt; median of 3, and best)
  batch tok/s      num_prompts x prompt_len / T
  single ms        one prompt's embed call (median of 5, and best)
  agreement        cosine similarity of the two engines' vectors, prompt by prompt (min and mean): both pool the
                   same hidden state, so it shows the two engines' bf16 rounding, not a different definition
Served (``--served``): ``vllm serve --runner pooling`` and ``pdcluster serve --mode M``, each alone on the box, each
server's default threading, prefix caching off, driven by the same client, ``pdcluster loadtest --endpoint
embeddings`` (random 256-token prompts, 64 at 2 req/s): requests/s, E2E latency, the server tree's peak RSS.
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
from vs_vllm import VLLM_CLI, VLLM_ENV, free_port, make_prompts, run_child, serve_one, vllm_bind  # noqa: E402

NUM_VECTORS_KEPT = 8  # per engine, for the agreement
# --task classify: SmolLM2 as a one-label cross-encoder, the same overrides on both sides.
RERANKER_OVERRIDES = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                      "method": "from_2_way_softmax"}


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
    classify = spec.get("task") == "classify"
    config = EngineConfig(model=spec["model_dir"], dtype=spec["dtype"], enable_prefix_caching=False,
                          num_threads=spec["threads"], max_num_batched_tokens=8192, max_num_seqs=64,
                          num_kv_blocks=2048, seed=0, max_model_len=spec["max_model_len"],
                          hf_overrides=json.dumps(RERANKER_OVERRIDES) if classify else "")
    engine = LLMEngine.from_config(config, progress=False)
    pooling = spec["pooling"]
    run = (lambda batch: engine.classify(batch)) if classify else (lambda batch: engine.embed(batch, pooling=pooling))
    result = timed_embed(run, spec["prompts"])
    result["torch_threads"] = torch.get_num_threads()
    print("OURS_RESULT " + json.dumps(result), flush=True)
    return 0


# ---- served ---------------------------------------------------------------------------------------------------
SERVED_KEYS = ("completed", "failed", "duration", "request_throughput", "total_input_tokens", "mean_e2el_ms",
               "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms")


def drive_loadtest(args, model_dir: Path, port: int, work: Path, label: str) -> dict:
    """``pdcluster loadtest --endpoint embeddings`` against the server on ``port`` (the same client for both)."""
    import subprocess

    out = work / f"{label}.json"
    cmd = [str(Path(sys.executable).parent / "pdcluster"), "loadtest", "--no-progress", "--no-server-metrics",
           "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2", "--tokenizer", str(model_dir),
           "--endpoint", "embeddings", "--dataset", "random", "--random-input-len", str(args.served_input_len),
           "--num-prompts", str(args.served_prompts), "--request-rate", str(args.request_rate), "--seed", "0",
           "--num-warmups", "2", "--result-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"pdcluster loadtest failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    raw = json.loads(out.read_text())
    return {k: raw.get(k) for k in SERVED_KEYS}


def served(args, model_dir: Path) -> dict:
    out: dict = {"settings": {"input_len": args.served_input_len, "num_prompts": args.served_prompts,
                              "request_rate": args.request_rate, "threads": "each server's default",
                              "client": "pdcluster loadtest --endpoint embeddings"}}
    with tempfile.TemporaryDirectory(prefix="embeddings_served_") as tmp:
        work = Path(tmp)
        port = free_port()
        vllm_cmd = [args.vllm_python, "-c", VLLM_CLI, "serve", str(model_dir), "--runner", "pooling",
                    "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--served-model-name",
                    "smollm2", "--no-enable-prefix-caching", "--max-model-len", "1024"]
        out["vllm"] = serve_one(args, model_dir, "vllm", vllm_cmd, VLLM_ENV, port, work, drive=drive_loadtest)
        for mode in args.served_modes:
            port = free_port()
            cmd = [str(Path(sys.executable).parent / "pdcluster"), "serve", "--mode", mode, "--host", "127.0.0.1",
                   "--port", str(port), "--dtype", args.dtype, "--no-prefix-caching", "--served-model-name",
                   "smollm2"]
            out[f"pdcluster_{mode}"] = ours = serve_one(args, model_dir, mode, cmd, {}, port, work,
                                                        drive=drive_loadtest)
            theirs = out["vllm"]
            out[f"ratios_{mode}"] = {
                "request_throughput": ours["request_throughput"] / theirs["request_throughput"],
                **{k: theirs[k] / ours[k] for k in ("mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
                                                     "peak_rss_mib")}}
    return out


def encoder_dir(model: str) -> Path:
    """The random-weight encoder of bge-small's or ModernBERT-base's shape, built once into the bench cache."""
    from pdcluster.engine.models.registry import default_cache_dir
    from pdcluster.engine.models.tiny_bert import BGE_SMALL, MODERNBERT_BASE, build_tiny_bert

    kind, shape = {"bge-small": ("bert", BGE_SMALL), "modernbert-base": ("modernbert", MODERNBERT_BASE)}[model]
    out = Path(default_cache_dir()) / "bench" / f"{model}-shape"
    if not (out / "config.json").is_file():
        build_tiny_bert(out, kind, shape=shape)
    return out


def agreement(a: list[list[float]], b: list[list[float]], task: str = "embed") -> dict:
    import numpy as np

    if task == "classify":
        diff = [float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b)]
        return {"probs_max_abs_diff": max(diff), "probs_mean_abs_diff": sum(diff) / len(diff), "num_prompts": len(diff)}
    cos = [float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y))) for x, y in zip(a, b)]
    return {"cosine_min": min(cos), "cosine_mean": sum(cos) / len(cos), "num_prompts": len(cos)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--task", default="embed", choices=["embed", "classify"])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "bge-small", "modernbert-base"])
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--served", action="store_true", help="also serve both (vllm serve --runner pooling against "
                   "pdcluster serve) and drive them with pdcluster loadtest --endpoint embeddings")
    p.add_argument("--served-modes", nargs="+", default=["colocated"], choices=["colocated", "local", "disagg"])
    p.add_argument("--served-prompts", type=int, default=64)
    p.add_argument("--served-input-len", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--server-start-timeout", type=float, default=600)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--_ours", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._ours:
        return ours_child(args._ours)
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    encoder = args.model != "smollm2"
    if encoder and (args.task != "embed" or args.served):
        p.error(f"--model {args.model} measures offline embeddings only")
    model_dir = encoder_dir(args.model) if encoder else resolve_model("smollm2", progress=False)
    tokenizer = Tokenizer(model_dir)
    if encoder:  # [CLS] text [SEP], as the tokenizer's template makes a prompt
        cls, sep = tokenizer.encode("", add_special_tokens=True)
        prompts = [[cls, *body, sep] for body in make_prompts(tokenizer, args.num_prompts, args.prompt_len - 2)]
    else:
        prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_len)
    pooling = "cls" if encoder else "last"
    result: dict = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "num_prompts": args.num_prompts,
                    "prompt_len": args.prompt_len, "task": args.task, "prefix_caching": False,
                    **({"hf_overrides": RERANKER_OVERRIDES} if args.task == "classify"
                       else {"pooling": f"{pooling}, normalised"})}
    if args.served and not args.vllm_python:
        p.error("--served needs --vllm-python")
    if args.served and args.task != "embed":
        p.error("--served measures embeddings only")
    if args.served:
        result["served"] = served(args, model_dir)
    if args.no_offline:
        emit_json(result, args.out)
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "dtype": args.dtype, "threads": args.threads, "task": args.task,
                   "model_dir": str(model_dir), "pooling": pooling, "max_model_len": 512 if encoder else 1024,
                   "hf_overrides": RERANKER_OVERRIDES if args.task == "classify" else None}, f)
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
            result["agreement"] = agreement(ours["vectors"], theirs["vectors"], args.task)
            theirs.pop("vectors")
        ours.pop("vectors")
    finally:
        os.unlink(f.name)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
