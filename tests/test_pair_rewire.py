"""A (prefill, decode) pair broken while both workers live, and what /health says about the workers
(issue 16, found by `pdcluster loadtest --chaos`). Real Ray actors, real control plane and KV transfer
on 127.0.0.1; the control plane's peer timeout is made small (1 s) through TransferConfig.

- A prefill worker frozen (SIGSTOP) for longer than the peer timeout is dropped by its decode worker;
  when it resumes it is the same process, so no restart re-wires it. The pair must come back by itself
  (the router re-wires it), /health must not list the prefill worker healthy while the pair cannot
  serve, and nothing may get a 503 meanwhile (the decode worker prefills by itself while it has no
  reachable prefill worker).
- /health lists each worker's pid, the actor's real os.getpid().
"""

import asyncio
import functools
import os
import signal
import time

import httpx
import pytest

from conftest import engine_config, make_engine, router_generate, settled_worker_stats
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from test_admin_api import serving

NUM_BLOCKS = 256
PEER_TIMEOUT_S = 1.0
STOP_S = 3.0 * PEER_TIMEOUT_S
_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=32)
PROMPTS = [list(range(4000 + 60 * i, 4000 + 60 * i + 40 + 3 * i)) for i in range(4)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_dir):
    return [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def cluster(ray_session):
    transfer = TransferConfig(heartbeat_interval_s=0.2, peer_timeout_s=PEER_TIMEOUT_S)
    c = Cluster(ClusterSpec(engine=_config(), transfer=transfer, mode="disagg", num_prefill=1, num_decode=1,
                            request_timeout_s=60, max_worker_restarts=0))
    try:
        yield c
    finally:
        c.shutdown()


async def _generate(router, rid, prompt):
    return await router_generate(router, rid, prompt, PARAMS)


async def _health_until(http, predicate, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = (await http.get("/health")).json()
        if predicate(health):
            return health
        assert time.monotonic() < deadline, f"/health never {what} within {timeout_s} s: {health}"
        await asyncio.sleep(0.05)


def _entry(health: dict, worker_id: str) -> dict:
    (entry,) = [w for w in health["workers"] if w["worker_id"] == worker_id]
    return entry


@pytest.mark.timeout(300)
def test_health_lists_each_workers_real_pid(ray_session, cluster):
    """Guards: the per-worker view the router exports (Router.stats -> /health) carries ``pid``, and it
    is the worker process's own os.getpid() (what `pdcluster loadtest --chaos` signals), for every role."""
    router = cluster.router
    handles = {**cluster.prefill_handles, **cluster.decode_handles}
    real = dict(zip(handles, ray_session.get([h.pid.remote() for h in handles.values()], timeout=30)))

    async def main():
        router.start(asyncio.get_running_loop())
        async with serving(build_app(router, "tiny-random")) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            return (await http.get("/health")).json()

    health = asyncio.run(main())
    assert health["status"] == "ok"
    listed = {w["worker_id"]: w["pid"] for w in health["workers"]}
    assert listed == real, (listed, real)
    assert all(pid != os.getpid() for pid in listed.values())  # the actors' processes, not this one


@pytest.mark.timeout(300)
def test_prefill_frozen_past_the_peer_timeout_is_rewired_when_it_resumes(ray_session, cluster, expected):
    """Guards the chaos run's "stop-prefill@40s+5s": a prefill worker SIGSTOPped for 3x the control
    plane's peer timeout, then SIGCONTed. Before the fix the decode worker had dropped it for good
    (same incarnation: nothing re-handshook), every request placed on the pair got 503 while /health
    listed every worker healthy. Now: while the pair is broken /health lists the prefill worker
    unhealthy and the pair under ``unwired_pairs``, a request is still served (the decode worker
    prefills it itself), and after SIGCONT the router re-wires the pair within a bounded time:
    requests are prefilled on the resumed worker again, token-exact, and /health is all healthy."""
    router = cluster.router
    recorder = router.record()
    router.config.health_interval_s = 0.2
    router.config.ping_timeout_s = 0.5
    # Slow, not dead, in the router's eyes (as in the chaos run, where the stop was shorter than the
    # strikes): the pair's breakage alone must show on /health.
    router.config.max_strikes = 1000
    router.config.admission_wait_s = 5.0  # a 503 comes quickly instead of being waited out
    (prefill_id, prefill), = cluster.prefill_handles.items()
    (decode_id, _), = cluster.decode_handles.items()
    pid = ray_session.get(prefill.pid.remote(), timeout=30)

    async def main():
        router.start(asyncio.get_running_loop())
        async with serving(build_app(router, "tiny-random")) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            out = {"before": await _generate(router, "before", PROMPTS[0])}
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                out["health_during"] = await _health_until(
                    http, lambda h: not _entry(h, prefill_id)["healthy"], 5 * PEER_TIMEOUT_S + 2.0,
                    "listed the frozen prefill worker unhealthy")
                out["during"] = await _generate(router, "during", PROMPTS[1])
                await asyncio.sleep(max(0.0, stopped + STOP_S - time.monotonic()))
            finally:
                os.kill(pid, signal.SIGCONT)
            resumed = time.monotonic()
            # Bounded: the pair must serve again on its own; each try that is not prefilled on the
            # resumed worker (503 before the fix, or prefilled locally while not yet re-wired) is retried.
            tries = 0
            while True:
                tries += 1
                rid = f"after{tries}"
                try:
                    tokens = await _generate(router, rid, PROMPTS[2])
                except Exception as e:  # noqa: BLE001 - RouterError 503 before the fix
                    tokens, error = None, e
                placed = [d for d in recorder.decisions if d.request_id == rid]
                if tokens is not None and placed and placed[-1].prefill_id == prefill_id:
                    out["after"], out["rewired_s"] = tokens, time.monotonic() - resumed
                    break
                assert time.monotonic() - resumed < 20.0, (
                    f"no request was prefilled on the resumed prefill worker within 20 s of SIGCONT "
                    f"({tries} tries; last: {error if tokens is None else 'placed ' + repr(placed)})")
                await asyncio.sleep(0.2)
            out["health_after"] = await _health_until(
                http, lambda h: all(w["healthy"] for w in h["workers"]) and not h["unwired_pairs"], 10.0,
                "listed every worker healthy again")
            out["last"] = await _generate(router, "last", PROMPTS[3])
            return out

    try:
        out = asyncio.run(main())
    finally:
        os.kill(pid, signal.SIGCONT)  # never leave a frozen process behind
    print(f"pair re-wired and prefilling again {out['rewired_s']:.2f} s after SIGCONT")
    during = out["health_during"]
    assert during["status"] == "ok", during  # the decode worker still serves (it prefills by itself)
    assert during["unwired_pairs"] == [{"prefill": prefill_id, "decode": decode_id}], during
    assert _entry(during, decode_id)["healthy"], during
    assert out["before"] == expected[0] and out["during"] == expected[1]
    assert out["after"] == expected[2] and out["last"] == expected[3]
    decisions = {d.request_id: d for d in recorder.decisions}
    assert decisions["before"].prefill_id == prefill_id
    assert decisions["during"].local, "with its only prefill worker unreachable the decode worker prefills itself"
    assert decisions["last"].prefill_id == prefill_id
    assert out["rewired_s"] < 10.0
    assert out["health_after"]["status"] == "ok"
    assert not router.requests
    for wid, s in settled_worker_stats(cluster, 10).items():
        assert s["num_free_blocks"] == s["num_blocks"], (wid, s)
