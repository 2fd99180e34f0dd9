"""The serving process's CPU per streamed token: ``pdcluster serve`` under ``pdcluster loadtest``, and the
CPU seconds the serve process itself (HTTP server and router; in Ray modes the workers are other
processes) spent during the run, per output token. On a GPU the workers' steps are short and this
process streams every token of every request, so its cost per token bounds the served throughput
(1 s / cost per token, on one core). Prints JSON.

With ``--api-servers N`` (N > 1) the serve process keeps the router and N API processes stream
(cluster/frontend/): the router process's CPU per token then bounds the throughput, and the API
processes' is reported beside it (summed; each streams a share).

    python bench/serve_cpu.py [--mode disagg] [--model tiny-random] [--concurrency 128] [--api-servers 1]
                              [--num-prompts 384] [--output-len 256] [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM_WARMUPS = 4


def run_once(args, engine_flags: tuple[str, ...] = ("--num-kv-blocks", "4096"), tokenizer: str | None = None) -> dict:
    """One server and one load test. ``engine_flags``: more `pdcluster serve` flags (bench/gpu_serve.py:
    the device, dtype, KV memory); ``tokenizer``: the load test's, for a model given as a directory."""
    from pdcluster.cli.main import main as pdcluster_main
    from pdcluster.tools.server_process import ServeProcess
    from vs_vllm import read_proc

    workers = ["--num-prefill", "1", "--num-decode", "1"] if args.mode == "disagg" else []
    entry = [sys.executable, str(ROOT / "bench" / "serve_stubbed.py")] if getattr(args, "stub_model", False) else None
    server = ServeProcess(["--mode", args.mode, "--model", args.model, *workers, "--max-num-seqs", str(args.concurrency),
                           "--max-model-len", "1024", "--api-servers", str(args.api_servers), *engine_flags],
                          timeout_s=args.start_timeout, entry=entry)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result_path = Path(tmp) / "result.json"
            api_pids = _api_processes(server.proc.pid)
            cpu_before = read_proc(server.proc.pid)["cpu_s"]
            api_cpu_before = sum(read_proc(pid)["cpu_s"] for pid in api_pids)
            rc = pdcluster_main(["loadtest", "--no-progress", "--base-url", server.base_url, "--model", args.model,
                                 "--dataset", "random", "--random-input-len", "64",
                                 "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                                 "--request-rate", "inf", "--max-concurrency", str(args.concurrency),
                                 "--num-warmups", str(NUM_WARMUPS), "--ignore-eos", "--result-json", str(result_path),
                                 *(["--tokenizer", tokenizer] if tokenizer else [])])
            cpu_s = read_proc(server.proc.pid)["cpu_s"] - cpu_before
            api_cpu_s = sum(read_proc(pid)["cpu_s"] for pid in api_pids) - api_cpu_before
            if rc not in (0, 1):
                raise RuntimeError(f"pdcluster loadtest failed with status {rc}")
            result = json.loads(result_path.read_text())
    finally:
        server.close()
    num_tokens = (args.num_prompts + NUM_WARMUPS) * args.output_len  # ignore_eos: every request its full length
    return {"serve_cpu_s": round(cpu_s, 2), "us_per_output_token": round(cpu_s / num_tokens * 1e6, 1),
            "num_api_processes": len(api_pids), "api_processes_cpu_s": round(api_cpu_s, 2),
            "api_processes_us_per_output_token": round(api_cpu_s / num_tokens * 1e6, 1),
            "output_throughput": round(result["output_throughput"], 1),
            "median_tpot_ms": round(result["median_tpot_ms"], 2), "completed": result["completed"],
            "failed": result["failed"]}


def _api_processes(pid: int) -> list[int]:
    """The serve process's API processes (multiprocessing spawn children; not Ray's, not its tracker),
    read from /proc (the GPU machine has no psutil)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return sorted(found)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="disagg", choices=("disagg", "colocated", "local"))
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=384)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--api-servers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--stub-model", action="store_true",
                    help="the engines' model stubbed (bench/serve_stubbed.py): a step costs what a GPU's short one "
                         "leaves to the host, so the serving path's own cost bounds the throughput")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from json_report import emit_json

    runs = [run_once(args) for _ in range(args.repeats)]
    emit_json({"mode": args.mode, "model": args.model, "stub_model": args.stub_model, "concurrency": args.concurrency, "api_servers": args.api_servers,
               "num_prompts": args.num_prompts, "output_len": args.output_len, "runs": runs,
               "median_us_per_output_token": sorted(r["us_per_output_token"] for r in runs)[len(runs) // 2]},
              args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
