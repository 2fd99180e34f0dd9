"""The Ray cluster, in-process driver: real Ray actors (custom resources as devices), real zmq event
stream, real KV transfer. Greedy outputs equal a single engine in every mode; the router's accounting
follows the decode workers' reports; placement policies do what they say."""

import asyncio
import functools
import random
import time

import pytest

from conftest import engine_config, make_engine, settled_worker_stats, transport_params
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

NUM_BLOCKS = 256

_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=32)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 120))] for _ in range(n)]


async def _run(router, prompts, params):
    router.start(asyncio.get_running_loop())

    async def one(i, prompt):
        tokens, last = [], None
        async for delta in router.generate(f"req-{i}", prompt, params):
            tokens += delta.new_token_ids
            last = delta
        assert last.finished and last.finish_reason in ("length", "stop"), (last.finish_reason, last.error)
        return tokens

    return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])


def _serve_and_check(spec, prompts, params, expected) -> dict[str, dict]:
    """Serve the prompts, check the outputs and that everything came back; every worker's stats."""
    cluster = Cluster(spec)
    try:
        outputs = asyncio.run(_run(cluster.router, prompts, params))
        assert outputs == expected
        stats = cluster.router.stats()
        assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
        assert all(w["kv_tokens"] == 0 and w["num_requests"] == 0 for w in stats["workers"])
        worker_stats = settled_worker_stats(cluster)
        for wid, st in worker_stats.items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
        return worker_stats
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def expected_greedy(tiny_dir):
    engine = make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _prompts(8)
    return prompts, params, [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", transport_params())
def test_disagg_equals_engine(ray_session, expected_greedy, transport):
    prompts, params, expected = expected_greedy
    spec = ClusterSpec(engine=_config(), transfer=TransferConfig(transport=transport, secret="k"), mode="disagg")
    _serve_and_check(spec, prompts, params, expected)


@pytest.mark.timeout(300)
def test_colocated_equals_engine(ray_session, expected_greedy):
    prompts, params, expected = expected_greedy
    spec = ClusterSpec(engine=_config(), transfer=TransferConfig(), mode="colocated")
    _serve_and_check(spec, prompts, params, expected)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ngram", "mtp", "draft_model"])
def test_disagg_with_speculation_equals_engine(ray_session, expected_greedy, method):
    prompts, params, expected = expected_greedy
    spec = ClusterSpec(engine=_config(spec_method=method, num_spec_tokens=3), transfer=TransferConfig(), mode="disagg")
    _serve_and_check(spec, prompts, params, expected)


@pytest.mark.timeout(300)
def test_disagg_with_async_scheduling_equals_engine(ray_session, expected_greedy):
    """`serve --async-scheduling`: the decode workers launch steps ahead (their connector acts between
    steps), the prefill workers finish each step first; outputs and accounting as without."""
    prompts, params, expected = expected_greedy
    spec = ClusterSpec(engine=_config(async_scheduling=True), transfer=TransferConfig(), mode="disagg")
    stats = _serve_and_check(spec, prompts, params, expected)
    ahead = {wid: st["num_steps_launched_ahead"] for wid, st in stats.items()}
    assert all(n > 0 for wid, n in ahead.items() if wid.startswith("decode")), ahead
    assert all(n == 0 for wid, n in ahead.items() if wid.startswith("prefill")), ahead


def _check_accounting(cluster, prompts, params, expected):
    """Run the prompts; at every decode report the router's count must be the worker's."""
    router = cluster.router
    recorder = router.record()  # every report, with the router's mirror right after applying it
    outputs = asyncio.run(_run(router, prompts, params))
    assert outputs == expected
    seen = [(x.reported_computed_tokens, x.mirrored_computed_tokens, x.num_prompt_tokens, x.num_output_tokens,
             x.finished) for x in recorder.reports]
    assert seen, "no decode reports"
    for reported, mirrored, num_prompt, num_output, finished in seen:
        assert mirrored == reported
        if not finished:
            # Every committed token but the newest has its KV, after any number of accepted drafts.
            assert reported == num_prompt + num_output - 1
    stats = router.stats()
    assert all(w["kv_tokens"] == 0 and w["num_requests"] == 0 for w in stats["workers"])
    assert router.streams.num_placements == 0, "events of ended placements are still routed"
    for wid, st in settled_worker_stats(cluster).items():
        assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
    return seen


@pytest.mark.timeout(300)
def test_32_concurrent_mixed_requests(ray_session, tiny_dir):
    prompts = _prompts(32, seed=5)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(prompts, params)]
    spec = ClusterSpec(engine=_config(spec_method="mtp", num_spec_tokens=3), transfer=TransferConfig(), mode="disagg")
    cluster = Cluster(spec)
    try:
        _check_accounting(cluster, prompts, params, expected)
    finally:
        cluster.shutdown()


