"""Seamless recovery: a decode worker killed mid-generation (Ray actor killed) is detected by the
router's health check; the request is re-prefilled with prompt + streamed tokens on a healthy pair and
the same stream continues. With greedy sampling the client's whole output equals an uninterrupted run.
Without a healthy worker left, the request ends with a clear error within its deadline."""

import asyncio
import os
import tempfile
import time

import pytest

from conftest import make_engine
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def ray_session(tiny_dir):
    ray = pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="pdcluster-ray-")
    ray.init(num_cpus=2, resources={"prefill_slot": 4, "decode_slot": 4}, include_dashboard=False,
             log_to_driver=False, _temp_dir=tmp)
    yield ray
    ray.shutdown()


def _config():
    return EngineConfig(model="tiny-random", num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=64)


async def _stream_and_kill(cluster, ray, prompt, params, kill_after, kill_role):
    router = cluster.router
    router.health_interval_s = 0.3
    tokens, last, killed_at, first_after_kill = [], None, None, None
    async for delta in router.generate("victim", prompt, params):
        tokens += delta.new_token_ids
        last = delta
        if killed_at is not None and first_after_kill is None and delta.new_token_ids:
            first_after_kill = time.monotonic()
        if killed_at is None and len(tokens) >= kill_after:
            r = router.requests["victim"]
            target = r.decode_id if kill_role == "decode" else r.prefill_id
            handles = {**cluster.decode_handles, **cluster.prefill_handles}
            ray.kill(handles[target], no_restart=True)
            killed_at = time.monotonic()
    return tokens, last, killed_at, first_after_kill


@pytest.mark.timeout(300)
def test_decode_worker_killed_mid_generation_stream_continues_exactly(ray_session):
    prompt = list(range(2000, 2040))
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    expected = make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate([prompt], params)[0].token_ids
    cluster = Cluster(ClusterSpec(engine=_config(), transfer=TransferConfig(), mode="disagg", num_prefill=1, num_decode=2))
    try:
        tokens, last, killed_at, resumed_at = asyncio.run(
            _stream_and_kill(cluster, ray_session, prompt, params, kill_after=20, kill_role="decode"))
        assert last.finished and last.finish_reason == "length", (last.finish_reason, last.error)
        assert tokens == expected, "the recovered stream must equal an uninterrupted greedy run"
        assert cluster.router.recoveries, "the request was never recovered"
        assert resumed_at is not None and resumed_at - killed_at < 10.0
        print(f"recovery: first token {resumed_at - killed_at:.2f}s after the kill")
        assert not cluster.router.requests
    finally:
        cluster.shutdown()


@pytest.mark.timeout(300)
def test_seeded_sampling_survives_recovery(ray_session):
    prompt = list(range(3000, 3030))
    params = SamplingParams(max_tokens=80, temperature=0.8, top_k=50, seed=1234, ignore_eos=True)
    expected = make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate([prompt], params)[0].token_ids
    cluster = Cluster(ClusterSpec(engine=_config(), transfer=TransferConfig(), mode="disagg", num_prefill=1, num_decode=2))
    try:
        tokens, last, _, _ = asyncio.run(
            _stream_and_kill(cluster, ray_session, prompt, params, kill_after=15, kill_role="decode"))
        assert last.finish_reason == "length"
        assert tokens == expected, "draws are keyed by the original output position, so sampling is unchanged"
    finally:
        cluster.shutdown()


@pytest.mark.timeout(300)
def test_no_healthy_worker_ends_with_clear_error_before_deadline(ray_session):
    prompt = list(range(2000, 2040))
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    spec = ClusterSpec(engine=_config(), transfer=TransferConfig(), mode="disagg", num_prefill=1, num_decode=1,
                       request_timeout_s=60)
    cluster = Cluster(spec)
    cluster.router.admission_wait_s = 2.0
    try:
        started = time.monotonic()
        tokens, last, killed_at, _ = asyncio.run(
            _stream_and_kill(cluster, ray_session, prompt, params, kill_after=10, kill_role="decode"))
        assert last.finished and last.finish_reason == "error"
        assert "down" in last.error or "decode worker" in last.error, last.error
        assert time.monotonic() - started < 30
    finally:
        cluster.shutdown()
