"""New weights while serving (engine/weight_update.py, cluster/generation_control.py, cluster/api/weight_routes.py):
what an RL trainer does between rollouts, on one engine and behind the real HTTP server.

- An update serves exactly what a fresh engine on the new checkpoint serves (tokens and logprobs; fp32 and the
  bf16 packed-GEMM path; a Mamba hybrid), with no request ever run on two sets of weights.
- KV computed under the old weights is never a prefix-cache hit afterwards (the version roots the block hashes).
- What cannot be updated is refused with its reason and changes nothing: another architecture, a reserved or reused
  version name, a missing checkpoint, requests still running on the engine, a request placed under other weights.
- Over HTTP: vLLM's pause / resume (abort and wait), SGLang's update_weights_from_disk and weight version, behind the
  flag and the API key; behind API processes the router process answers them.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.weight_update import WeightUpdateError, WeightVersionMismatch

PROMPTS = [list(range(1, 41)), [7, 8, 9, 10, 11], list(range(100, 133))]
NUM_TOKENS = 12


def perturbed_checkpoint(model: str, out_dir: Path, seed: int = 1) -> str:
    """A copy of built-in ``model``'s directory whose every floating tensor is scaled per element by 1 + 0.5 x a
    seeded normal draw: the same architecture, other weights (what a training step makes)."""
    from safetensors.torch import load_file, save_file

    src = resolve_model(model, progress=False)
    out_dir = Path(out_dir)
    if out_dir.exists():
        return str(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + "."))
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(tmp.glob("*.safetensors")):
        tensors = load_file(str(f))
        done: list[tuple[torch.Tensor, torch.Tensor]] = []  # (before, after): equal tensors (tied) stay equal
        for name in sorted(tensors):
            t = tensors[name]
            if t.is_floating_point():
                same = next((after for before, after in done if before.shape == t.shape and torch.equal(before, t)),
                            None)
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                tensors[name] = same if same is not None else (t.float() * (1 + 0.5 * noise)).to(t.dtype).contiguous()
                done.append((t, tensors[name]))
        save_file({k: v.clone() for k, v in tensors.items()}, str(f))
    tmp.rename(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Perturbed copies of the tiny models: {(model, seed): directory}."""
    root = tmp_path_factory.mktemp("weights")
    return {(m, s): perturbed_checkpoint(m, root / f"{m}-{s}", s)
            for m, s in (("tiny-random", 1), ("tiny-random", 2), ("tiny-hybrid", 1))}


def _add_tensor(model_dir: Path, name: str, like: str, factor: float) -> None:
    """Tensor ``name`` = ``factor`` x tensor ``like``, added to the checkpoint file holding ``like``."""
    from safetensors.torch import load_file, save_file

    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(str(f))
        if like in tensors:
            tensors[name] = tensors[like] * factor
            save_file(tensors, str(f))
            return
    raise AssertionError(f"no tensor {like} in {model_dir}")


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _run(engine, prompts=PROMPTS, **kw):
    outs = engine.generate(prompts, _params(logprobs=2, **kw))
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("model,dtype", [("tiny-random", "float32"), ("tiny-random", "bfloat16"),
                                         ("tiny-hybrid", "float32")])
def test_update_serves_what_a_fresh_engine_on_the_checkpoint_serves(checkpoints, model, dtype):
    engine = make_engine(model, dtype=dtype)
    before = _run(engine)
    new_dir = checkpoints[(model, 1)]
    want = _run(make_engine(new_dir, dtype=dtype))
    assert [t for t, _ in before] != [t for t, _ in want], "the checkpoints answer alike: the test proves nothing"
    update = engine.update_weights_from_disk(new_dir, "step-1")
    assert update.weight_version == engine.weight_version == "step-1" and update.num_tensors > 0
    assert update.num_bytes > 0 and engine.weights_path == new_dir
    assert _run(engine) == want
    # Back to the start-up checkpoint under a new name: its answers again.
    engine.update_weights_from_disk(str(resolve_model(model, progress=False)), "step-2")
    assert _run(engine) == before


def test_old_kv_is_never_a_hit_after_an_update(checkpoints):
    engine = make_engine("tiny-random", enable_prefix_caching=True)
    prompt = PROMPTS[0]
    engine.generate([prompt], _params())
    again = engine.generate([prompt], _params())[0]
    assert again.num_cached_tokens >= 32, "the prompt was not cached: the test proves nothing"
    new_dir = checkpoints[("tiny-random", 1)]
    engine.update_weights_from_disk(new_dir, "v1")
    after = engine.generate([prompt], _params())[0]
    assert after.num_cached_tokens == 0
    want = make_engine(new_dir).generate([prompt], _params())[0].token_ids
    assert after.token_ids == want
    # Under the new weights their own KV is cached as usual, and stamped requests hash by their version.
    assert engine.generate([prompt], _params())[0].num_cached_tokens >= 32