ACCEPTING_PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox",
]


@pytest.mark.timeout(600)
def test_router_accounting_follows_reports_under_speculation(ray_session, smollm2_dir):
    """SmolLM2 with n-gram drafts on repetitive prompts: steps accept a varying number of drafts, so a
    router that advanced its counts by one per step would drift; ours mirrors every report."""
    engine = make_engine("smollm2", num_kv_blocks=NUM_BLOCKS)
    prompts = [engine.tokenize(p) for p in ACCEPTING_PROMPTS]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    del engine
    cfg = _config(model="smollm2", spec_method="ngram", num_spec_tokens=3)
    cluster = Cluster(ClusterSpec(engine=cfg, transfer=TransferConfig(), mode="disagg"))
    try:
        seen = _check_accounting(cluster, prompts, params, expected)
        assert cluster.router.counters["num_accepted_tokens"] > 0, "no draft was accepted: the test has no teeth"
        steps_per_request = {}
        for reported, _, num_prompt, num_output, _ in seen:
            steps_per_request.setdefault(num_prompt, []).append(num_output)
        jumps = [b - a for outs in steps_per_request.values() for a, b in zip(outs, outs[1:])]
        assert max(jumps) > 1, "some step should have emitted several tokens"
    finally:
        cluster.shutdown()


# ---- placement policies on 2 prefill + 2 decode workers --------------------------------------------

@pytest.fixture(scope="module")
def cluster_2p2d(ray_session):
    spec = ClusterSpec(engine=_config(), transfer=TransferConfig(), mode="disagg", num_prefill=2, num_decode=2,
                       policy="round_robin")
    cluster = Cluster(spec)
    yield cluster
    cluster.shutdown()


def _set_policy(cluster, policy):
    from pdcluster.cluster.policies import Placer

    cluster.router.placement.placer = Placer(policy, 0, seed=1)
    cluster.router.record()


@pytest.mark.timeout(300)
def test_round_robin_alternates(cluster_2p2d):
    _set_policy(cluster_2p2d, "round_robin")

    async def sequential():
        cluster_2p2d.router.start(asyncio.get_running_loop())
        for i, prompt in enumerate(_prompts(4, seed=9)):
            async for _ in cluster_2p2d.router.generate(f"rr-{i}", prompt, SamplingParams(max_tokens=2)):
                pass

    asyncio.run(sequential())
    d = cluster_2p2d.router.recorder.decisions
    assert len({x.decode_id for x in d}) == 2 and len({x.prefill_id for x in d}) == 2
    assert [x.decode_id for x in d[:2]] == [x.decode_id for x in d[2:]]
    assert d[0].decode_id != d[1].decode_id and d[0].prefill_id != d[1].prefill_id


@pytest.mark.timeout(300)
def test_least_loaded_and_prefix_aware(cluster_2p2d):
    router = cluster_2p2d.router
    _set_policy(cluster_2p2d, "least_loaded")
    long_params = SamplingParams(max_tokens=40, ignore_eos=True)
    shared = list(range(1000, 1100))

    async def scenario():
        router.start(asyncio.get_running_loop())

        async def drain(rid, prompt, params):
            async for _ in router.generate(rid, prompt, params):
                pass

        # A long request occupies one decode worker; the next goes to the other (fewer KV tokens).
        first = asyncio.create_task(drain("ll-0", list(range(5, 305)), long_params))
        while not router.recorder.decisions:
            await asyncio.sleep(0.01)
        await drain("ll-1", [7, 8, 9], SamplingParams(max_tokens=2))
        await first
        # prefix_aware: requests sharing a long prefix land on the same prefill worker.
        router.placement.placer = __import__("pdcluster.cluster.policies", fromlist=["Placer"]).Placer("prefix_aware", 0)
        await drain("px-0", shared + [1], SamplingParams(max_tokens=2))
        await drain("px-1", shared + [2], SamplingParams(max_tokens=2))
        await drain("px-2", shared + [3], SamplingParams(max_tokens=2))

    asyncio.run(scenario())
    d = {x.request_id: x for x in router.recorder.decisions}
    assert d["ll-1"].decode_id != d["ll-0"].decode_id
    assert d["px-0"].prefill_id == d["px-1"].prefill_id == d["px-2"].prefill_id


