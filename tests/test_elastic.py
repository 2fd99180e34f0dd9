"""Workers join and leave a running cluster (real Ray actors, real KV transfer): a worker that is
added takes placements; a worker that drains gets none from the moment it starts draining, is
removed only when nothing depends on it, and nothing is lost or recomputed (no recovery, no failed
request, token-exact outputs, every block back)."""

import asyncio
import functools

import pytest

from conftest import (assert_all_blocks_free, assert_drained_cleanly, engine_config, make_engine, router_generate,
                      usable_transports)
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

NUM_BLOCKS = 256
_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=1024, prefill_chunk_size=16)
PROMPTS = [list(range(3000 + 50 * i, 3000 + 50 * i + 40 + 7 * i)) for i in range(6)]
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    return [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(PROMPTS, PARAMS)]


async def _generate(router, rid, prompt):
    return await router_generate(router, rid, prompt, PARAMS)


def _disagg(transport: str = "tcp", **kw) -> Cluster:
    return Cluster(ClusterSpec(engine=_config(), transfer=TransferConfig(transport=transport), mode="disagg",
                               policy="round_robin", **kw))


@pytest.mark.timeout(300)
def test_added_decode_worker_takes_placements(ray_session, expected):
    cluster = _disagg(num_prefill=1, num_decode=1)
    router = cluster.router
    recorder = router.record()
    try:
        async def main():
            router.start(asyncio.get_running_loop())
            added = await cluster.add_worker("decode")
            outs = [await _generate(router, f"r{i}", p) for i, p in enumerate(PROMPTS)]
            return added, outs

        added, outs = asyncio.run(main())
        assert outs == expected
        assert added in cluster.decode_handles and router.views[added].in_rotation
        assert sum(d.decode_id == added for d in recorder.decisions) == len(PROMPTS) // 2  # round robin over 2
        assert_all_blocks_free(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", [t for t in ("tcp", "shm") if t in usable_transports()])
def test_drain_decode_worker_mid_stream_loses_nothing(ray_session, expected, transport):
    cluster = _disagg(transport, num_prefill=1, num_decode=2)
    router = cluster.router
    recorder = router.record()
    leaving = sorted(cluster.decode_handles)[0]
    try:
        async def main():
            router.start(asyncio.get_running_loop())
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

        outs, result, began = asyncio.run(main())
        assert outs == expected[:4] + expected[4:]
        assert result.num_requests_waited_for >= 1, "the drain had nothing to wait for: the test has no teeth"
        assert_drained_cleanly(cluster, recorder, leaving, began)
    finally:
        cluster.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", [t for t in ("tcp", "shm") if t in usable_transports()])
def test_drain_prefill_worker_with_transfers_in_flight(ray_session, expected, transport):
    cluster = _disagg(transport, num_prefill=2, num_decode=1)
    router = cluster.router
    recorder = router.record()
    leaving = sorted(cluster.prefill_handles)[0]
    try:
        async def main():
            router.start(asyncio.get_running_loop())
            tasks = [asyncio.create_task(_generate(router, f"p{i}", p)) for i, p in enumerate(PROMPTS)]
            while not any(d.prefill_id == leaving for d in recorder.decisions):
                await asyncio.sleep(0.005)  # a transfer from the leaving worker is under way
            result = await cluster.remove_worker(leaving)
            return await asyncio.gather(*tasks), result

        outs, result = asyncio.run(main())
        assert outs == expected
        assert_drained_cleanly(cluster, recorder, leaving)  # a prefill drain re-prefills nothing either
    finally:
        cluster.shutdown()
