"""What a weight update costs an RL loop (engine/weight_update.py), against restarting the engine on the checkpoint.

SmolLM2 (or --model) is copied with every floating tensor perturbed (a stand-in for a training step's checkpoint),
then one engine alternates between the two checkpoints --rounds times: each update's read-and-check (prepare, off
the engine thread when served) and in-place copy (commit, the only part the engine thread waits for) are timed; a
fresh engine built on the checkpoint (what a restart costs, before the process and Ray start) is timed beside it.
After the last update the engine's greedy tokens are compared with the fresh engine's on the same checkpoint.
With ``--served MODE ...`` a real ``pdcluster serve --mode MODE --enable-weight-updates`` is started for each mode
(local, or disagg over Ray: one prefill and one decode worker), timed from its start to its first answer (what a
restart on the new checkpoint costs the RL loop), then updated --rounds times over HTTP (POST
/update_weights_from_disk, alternating checkpoints: the server's whole pause, read, copy and resume). Prints JSON
(and writes it with --out).

    python bench/weight_update.py [--model smollm2] [--dtype bfloat16] [--rounds 3] [--served local disagg]
                                  [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(mode: str, base: Path, dtype: str, work: Path, *extra: str):
    """A real ``pdcluster serve --mode MODE --enable-weight-updates`` on ``base``, once it answered a completion:
    (process, url, seconds from its start to that answer, its log file)."""
    import httpx

    port = _free_port()
    flags = ["--mode", mode, "--model", str(base), "--dtype", dtype, "--port", str(port), "--enable-weight-updates",
             "--num-kv-blocks", "256", "--max-model-len", "1024", *extra]
    if mode == "disagg":
        flags += ["--num-prefill", "1", "--num-decode", "1"]
    log = open(work / f"serve-{mode}.log", "w")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster.cli", "serve", *flags], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "RAY_TMPDIR": str(work)})
    url = f"http://127.0.0.1:{port}"
    body = {"model": str(base), "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc, log)
            raise RuntimeError(f"serve --mode {mode} did not come up: see {log.name}")
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return proc, url, time.perf_counter() - started, log


def stop_server(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def serve_and_update(mode: str, base: Path, other: Path, rounds: int, dtype: str, work: Path) -> dict:
    """A real server of ``mode`` on ``base``: seconds from its start to its first completion, and each update's
    round trip over HTTP (alternating ``other`` and ``base``); its answers after the last update."""
    import httpx

    proc, url, ready_s, log = start_server(mode, base, dtype, work)
    try:
        updates = []
        for i, target in enumerate([other, base] * rounds):
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/update_weights_from_disk", timeout=600,
                           json={"model_path": str(target), "weight_version": f"{mode}-{i + 1}"})
            updates.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"update {i + 1} on {mode}: HTTP {r.status_code}: {r.text[:500]}")
        return {"start_to_first_answer_s": round(ready_s, 2),
                "update_http_s_median": round(statistics.median(updates), 3),
                "update_http_s": [round(x, 3) for x in updates]}
    finally:
        stop_server(proc, log)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--served", nargs="*", default=[], choices=["local", "disagg"])
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT.parent))
    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.perturbed import perturb_checkpoint
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.sampling_params import SamplingParams

    base = resolve_model(args.model, progress=False)
    with tempfile.TemporaryDirectory(prefix="pdc-weights-") as tmp:
        other = perturb_checkpoint(base, Path(tmp) / "step-1", scale=0.05)

        def config(model: Path) -> EngineConfig:
            return EngineConfig(model=str(model), device="cpu", dtype=args.dtype, max_model_len=1024,
                                num_kv_blocks=256)

        t0 = time.perf_counter()
        engine = LLMEngine.from_config(config(base), progress=False)
        first_start_s = time.perf_counter() - t0
        prepare_s, commit_s, restart_s = [], [], []
        targets = [other, base] * args.rounds
        for i, target in enumerate(targets[: args.rounds * 2]):
            t0 = time.perf_counter()
            engine.prepare_weights(str(target), f"v{i + 1}")
            t1 = time.perf_counter()
            update = engine.commit_weights()
            t2 = time.perf_counter()
            prepare_s.append(t1 - t0)
            commit_s.append(t2 - t1)
            if i < args.rounds:
                t0 = time.perf_counter()
                fresh = LLMEngine.from_config(config(target), progress=False)
                restart_s.append(time.perf_counter() - t0)
                del fresh
        engine.update_weights_from_disk(str(other), "check")
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        answered = [o.token_ids for o in engine.generate(prompts, params)]
        fresh = LLMEngine.from_config(config(other), progress=False)
        want = [o.token_ids for o in fresh.generate(prompts, params)]
        result = {
            "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "weight_bytes": update.num_bytes, "num_tensors": update.num_tensors,
            "update_prepare_s_median": round(statistics.median(prepare_s), 3),
            "update_commit_s_median": round(statistics.median(commit_s), 4),
            "update_total_s_median": round(statistics.median(p + c for p, c in zip(prepare_s, commit_s)), 3),
            "restart_engine_s_median": round(statistics.median(restart_s), 3),
            "first_engine_start_s": round(first_start_s, 3),
            "prepare_s": [round(x, 3) for x in prepare_s], "commit_s": [round(x, 4) for x in commit_s],
            "restart_s": [round(x, 3) for x in restart_s],
            "tokens_equal_fresh_engine": answered == want,
            "note": "prepare reads and checks the checkpoint (off the engine thread when served); commit is the copy "
                    "the engine thread waits for; restart_engine_s is LLMEngine.from_config on the checkpoint (a "
                    "restart's engine part, before its process, Ray actor and warm-up of the server).",
        }
        for mode in args.served:
            result[f"served_{mode}"] = serve_and_update(mode, Path(base), Path(other), args.rounds, args.dtype, Path(tmp))
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
