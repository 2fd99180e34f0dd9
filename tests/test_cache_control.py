"""Cache control while serving: SGLang's /flush_cache (vLLM's /reset_prefix_cache) and SGLang's /abort_request by id
pattern, below the HTTP routes (LLMEngine.reset_prefix_cache, LocalRouter / ClusterRouter.flush_cache,
GenerationControl.abort_matching).

- A flush forgets every computed prefix: a prompt that hit the prefix cache computes again from its first token (no
  cached token) and answers the same tokens; KV pushed down to host memory never loads back; every forgotten block is
  told removed, so the Ray router's KV index drops them.
- A flush is refused (False, nothing forgotten) while a request is anywhere on the engine: waiting, running, waiting
  for its KV from another worker, loading its prefix from a lower tier.
- abort_matching ends exactly the requests in flight whose id the pattern matches whole; the others finish.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from conftest import engine_config, make_engine
from pdcluster.engine.block_manager import chained_block_hashes
from pdcluster.engine.request import RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from test_weight_updates import PROMPTS, _params
from test_weight_updates_cluster import _collect

BLOCK = 16
PROMPT = PROMPTS[0]  # 40 tokens: its first two blocks are a prefix hit when it comes again
NUM_CACHED = 2 * BLOCK


def _kv_events(engine) -> dict[tuple[str, str], set[int]]:
    """(kind, tier) -> the block hashes of the engine's KV events since the last call."""
    events: dict[tuple[str, str], set[int]] = {}
    for kind, tier, block_hashes in engine.kv_events.drain():
        events.setdefault((kind, tier), set()).update(block_hashes)
    return events


def _settle(engine, timeout_s: float = 30.0) -> None:
    """Step until no request is left and every block is free (an aborted load gives its blocks back when it ends)."""
    deadline = time.monotonic() + timeout_s
    while not engine.is_idle():
        assert time.monotonic() < deadline, "the engine did not settle"
        engine.step()
        time.sleep(0.001)


