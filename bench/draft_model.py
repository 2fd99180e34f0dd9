"""Draft-model speculation against vLLM's CPU build: SmolLM2 (bf16) as the target, drafted for by a draft model
(``--spec draft_model``; vLLM's ``speculative_config`` method ``draft_model``), the same prompts (token ids), k,
lengths, greedy, ignore_eos; each engine in its own process, one after the other, on ``--threads`` cores (vLLM
pinned with VLLM_CPU_OMP_THREADS_BIND), timed by the same function (``measure_generation`` in
bench/draft_model_vllm_side.py). Prints one JSON object: per engine, draft and batch size, output tokens/s (median
of ``--repeats`` passes), drafts proposed and accepted, whether the tokens equal the same engine's without
speculation (lossless), and the ratio ours / vLLM (> 1: we are faster).

    python bench/draft_model.py [--vllm-python /work/V/bin/python] [--drafts none self first10] [--k 3]
                                [--num-prompts 8] [--max-tokens 64] [--batches 1 8] [--repeats 3] [--threads 1]
                                [--out FILE]

Drafts: ``self`` is the target itself (every draft accepted where both run the same arithmetic: the upper bound of
acceptance, the draft costing what the target does), ``firstN`` the target's first N layers
(engine/models/layer_skip.py: a cheap draft, mostly rejected on an untrained model). Neither is a draft one would
pick for speed on this model; together they measure what the speculation machinery costs when drafts are accepted
and when they are not. Prompts: HumanEval's first ``--num-prompts`` (code, where drafts are accepted most).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from draft_model_vllm_side import measure_generation  # noqa: E402  (stdlib only)
from json_report import emit_json  # noqa: E402
from vs_vllm import VLLM_ENV, run_child, vllm_bind  # noqa: E402


def ours_child(spec_file: str) -> int:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    spec = json.loads(Path(spec_file).read_text())
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    results = {}
    for name, draft in spec["drafts"].items():
        speculative = {} if draft is None else dict(spec_method="draft_model", draft_model=draft,
                                                    num_spec_tokens=spec["k"])
        engine = LLMEngine.from_config(EngineConfig(model=spec["model_dir"], dtype=spec["dtype"],
                                                    num_threads=spec["threads"], enable_prefix_caching=False,
                                                    max_model_len=1024, seed=0, max_num_seqs=64, **speculative),
                                       progress=False)

        def run(prompts):
            outs = engine.generate(prompts, params)
            return ([o.token_ids for o in outs], sum(o.num_draft_tokens for o in outs),
                    sum(o.num_accepted_tokens for o in outs))

        results[name] = {f"batch_{b}": measure_generation(run, spec["prompts"], b, spec["repeats"])
                         for b in spec["batches"]}
    print("OURS_DRAFT_RESULT " + json.dumps(results), flush=True)
    return 0


def _summarise(results: dict) -> dict:
    """Drops the tokens, says per draft and batch whether they equal the no-speculation run's."""
    out = {}
    for name, per_batch in results.items():
        out[name] = {}
        for batch, r in per_batch.items():
            out[name][batch] = {k: v for k, v in r.items() if k != "tokens"}
            if "none" in results and name != "none":
                out[name][batch]["same_tokens_as_none"] = r["tokens"] == results["none"][batch]["tokens"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python")
    ap.add_argument("--drafts", nargs="+", default=["none", "self", "first10"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    ap.add_argument("--child-ours", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_ours:
        return ours_child(args.child_ours)

    from spec_decode import load_humaneval_prompts

    from pdcluster.engine.models.layer_skip import write_layer_skip_draft
    from pdcluster.engine.models.registry import default_cache_dir, resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = resolve_model("smollm2", progress=False)
    drafts = {}
    for name in args.drafts:
        if name == "none":
            drafts[name] = None
        elif name == "self":
            drafts[name] = str(model_dir)
        elif name.startswith("first") and name[5:].isdigit():
            out = default_cache_dir() / "drafts" / f"smollm2-{name}"
            if not (out / "config.json").is_file():
                write_layer_skip_draft(model_dir, out, int(name[5:]))
            drafts[name] = str(out)
        else:
            ap.error(f"--drafts: {name!r} is none, self or firstN")
    tokenizer = Tokenizer(model_dir)
    spec = {"prompts": [tokenizer.encode(t) for t in load_humaneval_prompts(args.num_prompts)],
            "max_tokens": args.max_tokens, "k": args.k, "drafts": drafts, "batches": args.batches,
            "repeats": args.repeats, "threads": args.threads, "dtype": args.dtype, "model_dir": str(model_dir)}
    report = {"what": "draft-model speculation, offline: output tokens/s over all prompts (median of the passes)",
              "ratio_definition": "ours tok/s / vllm tok/s: > 1.0 means pdcluster is faster",
              **{k: v for k, v in spec.items() if k not in ("prompts", "model_dir")},
              "num_prompts": len(spec["prompts"]), "prompt_tokens": [len(p) for p in spec["prompts"]]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    timeout_s = 1800
    ours = run_child([sys.executable, str(Path(__file__).resolve()), "--child-ours", f.name], "OURS_DRAFT_RESULT",
                     {}, timeout_s)
    noise = ("other_processes_cpu_s", "child_wall_s")  # run_child's gauges, beside the results
    report["pdcluster_run"] = {k: ours.pop(k) for k in noise}
    report["pdcluster"] = _summarise(ours)
    if args.vllm_python:
        vllm = run_child([args.vllm_python, str(BENCH_DIR / "draft_model_vllm_side.py"), f.name, str(model_dir)],
                         "VLLM_DRAFT_RESULT", {**VLLM_ENV, **vllm_bind(args.threads)}, timeout_s)
        report["vllm_run"] = {k: vllm.pop(k) for k in noise}
        report["vllm"] = _summarise(vllm)
        report["ratio"] = {name: {b: round(ours[name][b]["output_tok_s"] / vllm[name][b]["output_tok_s"], 3)
                                  for b in ours[name]} for name in ours}
        report["same_tokens_across_engines"] = {name: {b: ours[name][b]["tokens"] == vllm[name][b]["tokens"]
                                                       for b in ours[name]} for name in ours}
    Path(f.name).unlink()
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
