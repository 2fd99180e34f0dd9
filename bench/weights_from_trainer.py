"""What SGLang's weight update from a trainer's process group costs (cluster/weights_from_trainer.py), against the
update from disk of the same checkpoint.

A real ``pdcluster serve --mode local --enable-weight-updates`` on SmolLM2 (or --model) joins a gloo group with a
trainer process (tests/trainer_rank0.py, made as RL frameworks make theirs); each round the trainer broadcasts a
perturbed copy of the checkpoint (a training step's stand-in) or the original, alternating:
- ``running_one_call``: one /update_weights_from_distributed naming every tensor while generation runs (served at
  once);
- ``paused_buckets``: /pause_generation, the tensors in --buckets calls naming one version, /continue_generation
  (served together at the resume): slime's and AReaL's order;
- ``from_disk``: /update_weights_from_disk of the same checkpoint (what the trainer would do after writing it).
Each is timed from the first call to the last answer (the trainer's broadcasts included). After the last round
the server's greedy completion is compared with its completion after an update from disk of the same checkpoint.
Prints JSON (and writes it with --out).

    python bench/weights_from_trainer.py [--model smollm2] [--dtype bfloat16] [--rounds 3] [--buckets 4]
                                         [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    import httpx
    import torch

    from pdcluster.cluster.staged_checkpoint import checkpoint_shapes
    from pdcluster.engine.models.perturbed import perturb_checkpoint
    from pdcluster.engine.models.registry import resolve_model
    from trainer_rank0 import Trainer, free_port
    from weight_update import start_server, stop_server

    base = Path(resolve_model(args.model, progress=False))
    with tempfile.TemporaryDirectory(prefix="pdc-trainer-") as tmp, ThreadPoolExecutor(2) as pool:
        other = perturb_checkpoint(base, Path(tmp) / "step-1", scale=0.05)
        shapes = checkpoint_shapes(base)
        names = sorted(shapes)
        wire_dtype = _stored_dtype(base, names[0])  # the checkpoint's own: the tensors arrive as stored
        element_size = getattr(torch, wire_dtype).itemsize
        num_bytes = sum(math.prod(s) for s, _ in shapes.values()) * element_size
        proc, url, _, log = start_server("local", base, args.dtype, Path(tmp))
        port = free_port()
        trainer = Trainer(port, timeout_s=600)
        try:
            post = lambda route, body=None: httpx.post(f"{url}/{route}", json=body, timeout=600)  # noqa: E731
            trainer.join()
            joined = pool.submit(post, "init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo"})
            trainer.wait_joined()
            _ok(joined.result(600))

            def update(model_dir, bucket, **body):
                call = pool.submit(post, "update_weights_from_distributed", {
                    "names": bucket, "dtypes": [wire_dtype] * len(bucket),
                    "shapes": [list(shapes[n][0]) for n in bucket], **body})
                trainer.send(model_dir, bucket, wire_dtype)
                return _ok(call.result(600))

            timings: dict[str, list[float]] = {"running_one_call": [], "paused_buckets": [], "from_disk": []}
            received_s = []
            for i in range(args.rounds):
                target = other if i % 2 == 0 else base
                t0 = time.perf_counter()
                answer = update(target, names, weight_version=f"one-{i}")
                timings["running_one_call"].append(time.perf_counter() - t0)
                received_s.append(float(answer["message"].split(" in ")[1].split(" s")[0]))
                t0 = time.perf_counter()
                _ok(post("pause_generation", {"mode": "abort"}))
                size = -(-len(names) // args.buckets)
                for b in range(0, len(names), size):
                    update(target, names[b:b + size], weight_version=f"buckets-{i}")
                _ok(post("continue_generation"))
                timings["paused_buckets"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                _ok(post("update_weights_from_disk", {"model_path": str(target), "weight_version": f"disk-{i}"}))
                timings["from_disk"].append(time.perf_counter() - t0)
            body = {"model": str(base), "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True}
            update(other, names, weight_version="check-trainer")
            from_trainer = _ok(post("v1/completions", body))["choices"][0]["text"]
            _ok(post("update_weights_from_disk", {"model_path": str(other), "weight_version": "check-disk"}))
            from_disk = _ok(post("v1/completions", body))["choices"][0]["text"]
        finally:
            trainer.close()
            stop_server(proc, log)
    result = {
        "model": args.model, "dtype": args.dtype, "wire_dtype": wire_dtype, "num_tensors": len(names),
        "num_bytes": num_bytes, "buckets": args.buckets, "rounds": args.rounds, "threads": torch.get_num_threads(),
        **{f"{k}_s_median": round(statistics.median(v), 3) for k, v in timings.items()},
        "receive_s_median": round(statistics.median(received_s), 3),
        "receive_gb_per_s": round(num_bytes / statistics.median(received_s) / 1e9, 2),
        **{f"{k}_s": [round(x, 3) for x in v] for k, v in timings.items()},
        "same_answer_as_from_disk": from_trainer == from_disk,
        "note": "each timing runs from the first HTTP call to the last answer, the trainer's gloo broadcasts over "
                "loopback included; receive_s is the server's own figure for taking the broadcasts; the rest of "
                "an update from the trainer is writing the staged checkpoint (the replaced files) and the update "
                "from disk of it (read, check, copy in place).",
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ok(r):
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def _stored_dtype(model_dir: Path, name: str) -> str:
    """The dtype a checkpoint stores tensor ``name`` in, as torch names it ("bfloat16")."""
    from safetensors import safe_open

    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():  # noqa: SIM118
                return str(st.get_tensor(name).dtype).removeprefix("torch.")
    raise KeyError(name)


if __name__ == "__main__":
    main()