def test_a_reset_forgets_the_prefix_and_the_prompt_answers_the_same():
    engine = make_engine(dtype="float32")
    first = engine.generate([PROMPT], _params())[0]
    again = engine.generate([PROMPT], _params())[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == NUM_CACHED, "no prefix hit: proves nothing"
    cached = set(engine.scheduler.block_manager.cached_block_hashes())
    assert set(chained_block_hashes(PROMPT, BLOCK)) <= cached
    _kv_events(engine)
    assert engine.reset_prefix_cache() is True
    assert engine.scheduler.block_manager.cached_block_hashes() == []
    assert _kv_events(engine) == {("removed", "device"): cached}  # the router's index drops every one
    after = engine.generate([PROMPT], _params())[0]
    assert after.num_cached_tokens == 0 and after.token_ids == first.token_ids
    assert engine.generate([PROMPT], _params())[0].num_cached_tokens == NUM_CACHED  # caching goes on as before


def test_a_split_model_resets_on_rank_0_alone():
    """Tensor parallelism: the hashes live in rank 0's block manager; the other ranks hold their cache slices by
    block id only, so a reset on rank 0 is the whole reset, and the recomputed prompt answers the same."""
    engine = make_engine(dtype="float32", tensor_parallel_size=2)
    try:
        first = engine.generate([PROMPT], _params())[0]
        assert engine.generate([PROMPT], _params())[0].num_cached_tokens == NUM_CACHED
        assert engine.reset_prefix_cache() is True
        after = engine.generate([PROMPT], _params())[0]
        assert after.num_cached_tokens == 0 and after.token_ids == first.token_ids
    finally:
        engine.close()


def test_no_reset_while_a_request_is_on_the_engine():
    engine = make_engine(dtype="float32")
    engine.generate([PROMPT], _params())
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine.add_request(PROMPTS[2], long, request_id="waiting")
    assert engine.reset_prefix_cache() is False  # waiting, no block yet
    engine.step()
    assert engine.scheduler.requests["waiting"].status == RequestStatus.RUNNING
    assert engine.reset_prefix_cache() is False
    engine.abort_request("waiting")
    # Decode side of a KV transfer: its blocks are reserved while its KV is on its way.
    assert engine.add_remote_request("remote", PROMPTS[1], long) is not None
    assert engine.reset_prefix_cache() is False
    engine.abort_request("remote")
    _settle(engine)
    assert engine.generate([PROMPT], _params())[0].num_cached_tokens == NUM_CACHED, "a refused reset forgot"
    assert engine.reset_prefix_cache() is True
    assert engine.generate([PROMPT], _params())[0].num_cached_tokens == 0


def test_a_reset_empties_the_offload_tiers():
    """Host memory holds a prompt the pool evicted: after a reset it neither loads back nor is told held."""
    pool = 24  # blocks: 11 a 160-token prompt, so the third one pushes the first one's to host memory
    engine = make_engine(num_kv_blocks=pool, dtype="bfloat16", kv_offload_host_gib=0.01)
    rng = random.Random(1)
    a, b, c = ([rng.randrange(10, 40000) for _ in range(160)] for _ in range(3))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first_a = engine.generate([a], greedy)[0]
    engine.generate([b], greedy)
    engine.generate([c], greedy)
    tiers = engine.offload.tiers
    a_hashes = chained_block_hashes(a[:-1], BLOCK)
    in_host = set(a_hashes) & set(tiers.held_hashes()["host"])  # its tail: the pool evicts a prompt from its end
    assert len(in_host) >= 4, "the prompt did not reach host memory: the test proves nothing"
    # A request loading its prefix from host memory is on the engine: no reset under it.
    request_id = engine.add_request(a, greedy)
    engine.scheduler.schedule()
    assert engine.scheduler.requests[request_id].status == RequestStatus.WAITING_FOR_OFFLOAD
    assert engine.reset_prefix_cache() is False
    engine.abort_request(request_id)
    _settle(engine)
    held = set(tiers.held_hashes()["host"])
    assert held, "nothing in host memory: the test proves nothing"
    _kv_events(engine)
    assert engine.reset_prefix_cache() is True
    assert tiers.held_hashes() == {"host": []} and not any(tiers.tier_of(h) for h in a_hashes)
    assert _kv_events(engine)[("removed", "host")] == held
    again = engine.generate([a], greedy)[0]
    assert again.num_cached_tokens == again.num_offloaded_tokens == 0 and again.token_ids == first_a.token_ids
    assert engine.scheduler.num_free_blocks == pool
    engine.offload.close()


def _local_router():
    from pdcluster.cluster.local_router import LocalRouter

    return LocalRouter(engine_config("tiny-random", dtype="float32"), request_timeout_s=60)


def test_local_router_flushes_its_engine_and_not_under_a_request():
    router = _local_router()

    async def main():
        tokens, cached, _ = await _collect(router, "a", PROMPT)
        assert (await _collect(router, "b", PROMPT))[1] == NUM_CACHED
        assert await router.flush_cache() is True
        assert await _collect(router, "c", PROMPT) == (tokens, 0, "length")
        long = asyncio.ensure_future(_collect(router, "long", PROMPTS[1], 400))
        while not router.generation.num_in_flight:  # on the engine from here: its submit came before the flush
            await asyncio.sleep(0.01)
        assert await router.flush_cache() is False
        assert not long.done(), "the request ended before the flush: the refusal proves nothing"
        assert (await long)[2] == "length"
        assert (await _collect(router, "d", PROMPT))[1] == NUM_CACHED, "a refused flush forgot"

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
        assert router.num_open_streams == 0
    finally:
        router.close()


def test_abort_matching_ends_only_the_requests_whose_id_matches_whole():
    router = _local_router()

    async def main():
        keep = asyncio.ensure_future(_collect(router, "keep-1", PROMPTS[0], 300))
        drop = asyncio.ensure_future(_collect(router, "drop-1", PROMPTS[1], 900))
        while router.generation.num_in_flight < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # both stream tokens
        with pytest.raises(ValueError, match="'drop-\\(' is not a regular expression"):
            await router.abort_matching("drop-(")
        assert await router.abort_matching("") == 0  # matches an empty id only
        assert await router.abort_matching("drop") == 0  # whole ids: a prefix is no match
        assert await router.abort_matching(r"drop-\d+") == 1
        assert not keep.done(), "the other request ended before the abort: the test proves nothing"
        drop_tokens, _, drop_reason = await drop
        keep_tokens, _, keep_reason = await keep
        assert drop_reason == "abort" and len(drop_tokens) < 900
        assert keep_reason == "length" and len(keep_tokens) == 300
        assert await router.abort_matching(".*") == 0  # nothing in flight any more

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
        assert router.num_open_streams == 0
    finally:
        router.close()


@pytest.mark.timeout(300)
def test_disagg_cluster_flushes_every_worker_and_the_index(ray_session):
    """Both workers of a disaggregated pair forget the prompt (the decode worker reuses its own cache, the prefill
    worker's would be skipped in the transfer), and the router's KV index and prefix memory forget them too."""
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    cluster = Cluster(ClusterSpec(engine=engine_config("tiny-random", dtype="float32"),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg", policy="prefix_aware"))
    router = cluster.router
    workers = [*cluster.prefill_handles, *cluster.decode_handles]

    def indexed() -> dict[str, int]:
        return {w: sum(router.kv_index.num_blocks(w).values()) for w in workers}

    async def until(condition, what: str, timeout_s: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.05)

    async def main():
        router.start(asyncio.get_running_loop())
        tokens, _, _ = await _collect(router, "a", PROMPT)
        assert (await _collect(router, "b", PROMPT))[1] == NUM_CACHED, "no prefix hit: the test proves nothing"
        await until(lambda: all(indexed().values()), f"a worker's blocks never reached the index: {indexed()}")
        assert any(router.views[w].recent_hashes for w in workers)
        long = asyncio.ensure_future(_collect(router, "long", PROMPTS[1], 300))
        while not router.generation.num_in_flight:
            await asyncio.sleep(0.01)
        assert await router.flush_cache() is False  # a request in flight: no worker is asked
        await long
        assert await router.flush_cache() is True
        assert not any(router.views[w].recent_hashes for w in workers)
        await until(lambda: not any(indexed().values()), f"the index kept flushed blocks: {indexed()}")
        assert await _collect(router, "c", PROMPT) == (tokens, 0, "length")

    try:
        asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        cluster.shutdown()
