"""Send a workload on its arrival schedule and collect one record per request.

Open loop: a request is sent at its scheduled time whether or not earlier ones have finished (that is
what makes queueing visible in TTFT); ``max_concurrency`` caps requests in flight, and a request over
the cap waits for a slot, its TTFT counted from when it is actually sent (as vLLM does).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from pdcluster.tools.loadtest.client import RequestRecord, Target, send_request
from pdcluster.tools.loadtest.datasets import SampleRequest


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    duration_s: float  # first send to last answer


def http_client(target: Target, max_concurrency: int | None) -> httpx.AsyncClient:
    # trust_env=False: no proxy from the environment, only ever the given base URL.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency or 256)
    return httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s), limits=limits, trust_env=False)


async def run_workload(target: Target, requests: list[SampleRequest], send_times_s: np.ndarray,
                       max_concurrency: int | None = None, tokenizer=None, progress: bool = True,
                       description: str = "loadtest") -> RunOutcome:
    assert len(send_times_s) == len(requests), "one send time per request"
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=description, unit="req", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)

    async def one(http: httpx.AsyncClient, sample: SampleRequest) -> RequestRecord:
        if slots is None:
            record = await send_request(http, target, sample, tokenizer)
        else:
            async with slots:
                record = await send_request(http, target, sample, tokenizer)
        bar.update(1)
        return record

    try:
        async with http_client(target, max_concurrency) as http:
            start = time.perf_counter()
            tasks = []
            for sample, at_s in zip(requests, send_times_s.tolist()):
                delay_s = start + at_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                tasks.append(asyncio.create_task(one(http, sample)))
            records = list(await asyncio.gather(*tasks))
            duration_s = time.perf_counter() - start
    finally:
        bar.close()
    return RunOutcome(records, duration_s)
