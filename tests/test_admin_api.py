"""Draining workers from outside the server (cluster/api/admin.py): `POST /admin/drain` on a real HTTP
server drains a worker while requests stream on it, losing and recomputing nothing; mistakes (no key,
the wrong key, the API key, an unknown worker, a node hosting none, a body naming two selectors) are
clear 4xx; `pdcluster drain` against a real `pdcluster serve` does the same from the command line, as
a Kubernetes preStop hook runs it."""

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading

import httpx
import pytest

from conftest import assert_drained_cleanly
from pdcluster.cluster.api.admin import install_admin_routes
from pdcluster.cluster.api.app import build_app
from pdcluster.tools.server_process import ServeProcess
from test_elastic import PROMPTS, _disagg, _generate, expected  # noqa: F401 - expected is a fixture

ADMIN_KEY = "admin-k"
API_KEY = "api-k"


@contextlib.asynccontextmanager
async def serving(app):
    """``app`` on uvicorn on a free loopback port, on this loop (beside the router); yields its URL."""
    import uvicorn

    from pdcluster.cluster.http_server import listen

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def admin_app(cluster, admin_key=ADMIN_KEY):
    app = build_app(cluster.router, "tiny-random", api_key=API_KEY)
    install_admin_routes(app, cluster, admin_key)
    return app


