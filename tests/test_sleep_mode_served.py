"""Sleep mode served (cluster/generation_control.py, cluster/api/sleep_routes.py) behind the real HTTP server and the
real ``openai`` client, as an RL trainer drives it: vLLM's /sleep, /wake_up, /is_sleeping and SGLang's
release / resume_memory_occupation; generation answers 503 while asleep and the same tokens after; a level-2 sleep,
a weight update and the wake in verl's order serve the update; behind the flag and the API key, in /metrics; behind
API processes the router process answers them; on a disaggregated Ray cluster every worker (the decode worker's
shared-memory cache too) sleeps and wakes.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import engine_config, make_engine, settled_worker_stats
from pdcluster.engine.sampling_params import SamplingParams
from test_weight_updates import NUM_TOKENS, PROMPTS, checkpoints  # noqa: F401 - a fixture
from test_weight_updates_served import ThreadPool, _local_router, _texts, _until

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def test_sleep_and_wake_over_http(checkpoints):  # noqa: F811
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    new_dir = checkpoints[("tiny-random", 1)]
    want_old = _texts(make_engine("tiny-random"), PROMPTS[:1])[0]
    want_new = _texts(make_engine(new_dir), PROMPTS[:1])[0]
    router = _local_router()
    engine = router.worker.engine
    try:
        with serving(build_app(router, "tiny-random", weight_updates=True, sleep_mode=True)) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

            def complete(max_tokens=NUM_TOKENS):
                return client.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0]

            def post(route, **kw):
                return httpx.post(f"{base_url}/{route}", timeout=120, **kw)

            def is_sleeping():
                return httpx.get(f"{base_url}/is_sleeping", timeout=30).json()["is_sleeping"]

            assert not is_sleeping() and complete().text == want_old
            # Level 1 with a request in flight (mode wait, the default): it finishes whole first.
            with ThreadPool() as pool:
                long = pool.submit(lambda: complete(300))
                _until(lambda: router.generation.num_in_flight == 1)
                r = post("sleep?level=1")
                assert long.result(60).finish_reason == "length"
            body = r.json()
            assert r.status_code == 200 and body["is_sleeping"] and body["sleep_level"] == 1, body
            assert body["workers"][0]["released_bytes"]["kv_cache"] > 0
            assert is_sleeping() and engine.sleep_state.asleep == {"kv_cache"}
            with pytest.raises(openai.APIStatusError, match="the model is sleeping") as asleep:
                complete()
            assert asleep.value.status_code == 503
            r = post("generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 503 and "sleeping" in r.text
            # What needs no weights goes on: tokenizing, the model list, health.
            assert post("tokenize", json={"prompt": "hello"}).status_code == 200
            assert httpx.get(f"{base_url}/v1/models", timeout=30).status_code == 200
            metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
            assert "pdcluster:engine_sleep_level 1.0" in metrics
            r = post("wake_up")
            assert r.status_code == 200 and r.json()["is_sleeping"] is False and not is_sleeping()
            assert complete().text == want_old
            assert "pdcluster:engine_sleep_level 0.0" in httpx.get(f"{base_url}/metrics", timeout=30).text
            # mode=abort ends the request in flight.
            with ThreadPool() as pool:
                long = pool.submit(lambda: complete(900))
                _until(lambda: router.generation.num_in_flight == 1)
                assert post("sleep?level=1&mode=abort").status_code == 200
                assert long.result(60).finish_reason == "abort"
            assert post("wake_up?tags=kv_cache").json()["asleep_tags"] == []
            # verl's order for a weight update: level 2, wake the weights, update, wake the KV cache.
            assert post("sleep", params={"level": 2}).json()["asleep_tags"] == ["kv_cache", "weights"]
            assert post("wake_up", params={"tags": "weights"}).json()["asleep_tags"] == ["kv_cache"]
            r = post("update_weights_from_disk", json={"model_path": new_dir, "weight_version": "step-1"})
            assert r.status_code == 200 and r.json()["success"], r.text
            assert is_sleeping(), "the KV cache still sleeps: an update does not wake it"
            assert post("wake_up", params={"tags": ["kv_cache"]}).status_code == 200 and not is_sleeping()
            assert engine.sleep_state.num_reloads == 0 and complete().text == want_new
            # SGLang's pair, by tag.
            r = post("release_memory_occupation", json={"tags": ["kv_cache"]})
            assert r.status_code == 200 and r.json()["success"] is True and engine.sleep_state.asleep == {"kv_cache"}
            r = post("resume_memory_occupation", json={})
            assert r.status_code == 200 and r.json()["success"] is True and not is_sleeping()
            assert complete().text == want_new
            # Refused, nothing released: a level, a tag, a mode.
            for route, kw, message in [("sleep?level=3", {}, "level: 1 (discard the KV cache"),
                                       ("sleep?mode=keep", {}, "mode=keep is not supported"),
                                       ("wake_up?tags=cuda_graph", {}, "'cuda_graph' is not one of"),
                                       ("release_memory_occupation", {"json": {"tags": ["all"]}}, "'all' is not")]:
                r = post(route, **kw)
                assert r.status_code == 400 and message in r.text, (route, r.text)
            assert not is_sleeping() and complete().text == want_new
            assert router.num_open_streams == 0
        with serving(build_app(router, "tiny-random")) as base_url:  # the routes only with the flag
            assert httpx.post(f"{base_url}/sleep").status_code == 404
            assert httpx.get(f"{base_url}/is_sleeping").status_code == 404
        with serving(build_app(router, "tiny-random", api_key="k", sleep_mode=True)) as base_url:
            assert httpx.post(f"{base_url}/sleep").status_code == 401 and not router.is_sleeping
            assert httpx.get(f"{base_url}/is_sleeping").status_code == 401
    finally:
        router.close()


def test_the_flag_turns_the_routes_on():
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.api.options import ApiOptions

    def options(*argv):
        return ApiOptions.from_args(build_parser().parse_args(["serve", "--model", "tiny-random", *argv]),
                                    runtime_lora=False)

    assert not options().sleep_mode and options("--enable-sleep-mode").sleep_mode


def test_api_processes_forward_the_routes_to_the_router_process():
    """Behind --api-servers N the router process answers the sleep routes, so a sleep sent to any API process holds
    for all of them."""
    from fastapi import FastAPI

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.api.middleware import install_error_handlers
    from pdcluster.cluster.api.sleep_routes import install_sleep_routes
    from pdcluster.cluster.frontend.admin_proxy import install_sleep_routes_proxy
    from test_api_servers import with_one_api_process

    router = _local_router()
    admin_app = FastAPI()
    install_error_handlers(admin_app)
    install_sleep_routes(admin_app, router)

    async def body(remote):
        remote.announce_ready()
        api = build_app(remote, "tiny-random", router_control=False)
        install_sleep_routes_proxy(api, remote)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://api") as client:
            r = await client.post("/sleep?level=2", timeout=60)
            assert r.status_code == 200 and r.json()["sleep_level"] == 2, r.text
            assert router.is_sleeping and (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
            r = await client.post("/generate", timeout=60, json={"input_ids": PROMPTS[0]})
            assert r.status_code == 503 and "sleeping" in r.text
            assert (await client.post("/wake_up?tags=everything")).status_code == 400
            assert (await client.post("/wake_up", timeout=120)).status_code == 200 and not router.is_sleeping
            assert router.worker.engine.sleep_state.num_reloads == 1

    with_one_api_process(router, body, admin_app)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_disagg_cluster_sleeps_and_wakes_every_worker(ray_session):
    """Over shm the decode worker's cache is a shared segment its prefill peer maps: released with MADV_REMOVE, both
    sides' pages go, and the transfers after the wake land in it as before."""
    from pdcluster.cluster.api.router_contract import RouterError
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in make_engine("tiny-random").generate(PROMPTS, params)]
    cluster = Cluster(ClusterSpec(engine=engine_config("tiny-random", dtype="float32", enable_prefix_caching=True),
                                  transfer=TransferConfig(transport="shm"), mode="disagg"))

    async def collect(request_id, prompt):
        tokens = []
        async for delta in cluster.router.generate(request_id, list(prompt), params):
            tokens += delta.new_token_ids
        return tokens

    async def main():
        router = cluster.router
        router.start(asyncio.get_running_loop())
        assert list(await asyncio.gather(*(collect(f"a{i}", p) for i, p in enumerate(PROMPTS)))) == want
        answer = await router.sleep(("kv_cache", "weights"), 2)
        workers = {w["worker_id"]: w for w in answer["workers"]}
        assert len(workers) == 2 and all(w["released_bytes"]["kv_cache"] > 0 and w["released_bytes"]["weights"] > 0
                                         for w in workers.values()), workers
        with pytest.raises(RouterError, match="the model is sleeping") as asleep:
            await collect("z", PROMPTS[0])
        assert asleep.value.status == 503
        answer = await router.wake_up(("kv_cache", "weights"))
        assert not router.is_sleeping and all(not w["is_sleeping"] for w in answer["workers"])
        assert list(await asyncio.gather(*(collect(f"b{i}", p) for i, p in enumerate(PROMPTS)))) == want

    try:
        asyncio.run(asyncio.wait_for(main(), 300))
        for wid, st in settled_worker_stats(cluster).items():
            assert st["num_free_blocks"] == st["num_blocks"], (wid, st)
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_serve_with_api_processes_sleeps_through_any_of_them():
    """`pdcluster serve --api-servers 2 --enable-sleep-mode`: whichever API process takes the sleep, the router
    process does it, and every process answers 503 until the wake, then the same text as before."""
    from test_serve import Server

    server = Server("--mode", "local", "--api-servers", "2", "--enable-sleep-mode", "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    try:
        base = server.base_url
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=60)

        def complete():
            return client.completions.create(model="tiny-random", prompt=PROMPTS[1], max_tokens=NUM_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        want = complete()
        assert httpx.post(f"{base}/sleep", timeout=60).status_code == 401
        r = httpx.post(f"{base}/sleep?level=2", headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["sleep_level"] == 2, r.text
        for _ in range(6):  # the kernel spreads connections over both processes
            assert httpx.get(f"{base}/is_sleeping", headers=auth, timeout=30).json() == {"is_sleeping": True}
            with pytest.raises(openai.APIStatusError, match="the model is sleeping"):
                complete()
        r = httpx.post(f"{base}/wake_up", headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["is_sleeping"] is False, r.text
        for _ in range(6):
            assert complete() == want
    finally:
        server.close()
