"""n > 1 with the prompt computed once (engine/forks.py): the choices of one request share a fork_group;
the first leads, the others start from the prefix cache once the leader's prompt is in it. Each choice
equals the same request sent alone with its seed; the stats show the prompt computed (and, in disagg,
transferred) once — each follower recomputes only the tail past the last full block.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from conftest import engine_config, make_engine, settled_worker_stats
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

N = 4
BLOCK_SIZE = 16
PROMPT = list(range(1000, 1045))  # 45 tokens: 2 full blocks + a tail of 13
PARAMS = SamplingParams(max_tokens=10, temperature=0.9, seed=100, ignore_eos=True)


def _tail(num_prompt: int) -> int:
    """What a follower computes: past the cached full blocks (the last prompt token is always computed)."""
    return num_prompt - BLOCK_SIZE * ((num_prompt - 1) // BLOCK_SIZE)


def _choice(j: int) -> SamplingParams:
    return replace(PARAMS, seed=PARAMS.seed + j, fork_group="grp")


@pytest.fixture(scope="module")
def alone(tiny_dir):
    engine = make_engine("tiny-random", num_kv_blocks=256, enable_prefix_caching=False)
    return [engine.generate([PROMPT], replace(PARAMS, seed=PARAMS.seed + j))[0].token_ids for j in range(N)]


def test_forked_choices_equal_alone_and_compute_the_prompt_once(alone):
    engine = make_engine("tiny-random", num_kv_blocks=256)
    leader = engine.add_request(PROMPT, _choice(0), request_id="c0")
    for j in range(1, N):
        engine.add_request(PROMPT, _choice(j), request_id=f"c{j}", follow=leader)
    assert len(engine.scheduler.forks) == N - 1
    outputs: dict[str, list[int]] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert [outputs[f"c{j}"] for j in range(N)] == alone
    assert engine.scheduler.num_prompt_tokens_computed == len(PROMPT) + (N - 1) * _tail(len(PROMPT))
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


def test_followers_of_an_aborted_leader_still_run(alone):
    engine = make_engine("tiny-random", num_kv_blocks=256)
    leader = engine.add_request(PROMPT, _choice(0), request_id="c0")
    engine.add_request(PROMPT, _choice(1), request_id="c1", follow=leader)
    engine.abort_request(leader)
    outputs = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert outputs == {"c1": alone[1]}
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


async def _run_group(router):
    router.start(asyncio.get_running_loop())

    async def one(j):
        tokens = []
        async for delta in router.generate(f"n-{j}", PROMPT, _choice(j)):
            tokens += delta.new_token_ids
            assert delta.error is None, delta.error
        return tokens

    outs = await asyncio.gather(*[one(j) for j in range(N)])
    assert not router.submitter.group_pairs, "the group's pair outlived its requests"
    return outs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_cluster_forks_the_prompt_once(ray_session, alone, mode):
    spec = ClusterSpec(engine=engine_config(num_kv_blocks=256, prefill_chunk_size=64), mode=mode,
                       transfer=TransferConfig(transport="tcp", secret="k"), num_decode=2)
    cluster = Cluster(spec)
    try:
        assert asyncio.run(_run_group(cluster.router)) == alone
        stats = settled_worker_stats(cluster)
        decode = [s for s in stats.values() if "num_reserved" in s]
        prefill = [s for s in stats.values() if "bytes_sent" in s]
        used = [s for s in decode if s["num_prompt_tokens_computed"] > 0]
        if mode == "disagg":
            # One prefill, one transfer; the followers' tails on the one decode worker that got the group.
            assert sum(s["num_prompt_tokens_computed"] for s in prefill) == len(PROMPT)
            assert [s["num_prompt_tokens_computed"] for s in used] == [(N - 1) * _tail(len(PROMPT))]
        else:
            assert [s["num_prompt_tokens_computed"] for s in used] == [len(PROMPT) + (N - 1) * _tail(len(PROMPT))]
        for wid, st in stats.items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
    finally:
        cluster.shutdown()
