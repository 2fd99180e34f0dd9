"""SGLang's weight update from a trainer's process group (cluster/weights_from_trainer.py, cluster/trainer_group.py,
cluster/staged_checkpoint.py) behind the real HTTP server: a trainer process (tests/trainer_rank0.py, made as RL
frameworks make theirs) joins a gloo group with the server's router and broadcasts a checkpoint's tensors; the
server then answers as a fresh engine on that checkpoint answers. In buckets while paused (slime's order), in one
call while running, refused by name, in verl's sleep order; (slow) through an API process, with a trainer that dies
mid-update, and on a disaggregated Ray cluster, every worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_engine
from test_weight_updates import NUM_TOKENS, PROMPTS, checkpoints  # noqa: F401 - a fixture
from test_weight_updates_served import ThreadPool, _local_router, _texts
from trainer_rank0 import Trainer, free_port

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def _names(model_dir) -> list[str]:
    from pdcluster.cluster.staged_checkpoint import checkpoint_shapes

    return sorted(checkpoint_shapes(model_dir))


class _Session:
    """A server at ``base_url`` and a trainer joined with it in group ``weight_update_group``."""

    def __init__(self, base_url: str, pool: ThreadPool):
        self.base_url, self.pool = base_url, pool
        self.trainer_port = free_port()
        self.trainer = Trainer(self.trainer_port)

    def post(self, route: str, body: dict | None = None, timeout: float = 120):
        return httpx.post(f"{self.base_url}/{route}", json=body, timeout=timeout)

    def join(self) -> None:
        self.trainer.join()
        answer = self.pool.submit(lambda: self.post("init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": self.trainer_port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo"}))
        self.trainer.wait_joined()
        r = answer.result(120)
        assert r.status_code == 200 and r.json()["success"] is True, r.text

    def update(self, model_dir, names: list[str], dtype: str = "float32", zeros: dict | None = None,
               **body) -> httpx.Response:
        """One update_weights_from_distributed call, the trainer broadcasting ``names`` meanwhile."""
        from pdcluster.cluster.staged_checkpoint import checkpoint_shapes

        shapes = checkpoint_shapes(model_dir)
        answer = self.pool.submit(lambda: self.post("update_weights_from_distributed", {
            "names": names, "dtypes": [dtype] * len(names),
            "shapes": [list(zeros[n]) if n in (zeros or {}) else list(shapes[n][0]) for n in names], **body}))
        self.trainer.send(model_dir, names, dtype, zeros)
        return answer.result(120)


def test_buckets_while_paused_then_one_call_while_running(checkpoints):  # noqa: F811
    """slime's order: pause, the checkpoint in two buckets naming one version (staged: the old weights still serve
    until the resume, which serves both buckets as that version), resume; then a second checkpoint in one call while
    running (served at once under a version of its own). Each time the server's tokens equal a fresh engine's on
    that checkpoint; the staged checkpoint the workers read before goes once the next is served."""
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    first, second = checkpoints[("tiny-random", 1)], checkpoints[("tiny-random", 2)]
    want = {d: _texts(make_engine(d), PROMPTS[:1])[0] for d in ("tiny-random", first, second)}
    router = _local_router()
    try:
        with serving(build_app(router, "tiny-random", weight_updates=True)) as base_url, ThreadPool() as pool:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

            def complete():
                return client.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=NUM_TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0].text

            s = _Session(base_url, pool)
            try:
                s.join()
                names = _names(first)
                assert s.post("pause_generation", {"mode": "abort"}).status_code == 200
                for bucket in (names[:len(names) // 2], names[len(names) // 2:]):
                    r = s.update(first, bucket, weight_version="step-1")
                    assert r.status_code == 200 and r.json()["success"] is True, r.text
                    assert "served when generation resumes" in r.json()["message"]
                assert router.weight_version == "default"  # staged, not served
                r = s.post("update_weights_from_disk", {"model_path": second})
                assert r.status_code == 409 and "staged" in r.json()["message"], r.text
                r = s.post("continue_generation")
                assert r.status_code == 200 and r.json()["weight_update"]["weight_version"] == "step-1", r.text
                assert complete() == want[first]
                staged_first = Path(router.generation.weights_path)
                assert staged_first.name.startswith("pdcluster-weights-") and staged_first.is_dir()
                # Running: one call, served at once (its own version), the earlier staged checkpoint removed.
                r = s.update(second, _names(second), dtype="float32")
                assert r.status_code == 200 and r.json()["weight_version"] == "trainer-2", r.text
                assert router.weight_version == "trainer-2" and complete() == want[second]
                assert not staged_first.exists()
                staged_second = Path(router.generation.weights_path)
                assert s.post("destroy_weights_update_group", {}).json()["success"] is True
            finally:
                s.trainer.close()
            assert complete() == want[second]
            # An update from disk serves no staged checkpoint: the last one goes (at the latest with the server).
            assert s.post("update_weights_from_disk", {"model_path": first}).status_code == 200
            assert complete() == want[first]
    finally:
        router.close()
    assert not staged_second.exists(), "a staged checkpoint outlived the server"
    assert Path(first).is_dir() and Path(router.generation.weights_path) == Path(first)  # never one it did not write


def test_refusals_take_the_broadcasts_and_change_nothing(checkpoints):  # noqa: F811
    """A tensor the served checkpoint lacks, or of another shape: 400 naming it, once its broadcast was taken (the
    trainer goes on: the next update works). A GPU backend, a rank outside the group, an unknown group, a second
    join, an update before any join, and an update after leaving: refused by name."""
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    new_dir = checkpoints[("tiny-random", 1)]
    router = _local_router()
    try:
        with serving(build_app(router, "tiny-random", weight_updates=True)) as base_url, ThreadPool() as pool:
            s = _Session(base_url, pool)
            base = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
            for body, message in [({**base, "backend": "nccl"}, "backend 'nccl'"),
                                  ({**base, "backend": "gloo", "rank_offset": 2}, "rank_offset 2 must be within")]:
                r = s.post("init_weights_update_group", body)
                assert r.status_code == 400 and message in r.json()["message"], r.text
            r = s.post("update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
            assert r.status_code == 400 and "no group 'weight_update_group'" in r.json()["message"], r.text
            try:
                s.join()
                r = s.post("init_weights_update_group", {**base, "backend": "gloo"})
                assert r.status_code == 400 and "joined already" in r.json()["message"]
                names = _names(new_dir)
                unknown = "model.layers.99.mlp.up_proj.weight"
                r = s.update(new_dir, [names[0], unknown], zeros={unknown: [4, 4]})
                assert r.status_code == 400 and unknown in r.json()["message"], r.text
                assert "not in the served checkpoint" in r.json()["message"]
                assert "received and dropped" in r.json()["message"]
                norm = "model.norm.weight"
                (size,) = _shape(new_dir, norm)
                r = s.update(new_dir, [norm], zeros={norm: [size + 1]})
                assert r.status_code == 400 and f"{norm} [{size + 1}] (served [{size}])" in r.json()["message"], r.text
                r = s.post("update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"],
                                                               "shapes": [[1], [1]]})
                assert r.status_code == 400 and "as long as each other" in r.json()["message"]
                r = s.post("update_weights_from_distributed", {"names": ["a"], "dtypes": ["int8"], "shapes": [[1]]})
                assert r.status_code == 400 and "not a floating torch dtype" in r.json()["message"]
                r = s.post("update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                                               "load_format": "flattened_bucket"})
                assert r.status_code == 400 and "load_format" in r.text, r.text
                assert router.weight_version == "default"
                # The group is in step: a whole update works, bfloat16 on the wire to a float32 server.
                r = s.update(new_dir, names, dtype="bfloat16", weight_version="bf16-wire")
                assert r.status_code == 200 and router.weight_version == "bf16-wire", r.text
                assert s.post("destroy_weights_update_group", {}).status_code == 200
                r = s.post("destroy_weights_update_group", {})
                assert r.status_code == 400 and "no group" in r.json()["message"]
            finally:
                s.trainer.close()
            assert router.num_open_streams == 0
    finally:
        router.close()


def _shape(model_dir, name: str) -> tuple[int, ...]:
    from pdcluster.cluster.staged_checkpoint import checkpoint_shapes

    return checkpoint_shapes(model_dir)[name][0]


def test_staged_checkpoint_links_what_it_does_not_replace(tmp_path, checkpoints):  # noqa: F811
    """Unit: files without a replaced tensor are links to the served files' real paths (not to an earlier staged
    checkpoint, which goes); a tied model's lm_head.weight is left out; shapes are checked before any file is
    written."""
    import torch
    from safetensors.torch import load_file

    from pdcluster.cluster.staged_checkpoint import StagedCheckpointError, write_staged_checkpoint
    from pdcluster.engine.models.registry import resolve_model

    base = resolve_model("tiny-random", progress=False)
    embed = load_file(str(Path(checkpoints[("tiny-random", 1)]) / "model.safetensors"))["model.embed_tokens.weight"]
    one = write_staged_checkpoint(base, {"model.embed_tokens.weight": embed, "lm_head.weight": embed}, tmp_path)
    assert (one / "config.json").is_symlink() and (one / "config.json").resolve() == (base / "config.json").resolve()
    written = load_file(str(one / "model.safetensors"))
    assert torch.equal(written["model.embed_tokens.weight"], embed) and "lm_head.weight" not in written
    served = load_file(str(base / "model.safetensors"))
    assert all(torch.equal(written[n], t) for n, t in served.items() if n != "model.embed_tokens.weight")
    two = write_staged_checkpoint(one, {"model.norm.weight": served["model.norm.weight"] * 2}, tmp_path)
    assert (two / "config.json").resolve() == (base / "config.json").resolve()
    with pytest.raises(StagedCheckpointError, match="differ in shape"):
        write_staged_checkpoint(base, {"model.norm.weight": torch.zeros(3)}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([one.name, two.name])
    import json

    quantized = tmp_path / "quantized"  # a trainer's tensors would be read as its fp8 codes: refused by name
    quantized.mkdir()
    (quantized / "model.safetensors").symlink_to(base / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(StagedCheckpointError, match=r"quantized \(fp8\)"):
        write_staged_checkpoint(quantized, {"model.norm.weight": served["model.norm.weight"]}, tmp_path)


@pytest.mark.slow
def test_through_an_api_process_the_router_process_receives(checkpoints):  # noqa: F811
    """Behind API processes (``serve --api-servers N``) the router process joins the group and receives: the routes
    cross the admin proxy like the other weight routes, and the API process's /generate answers on the new weights."""
    import asyncio

    from fastapi import FastAPI

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.api.middleware import install_error_handlers
    from pdcluster.cluster.api.weight_routes import install_weight_routes
    from pdcluster.cluster.frontend.admin_proxy import install_weight_routes_proxy
    from test_api_servers import with_one_api_process

    new_dir = checkpoints[("tiny-random", 1)]
    engine = make_engine(new_dir)
    want = engine.tokenizer.decode(engine.generate([PROMPTS[0]], _sampling())[0].token_ids)
    router = _local_router()
    admin_app = FastAPI()
    install_error_handlers(admin_app)
    install_weight_routes(admin_app, router)
    port = free_port()
    trainer = Trainer(port)

    async def body(remote):
        remote.announce_ready()
        api = build_app(remote, "tiny-random", router_control=False)
        install_weight_routes_proxy(api, remote)
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            trainer.join()
            joined = asyncio.ensure_future(client.post("/init_weights_update_group", timeout=120, json={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo"}))
            await asyncio.to_thread(trainer.wait_joined)
            assert (await joined).json()["success"] is True
            names = _names(new_dir)
            shapes = [list(_shape(new_dir, n)) for n in names]
            updated = asyncio.ensure_future(client.post("/update_weights_from_distributed", timeout=120, json={
                "names": names, "dtypes": ["torch.float32"] * len(names), "shapes": shapes, "weight_version": "rl-7"}))
            await asyncio.to_thread(trainer.send, new_dir, names)
            r = await updated
            assert r.status_code == 200 and r.json()["weight_version"] == "rl-7", r.text
            r = await client.post("/generate", timeout=60, json={
                "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0,
                                                            "ignore_eos": True}})
            assert r.json()["text"] == want and r.json()["meta_info"]["weight_version"] == "rl-7", r.text

    try:
        with_one_api_process(router, body, admin_app)
    finally:
        trainer.close()


def _sampling():
    from pdcluster.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_disagg_cluster_every_worker_serves_the_trainers_weights(ray_session, checkpoints):  # noqa: F811
    """A disaggregated Ray cluster: the router joins the trainer's group; two buckets while paused, then the resume:
    every worker (prefill and decode) serves them under the version named, the cluster answers as one engine on that
    checkpoint does, a decode worker added afterwards takes them from the staged checkpoint before it takes
    requests; a second update while running replaces them (the first staged checkpoint goes); no block is left."""
    import asyncio

    from conftest import engine_config, settled_worker_stats
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    first, second = checkpoints[("tiny-random", 1)], checkpoints[("tiny-random", 2)]
    refs = {d: [o.token_ids for o in make_engine(d).generate(PROMPTS, _sampling())] for d in (first, second)}
    cluster = Cluster(ClusterSpec(engine=engine_config("tiny-random", dtype="float32"),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg"))
    ray = cluster._ray
    port = free_port()
    trainer = Trainer(port)

    def versions() -> set[str]:
        handles = {**cluster.prefill_handles, **cluster.decode_handles}
        return set(ray.get([h.weight_version.remote() for h in handles.values()], timeout=60))

    async def run(tag):
        async def one(i, prompt):
            tokens = []
            async for delta in cluster.router.generate(f"{tag}-{i}", list(prompt), _sampling()):
                tokens += delta.new_token_ids
            return tokens
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    async def update(receiver, model_dir, names, **kw):
        call = asyncio.ensure_future(receiver.update(names, ["float32"] * len(names),
                                                     [list(_shape(model_dir, n)) for n in names], **kw))
        await asyncio.to_thread(trainer.send, model_dir, names)
        return await call

    async def main():
        router = cluster.router
        router.start(asyncio.get_running_loop())
        receiver = router.trainer_weights
        trainer.join()
        joined = asyncio.ensure_future(receiver.init_group("127.0.0.1", port, 1, 2))
        await asyncio.to_thread(trainer.wait_joined)
        await joined
        names = _names(first)
        await router.pause("wait")
        for bucket in (names[:10], names[10:]):
            await update(receiver, first, bucket, weight_version="step-1")
        assert versions() == {"default"}
        answer = await router.resume()
        assert answer["weight_version"] == "step-1" and len(answer["workers"]) == 2 and versions() == {"step-1"}
        staged_first = router.generation.weights_path
        assert await run("first") == refs[first]
        added = await cluster.add_worker("decode")
        assert ray.get(cluster.decode_handles[added].weight_version.remote(), timeout=60) == "step-1"
        answer = await update(receiver, second, _names(second), weight_version="step-2")
        assert answer["weight_version"] == "step-2" and len(answer["workers"]) == 3 and versions() == {"step-2"}
        assert not Path(staged_first).exists()
        assert await run("second") == refs[second]
        await receiver.destroy_group()

    try:
        asyncio.run(asyncio.wait_for(main(), 300))
        for wid, st in settled_worker_stats(cluster).items():
            assert st["num_free_blocks"] == st["num_blocks"], (wid, st)
    finally:
        trainer.close()
        staged = cluster.router.generation.weights_path
        cluster.shutdown()
    assert staged and not Path(staged).exists()


@pytest.mark.slow
def test_a_trainer_that_dies_mid_update_ends_the_call_and_a_new_group_works(checkpoints):  # noqa: F811
    """The trainer process dies before its broadcasts: the update answers 503 naming the group (not a hang, not a
    500), the broken group is left, nothing changed; a new trainer joins under the same name and updates."""
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    new_dir = checkpoints[("tiny-random", 1)]
    router = _local_router()
    try:
        with serving(build_app(router, "tiny-random", weight_updates=True)) as base_url, ThreadPool() as pool:
            s = _Session(base_url, pool)
            try:
                s.join()
                names = _names(new_dir)
                call = pool.submit(s.post, "update_weights_from_distributed", {
                    "names": names, "dtypes": ["float32"] * len(names),
                    "shapes": [list(_shape(new_dir, n)) for n in names]})
                s.trainer.process.kill()
                r = call.result(120)
                assert r.status_code == 503 and "group 'weight_update_group'" in r.json()["message"], r.text
                assert router.weight_version == "default" and not router.trainer_weights.groups
            finally:
                s.trainer.close()
            s = _Session(base_url, pool)
            try:
                s.join()
                r = s.update(new_dir, _names(new_dir), weight_version="after")
                assert r.status_code == 200 and router.weight_version == "after", r.text
            finally:
                s.trainer.close()
    finally:
        router.close()


def test_verls_order_sleep_update_wake_serves_the_new_weights(checkpoints):  # noqa: F811
    """Sleep (level 2: the weights discarded), the update from the trainer, wake: the update is served at once (the
    gate a sleep closes is not a caller's pause: nothing is staged, as no resume will come), restoring the weights,
    and after the wake the server answers on them."""
    from pdcluster.cluster.api.app import build_app
    from test_api import serving

    new_dir = checkpoints[("tiny-random", 1)]
    want = _texts(make_engine(new_dir), PROMPTS[:1])[0]
    router = _local_router()
    try:
        with serving(build_app(router, "tiny-random", weight_updates=True, sleep_mode=True)) as base_url, \
                ThreadPool() as pool:
            s = _Session(base_url, pool)
            try:
                s.join()
                assert s.post("sleep?level=2").status_code == 200
                r = s.update(new_dir, _names(new_dir), weight_version="rollout-2")
                assert r.status_code == 200 and router.weight_version == "rollout-2", r.text
                assert not router.trainer_weights.staged
                assert s.post("wake_up").status_code == 200
            finally:
                s.trainer.close()
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            text = client.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=NUM_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            assert text == want
    finally:
        router.close()


def test_a_cancelled_update_holds_the_group_until_its_broadcasts_are_taken(checkpoints):  # noqa: F811
    """A caller that goes away mid-update (a client's timeout, a shutdown: its task cancelled) cannot stop the thread
    that receives the broadcasts. The call ends only once they were taken (dropped: nothing staged), and holds the
    group until then, so the next update's receives are never posted beside them (gloo would match the trainer's
    next broadcasts to whichever were posted first). The next update then stages exactly its own tensors."""
    import asyncio

    import torch
    from safetensors.torch import load_file

    first, second = checkpoints[("tiny-random", 1)], checkpoints[("tiny-random", 2)]
    names = _names(first)
    want = {}
    for f in Path(second).glob("*.safetensors"):
        want.update({n: t for n, t in load_file(str(f)).items() if n in names})
    router = _local_router()
    port = free_port()
    trainer = Trainer(port)

    async def scenario():
        try:
            await steps()
        except BaseException:
            trainer.process.kill()  # a receive left waiting fails at once (asyncio.run waits for its thread)
            raise

    async def steps():
        await router.pause("abort")
        weights = router.trainer_weights
        trainer.join()
        joining = asyncio.create_task(weights.init_group("127.0.0.1", port, 1, 2, timeout_s=60))
        await asyncio.to_thread(trainer.wait_joined)
        assert (await joining)["success"] is True
        body = dict(names=names, dtypes=["float32"] * len(names), shapes=[list(_shape(first, n)) for n in names])
        cancelled = asyncio.create_task(weights.update(**body, weight_version="cancelled"))
        for _ in range(100):  # until its receive runs (bounded: 5 s)
            if weights._lock.locked():
                break
            await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.sleep(0.5)
        assert not cancelled.done(), "the cancelled update ended before its broadcasts were taken"
        assert weights._lock.locked(), "the group was let go while a receive still runs"
        following = asyncio.create_task(weights.update(**body, weight_version="following"))
        await asyncio.to_thread(trainer.send, first, names)  # the cancelled update's broadcasts
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert not weights.staged
        await asyncio.to_thread(trainer.send, second, names)
        assert (await following)["success"] is True
        assert weights.staged_version == "following" and sorted(weights.staged) == sorted(names)
        for name in names:
            assert torch.equal(weights.staged[name], want[name].float()), name

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        trainer.close()
        router.close()
