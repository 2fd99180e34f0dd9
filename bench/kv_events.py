"""vLLM's KV events (serve --kv-events-config), two questions:

1. Does vLLM read what we publish? `pdcluster serve --mode local` on the real model with events on, a multi-turn
   chat workload (each turn extends the last: stores chain from cached blocks, the small pool evicts), every batch
   a subscriber receives handed to vLLM's own decoder (``msgspec.msgpack.Decoder(KVEventBatch)``, run by
   ``--vllm-python``, a Python with vLLM installed) and encoded again by vLLM's encoder: the bytes must come back
   equal. Also checks the stored blocks' tokens against the prompts sent.
2. What do they cost the engine? Decode steps of a batch with and without a publisher fed every step as a worker
   feeds it, turns A B A B (A without), tokens/s and the ratio.

    python bench/kv_events.py [--model smollm2] [--vllm-python /work/V/bin/python] [--turns 24] [--rounds 3]
                              [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)

# Run by --vllm-python: each payload (hex, a line) decoded by vLLM's decoder and encoded again; prints JSON.
VLLM_ROUND_TRIP = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
dec, enc = msgspec.msgpack.Decoder(type=KVEventBatch), msgspec.msgpack.Encoder()
kinds, same, n = {}, 0, 0
for line in open(sys.argv[1]):
    payload = bytes.fromhex(line.strip())
    batch = dec.decode(payload)
    n += 1
    same += enc.encode(batch) == payload
    for e in batch.events:
        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
import vllm
print(json.dumps({"vllm_version": vllm.__version__, "batches": n, "reencoded_equal": same, "events": kinds}))
"""


def interop(args) -> dict:
    import httpx
    import zmq

    from pdcluster.tools.server_process import ServeProcess
    from pdcluster.wire.kv_events import decode_batch

    config = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "topic": "kv"})
    flags = ["--model", args.model, "--mode", "local", "--num-kv-blocks", "96", "--max-model-len", "2048",
             "--kv-events-config", config]
    rng = random.Random(0)
    payloads, sent_prompts = [], []
    ctx = zmq.Context()
    with ServeProcess(flags, timeout_s=600) as server:
        http = httpx.Client(base_url=server.base_url, timeout=120)
        source = http.get("/kv_event_sources").json()["0"]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(source["endpoint"])
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.5)
        history: list[int] = []
        for turn in range(args.turns):
            if turn % 6 == 0:
                history = []  # a new conversation
            history = history + [rng.randrange(100, 40000) for _ in range(rng.randrange(40, 200))]
            r = http.post("/v1/completions", json={"model": args.model, "prompt": history, "max_tokens": 16,
                                                   "temperature": 0}).json()
            sent_prompts.append(list(history))
            history += http.post("/tokenize", json={"model": args.model, "prompt": r["choices"][0]["text"],
                                                    "add_special_tokens": False}).json()["tokens"]
        deadline = time.monotonic() + 3
        while (left := deadline - time.monotonic()) > 0 and sub.poll(int(left * 1000) + 1):
            payloads.append(sub.recv_multipart()[2])
    ctx.destroy(linger=0)
    stored = [e for p in payloads for e in decode_batch(p)[1] if e["type"] == "BlockStored" and e["token_ids"]]
    # Every stored block's tokens are a block of some prompt sent (or of its answer, past the prompt).
    blocks_sent = {tuple(p[i: i + 16]) for p in sent_prompts for i in range(0, len(p) - 15, 16)}
    told = [tuple(e["token_ids"][i: i + 16]) for e in stored for i in range(0, len(e["token_ids"]), 16)]
    out = {"turns": args.turns, "batches": len(payloads), "stored_runs": len(stored),
           "stored_blocks": len(told), "stored_blocks_of_prompts": sum(b in blocks_sent for b in told),
           "runs_with_parent": sum(e["parent_block_hash"] is not None for e in stored),
           "removed_blocks": sum(len(e["block_hashes"]) for p in payloads for e in decode_batch(p)[1]
                                 if e["type"] == "BlockRemoved")}
    if args.vllm_python:
        with tempfile.NamedTemporaryFile("w", suffix=".hex", delete=False) as f:
            f.write("\n".join(p.hex() for p in payloads))
        try:
            r = subprocess.run([args.vllm_python, "-c", VLLM_ROUND_TRIP, f.name], capture_output=True, text=True,
                               timeout=600, cwd=tempfile.gettempdir())
        finally:
            os.unlink(f.name)
        if r.returncode != 0:
            raise SystemExit(f"vLLM's decoder failed:\n{r.stderr[-3000:]}")
        out["vllm_decoder"] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def cost(args) -> dict:
    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.loaded_model import LoadedModel
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.node.kv_event_publisher import make_kv_event_publisher

    torch.set_num_threads(1)
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"})
    engines = {name: LLMEngine(LoadedModel.load(EngineConfig(model=args.model, num_threads=1, max_model_len=1024,
                                                             kv_events_config=cfg), progress=False))
               for name, cfg in (("off", ""), ("on", config))}
    publisher = make_kv_event_publisher(engines["on"], "bench")
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rng = random.Random(1)
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for _ in range(args.rounds):
            for name in ("off", "on"):
                engine = engines[name]
                prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
                for p in prompts:
                    engine.add_request(p, params)
                started = time.perf_counter()
                for _ in range(100_000):  # bounded: the batch finishes
                    if not engine.has_unfinished():
                        break
                    engine.step()
                    entries = engine.kv_events.drain_described()  # what a worker's turn does
                    if publisher is not None and name == "on" and entries:
                        publisher.publish(time.time(), entries)
                times[name].append(time.perf_counter() - started)
    finally:
        publisher.close()
    tokens = args.batch * (args.prompt_len + args.output_len)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len, "rounds": args.rounds,
            "times_s": times, "tok_s_median": {n: tokens / t for n, t in median.items()},
            "on_over_off_time": median["on"] / median["off"], "publisher_dropped": publisher.num_dropped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--vllm-python", default=None, help="a Python with vLLM installed: its decoder reads our batches")
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {"model": args.model, "interop": interop(args)}
    if not args.skip_cost:
        report["cost"] = cost(args)
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
