"""The autoscale planner: its policy as a pure function of what the router sees, and the planner
acting on a real Ray cluster (load over the SLO adds a worker that then takes placements; load well
under it drains one with requests in flight, losing and recomputing nothing)."""

import asyncio
import dataclasses
import functools
import time

import pytest

from conftest import engine_config, make_engine, settled_worker_stats
from pdcluster.cluster.autoscale import Action, AutoscaleConfig, Planner, Snapshot, decide
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

CFG = AutoscaleConfig(min_prefill=1, max_prefill=2, min_decode=1, max_decode=2, slo_ttft_ms=1000, slo_tpot_ms=100)


def snap(**kw):
    base = dict(num_prefill=1, num_decode=1, p90_ttft_ms=500.0, p90_tpot_ms=50.0, num_waiting=0, kv_usage=0.5,
                disagg=True)
    base.update(kw)
    return Snapshot(**base)


@pytest.mark.parametrize("s, want", [
    (snap(), None),  # inside both SLOs, not quiet: hold
    (snap(p90_tpot_ms=150.0), Action("add", "decode", "")),
    (snap(kv_usage=0.95), Action("add", "decode", "")),
    (snap(p90_ttft_ms=1500.0), Action("add", "prefill", "")),
    (snap(num_waiting=3), Action("add", "prefill", "")),
    (snap(p90_ttft_ms=1500.0, disagg=False), Action("add", "decode", "")),  # colocated: decode prefills
    (snap(p90_ttft_ms=1500.0, num_prefill=2), None),  # at max: nothing to add
    (snap(p90_tpot_ms=150.0, num_decode=2, p90_ttft_ms=1500.0), Action("add", "prefill", "")),
    (snap(p90_ttft_ms=100.0, p90_tpot_ms=10.0, kv_usage=0.1, num_decode=2), Action("drain", "decode", "")),
    (snap(p90_ttft_ms=100.0, p90_tpot_ms=10.0, kv_usage=0.1, num_prefill=2), Action("drain", "prefill", "")),
    (snap(p90_ttft_ms=100.0, p90_tpot_ms=10.0, kv_usage=0.1), None),  # at the minimum: keep
    (snap(p90_ttft_ms=None, p90_tpot_ms=None, kv_usage=0.0, num_decode=2), Action("drain", "decode", "")),
    (snap(p90_ttft_ms=100.0, p90_tpot_ms=10.0, kv_usage=0.1, num_decode=2, num_waiting=1), Action("add", "prefill", "")),
])
def test_decide(s, want):
    got = decide(s, CFG)
    assert (got.kind, got.role) == (want.kind, want.role) if want else got is None, got


def test_config_refuses_impossible_bounds():
    with pytest.raises(ValueError, match="--min-decode/--max-decode"):
        AutoscaleConfig(min_decode=3, max_decode=2)
    with pytest.raises(ValueError, match="--slo-ttft-ms"):
        AutoscaleConfig(slo_ttft_ms=0)


NUM_BLOCKS = 256
_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=32)
PROMPTS = [list(range(9000 + 40 * i, 9000 + 40 * i + 30)) for i in range(8)]
PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.mark.timeout(300)
def test_planner_adds_under_load_and_drains_when_quiet(ray_session):
    expected = [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(PROMPTS, PARAMS)]
    cluster = Cluster(ClusterSpec(engine=_config(), transfer=TransferConfig(), mode="disagg", num_prefill=1,
                                  num_decode=1, policy="round_robin"))
    router = cluster.router
    recorder = router.record()
    # TPOT SLO no CPU can meet: the planner must add a decode worker.
    strict = AutoscaleConfig(max_decode=2, slo_tpot_ms=0.001, slo_ttft_ms=1e6, cooldown_s=0.0, min_samples=4,
                             window_s=600.0)
    planner = Planner(cluster, strict)

    async def generate(rid, prompt):
        out = []
        async for delta in router.generate(rid, prompt, PARAMS):
            out += delta.new_token_ids
        return out

    async def main():
        router.start(asyncio.get_running_loop())
        first = [await generate(f"a{i}", p) for i, p in enumerate(PROMPTS[:4])]
        added = await planner.step()
        new_worker = planner.decisions[-1][2]
        second = await asyncio.gather(*(generate(f"b{i}", p) for i, p in enumerate(PROMPTS[4:], 4)))
        # Now an SLO far above what is measured: quiet, so the planner drains one decode worker while
        # requests run on both.
        planner.config = dataclasses.replace(strict, slo_tpot_ms=1e6, low_fraction=1.0, kv_low=1.0)
        running = [asyncio.create_task(generate(f"c{i}", p)) for i, p in enumerate(PROMPTS[:4])]
        deadline = time.monotonic() + 60
        while not (len(router.requests) == 4 and all(r.running for r in router.requests.values())):
            assert time.monotonic() < deadline, "the requests never all ran"
            await asyncio.sleep(0.005)
        drained = await planner.step()
        third = await asyncio.gather(*running)
        return first, added, new_worker, second, drained, third

    try:
        first, added, new_worker, second, drained, third = asyncio.run(main())
        assert (added.kind, added.role) == ("add", "decode")
        assert first + second == expected and third == expected[:4]
        assert any(d.decode_id == new_worker for d in recorder.decisions if d.request_id.startswith("b"))
        assert (drained.kind, drained.role) == ("drain", "decode")
        assert len(cluster.decode_handles) == 1
        assert not recorder.recoveries, "a drain must not recompute anything"
        for s in settled_worker_stats(cluster, 10).values():
            assert s["num_free_blocks"] == s["num_blocks"], s
    finally:
        cluster.shutdown()


@pytest.mark.timeout(400)
def test_serve_autoscale_adds_a_worker_and_exports_it(tiny_dir):
    """`pdcluster serve --autoscale` end to end: with a TPOT SLO no CPU meets, the planner (running on
    the server's loop) adds the second decode worker it is allowed; /metrics shows the action and
    the workers in rotation, and requests keep succeeding."""
    import httpx

    from pdcluster.tools.loadtest.server_metrics import parse_prometheus
    from pdcluster.tools.server_process import ServeProcess

    flags = ["--mode", "colocated", "--model", "tiny-random", "--num-kv-blocks", "128", "--autoscale",
             "--max-decode", "2", "--slo-tpot-ms", "0.001"]
    with ServeProcess(flags) as server:
        body = {"model": "tiny-random", "prompt": "hello there", "max_tokens": 8, "temperature": 0}
        deadline = time.monotonic() + 240
        metrics = {}
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            while time.monotonic() < deadline:
                assert http.post("/v1/completions", json=body).status_code == 200
                metrics = parse_prometheus(http.get("/metrics").text)
                if metrics.get("pdcluster:autoscale_actions_total", 0) >= 1:
                    break
            assert metrics.get("pdcluster:autoscale_actions_total", 0) >= 1, "the planner never acted"
            for _ in range(4):  # the new worker serves as well
                assert http.post("/v1/completions", json=body).status_code == 200
            metrics = parse_prometheus(http.get("/metrics").text)
    assert metrics.get("pdcluster:num_workers") == 2.0, metrics.get("pdcluster:num_workers")
