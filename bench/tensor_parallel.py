"""Tensor parallelism's cost and agreement: prefill and decode tokens/s of one engine with the model whole and split
over N ranks (engine/tensor_parallel/), the greedy tokens' agreement with the whole model, and the latency of one
all-reduce of a decode step's hidden states between two ranks (two per layer per step). Prints JSON. With
``--pipeline`` the sizes are pipeline stages (engine/pipeline_parallel.py) instead, with rank 0's share of the weights
and of the KV cache's layers.

    python bench/tensor_parallel.py [--model smollm2] [--sizes 1 3] [--dtype bfloat16] [--batches 1 8] [--pipeline]

On a CPU the ranks share the cores (each takes cores / N threads): the split buys memory per rank, not speed, and this
measures what it costs. On GPUs each rank has its own device and bandwidth: there the split is the speed-up.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_report import emit_json  # noqa: E402


def _prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    text = "The history of computing is a story of people, machines and ideas. " * 80
    ids = tokenizer.encode(text)
    return [ids[i : i + prompt_len] for i in range(batch)]


def bench_engine(model: str, dtype: str, tp: int, batches: list[int], prompt_len: int, new_tokens: int,
                 pipeline: bool = False) -> dict:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    from pdcluster.engine.weight_update import served_bytes

    split = {"pipeline_parallel_size" if pipeline else "tensor_parallel_size": tp}
    engine = LLMEngine.from_config(EngineConfig(model=model, dtype=dtype, num_kv_blocks=2048, **split,
                                                max_num_batched_tokens=max(2048, max(batches) * prompt_len),
                                                enable_prefix_caching=False), progress=False)
    try:
        out = {"num_threads_per_rank": torch.get_num_threads(), "rank0_weight_bytes": served_bytes(engine.model),
               "rank0_kv_cache_bytes": engine.kv_cache.numel() * engine.kv_cache.element_size(), "batches": {}}
        for batch in batches:
            prompts = _prompts(engine.tokenizer, batch, prompt_len)
            engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm caches
            for p in prompts:
                engine.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0))
            t0 = time.perf_counter()
            t_prefill, outputs = None, {}
            while engine.has_unfinished():
                for o in engine.step():
                    if o.finished:
                        outputs[o.request_id] = o.token_ids
                if t_prefill is None and all(r.output_token_ids for r in engine.scheduler.running) \
                        and not engine.scheduler.waiting:
                    t_prefill = time.perf_counter()
            t_end = time.perf_counter()
            out["batches"][batch] = {
                "prefill_tok_s": round(batch * prompt_len / (t_prefill - t0), 1),
                "decode_tok_s": round(batch * (new_tokens - 1) / (t_end - t_prefill), 1),
                "decode_step_ms": round((t_end - t_prefill) / (new_tokens - 1) * 1e3, 2),
                "tokens": [outputs[k] for k in sorted(outputs)],
            }
        return out
    finally:
        engine.close()


def _allreduce_peer(shm_path: str, shape: tuple[int, ...], reps: int) -> None:
    from pdcluster.engine.tensor_parallel.group import TPGroup

    torch.set_num_threads(1)
    group = TPGroup.join(1, 2, torch.device("cpu"), shm_path=shm_path)
    x = torch.ones(shape, dtype=torch.bfloat16)
    for _ in range(20 + reps):
        group.all_reduce_(x)


def allreduce_us(hidden: int, rows: int, reps: int = 500) -> float:
    """Two CPU ranks' all-reduce of [rows, hidden] bf16 (shared memory: shm_allreduce.py), in microseconds (rank 0's
    mean)."""
    from pdcluster.engine.tensor_parallel.group import TPGroup
    from pdcluster.engine.tensor_parallel.shm_allreduce import create_segment, remove_segment

    path = create_segment(2)
    peer = multiprocessing.get_context("spawn").Process(target=_allreduce_peer, args=(path, (rows, hidden), reps),
                                                        daemon=True)
    peer.start()
    group = TPGroup.join(0, 2, torch.device("cpu"), shm_path=path)
    x = torch.ones((rows, hidden), dtype=torch.bfloat16)
    for _ in range(20):
        group.all_reduce_(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        group.all_reduce_(x)
    us = (time.perf_counter() - t0) / reps * 1e6
    peer.join(30)
    remove_segment(path)
    return round(us, 1)


# A Llama whose heads split 2 and 4 ways (SmolLM2-135M's 9 heads split only 3 ways), ~0.3B parameters.
RANDOM_LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=49152, max_position_embeddings=4096, rope_theta=10000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)


def random_llama_dir(out: Path) -> Path:
    """RANDOM_LLAMA with seeded random weights (bf16) and SmolLM2's tokenizer, saved to ``out`` once."""
    if (out / "config.json").is_file():
        return out
    import transformers

    from pdcluster.engine.models.registry import resolve_model

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**RANDOM_LLAMA)).to(torch.bfloat16)
    hf.save_pretrained(str(out))
    shutil.copy(resolve_model("smollm2", progress=False) / "tokenizer.json", out / "tokenizer.json")
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions, up to each pair's first difference, that agree (1.0: every token equal)."""
    total = same = 0
    for x, y in zip(a, b):
        total += len(x)
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return round(same / max(total, 1), 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a built-in name, a model directory, or random-llama (RANDOM_LLAMA)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--pipeline", action="store_true", help="the sizes are pipeline stages, not tensor-parallel ranks")
    p.add_argument("--out", default="")
    args = p.parse_args()
    from pdcluster.engine.models.architectures import arch_from_dir
    from pdcluster.engine.models.registry import resolve_model

    if args.model == "random-llama":
        from pdcluster.engine.models.registry import default_cache_dir

        args.model = str(random_llama_dir(Path(os.environ.get("PDCLUSTER_CACHE_DIR") or default_cache_dir())
                                          / "bench-random-llama"))
    arch = arch_from_dir(resolve_model(args.model, progress=False))
    runs = {tp: bench_engine(args.model, args.dtype, tp, args.batches, args.prompt_len, args.new_tokens, args.pipeline)
            for tp in args.sizes}
    kind = "pp" if args.pipeline else "tp"
    base = runs[args.sizes[0]]
    result = {
        "model": args.model, "dtype": args.dtype, "cores": len(os.sched_getaffinity(0)),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "allreduces_per_step": 2 * arch.num_layers if not args.pipeline else None,
        "hand_overs_per_step": {f"pp{n}": n for n in args.sizes} if args.pipeline else None,
        "allreduce_us": {f"decode_batch_{b}": allreduce_us(arch.hidden_size, b) for b in args.batches},
        "runs": {},
    }
    for tp, run in runs.items():
        summary = {k: run[k] for k in ("num_threads_per_rank", "rank0_weight_bytes", "rank0_kv_cache_bytes")}
        for b, r in run["batches"].items():
            summary[f"batch_{b}"] = {k: v for k, v in r.items() if k != "tokens"}
            summary[f"batch_{b}"][f"greedy_agreement_with_{kind}{args.sizes[0]}"] = agreement(
                base["batches"][b]["tokens"], r["tokens"])
        result["runs"][f"{kind}{tp}"] = summary
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
