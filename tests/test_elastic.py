"""Workers join and leave a running cluster (real Ray actors, real KV transfer): a worker that is
added takes placements; a worker that drains gets none from the moment it starts draining, is
removed only when nothing depends on it, and nothing is lost or recomputed (no recovery, no failed
request, token-exact outputs, every block back)."""

import asyncio
import functools

import pytest

from conftest import (assert_all_blocks_free, assert_drained_cleanly, engine_config, make_engine, router_generate,
                      run_with_router, slow_params, usable_transports)
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

NUM_BLOCKS = 256
_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=16)
PROMPTS = [list(range(3000 + 50 * i, 3000 + 50 * i + 40 + 7 * i)) for i in range(6)]
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def expected():
    return [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(PROMPTS, PARAMS)]


# tcp (the default transport) in the default suite, shm in the slow pass.
@pytest.fixture(params=slow_params([t for t in ("tcp", "shm") if t in usable_transports()], slow=("shm",)))
def transport(request) -> str:
    return request.param


@pytest.fixture
def disagg(ray_session):
    """``disagg(transport="tcp", num_prefill=, num_decode=)`` -> a round-robin disaggregated Cluster and the
    recorder of its router's decisions (started at once); every cluster made is shut down after the test."""
    made = []

    def _make(transport: str = "tcp", **kw):
        made.append(_disagg(transport, **kw))
        return made[-1], made[-1].router.record()

    yield _make
    for cluster in made:
        cluster.shutdown()


def _disagg(transport: str = "tcp", **kw) -> Cluster:
    return Cluster(ClusterSpec(engine=_config(), transfer=TransferConfig(transport=transport), mode="disagg",
                               policy="round_robin", **kw))


async def _generate(router, rid, prompt):
    return await router_generate(router, rid, prompt, PARAMS)


def test_added_decode_worker_takes_placements(disagg, expected):
    cluster, recorder = disagg(num_prefill=1, num_decode=1)
    router = cluster.router

    async def scenario():
        added = await cluster.add_worker("decode")
        outs = [await _generate(router, f"r{i}", p) for i, p in enumerate(PROMPTS)]
        return added, outs

    added, outs = run_with_router(router, scenario)
    assert outs == expected
    assert added in cluster.decode_handles and router.views[added].in_rotation
    assert sum(d.decode_id == added for d in recorder.decisions) == len(PROMPTS) // 2  # round robin over 2
    assert_all_blocks_free(cluster)


@pytest.mark.slow  # ~20 s: the launch path is in the default run (tests/test_serve.py, prefill 2 / decode 1)
def test_workers_added_to_a_cluster_split_each_role_its_own_way(disagg, expected):
    """Prefill workers split over two ranks, decode workers whole (heterogeneous tensor parallelism): a worker added
    while serving takes its role's split, and the tokens are the whole model's."""
    cluster, recorder = disagg(num_prefill=1, num_decode=1, prefill_tensor_parallel_size=2)
    router = cluster.router

    async def scenario():
        added = [await cluster.add_worker("prefill"), await cluster.add_worker("decode")]
        outs = [await _generate(router, f"r{i}", p) for i, p in enumerate(PROMPTS)]
        return added, outs

    added, outs = run_with_router(router, scenario)
    assert outs == expected
    splits = {wid: st["tensor_parallel_size"] for wid, st in cluster.worker_stats().items()}
    assert sorted(splits.values()) == [1, 1, 2, 2] and splits[added[0]] == 2 and splits[added[1]] == 1
    assert {d.prefill_id for d in recorder.decisions} == set(cluster.prefill_handles)  # both prefill workers served
    assert_all_blocks_free(cluster)


def test_drain_decode_worker_mid_stream_loses_nothing(disagg, expected, transport):
    cluster, recorder = disagg(transport, num_prefill=1, num_decode=2)
    router = cluster.router
    leaving = sorted(cluster.decode_handles)[0]

    async def scenario():
        first = [asyncio.create_task(_generate(router, f"a{i}", p)) for i, p in enumerate(PROMPTS[:4])]
        while not any(r.attempt is not None and r.attempt.decode_id == leaving and r.emitted
                      for r in router.requests.values()):
            await asyncio.sleep(0.01)  # a request is streaming on the leaving worker
        drain = asyncio.create_task(cluster.remove_worker(leaving))
        await asyncio.sleep(0)  # the drain has begun: nothing new may go there
        began = len(recorder.decisions)
        later = [asyncio.create_task(_generate(router, f"b{i}", p)) for i, p in enumerate(PROMPTS[4:], 4)]
        outs = await asyncio.gather(*first, *later)
        return outs, await drain, began

    outs, result, began = run_with_router(router, scenario)
    assert outs == expected[:4] + expected[4:]
    assert result.num_requests_waited_for >= 1, "the drain had nothing to wait for: the test has no teeth"
    assert_drained_cleanly(cluster, recorder, leaving, began)


def test_drain_prefill_worker_with_transfers_in_flight(disagg, expected, transport):
    cluster, recorder = disagg(transport, num_prefill=2, num_decode=1)
    router = cluster.router
    leaving = sorted(cluster.prefill_handles)[0]

    async def scenario():
        tasks = [asyncio.create_task(_generate(router, f"p{i}", p)) for i, p in enumerate(PROMPTS)]
        while not any(d.prefill_id == leaving for d in recorder.decisions):
            await asyncio.sleep(0.005)  # a transfer from the leaving worker is under way
        result = await cluster.remove_worker(leaving)
        return await asyncio.gather(*tasks), result

    outs, result = run_with_router(router, scenario)
    assert outs == expected
    assert_drained_cleanly(cluster, recorder, leaving)  # a prefill drain re-prefills nothing either
