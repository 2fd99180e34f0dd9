"""Beam search against vLLM's CPU build: ``LLMEngine.beam_search`` and vLLM's ``LLM.beam_search``, the same
prompts (token ids), beam width and length, greedy steps (temperature 0), each engine in its own process, one
after the other, timed by the same function (``measure_beams`` in bench/beam_search_vllm_side.py). Prints one
JSON object: each engine's seconds per search (median of ``--repeats``), the ratio vLLM / ours (> 1: we are
faster) and how many prompts got the very same beams, in the same order, from both.

    python bench/beam_search.py [--vllm-python /work/vllmenv/bin/python] [--beam-width 4] [--max-tokens 32]
                                [--repeats 3] [--threads 1] [--no-prefix-caching] [--out FILE]

Prefix caching is on in both by default: beam search is built on it (each step runs every live beam as a
request of prompt + beam, and the cache serves what was computed before). Both run the model on ``--threads``
cores (vLLM pinned with VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from beam_search_vllm_side import measure_beams  # noqa: E402  (stdlib only)
from json_report import emit_json  # noqa: E402
from vs_vllm import VLLM_ENV, run_child, vllm_bind  # noqa: E402

TEXTS = ["The history of the Roman Empire begins with", "def quicksort(arr):\n    ",
         "In a small village by the sea, there lived", "The three laws of thermodynamics are"]


def ours_child(spec_file: str) -> int:
    from pdcluster.engine.beam_search import BeamSearchParams
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    spec = json.loads(Path(spec_file).read_text())
    engine = LLMEngine.from_config(EngineConfig(model="smollm2", dtype=spec["dtype"], num_threads=spec["threads"],
                                                enable_prefix_caching=spec["prefix_caching"], max_model_len=1024,
                                                seed=0, max_num_seqs=64), progress=False)
    params = BeamSearchParams(beam_width=spec["beam_width"], max_tokens=spec["max_tokens"])

    def run(prompts):
        return [[beam.output_token_ids for beam in beams] for beams in engine.beam_search(prompts, params)]

    print("OURS_BEAM_RESULT " + json.dumps(measure_beams(run, spec["prompts"], spec["repeats"])), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--child-ours", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_ours:
        return ours_child(args.child_ours)

    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = resolve_model("smollm2", progress=False)
    tokenizer = Tokenizer(model_dir)
    spec = {"prompts": [tokenizer.encode(t) for t in TEXTS], "beam_width": args.beam_width,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": args.threads, "dtype": args.dtype,
            "prefix_caching": not args.no_prefix_caching}
    report = {"what": "beam search, offline: seconds per search over all prompts (median)",
              "ratio_definition": "vllm seconds / ours: > 1.0 means pdcluster is faster",
              **{k: v for k, v in spec.items() if k != "prompts"}, "num_prompts": len(TEXTS)}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    timeout_s = 1800
    ours = run_child([sys.executable, str(Path(__file__).resolve()), "--child-ours", f.name], "OURS_BEAM_RESULT",
                     {}, timeout_s)
    report["pdcluster"] = {k: v for k, v in ours.items() if k != "beams"}
    if args.vllm_python:
        vllm = run_child([args.vllm_python, str(BENCH_DIR / "beam_search_vllm_side.py"), f.name, str(model_dir)],
                         "VLLM_BEAM_RESULT", {**VLLM_ENV, **vllm_bind(args.threads)}, timeout_s)
        report["vllm"] = {k: v for k, v in vllm.items() if k != "beams"}
        report["ratio"] = round(vllm["median_s"] / ours["median_s"], 3)
        report["prompts_with_identical_beams"] = sum(a == b for a, b in zip(ours["beams"], vllm["beams"]))
    Path(f.name).unlink()
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
