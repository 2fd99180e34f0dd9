"""Weight updates served (cluster/generation_control.py, cluster/api/weight_routes.py) behind the real HTTP server and
the real ``openai`` client: vLLM's pause / resume (abort and wait), SGLang's update_weights_from_disk and weight
version, behind the flag and the API key, in /metrics; behind API processes the router process answers them, and a
real ``pdcluster serve --api-servers 2`` does it through either process.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import make_engine
from test_weight_updates import NUM_TOKENS, PROMPTS, _params, checkpoints  # noqa: F401 - a fixture

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def _local_router():
    from conftest import engine_config
    from pdcluster.cluster.local_router import LocalRouter

    return LocalRouter(engine_config("tiny-random", dtype="float32"), request_timeout_s=60)


def _texts(engine, prompts) -> list[str]:
    return [engine.tokenizer.decode(o.token_ids) for o in engine.generate(prompts, _params())]


def test_pause_resume_and_update_over_http(checkpoints):  # noqa: F811
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    new_dir = checkpoints[("tiny-random", 1)]
    want_new = _texts(make_engine(new_dir), PROMPTS[:1])[0]
    want_old = _texts(make_engine("tiny-random"), PROMPTS[:1])[0]
    router = _local_router()
    try:
        with serving(build_app(router, "tiny-random", weight_updates=True)) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

            def complete(max_tokens=NUM_TOKENS):
                return client.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0]

            def get(route):
                return httpx.get(f"{base_url}/{route}", timeout=60).json()

            assert get("get_weight_version") == get("weight_info") == {"weight_version": "default"}
            assert get("is_paused") == {"is_paused": False}
            assert complete().text == want_old
            # wait: a request in flight finishes whole (old weights), one sent meanwhile waits for /resume.
            with ThreadPool() as pool:
                long = pool.submit(lambda: complete(400))
                _until(lambda: router.generation.num_in_flight == 1)
                r = httpx.post(f"{base_url}/pause?mode=wait", timeout=60)
                assert r.status_code == 200 and r.json() == {"status": "paused"}
                assert long.result(60).finish_reason == "length" and get("is_paused") == {"is_paused": True}
                waiting = pool.submit(complete)
                time.sleep(0.3)
                assert not waiting.done(), "a request ran while generation was paused"
                assert httpx.post(f"{base_url}/resume", timeout=60).json() == {"status": "resumed"}
                assert waiting.result(60).text == want_old
                # abort: the request in flight ends with finish_reason "abort".
                long = pool.submit(lambda: complete(900))
                _until(lambda: router.generation.num_in_flight == 1)
                assert httpx.post(f"{base_url}/pause?mode=abort", timeout=60).status_code == 200
                assert long.result(60).finish_reason == "abort"
                httpx.post(f"{base_url}/resume", timeout=60)
            r = httpx.post(f"{base_url}/pause?mode=keep", timeout=60)
            assert r.status_code == 400 and "mode=keep is not supported" in r.text and not router.is_paused
            # SGLang's names for abort and resume; its modes that keep requests across the pause are refused.
            assert httpx.post(f"{base_url}/pause_generation", json={"mode": "abort"}, timeout=60).status_code == 200
            assert router.is_paused
            assert httpx.post(f"{base_url}/continue_generation", timeout=60).json() == {"status": "resumed"}
            assert not router.is_paused
            for mode in ("retract", "in_place"):
                r = httpx.post(f"{base_url}/pause_generation", json={"mode": mode}, timeout=60)
                assert r.status_code == 400 and f"mode {mode!r} is not supported" in r.text and not router.is_paused
            # SGLang's update: in-flight requests finish first, the answer's counts, new tokens from then on.
            with ThreadPool() as pool:
                long = pool.submit(lambda: complete(300))
                _until(lambda: router.generation.num_in_flight == 1)
                r = httpx.post(f"{base_url}/update_weights_from_disk",
                               json={"model_path": new_dir, "weight_version": "step-1"}, timeout=120)
                assert long.result(60).finish_reason == "length"
            body = r.json()
            assert r.status_code == 200 and body["success"] is True and body["num_paused_requests"] == 1, body
            assert body["weight_version"] == "step-1" and body["workers"][0]["num_tensors"] > 0
            assert get("get_weight_version") == {"weight_version": "step-1"} and get("is_paused")["is_paused"] is False
            assert complete().text == want_new
            # SGLang's /generate names the weights each answer came from (RL loops drop stale rollouts by it).
            r = httpx.post(f"{base_url}/generate", timeout=60, json={
                "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0,
                                                        "ignore_eos": True}})
            assert r.json()["text"] == want_new and r.json()["meta_info"]["weight_version"] == "step-1", r.text
            assert get("get_model_info")["weight_version"] == "step-1"
            # Refused: nothing changes, SGLang's failure body.
            for payload, status, message in [
                ({"model_path": checkpoints[("tiny-random", 2)], "weight_version": "step-1"}, 400,
                 "was given to other weights by an earlier update"),
                ({"model_path": checkpoints[("tiny-hybrid", 1)]}, 400, "holds a"),
                ({"model_path": new_dir, "load_format": "pt"}, 400, "load_format"),  # the body's check
            ]:
                r = httpx.post(f"{base_url}/update_weights_from_disk", json=payload, timeout=120)
                assert r.status_code == status and message in r.text, (payload, r.status_code, r.text)
                if "load_format" not in payload:
                    assert r.json()["success"] is False
            assert get("weight_info") == {"weight_version": "step-1"} and complete().text == want_new
            metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
            assert 'pdcluster:weight_version_info{weight_version="step-1"} 1.0' in metrics
            assert 'weight_version="default"' not in metrics
            assert "pdcluster:weight_updates 1.0" in metrics and "pdcluster:generation_paused 0.0" in metrics
            assert router.num_open_streams == 0
        with serving(build_app(router, "tiny-random")) as base_url:  # the routes only with the flag
            assert httpx.post(f"{base_url}/pause").status_code == 404
            assert httpx.get(f"{base_url}/get_weight_version").status_code == 404
        with serving(build_app(router, "tiny-random", api_key="k", weight_updates=True)) as base_url:
            assert httpx.post(f"{base_url}/pause").status_code == 401 and not router.is_paused
            assert httpx.get(f"{base_url}/weight_info").status_code == 401
            auth = {"Authorization": "Bearer k"}
            assert httpx.post(f"{base_url}/pause", headers=auth, timeout=60).status_code == 200 and router.is_paused
            assert httpx.post(f"{base_url}/resume", headers=auth, timeout=60).status_code == 200
    finally:
        router.close()


def test_the_flag_and_vllms_dev_mode_turn_the_routes_on(monkeypatch):
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.api.options import ApiOptions

    def options(*argv):
        return ApiOptions.from_args(build_parser().parse_args(["serve", "--model", "tiny-random", *argv]),
                                    runtime_lora=False)

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert not options().weight_updates and options("--enable-weight-updates").weight_updates
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert options().weight_updates


def test_api_processes_forward_the_routes_to_the_router_process(checkpoints):  # noqa: F811
    """Behind --api-servers N: the routes in an API process are answered by the router process (its admin app),
    so a pause or an update sent to any API process holds for all of them; so does SGLang's /abort_request, for a
    request of any API process."""
    from fastapi import FastAPI

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.api.middleware import install_error_handlers
    from pdcluster.cluster.api.control_routes import install_control_routes
    from pdcluster.cluster.api.weight_routes import install_weight_routes
    from pdcluster.cluster.frontend.admin_proxy import install_control_proxy, install_weight_routes_proxy
    from test_api_servers import with_one_api_process

    router = _local_router()
    admin_app = FastAPI()
    install_error_handlers(admin_app)
    install_weight_routes(admin_app, router)
    install_control_routes(admin_app, router)

    async def body(remote):
        remote.announce_ready()
        api = build_app(remote, "tiny-random", router_control=False)
        install_weight_routes_proxy(api, remote)
        install_control_proxy(api, remote)
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            long = asyncio.ensure_future(client.post("/generate", timeout=60, json={
                "input_ids": PROMPTS[0], "rid": "far", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}))
            while router.generation.num_in_flight != 1:
                assert not long.done(), (await long).text
                await asyncio.sleep(0.01)
            assert (await client.post("/abort_request", json={"rid": "far"})).json() == {"num_aborted": 1}
            assert (await long).json()["meta_info"]["finish_reason"]["type"] == "abort"
            assert (await client.post("/pause?mode=wait")).json() == {"status": "paused"}
            assert router.is_paused and (await client.get("/is_paused")).json() == {"is_paused": True}
            assert (await client.post("/resume")).status_code == 200 and not router.is_paused
            r = await client.post("/update_weights_from_disk", timeout=120,
                                  json={"model_path": checkpoints[("tiny-random", 1)], "weight_version": "w"})
            assert r.status_code == 200 and r.json()["success"] is True
            assert (await client.get("/get_weight_version")).json() == {"weight_version": "w"}
            assert router.weight_version == "w"
            r = await client.post("/update_weights_from_disk", json={"model_path": "nowhere/at/all"})
            assert r.status_code == 400 and r.json()["success"] is False

    with_one_api_process(router, body, admin_app)


class ThreadPool:
    """A few threads for blocking client calls beside the test's own (bounded: each result is waited with a
    timeout)."""

    def __enter__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(4)
        return self._pool

    def __exit__(self, *exc):
        self._pool.shutdown(wait=True, cancel_futures=True)


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)



@pytest.mark.timeout(300)
def test_serve_with_api_processes_updates_through_any_of_them(checkpoints):  # noqa: F811
    """`pdcluster serve --api-servers 2 --enable-weight-updates`: whichever API process takes the update, the
    router process does it, and every process answers from the new weights and names their version."""
    from test_serve import Server

    new_dir = checkpoints[("tiny-random", 1)]
    engine = make_engine(new_dir, num_kv_blocks=256)
    want = engine.tokenizer.decode(engine.generate([PROMPTS[1]], _params())[0].token_ids)
    server = Server("--mode", "local", "--api-servers", "2", "--enable-weight-updates", "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    try:
        base = server.base_url
        assert httpx.post(f"{base}/update_weights_from_disk", json={"model_path": new_dir}).status_code == 401
        r = httpx.post(f"{base}/update_weights_from_disk", json={"model_path": new_dir, "weight_version": "rl-1"},
                       headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=60)
        for _ in range(6):  # the kernel spreads connections over both processes
            assert httpx.get(f"{base}/get_weight_version", headers=auth, timeout=30).json() == {"weight_version": "rl-1"}
            r = client.completions.create(model="tiny-random", prompt=PROMPTS[1], max_tokens=NUM_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == want
            # SGLang's /generate: the version travels from the router process with the first token.
            r = httpx.post(f"{base}/generate", headers=auth, timeout=60, json={
                "input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0,
                                                        "ignore_eos": True}})
            assert r.json()["text"] == want and r.json()["meta_info"]["weight_version"] == "rl-1", r.text
            # An API process reads it off the router process's stats (sent every 0.5 s): it follows within one.
            _until(lambda: httpx.get(f"{base}/get_model_info", headers=auth,
                                     timeout=30).json()["weight_version"] == "rl-1", timeout_s=5)
            # /flush_cache and /abort_request: the router process's (admin_proxy.install_control_proxy).
            assert httpx.post(f"{base}/flush_cache", headers=auth, timeout=60).status_code == 200
            r = httpx.post(f"{base}/abort_request", headers=auth, timeout=60, json={"rid": "none-such"})
            assert r.json() == {"num_aborted": 0}, r.text
    finally:
        server.close()


def test_the_choices_of_one_request_run_on_one_set_of_weights():
    """A pause that comes while an n > 1 request fans out: a choice whose sibling is in flight still enters (the
    drain waits for it), so all of a response's choices run before the update; another request waits."""
    from pdcluster.cluster.generation_control import GenerationControl

    async def no_abort(request_id: str) -> None:
        return None

    async def main():
        control = GenerationControl(no_abort, targets=None, admit_timeout_s=5)
        async with control.entered("r-0", "r"):
            drained = asyncio.ensure_future(control.pause("wait", timeout_s=5))
            await asyncio.sleep(0.05)
            assert control.is_paused and not drained.done()
            async with control.entered("r-1", "r"):  # the sibling: in, though paused
                assert control.num_in_flight == 2
            other = asyncio.ensure_future(control.entered("s-0", "s").__aenter__())
            await asyncio.sleep(0.1)
            assert not other.done(), "a new request entered while paused"
        assert await asyncio.wait_for(drained, 5) == 1
        assert not other.done()
        control.resume()
        await asyncio.wait_for(other, 5)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_update_weights_command(checkpoints, capsys, monkeypatch):  # noqa: F811
    """`pdcluster update-weights` against the real HTTP server: the answer printed and exit 0; a refusal's reason
    and exit 1; a server without the routes told to start with the flag."""
    import json

    from pdcluster.cli.main import main as cli
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    router = _local_router()
    try:
        with serving(build_app(router, "tiny-random", api_key="k", weight_updates=True)) as base_url:
            new_dir = checkpoints[("tiny-random", 1)]
            assert cli(["update-weights", "--url", base_url, "--model-path", new_dir, "--weight-version", "c1",
                        "--api-key", "k"]) == 0
            assert json.loads(capsys.readouterr().out)["weight_version"] == "c1" and router.weight_version == "c1"
            assert cli(["update-weights", "--url", base_url, "--model-path", new_dir, "--api-key", "wrong"]) == 1
            assert "HTTP 401" in capsys.readouterr().err
            monkeypatch.setenv("PDCLUSTER_API_KEY", "k")
            assert cli(["update-weights", "--url", base_url, "--model-path", checkpoints[("tiny-hybrid", 1)]]) == 1
            err = capsys.readouterr().err
            assert "HTTP 400" in err and "holds a" in err and router.weight_version == "c1"
        with serving(build_app(router, "tiny-random")) as base_url:
            assert cli(["update-weights", "--url", base_url, "--model-path", new_dir]) == 1
            assert "start it with --enable-weight-updates" in capsys.readouterr().err
    finally:
        router.close()
