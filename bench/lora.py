"""What serving LoRA adapters costs the engine: prefill and decode time of one batch with no adapters loaded, with
adapters loaded but every request on the base model, every request on one adapter, and the requests spread over
several adapters. Prints one JSON object.

    python bench/lora.py [--model smollm2] [--num-adapters 4] [--rank 16] [--batch 16] [--input-len 128]
                         [--output-len 64] [--repeats 3] [--out bench/results/lora.json]

The adapters are made by peft on the model (all seven projections, random B so they change the output) and saved
in PEFT's format in a temporary folder. Prefix caching is off (every run computes its prompts); greedy,
``ignore_eos``. Prefill = the batch with max_tokens 1; decode per step = (whole run - prefill) / (output_len - 1).
The scenarios alternate within each repeat (noise spreads over all of them); medians reported.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_report import emit_json  # noqa: E402

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, num: int, rank: int, folder: Path) -> list[str]:
    import peft
    import torch
    import transformers

    paths = []
    for i in range(num):
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_MODULES,
                                                        init_lora_weights=False))
        model.save_pretrained(folder / f"lora{i}")
        paths.append(f"lora{i}={folder / f'lora{i}'}")
    return paths


def time_batch(engine, prompts, names, output_len: int) -> tuple[float, float]:
    from pdcluster.engine.sampling_params import SamplingParams

    def run(max_tokens: int) -> float:
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, lora_name=n) for n in names]
        started = time.perf_counter()
        outs = engine.generate(prompts, params)
        assert all(len(o.token_ids) == max_tokens for o in outs)
        return time.perf_counter() - started

    prefill = run(1)
    total = run(output_len)
    return prefill, (total - prefill) / (output_len - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.registry import resolve_model

    model_dir = resolve_model(args.model, progress=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.batch)]
    common = dict(model=args.model, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=max(args.batch, 16),
                  num_threads=args.num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        modules = make_adapters(model_dir, args.num_adapters, args.rank, Path(tmp))
        plain = LLMEngine.from_config(EngineConfig(**common), progress=False)
        served = LLMEngine.from_config(EngineConfig(**common, lora_modules=tuple(modules), max_lora_rank=args.rank),
                                       progress=False)
    names = [m.partition("=")[0] for m in modules]
    scenarios = {
        "no_adapters_loaded": (plain, [None] * args.batch),
        "adapters_loaded_base_requests": (served, [None] * args.batch),
        "one_adapter": (served, [names[0]] * args.batch),
        f"{args.num_adapters}_adapters_mixed": (served, [names[i % len(names)] for i in range(args.batch)]),
        "half_base_half_one_adapter": (served, [names[0] if i % 2 else None for i in range(args.batch)]),
    }
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in scenarios}
    for _ in range(args.repeats):
        for key, (engine, lora_names) in scenarios.items():
            samples[key].append(time_batch(engine, prompts, lora_names, args.output_len))
    base_prefill = statistics.median(s[0] for s in samples["no_adapters_loaded"])
    base_step = statistics.median(s[1] for s in samples["no_adapters_loaded"])
    results = {}
    for key, runs in samples.items():
        prefill, step = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        results[key] = {"prefill_s": round(prefill, 4), "decode_step_ms": round(step * 1e3, 3),
                        "prefill_x_no_adapters": round(prefill / base_prefill, 3),
                        "decode_step_x_no_adapters": round(step / base_step, 3),
                        "decode_step_ms_runs": [round(r[1] * 1e3, 3) for r in runs]}
    emit_json({"model": args.model, "dtype": plain.dtype_name, "deterministic": plain.deterministic,
               "num_adapters": args.num_adapters, "rank": args.rank, "batch": args.batch,
               "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
               "scenarios": results}, args.out)


if __name__ == "__main__":
    main()
