"""Ray actor restarts: a worker process that crashes (SIGKILL, not ``ray.kill``) is restarted by Ray
under the same worker id. The router notices the new incarnation, recovers what the old process held,
re-runs the control-plane handshakes (a restarted prefill worker listens on a new port; a restarted
decode worker has no peers and a new data-plane address) and puts the worker back in rotation. A request
streaming through the crash continues exactly; later requests run on the restarted worker."""

import asyncio
import os
import signal
import time

import pytest

from conftest import make_engine
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

NUM_BLOCKS = 256



async def _generate(router, request_id, prompt, params):
    tokens, last = [], None
    async for delta in router.generate(request_id, prompt, params):
        tokens += delta.new_token_ids
        last = delta
    return tokens, last


async def _wait_rejoined(router, worker_id, old_incarnation, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.views[worker_id].healthy and router.health.incarnations.get(worker_id) not in (None, old_incarnation):
            return time.monotonic()
        await asyncio.sleep(0.1)
    raise AssertionError(f"{worker_id} did not rejoin within {timeout_s} s")


@pytest.mark.timeout(600)
def test_crashed_workers_restart_and_rejoin(ray_session):
    prompt_a, prompt_b, prompt_c = list(range(2000, 2040)), list(range(3000, 3050)), list(range(7000, 7033))
    params_a = SamplingParams(max_tokens=150, ignore_eos=True)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS)
    expected_a = engine.generate([prompt_a], params_a)[0].token_ids
    expected_b, expected_c = (o.token_ids for o in engine.generate([prompt_b, prompt_c], params))
    del engine
    config = EngineConfig(model="tiny-random", num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=64)
    cluster = Cluster(ClusterSpec(engine=config, transfer=TransferConfig(), mode="disagg", num_prefill=1, num_decode=1,
                                  request_timeout_s=240, max_worker_restarts=2))
    router = cluster.router
    router.record()  # decisions and recoveries, for the asserts below
    router.config.health_interval_s = 0.3
    router.config.admission_wait_s = 120.0  # the only decode worker is coming back: wait for it
    (decode_id, decode), = cluster.decode_handles.items()
    (prefill_id, prefill), = cluster.prefill_handles.items()

    async def main():
        timings = {}
        # 1. The only decode worker crashes while A streams: A waits for the restart and continues.
        tokens, state = [], {}

        async def consume_a():
            async for delta in router.generate("a", prompt_a, params_a):
                tokens.extend(delta.new_token_ids)
                state["last"] = delta

        task_a = asyncio.create_task(consume_a())
        while len(tokens) < 10 and not task_a.done():
            await asyncio.sleep(0.02)
        old = router.health.incarnations[decode_id]
        pid = await decode.pid.remote()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        timings["decode_rejoined_s"] = await _wait_rejoined(router, decode_id, old) - killed
        pids = {"decode": (pid, router.views[decode_id].pid, await decode.pid.remote())}  # old, listed, real
        await asyncio.wait_for(task_a, 180)
        timings["decode_recovered_s"] = router.recorder.recoveries[0][1] if router.recorder.recoveries else None
        # 2. A new request runs on the restarted decode worker (needs the re-wired handshake).
        out_b = await _generate(router, "b", prompt_b, params)
        # 3. The prefill worker crashes: it comes back on a new port; decode re-connects to it.
        old = router.health.incarnations[prefill_id]
        pid = await prefill.pid.remote()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        timings["prefill_rejoined_s"] = await _wait_rejoined(router, prefill_id, old) - killed
        pids["prefill"] = (pid, router.views[prefill_id].pid, await prefill.pid.remote())
        out_c = await _generate(router, "c", prompt_c, params)
        return tokens, state["last"], out_b, out_c, timings, pids

    try:
        tokens_a, last_a, (tokens_b, last_b), (tokens_c, last_c), timings, pids = asyncio.run(main())
        print(f"restart timings: {timings}")
        assert last_a.finish_reason == "length", (last_a.finish_reason, last_a.error)
        assert tokens_a == expected_a, "the stream must continue exactly across the decode worker's restart"
        assert (last_b.finish_reason, tokens_b) == ("length", expected_b), last_b.error
        assert (last_c.finish_reason, tokens_c) == ("length", expected_c), last_c.error
        decisions = {d.request_id: d for d in router.recorder.decisions}
        assert decisions["b"].decode_id == decode_id and decisions["c"].prefill_id == prefill_id
        assert not decisions["c"].local, "C must be prefilled on the restarted prefill worker, not locally"
        for role, (old_pid, listed, real) in pids.items():  # /health's pid is the replacement's once it rejoined
            assert listed == real != old_pid, (role, old_pid, listed, real)
        assert not router.requests
        stats = cluster.worker_stats()
        for wid, s in stats.items():
            assert s["num_free_blocks"] == s["num_blocks"], (wid, s)
    finally:
        cluster.shutdown()
