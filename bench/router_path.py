"""The router process's own CPU per streamed token, alone: what caps a whole cluster's output tokens/s, since
every token of every request passes through its one process (cluster/router/, cluster/frontend/service.py).

This process runs the real ClusterRouter behind the real RouterService on its uvloop loop. Around it, in
processes of their own: a scripted decode worker (a step of one token per running request every
``--step-ms``, each request's last token as its own Tokens event, on the real event stream) and one API
process's RemoteRouter consuming ``--concurrency`` streams (no HTTP). Placement is stubbed (the worker admits
at once; no Ray), so what is measured is the per-token path: worker events in, deltas out. The router is not
saturated (the worker paces its steps), so CPU seconds / tokens streamed is its cost, not a queue's.

    python bench/router_path.py --concurrency 128 --num-requests 1024 --output-len 256 --out F

Prints JSON: router_us_per_output_token (this process's CPU, every thread), the tokens/s that cost caps one
core at, and the run's own throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _worker(event_address: str, admitted: "mp.Queue", output_len: int, step_ms: float, deadline_s: float) -> None:
    """The scripted decode worker: admits what the router submits, then one token a step per running request
    (a request's first token is its first step's row, as a colocated worker's prefill gives it)."""
    import queue

    from pdcluster.node.event_pusher import EventPusher
    from pdcluster.node.events import ADMITTED, Admission, StepTokens, Tokens

    push = EventPusher(event_address)
    running: dict[str, int] = {}  # wid -> tokens sent
    end = time.monotonic() + deadline_s
    next_step = time.monotonic()
    while time.monotonic() < end:
        while True:  # what the router submitted since the last step
            try:
                wid = admitted.get(timeout=0.05) if not running else admitted.get_nowait()
            except queue.Empty:
                break
            if wid is None:
                push.close()
                return
            push(Admission(wid, "d0", ADMITTED))
            running[wid] = 0
        if not running:
            next_step = time.monotonic()
            continue
        next_step += step_ms / 1e3
        time.sleep(max(0.0, next_step - time.monotonic()))
        rows = [w for w, n in running.items() if n + 1 < output_len]
        n = len(rows)
        if rows:
            counts = [running[w] + 1 for w in rows]
            push(StepTokens(worker_id="d0", request_ids=rows, num_new_tokens=[1] * n,
                            new_token_ids=[100 + c % 50 for c in counts],
                            num_computed_tokens=[len(PROMPT) + c for c in counts], num_output_tokens=counts,
                            num_draft_tokens=[0] * n, num_accepted_tokens=[0] * n, num_cached_tokens=[0] * n,
                            num_offloaded_tokens=[0] * n))
            for w in rows:
                running[w] += 1
        for w in [w for w, n in running.items() if n + 1 >= output_len]:
            push(Tokens(request_id=w, worker_id="d0", new_token_ids=[7], num_computed_tokens=len(PROMPT) + output_len,
                        num_output_tokens=output_len, finished=True, finish_reason="length"))
            del running[w]
    push.close()


def _client(endpoint: str, reply_endpoint: str, concurrency: int, num_requests: int, output_len: int,
            result: "mp.Queue") -> None:
    """One API process's RemoteRouter, ``concurrency`` streams at a time, no HTTP."""
    from pdcluster.cluster.frontend.remote_router import RemoteRouter, handshake
    from pdcluster.engine.sampling_params import SamplingParams

    async def main() -> dict:
        welcome = await asyncio.to_thread(handshake, endpoint, 0, 30.0)
        router = RemoteRouter(endpoint, reply_endpoint, 0, welcome)
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        ids = iter(range(num_requests))
        tokens = 0

        async def stream_all() -> None:
            nonlocal tokens
            for i in ids:
                async for delta in router.generate(f"r{i}", PROMPT, params):
                    tokens += len(delta.new_token_ids)

        t0 = time.monotonic()
        await asyncio.gather(*(stream_all() for _ in range(concurrency)))
        seconds = time.monotonic() - t0
        router.close()
        return {"tokens": tokens, "seconds": seconds}

    result.put(asyncio.run(main()))


class _ScriptedDecode:
    """The decode worker's actor handle as the router calls it: ``submit`` hands the placement to the worker."""

    def __init__(self, admitted: "mp.Queue"):
        class submit:  # noqa: N801 - Ray's handle.method.remote(...) shape
            @staticmethod
            def remote(wid, prompt, params, prefill_id):
                async def call():
                    admitted.put(wid)
                return call()

        class abort:  # noqa: N801
            @staticmethod
            def remote(wid):
                pass

        self.submit, self.abort = submit, abort


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=10.0, help="the worker's step interval (the router must keep up)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import uvloop

    from pdcluster.cluster.frontend.service import RouterService
    from pdcluster.cluster.router import ClusterRouter, RouterConfig
    from pdcluster.engine.gc_heap import freeze_startup_objects
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    model_dir = resolve_model("tiny-random", progress=False)
    tokenizer = Tokenizer(str(model_dir))
    ctx = mp.get_context("spawn")
    admitted, result = ctx.Queue(), ctx.Queue()
    socket_dir = tempfile.mkdtemp(prefix="pdc-rp-")
    endpoint = f"ipc://{socket_dir}/router"

    async def serve() -> dict:
        router = ClusterRouter({}, {}, tokenizer, "tiny-random", max_model_len=4096, block_size=16,
                               config=RouterConfig(health_interval_s=3600, request_timeout_s=args.timeout_s))
        router.decode["d0"] = _ScriptedDecode(admitted)
        router.membership.add("d0", "decode", router.decode["d0"], 1 << 20, 16, incarnation="i0")
        service = RouterService(router, endpoint, str(model_dir))
        serving = asyncio.create_task(service.run())
        worker = ctx.Process(target=_worker, args=(router.event_address, admitted, args.output_len, args.step_ms,
                                                   args.timeout_s), daemon=True)
        client = ctx.Process(target=_client, args=(endpoint, f"ipc://{socket_dir}/api-0", args.concurrency,
                                                   args.num_requests, args.output_len, result), daemon=True)
        worker.start()
        client.start()
        freeze_startup_objects()  # as a serving process does once started
        t0 = time.monotonic()
        cpu0 = os.times()
        while client.is_alive() and time.monotonic() - t0 < args.timeout_s:
            await asyncio.sleep(0.1)
        cpu1 = os.times()
        out = await asyncio.to_thread(result.get, True, 30)
        admitted.put(None)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        service.close()
        router.close()
        worker.join(10)
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        return {**out, "router_cpu_s": cpu_s}

    run = uvloop.run(serve())
    us = run["router_cpu_s"] / max(1, run["tokens"]) * 1e6
    report = {
        "concurrency": args.concurrency, "num_requests": args.num_requests, "output_len": args.output_len,
        "step_ms": args.step_ms, "tokens": run["tokens"], "seconds": round(run["seconds"], 2),
        "output_tokens_per_s": round(run["tokens"] / run["seconds"], 1),
        "router_cpu_s": round(run["router_cpu_s"], 3),
        "router_us_per_output_token": round(us, 2),
        "router_ceiling_tokens_per_s": round(1e6 / us) if us else None,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