@pytest.mark.timeout(300)
def test_cached_tokens_come_from_the_worker_that_prefilled(cluster_2p2d):
    """A repeated prompt is served from the prefill worker's prefix cache (prefix_aware places it on
    the same one): the usage the router reports says how many prompt tokens were cached, counted by
    that worker, in full blocks; the first time, none."""
    router = cluster_2p2d.router
    _set_policy(cluster_2p2d, "prefix_aware")
    prompt = list(range(7000, 7000 + 100))  # 6 full blocks of 16 and a partial one
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def cached(rid):
        router.start(asyncio.get_running_loop())
        last = None
        async for delta in router.generate(rid, prompt, params):
            last = delta
        return last.num_cached_tokens

    first = asyncio.run(cached("cache-0"))
    second = asyncio.run(cached("cache-1"))
    placed = {d.request_id: d.prefill_id for d in router.recorder.decisions}
    assert placed["cache-0"] == placed["cache-1"]
    assert first == 0
    assert second == 96, second  # every full block of the prompt (the partial tail is recomputed)


@pytest.mark.timeout(300)
def test_kv_aware_sends_a_repeated_prompt_to_the_worker_holding_its_blocks(cluster_2p2d):
    """The workers' KV events fill the router's index; kv_aware then places a repeated long prompt on
    the prefill worker that holds its blocks, although least_loaded would pick the other (both idle: the
    lower id). The index forgets nothing it should not: each prompt is held where it was prefilled."""
    from pdcluster.cluster.metrics import Metrics
    from pdcluster.engine.block_manager import chained_block_hashes

    router = cluster_2p2d.router
    _set_policy(cluster_2p2d, "round_robin")  # the first placements: a on one prefill worker, b on the other
    a, b = list(range(8000, 8160)), list(range(9000, 9160))  # 10 full blocks each
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def place(rid, prompt):
        router.start(asyncio.get_running_loop())
        async for _ in router.generate(rid, prompt, params):
            pass

    async def indexed(worker_id, prompt, timeout_s=30.0):
        hashes = chained_block_hashes(prompt, 16)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while router.kv_index.overlap(worker_id, hashes) < len(hashes):
            assert asyncio.get_running_loop().time() < deadline, f"{worker_id}'s KV events never arrived"
            await asyncio.sleep(0.02)

    async def scenario():
        await place("kv-a", a)
        await place("kv-b", b)
        first = {d.request_id: d.prefill_id for d in router.recorder.decisions}
        await indexed(first["kv-a"], a)
        await indexed(first["kv-b"], b)
        _set_policy(cluster_2p2d, "kv_aware")
        for rid, prompt in (("kv-b2", b), ("kv-a2", a)):  # b first: least_loaded would send it to prefill-0
            await place(rid, prompt)
        deadline = time.monotonic() + 10  # every worker's tiers, once a health check has reported them
        while not all(w["kv_tiers"] for w in router.stats()["workers"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return first

    first = asyncio.run(scenario())
    assert first["kv-a"] != first["kv-b"]
    again = {d.request_id: d.prefill_id for d in router.recorder.decisions}
    assert again["kv-a2"] == first["kv-a"] and again["kv-b2"] == first["kv-b"]
    hashes_a = chained_block_hashes(a, 16)
    assert router.kv_index.overlap(first["kv-b"], hashes_a) == 0  # a's blocks are not where b went
    # /metrics: every tier's usage, summed over the workers.
    metrics = Metrics("m")
    metrics.refresh(router.stats())
    text = metrics.render().decode()
    assert f'pdcluster:kv_tier_capacity_blocks{{model_name="m",tier="device"}} {4 * NUM_BLOCKS}.0' in text
