"""Weight updates on a disaggregated Ray cluster (cluster/generation_control.py, cluster/router/weights.py): the
prefill and the decode worker of every request serve one version of the weights.

- An update reaches every worker (each reports the version) and the cluster then answers as one engine on the new
  checkpoint does; a request in flight when it began finishes first on the old weights (mode wait), whole.
- A checkpoint one worker cannot take changes no worker; the prompts' old KV is never a hit afterwards (its blocks
  hash under the old version in every worker's cache and in the router's KV index).
- A decode worker added after an update takes the served weights before it takes requests.
- A worker holding other weights refuses a request placed under the new version (it is placed elsewhere), and the
  health check takes it out of rotation and gives it the served weights, unless the files at the update's path
  changed since (then it stays out).
- Nothing is stranded: every worker's blocks are free at the end.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from conftest import engine_config, make_engine, settled_worker_stats
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.engine.sampling_params import SamplingParams
from test_weight_updates import PROMPTS, perturbed_checkpoint

NUM_TOKENS = 10


def _params(max_tokens: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _collect(router, request_id: str, prompt, max_tokens: int = NUM_TOKENS):
    tokens, cached, reason = [], None, None
    async for delta in router.generate(request_id, list(prompt), _params(max_tokens)):
        tokens += delta.new_token_ids
        cached = delta.num_cached_tokens if cached is None else cached
        reason = delta.finish_reason or reason
    return tokens, cached, reason


@pytest.mark.timeout(400)
def test_disagg_cluster_updates_every_worker(ray_session, tmp_path):
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    new_dir = perturbed_checkpoint("tiny-random", tmp_path / "tiny-random-1", 1)
    old_ref = [o.token_ids for o in make_engine("tiny-random").generate(PROMPTS, _params())]
    new_ref = [o.token_ids for o in make_engine(new_dir).generate(PROMPTS, _params())]
    assert old_ref != new_ref
    cluster = Cluster(ClusterSpec(engine=engine_config("tiny-random", dtype="float32", enable_prefix_caching=True),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg"))
    ray = cluster._ray

    def versions() -> dict[str, str]:
        handles = {**cluster.prefill_handles, **cluster.decode_handles}
        return dict(zip(handles, ray.get([h.weight_version.remote() for h in handles.values()], timeout=60)))

    async def run(tag):
        return await asyncio.gather(*(_collect(cluster.router, f"{tag}-{i}", p) for i, p in enumerate(PROMPTS)))

    async def main():
        router = cluster.router
        router.start(asyncio.get_running_loop())
        assert [t for t, _, _ in await run("old")] == old_ref
        assert [c for _, c, _ in await run("old-again")][0] >= 32, "the prompt was not cached: the test proves nothing"
        # A checkpoint of another architecture: refused on every worker, none changed.
        with pytest.raises(RouterError, match="holds a") as refused:
            await router.update_weights_from_disk(str(perturbed_checkpoint("tiny-hybrid", tmp_path / "h", 1)), "v1")
        assert refused.value.status == 400 and set(versions().values()) == {"default"}
        assert router.weight_version == "default" and not router.is_paused
        # Update while a long request decodes: it finishes first, whole, on the old weights.
        long = asyncio.ensure_future(_collect(router, "long", PROMPTS[0], 300))
        while not router.generation.num_in_flight:
            await asyncio.sleep(0.01)
        answer = await router.update_weights_from_disk(new_dir, "v1")
        assert long.done() and (await long)[2] == "length" and len((await long)[0]) == 300
        assert (await long)[0][:NUM_TOKENS] == old_ref[0]
        assert answer["num_paused_requests"] == 1 and len(answer["workers"]) == 2
        assert set(versions().values()) == {"v1"} and router.weight_version == "v1"
        after = await run("new")
        assert [t for t, _, _ in after] == new_ref
        assert after[0][1] == 0, "KV of the old weights was a prefix hit under the new ones"
        # The first delta names the weights (SGLang's /generate shows it in meta_info.weight_version).
        stream = router.generate("named", list(PROMPTS[2]), _params())
        assert (await stream.__anext__()).weight_version == "v1"
        await stream.aclose()
        # abort_all_requests: the request in flight ends with "abort", every worker takes the weights (an abort still
        # on its way to a worker does not make its commit fail), none leaves rotation.
        long = asyncio.ensure_future(_collect(router, "long-abort", PROMPTS[1], 900))
        while not router.generation.num_in_flight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        answer = await router.update_weights_from_disk(new_dir, "v1b", abort_all=True)
        assert (await long)[2] == "abort" and answer["num_paused_requests"] == 1 and len(answer["workers"]) == 2
        assert set(versions().values()) == {"v1b"} and all(v.healthy for v in router.views.values())
        assert [t for t, _, _ in await run("after-abort")] == new_ref
        answer = await router.update_weights_from_disk(new_dir, "v1")  # back to v1's name: the same contents
        assert set(versions().values()) == {"v1"}
        # A decode worker added now serves v1 before it takes requests.
        added = await cluster.add_worker("decode")
        assert versions()[added] == "v1"
        assert [t for t, _, _ in await run("added")] == new_ref
        # A worker on other weights (it missed the update) refuses v1's requests: the router places them on another;
        # none is answered from the wrong weights. The first decode worker goes stale (the placement tries it first:
        # least loaded, first in order), with the health check's repair held off to see the refusals.
        stale = next(w for w in cluster.decode_handles if w != added)
        expected = router.health.weight_version
        router.health.weight_version = lambda: None
        ray.get(cluster.decode_handles[stale].prepare_weights.remote(str(cluster._engine.model), "stale"), timeout=60)
        ray.get(cluster.decode_handles[stale].commit_weights.remote(), timeout=60)
        assert versions()[stale] == "stale"
        recorder = router.record()
        for round_ in range(2):
            assert [t for t, _, _ in await run(f"mixed-{round_}")] == new_ref
        tried = {d.decode_id for d in recorder.decisions}
        assert stale in tried, f"no request was offered to the stale worker: the test proves nothing ({tried})"
        # The health check finds it stale, takes it out of rotation and gives it the served weights.
        router.health.weight_version = expected
        deadline = asyncio.get_running_loop().time() + 30
        while versions()[stale] != "v1" or not router.views[stale].healthy:
            assert asyncio.get_running_loop().time() < deadline, (versions(), router.views[stale].healthy)
            await asyncio.sleep(0.1)
        assert [t for t, _, _ in await run("repaired")] == new_ref
        # The trainer wrote the next checkpoint over v1's path: a worker that misses v1 now cannot take it from
        # there (other contents under v1's name), so it stays out of rotation; the others serve on.
        shutil.rmtree(new_dir)
        shutil.copytree(perturbed_checkpoint("tiny-random", tmp_path / "tiny-random-2", 2), new_dir)
        ray.get(cluster.decode_handles[stale].prepare_weights.remote(str(cluster._engine.model), "stale"), timeout=60)
        ray.get(cluster.decode_handles[stale].commit_weights.remote(), timeout=60)
        await asyncio.sleep(3 * router.config.health_interval_s + 1)
        assert versions()[stale] == "stale" and not router.views[stale].healthy
        assert [t for t, _, _ in await run("without-stale")] == new_ref
        with pytest.raises(Exception, match="no longer holds the checkpoint of weights 'v1'"):
            await cluster.add_worker("decode")  # a new worker (nothing held before) is refused the same way

    try:
        asyncio.run(asyncio.wait_for(main(), 300))
        for wid, st in settled_worker_stats(cluster).items():
            assert st["num_free_blocks"] == st["num_blocks"], (wid, st)
    finally:
        cluster.shutdown()
