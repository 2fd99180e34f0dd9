"""vLLM's runtime LoRA routes (cluster/api/lora_routes.py) on every serving path: one engine behind the real HTTP
server and the real ``openai`` client, API processes behind a router process (real zmq ipc), and a
disaggregated Ray cluster, where every worker must load the adapter (cluster/router/lora.py).

- POST /v1/load_lora_adapter makes the adapter a ``model`` the API serves (its tokens are peft's) and lists it;
  POST /v1/unload_lora_adapter makes that name a 404 again; vLLM's answers and status codes (400 for a name
  loaded twice or an adapter that cannot run, with the reason; 404 for unloading an unknown name);
- the routes exist only with --enable-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING) and sit behind the API key;
- on a cluster, a load reaches the prefill and the decode workers alike, one refused anywhere is undone
  everywhere, and a worker added later is given the adapters loaded before it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time

import pytest

from conftest import engine_config, make_engine, settled_worker_stats
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.engine.sampling_params import SamplingParams
from test_lora import MODEL, NUM_TOKENS, PROMPTS, _copy, _params, adapters, references  # noqa: F401

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def _local_router(**kw):
    from pdcluster.cluster.local_router import LocalRouter

    return LocalRouter(engine_config(MODEL, dtype="float32", enable_lora=True, **kw), request_timeout_s=30)


def test_load_and_unload_over_http(adapters, references, tmp_path):  # noqa: F811
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    router = _local_router()
    decode = router.tokenizer.decode
    try:
        with serving(build_app(router, MODEL, runtime_lora=True)) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

            def complete(model: str) -> str:
                return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=NUM_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text

            def post(route: str, **body) -> httpx.Response:
                return httpx.post(f"{base_url}/v1/{route}", json=body, timeout=60)

            assert [m.id for m in client.models.list().data] == [MODEL]
            with pytest.raises(openai.NotFoundError):
                complete("a1")
            r = post("load_lora_adapter", lora_name="a1", lora_path=adapters["a1"])
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' added successfully."
            assert complete("a1") == decode(references[("a1", 0)])
            assert complete(MODEL) == decode(references[(None, 0)])
            cards = {m.id: m for m in client.models.list().data}
            assert list(cards) == [MODEL, "a1"] and cards["a1"].parent == MODEL
            # vLLM's refusals: 400 with the reason, and nothing changes.
            refusals = [
                (dict(lora_name="a1", lora_path=adapters["a2"]), "The lora adapter 'a1' has already been loaded."),
                (dict(lora_name="a2", lora_path=str(tmp_path / "nowhere")), "no such directory"),
                (dict(lora_name="a2", lora_path=_copy(adapters["a2"], tmp_path / "dora", config={"use_dora": True})),
                 "DoRA"),
                (dict(lora_name=MODEL, lora_path=adapters["a2"]), "is the base model's name"),
                (dict(lora_name="a2"), "lora_path"),
                (dict(lora_name="a2", lora_path=adapters["a2"], lora_rank=4), "lora_rank"),
            ]
            for body, message in refusals:
                r = post("load_lora_adapter", **body)
                assert r.status_code == 400 and message in r.text, (body, r.status_code, r.text)
            assert [m.id for m in client.models.list().data] == [MODEL, "a1"]
            r = post("unload_lora_adapter", lora_name="a1")
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' removed successfully."
            with pytest.raises(openai.NotFoundError):
                complete("a1")
            r = post("unload_lora_adapter", lora_name="a1")
            assert r.status_code == 404 and "The lora adapter 'a1' cannot be found." in r.text
            # Loaded again (another adapter under the name): its own tokens.
            assert post("load_lora_adapter", lora_name="a1", lora_path=adapters["a2"]).status_code == 200
            assert complete("a1") == decode(references[("a2", 0)])
            assert router.num_open_streams == 0
    finally:
        router.close()


def test_routes_only_with_enable_lora_and_behind_the_api_key(adapters):  # noqa: F811
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    router = _local_router()
    try:
        with serving(build_app(router, MODEL)) as base_url:  # runtime_lora off: no such route
            r = httpx.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]})
            assert r.status_code == 404 and router.lora_names == ()
        with serving(build_app(router, MODEL, api_key="k", runtime_lora=True)) as base_url:
            body = {"lora_name": "a1", "lora_path": adapters["a1"]}
            assert httpx.post(f"{base_url}/v1/load_lora_adapter", json=body).status_code == 401
            assert router.lora_names == ()
            r = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer k"},
                           timeout=60)
            assert r.status_code == 200 and router.lora_names == ("a1",)
    finally:
        router.close()


def test_the_cli_flag_and_vllms_variable_turn_it_on(monkeypatch):
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.engine_args import engine_config_from_args

    def config(*argv):
        return engine_config_from_args(build_parser().parse_args(["serve", "--model", MODEL, *argv]))

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not config().enable_lora
    got = config("--enable-lora", "--max-loras", "3")
    assert got.enable_lora and got.max_loras == 3
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert config().enable_lora


def test_api_processes_load_through_the_router_process(adapters, references):  # noqa: F811
    """Behind --api-servers N: a load sent to one API process is done by the router process (its lora routes
    beside the admin routes); that process names the adapter at once and the others from the router's next
    Stats; a refusal comes back with its status and reason."""
    from fastapi import FastAPI

    from pdcluster.cluster.api.lora_routes import install_lora_routes
    from pdcluster.cluster.api.middleware import install_error_handlers
    from test_api_servers import _remote, _run_with_service, _tokens

    router = _local_router()
    socket_dir = tempfile.mkdtemp(prefix="pdc-")
    admin_app = FastAPI()
    install_error_handlers(admin_app)
    install_lora_routes(admin_app, router, MODEL, ("alias",))  # serve --served-model-name MODEL alias

    async def main(service):
        first, second = await _remote(socket_dir, 0), await _remote(socket_dir, 1)
        for remote in (first, second):
            remote.announce_ready()  # as an API process does once its HTTP server listens: Stats come from now on
        try:
            assert first.lora_names == second.lora_names == ()
            with pytest.raises(RouterError, match="'alias' is the base model's name") as taken:
                await first.load_lora("alias", adapters["a2"])  # a served name is no adapter's
            assert taken.value.status == 400 and router.lora_names == ()
            await first.load_lora("a2", adapters["a2"])
            assert first.lora_names == ("a2",)
            deadline = time.monotonic() + 10
            while second.lora_names != ("a2",):
                assert time.monotonic() < deadline, "the other API process never learned the adapter"
                await asyncio.sleep(0.05)
            tokens, _ = await _tokens(second.generate("r-a2", PROMPTS[2], _params("a2")))
            assert tokens == references[("a2", 2)]
            with pytest.raises(RouterError, match="has already been loaded") as refused:
                await second.load_lora("a2", adapters["a1"])
            assert refused.value.status == 400
            await second.unload_lora("a2")
            with pytest.raises(RouterError, match="cannot be found") as missing:
                await first.unload_lora("a2")
            assert missing.value.status == 404 and router.lora_names == ()
        finally:
            first.close()
            second.close()

    try:
        _run_with_service(router, socket_dir, main, admin_app)
    finally:
        router.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


async def _drain(stream) -> list[int]:
    tokens = []
    async for delta in stream:
        tokens += delta.new_token_ids
    return tokens


@pytest.mark.timeout(400)
def test_disagg_cluster_loads_on_every_worker(ray_session, adapters, references, tmp_path):  # noqa: F811
    """Disaggregated over Ray (tcp): a load reaches the prefill and the decode worker (equal digests), its
    requests decode with the adapter on both sides; an adapter one worker cannot read is undone on the
    others; a decode worker added later gets the runtime adapters before it takes requests; an unload leaves
    every worker."""
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    cluster = Cluster(ClusterSpec(engine=engine_config(MODEL, dtype="float32", enable_lora=True, max_loras=2,
                                                       lora_modules=(f"a2={adapters['a2']}",)),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg"))
    ray = cluster._ray

    def held() -> dict[str, dict]:
        handles = {**cluster.prefill_handles, **cluster.decode_handles}
        return dict(zip(handles, ray.get([h.lora_adapters.remote() for h in handles.values()], timeout=60)))

    async def run(jobs, tag):
        async def one(k, name, i):
            tokens = []
            async for delta in cluster.router.generate(f"{tag}-{k}", PROMPTS[i], _params(name)):
                tokens += delta.new_token_ids
            return tokens

        return await asyncio.gather(*[one(k, name, i) for k, (name, i) in enumerate(jobs)])

    async def main():
        router = cluster.router
        router.start(asyncio.get_running_loop())
        assert router.lora_names == ("a2",) and router.lora.digests["a2"], "start-up digests not learned"
        bad = _copy(adapters["a1"], tmp_path / "dora", config={"use_dora": True})
        with pytest.raises(RouterError, match="DoRA") as refused:
            await router.load_lora("a3", bad)
        assert refused.value.status == 400 and "a3" not in router.lora_names
        assert all("a3" not in h for h in held().values())
        digest = await router.load_lora("a1", adapters["a1"])
        assert all(h == {"a2": router.lora.digests["a2"], "a1": digest} for h in held().values()), held()
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a1", None, "a2")]
        for job, tokens in zip(jobs, await run(jobs, "first")):
            assert tokens == references[job], job
        with pytest.raises(RouterError, match="already been loaded"):
            await router.load_lora("a1", adapters["a2"])
        # A worker added now is given a1 before it takes requests.
        added = await cluster.add_worker("decode")
        assert held()[added]["a1"] == digest
        for job, tokens in zip(jobs, await run(jobs, "second")):
            assert tokens == references[job], job
        # Unloaded while a long a1 request decodes: the decode workers keep a1's weights for it, so they hold
        # max_loras (2) adapters and refuse a3, which the prefill worker took: the load is undone there.
        long = asyncio.ensure_future(_drain(router.generate("long", PROMPTS[0], SamplingParams(
            max_tokens=900, ignore_eos=True, lora_name="a1"))))
        while not any(len(r.emitted) > 2 for r in router.streams.requests.values()):
            await asyncio.sleep(0.01)
        await router.unload_lora("a1")
        assert router.lora_names == ("a2",) and all(set(h) == {"a2"} for h in held().values())
        with pytest.raises(RouterError, match=r"max_loras 2.* \(worker decode-") as full:
            await router.load_lora("a3", adapters["a1"])
        assert full.value.status == 400 and all(set(h) == {"a2"} for h in held().values())
        assert not long.done(), "the long request ended before the refused load: the test proved nothing"
        assert len(await long) == 900  # it finished with a1's weights, unloaded meanwhile
        with pytest.raises(RouterError, match="does not exist") as gone:
            await run([("a1", 0)], "third")
        assert gone.value.status == 404
        assert await router.load_lora("a3", adapters["a1"]) == digest  # the decode workers let a1 go

    try:
        asyncio.run(main())
        for wid, st in settled_worker_stats(cluster).items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
    finally:
        cluster.shutdown()


@pytest.mark.timeout(600)
def test_serve_with_two_api_processes_and_vllms_variable(adapters, references, monkeypatch):  # noqa: F811
    """`pdcluster serve --api-servers 2` (real processes) with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in its
    environment, as a vLLM deployment sets it: a load through either API process serves the adapter through
    both, and an unload takes it away from both."""
    from test_serve import Server

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    want = make_engine(MODEL, num_kv_blocks=64).tokenizer.decode(references[("a1", 0)])
    server = Server("--mode", "local", "--api-servers", "2", "--dtype", "float32")
    try:
        r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": "a1", "lora_path": adapters["a1"]})
        assert r.status_code == 200, r.text

        def models() -> set[tuple[str, ...]]:  # what each API process lists (new connections spread over both)
            return {tuple(m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"])
                    for _ in range(12)}

        deadline = time.monotonic() + 20
        while models() != {(MODEL, "a1")}:
            assert time.monotonic() < deadline, models()
            time.sleep(0.2)
        for _ in range(6):
            with httpx.Client(base_url=server.base_url, timeout=120) as http:  # a new connection each time
                r = http.post("/v1/completions", json={"model": "a1", "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS,
                                                       "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want
        assert r.json()["usage"]["completion_tokens"] == NUM_TOKENS
        r = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "a1"}, timeout=60)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        while models() != {(MODEL,)}:
            assert time.monotonic() < deadline, models()
            time.sleep(0.2)
        r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "a1", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        status = server.interrupt(timeout_s=60)
        assert status == 0 and "Traceback" not in server.output(), server.output()[-3000:]
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restarted_worker_is_given_the_runtime_adapters(ray_session, adapters, references):  # noqa: F811
    """A decode worker that crashes (SIGKILL) is restarted by Ray from its start-up config, which has no runtime
    adapters: the router's re-wiring gives it a1 again before it takes requests, so an a1 request placed on it
    after the restart decodes with a1."""
    import os
    import signal

    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    cluster = Cluster(ClusterSpec(engine=engine_config(MODEL, dtype="float32", enable_lora=True),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg", max_worker_restarts=1,
                                  request_timeout_s=240))
    router = cluster.router
    router.config.health_interval_s = 0.3
    router.config.admission_wait_s = 120.0  # the only decode worker is coming back: wait for it
    (decode_id, decode), = cluster.decode_handles.items()

    async def main():
        router.start(asyncio.get_running_loop())
        digest = await router.load_lora("a1", adapters["a1"])
        old = router.health.incarnations[decode_id]
        os.kill(await decode.pid.remote(), signal.SIGKILL)
        deadline = time.monotonic() + 180
        while not (router.views[decode_id].healthy and router.health.incarnations.get(decode_id) not in (None, old)):
            assert time.monotonic() < deadline, f"{decode_id} did not rejoin"
            await asyncio.sleep(0.1)
        assert await decode.lora_adapters.remote() == {"a1": digest}
        return await _drain(router.generate("after", PROMPTS[1], _params("a1")))

    try:
        assert asyncio.run(main()) == references[("a1", 1)]
    finally:
        cluster.shutdown()