def auth(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.timeout(300)
def test_drain_route_drains_a_streaming_worker_and_refuses_mistakes(ray_session, expected):
    cluster = _disagg("tcp", num_prefill=1, num_decode=2)
    router = cluster.router
    recorder = router.record()
    leaving = sorted(cluster.decode_handles)[0]

    async def main():
        router.start(asyncio.get_running_loop())
        async with serving(admin_app(cluster)) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            # Mistakes first: each a clear 4xx, and nothing is drained.
            r = await http.post("/admin/drain", json={"worker_id": leaving})
            assert r.status_code == 401 and "missing admin key" in r.json()["error"]["message"], r.text
            for key in ("wrong", API_KEY):  # the API key is not the admin key
                r = await http.post("/admin/drain", json={"worker_id": leaving}, headers=auth(key))
                assert r.status_code == 401 and "invalid admin key" in r.json()["error"]["message"], r.text
            r = await http.post("/admin/drain", json={"worker_id": "decode-9-nope"}, headers=auth(ADMIN_KEY))
            assert r.status_code == 404 and "'decode-9-nope'" in r.json()["error"]["message"] \
                and leaving in r.json()["error"]["message"], r.text
            r = await http.post("/admin/drain", json={"node_ip": "10.255.0.9"}, headers=auth(ADMIN_KEY))
            assert r.status_code == 404 and "'10.255.0.9'" in r.json()["error"]["message"], r.text
            r = await http.post("/admin/drain", json={"worker_id": leaving, "node_ip": "10.255.0.9"},
                                headers=auth(ADMIN_KEY))
            assert r.status_code == 400 and "exactly one of" in r.json()["error"]["message"], r.text
            r = await http.post("/admin/drain", json={"worker": leaving}, headers=auth(ADMIN_KEY))
            assert r.status_code == 400 and r.json()["error"]["param"] == "worker", r.text
            r = await http.post("/admin/drain", json={"worker_id": leaving, "timeout_s": -1}, headers=auth(ADMIN_KEY))
            assert r.status_code == 400 and r.json()["error"]["param"] == "timeout_s", r.text
            r = await http.post("/admin/drain", content=b"{not json", headers=auth(ADMIN_KEY))
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
            assert all(v.in_rotation for v in router.views.values())

            r = await http.get("/admin/workers", headers=auth(ADMIN_KEY))
            assert r.status_code == 200, r.text
            listed = {w["worker_id"]: w for w in r.json()["workers"]}
            assert set(listed) == set(router.views) and all(w["node_ip"] and w["in_rotation"] for w in listed.values())

            # Now a real drain, while requests stream on the leaving worker.
            tasks = [asyncio.create_task(_generate(router, f"a{i}", p)) for i, p in enumerate(PROMPTS)]
            while not any(r.attempt is not None and r.attempt.decode_id == leaving and r.emitted
                          for r in router.requests.values()):
                await asyncio.sleep(0.01)
            began = len(recorder.decisions)
            r = await http.post("/admin/drain", json={"worker_id": leaving}, headers=auth(ADMIN_KEY))
            return await asyncio.gather(*tasks), r, began

    try:
        outs, r, began = asyncio.run(main())
        assert r.status_code == 200, r.text
        (drained,) = r.json()["drained"]
        assert drained["worker_id"] == leaving and drained["role"] == "decode"
        assert drained["num_requests_waited_for"] >= 1, "the drain had nothing to wait for: the test has no teeth"
        assert r.json()["workers_in_rotation"] == {"prefill": 1, "decode": 1} and not r.json()["warnings"]
        assert outs == expected
        assert_drained_cleanly(cluster, recorder, leaving, began)
    finally:
        cluster.shutdown()


def test_admin_routes_without_an_admin_key_are_disabled():
    """No --admin-key: the routes exist but refuse everyone (403 naming the flag), even with the API key."""
    from fastapi import FastAPI

    from pdcluster.cluster.api.admin import install_admin_routes

    class NoCluster:  # the routes refuse before they touch the cluster
        router = None

    app = FastAPI()
    install_admin_routes(app, NoCluster(), None)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            return [await http.post("/admin/drain", json={"all": True}, headers=auth(API_KEY)),
                    await http.get("/admin/workers")]

    for r in asyncio.run(main()):
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"], r.text


def _cli(*args, key=ADMIN_KEY, capsys=None):
    """`pdcluster drain ARGS` in this process (as fast as it gets): (exit status, stdout, stderr)."""
    from pdcluster.cli.main import main

    capsys.readouterr()
    env = {"PDCLUSTER_ADMIN_KEY": key}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        status = main(["drain", *args])
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pdcluster_drain_cli_against_a_real_server(tiny_dir, capsys):
    """`pdcluster drain` as the preStop hook runs it (a process of its own) against `pdcluster serve`
    (colocated, two decode workers), draining one while streaming requests run on both: every request
    completes and the server keeps serving on the other. Mistakes exit 1 with the server's reason."""
    # Long requests (1,900 tokens), one at a time per worker (--max-num-seqs 1) and four per worker: the
    # leaving worker must still have some when the drain process (a Python start-up of its own) reaches the
    # server. Two requests a worker running side by side ended first once decode steps got faster (tiny-random
    # decodes 1,900 tokens in about a second); queued behind each other they last seconds.
    flags = ["--mode", "colocated", "--model", "tiny-random", "--num-kv-blocks", "512", "--max-model-len", "2048",
             "--num-decode", "2", "--max-num-seqs", "1", "--router-policy", "round_robin", "--api-key", API_KEY]
    os.environ["PDCLUSTER_ADMIN_KEY"] = ADMIN_KEY  # the server reads it at start
    try:
        server = ServeProcess(flags)
    finally:
        del os.environ["PDCLUSTER_ADMIN_KEY"]
    url = server.base_url
    with server:
        status, out, err = _cli("--url", url, "--list", capsys=capsys)
        assert status == 0, err
        workers = [line.split("\t") for line in out.splitlines()]
        assert len(workers) == 2 and all(w[1] == "decode" and w[3] == "in rotation" for w in workers), out
        leaving = workers[0][0]
        status, _, err = _cli("--url", url, "--worker-id", "decode-7-nope", capsys=capsys)
        assert status == 1 and "HTTP 404" in err and "decode-7-nope" in err, err
        status, _, err = _cli("--url", url, "--worker-id", leaving, key=API_KEY, capsys=capsys)
        assert status == 1 and "HTTP 401" in err, err
        status, _, err = _cli("--url", url, "--all", key="", capsys=capsys)
        assert status == 2 and "--admin-key" in err, err

        body = {"model": "tiny-random", "prompt": "count with me: 1, 2, 3,", "max_tokens": 1900, "temperature": 0,
                "ignore_eos": True, "stream": True}
        results, started = {}, threading.Semaphore(0)

        def stream(i):
            with httpx.Client(base_url=url, timeout=300, headers=auth(API_KEY)) as http:
                with http.stream("POST", "/v1/completions", json=body) as r:
                    chunks, finish = 0, None
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if chunks == 1:
                                started.release()
                            finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
                    results[i] = (r.status_code, finish)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for _ in range(2):  # one request streams on each worker (round robin: four on each, three queued)
            assert started.acquire(timeout=120)
        drained = subprocess.run([sys.executable, "-m", "pdcluster.cli", "drain", "--url", url, "--worker-id",
                                  leaving], capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "PDCLUSTER_ADMIN_KEY": ADMIN_KEY})
        for t in threads:
            t.join(300)
        assert drained.returncode == 0, drained.stderr
        match = re.search(rf"drained decode worker {leaving} in [\d.]+ s \((\d+) requests waited for\)", drained.stdout)
        assert match and int(match.group(1)) >= 1, drained.stdout
        assert [results.get(i) for i in range(8)] == [(200, "length")] * 8, results  # all ran to the end
        with httpx.Client(base_url=url, timeout=60, headers=auth(API_KEY)) as http:
            r = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 8})
            assert r.status_code == 200, r.text
        status, out, _ = _cli("--url", url, "--list", capsys=capsys)
        assert [line.split("\t")[0] for line in out.splitlines()] == [workers[1][0]]