def test_refusals_change_nothing(checkpoints, tmp_path):
    engine = make_engine("tiny-random")
    before = _run(engine)
    refusals = [
        ((checkpoints[("tiny-hybrid", 1)], "v1"), "holds a"),
        ((str(tmp_path / "nowhere"), "v1"), "model_path"),
        ((checkpoints[("tiny-random", 1)], "default"), "names the weights the server started with"),
        ((checkpoints[("tiny-random", 1)], " "), "non-empty"),
    ]
    for args, message in refusals:
        with pytest.raises(WeightUpdateError, match=message):
            engine.update_weights_from_disk(*args)
    other = tmp_path / "wider"
    shutil.copytree(checkpoints[("tiny-random", 1)], other)
    config = (other / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
    assert config != (other / "config.json").read_text(), "the config edit missed"
    (other / "config.json").write_text(config)
    with pytest.raises(WeightUpdateError, match="rms_norm_eps"):
        engine.update_weights_from_disk(str(other), "v1")
    engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")
    with pytest.raises(WeightUpdateError, match="was given to other weights by an earlier update here"):
        engine.update_weights_from_disk(checkpoints[("tiny-random", 2)], "v1")
    engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")  # the same name, the same checkpoint
    engine.update_weights_from_disk(str(resolve_model("tiny-random", progress=False)), "v2")
    assert _run(engine) == before and engine.weight_version == "v2"


def test_a_checkpoint_that_unties_what_the_served_model_ties_is_refused(checkpoints, tmp_path):
    """NemotronH's loader ties the LM head to the embedding where the checkpoint's are equal (one tensor): a
    checkpoint whose two differ cannot go into that one tensor."""
    engine = make_engine("tiny-hybrid")
    assert engine.model.lm_head is engine.model.embed_tokens, "not tied: the test proves nothing"
    before = _run(engine)
    untied = tmp_path / "untied"
    shutil.copytree(checkpoints[("tiny-hybrid", 1)], untied)
    _add_tensor(untied, "lm_head.weight", "lm_head.weight", 2.0)
    with pytest.raises(WeightUpdateError, match="are one tensor in the served model .* differ in the new"):
        engine.update_weights_from_disk(str(untied), "v1")
    assert _run(engine) == before and engine.weight_version == "default"


def test_no_update_under_a_running_request_and_no_request_under_other_weights(checkpoints):
    engine = make_engine("tiny-random")
    engine.add_request(PROMPTS[0], _params())
    engine.step()
    with pytest.raises(WeightUpdateError, match="1 requests are running: pause generation first"):
        engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")
    assert engine.weight_version == "default" and engine.pending_weights is None
    while engine.has_unfinished():
        engine.step()
    engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")
    with pytest.raises(WeightVersionMismatch, match="serves weights 'v1', the request was placed under 'default'"):
        engine.add_request(PROMPTS[0], _params(weight_version="default"))
    rid = engine.add_request(PROMPTS[0], _params(weight_version="v1"))
    assert engine.scheduler.requests[rid].sampling_params.weight_version == "v1"
    rid = engine.add_request(PROMPTS[1], _params())  # unstamped: stamped with what is served
    assert engine.scheduler.requests[rid].sampling_params.weight_version == "v1"


def test_a_checkpoints_digest_follows_its_contents(checkpoints, tmp_path):
    from pdcluster.engine.weight_update import checkpoint_digest

    one, two = checkpoints[("tiny-random", 1)], checkpoints[("tiny-random", 2)]
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)
    assert checkpoint_digest(copy) == checkpoint_digest(one) != checkpoint_digest(two)
    _add_tensor(copy, "model.embed_tokens.weight", "model.embed_tokens.weight", 1.0001)  # a small training step
    assert checkpoint_digest(copy) != checkpoint_digest(one)


def test_block_hashes_are_rooted_in_the_version():
    from pdcluster.engine.block_manager import block_hash_root, chained_block_hashes

    plain = chained_block_hashes(list(range(64)), 16, block_hash_root(_params()))
    assert chained_block_hashes(list(range(64)), 16, block_hash_root(_params(weight_version="default"))) == plain
    v1 = chained_block_hashes(list(range(64)), 16, block_hash_root(_params(weight_version="v1")))
    v2 = chained_block_hashes(list(range(64)), 16, block_hash_root(_params(weight_version="v2")))
    assert len({plain[0], v1[0], v2[0]}) == 3
    salted = block_hash_root(_params(weight_version="v1", cache_salt="s"))
    assert salted not in (block_hash_root(_params(weight_version="v1")), block_hash_root(_params(cache_salt="s")))


# ---- served ---------------------------------------------------------------------------------------------------
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def _local_router():
    from conftest import engine_config
    from pdcluster.cluster.local_router import LocalRouter

    return LocalRouter(engine_config("tiny-random", dtype="float32"), request_timeout_s=60)


def _texts(engine, prompts) -> list[str]:
    return [engine.tokenizer.decode(o.token_ids) for o in engine.generate(prompts, _params())]


def test_pause_resume_and_update_over_http(checkpoints):
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


def test_api_processes_forward_the_routes_to_the_router_process(checkpoints):
    """Behind --api-servers N: the routes in an API process are answered by the router process (its admin app),
    so a pause or an update sent to any API process holds for all of them."""
    from fastapi import FastAPI

    from pdcluster.cluster.api.middleware import install_error_handlers
    from pdcluster.cluster.api.weight_routes import install_weight_routes
    from pdcluster.cluster.frontend.admin_proxy import install_weight_routes_proxy
    from pdcluster.cluster.frontend.service import RouterService
    from pdcluster.cluster.frontend.supervisor import _asgi_admin
    from test_api_servers import _remote

    router = _local_router()
    socket_dir = tempfile.mkdtemp(prefix="pdc-")
    admin_app = FastAPI()
    install_error_handlers(admin_app)
    install_weight_routes(admin_app, router)

    async def main():
        service = RouterService(router, f"ipc://{socket_dir}/router", str(router.tokenizer.model_dir),
                                admin=_asgi_admin(admin_app))
        serving = asyncio.create_task(service.run())
        remote = await _remote(socket_dir, 0)
        remote.announce_ready()
        api = FastAPI()
        install_weight_routes_proxy(api, remote)
        transport = httpx.ASGITransport(app=api)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
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
        finally:
            remote.close()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            service.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        router.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


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
def test_serve_with_api_processes_updates_through_any_of_them(checkpoints):
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
    finally:
        server.close()
