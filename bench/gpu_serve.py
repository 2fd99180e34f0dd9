"""Served on a GPU: `pdcluster serve --mode local` on gpu_check's random-weight 1.1B Llama (bf16) under
`pdcluster loadtest` (random 64-token prompts, 256-token answers, 128 concurrent), once per
``--api-servers`` value: output tokens/s, TPOT, and the CPU per streamed token of the serve process
(router and engine; with one API process the HTTP server too) and of the API processes. Whether one
HTTP process holds a GPU back, and how many it takes not to (bench/serve_cpu.py measures the same on a
CPU). Prints JSON.

The GPU machine has no Ray (local mode needs none) and no FastAPI stack: bench/gpu_session.sh installs
the carried wheels (its header says which) before running this with GPU_SERVE=1.

    python bench/gpu_serve.py [--device cuda] [--quick] [--api-servers 1,2,4] [--mixed-cuda-graph-tokens 0,512]
                              [--num-prompts 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="gpu_check's small Llama and few prompts (the dry run)")
    ap.add_argument("--api-servers", default="1,2,4")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=None, help="default: 8 (0.5 with --quick)")
    ap.add_argument("--mixed-cuda-graph-tokens", default="0",
                    help="comma list: each --api-servers value runs once per value (0: prefill and mixed steps eager; "
                         "N: through piecewise CUDA graphs up to N tokens, engine/piecewise_graphs.py)")
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from gpu_check import LLAMA_1B, LLAMA_QUICK, import_pdcluster, random_llama

    import_pdcluster()
    import pdcluster.engine

    # The servers are subprocesses: where this checkout is not installed (the GPU machine) they import it
    # from gpu_check's folder of links, as this process does.
    links = Path(pdcluster.engine.__path__[0]).parents[1]
    if (links / "pdcluster").is_dir():
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(links), os.environ.get("PYTHONPATH")) if p)
    import torch

    from json_report import emit_json
    from serve_cpu import run_once

    work = Path(tempfile.mkdtemp(prefix="gpu-serve-"))
    started = time.monotonic()
    try:
        hf, model_dir = random_llama(LLAMA_QUICK if args.quick else LLAMA_1B, args.device, work / "llama-1b")
        del hf  # the server loads its own copy
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        runs = {}
        for mixed in [int(n) for n in args.mixed_cuda_graph_tokens.split(",")]:
            for num in [int(n) for n in args.api_servers.split(",")]:
                run_args = argparse.Namespace(mode="local", model=str(model_dir), concurrency=args.concurrency,
                                              num_prompts=args.num_prompts, output_len=args.output_len,
                                              api_servers=num, start_timeout=args.start_timeout)
                engine_flags = ("--device", args.device, "--dtype", "bfloat16", "--kv-cache-memory-gib",
                                str(args.kv_cache_memory_gib or (0.5 if args.quick else 8.0)),
                                "--mixed-cuda-graph-tokens", str(mixed))
                key = str(num) if not mixed else f"{num}+piecewise{mixed}"
                try:
                    runs[key] = run_once(run_args, engine_flags, tokenizer=str(model_dir))
                except Exception as e:  # noqa: BLE001 - the next value still runs; the report says why
                    runs[key] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
                print(f"--api-servers {num} --mixed-cuda-graph-tokens {mixed}: {runs[key]}", file=sys.stderr,
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    emit_json({"device": device_name, "model": "random Llama " + ("quick" if args.quick else "1.1B") + " bf16",
               "concurrency": args.concurrency, "num_prompts": args.num_prompts, "output_len": args.output_len,
               "api_servers": runs, "elapsed_s": round(time.monotonic() - started, 1)}, args.out, indent=2)
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
