"""Soak: many requests at a steady rate through the Ray cluster, 10% aborted by the client mid-stream,
one decode worker killed mid-run. End state: no leaked block on any live worker, every router count
zero, every request with a final status, every completed greedy request token-exact.

The default run (in CI) sends 200 requests; the long run (``-m slow``, run by .ci/run when the time
budget allows) sends 2,000 (PDCLUSTER_SOAK_REQUESTS overrides)."""

import asyncio
import json
import os
import random
import time

import pytest

from conftest import make_engine
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

NUM_BLOCKS = 512



def _soak(ray, num_requests: int, rate_per_s: float):
    rng = random.Random(42)
    # Requests draw from a pool of distinct (prompt, max_tokens) pairs: repeats exercise the prefix
    # caches on both sides, as repeated system prompts do, and keep the offline oracle small.
    num_distinct = min(num_requests, 300)
    pool_prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 200))] for _ in range(num_distinct)]
    pool_max_tokens = [rng.randrange(4, 48) for _ in range(num_distinct)]
    picks = [i if i < num_distinct else rng.randrange(num_distinct) for i in range(num_requests)]
    prompts = [pool_prompts[k] for k in picks]
    max_tokens = [pool_max_tokens[k] for k in picks]
    aborted = set(rng.sample(range(num_requests), num_requests // 10))
    engine = make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS)
    pool_expected = [o.token_ids for o in engine.generate(
        pool_prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in pool_max_tokens])]
    expected = [pool_expected[k] for k in picks]
    del engine
    cfg = EngineConfig(model="tiny-random", num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=64)
    cluster = Cluster(ClusterSpec(engine=cfg, transfer=TransferConfig(), mode="disagg", num_prefill=1, num_decode=2,
                                  request_timeout_s=300))
    router = cluster.router
    router.record()  # decisions and recoveries, for the asserts below
    router.config.health_interval_s = 0.3
    final = {}
    t_start = time.monotonic()

    async def one(i):
        tokens = []
        params = SamplingParams(max_tokens=max_tokens[i], ignore_eos=True)
        try:
            async for delta in router.generate(f"soak-{i}", prompts[i], params):
                tokens += delta.new_token_ids
                if i in aborted and len(tokens) >= 2:
                    final[i] = ("client_abort", tokens)
                    return  # leaving the stream early = client disconnect
                if delta.finished:
                    final[i] = (delta.finish_reason, tokens, delta.error)
        except Exception as e:  # noqa: BLE001 - admission refused is a final status too
            final[i] = (f"refused: {e}", tokens)

    async def main():
        tasks = []
        killed = False
        for i in range(num_requests):
            tasks.append(asyncio.create_task(one(i)))
            if not killed and i == num_requests // 2:
                victim = next(iter(cluster.decode_handles))
                ray.kill(cluster.decode_handles[victim], no_restart=True)
                killed = True
            await asyncio.sleep(rng.expovariate(rate_per_s))
        done, pending = await asyncio.wait(tasks, timeout=240)
        if pending:  # name the hung requests and where the router thinks they are
            hung = {rid: (r.attempt and r.attempt.pair, r.attempt and r.attempt.number, len(r.emitted),
                          r.recovering, r.attempt and r.attempt.t_kv_ready > 0)
                    for rid, r in router.requests.items()}
            raise AssertionError(f"{len(pending)} requests hung; router state "
                                 f"(pair, placement, streamed, recovering, kv landed): {hung}")
        # Let the health check see the kill and abort messages land.
        await asyncio.sleep(1.0)

    try:
        asyncio.run(main())
        assert len(final) == num_requests, f"requests without a final status: {set(range(num_requests)) - set(final)}"
        completed = [i for i, v in final.items() if v[0] == "length"]
        errors = {i: v for i, v in final.items() if v[0] not in ("length", "client_abort")}
        assert not errors, f"unexpected final statuses: {list(errors.items())[:5]}"
        for i in completed:
            assert final[i][1] == expected[i], f"request {i} is not token-exact"
        assert not router.requests, "router still tracks requests"
        assert router.streams.num_placements == 0, "router still routes events of ended placements"
        stats = router.stats()
        assert all(w["kv_tokens"] == 0 and w["num_requests"] == 0 for w in stats["workers"])
        # Every live worker: all blocks free, nothing reserved, held or in transfer.
        live = {wid: h for wid, h in {**cluster.prefill_handles, **cluster.decode_handles}.items()
                if router.views[wid].healthy}
        deadline = time.monotonic() + 10
        while True:
            st = dict(zip(live, ray.get([h.stats.remote() for h in live.values()], timeout=30)))
            if all(s["num_free_blocks"] == s["num_blocks"] for s in st.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for wid, s in st.items():
            assert s["num_free_blocks"] == s["num_blocks"], f"{wid} leaked blocks: {s}"
            assert s.get("num_reserved", 0) == 0 and s.get("num_held", 0) == 0 and s.get("num_transfers", 0) == 0, s
        recovery_s = sorted(t for _, t in router.recorder.recoveries)
        print("soak:", json.dumps({
            "requests": num_requests, "completed_token_exact": len(completed), "client_aborts": len(aborted),
            "decode_workers_killed": 1, "recoveries": len(recovery_s),
            "recovery_s_median": recovery_s[len(recovery_s) // 2] if recovery_s else None,
            "recovery_s_max": recovery_s[-1] if recovery_s else None,
            "leaked_blocks": 0, "hung_requests": 0, "wall_s": round(time.monotonic() - t_start, 1)}))
    finally:
        cluster.shutdown()


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_soak(ray_session):
    _soak(ray_session, num_requests=200, rate_per_s=20.0)


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(3000)
def test_soak_long(ray_session):
    _soak(ray_session, num_requests=int(os.environ.get("PDCLUSTER_SOAK_REQUESTS", "2000")), rate_per_s=15.0)
