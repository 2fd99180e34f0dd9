"""`serve --middleware module.Name` (vLLM's flag; cluster/api/user_middleware.py): the operator's ASGI middleware
around the API. Real servers on tiny-random with a module written here: a class and an async function, in the order
given (the last outermost), outside the API key check (a refusal passes through them too), streamed answers through
them, every API process of several importing them; a name that is not a middleware is one line at start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from pdcluster.tools.server_process import ServeProcess

pytestmark = pytest.mark.timeout(300)

BASE = ["--model", "tiny-random", "--mode", "local", "--num-kv-blocks", "64", "--max-model-len", "512"]
MODULE = '''
import os
import sys

print(f"site_middleware imported in {os.getpid()}", file=sys.stderr, flush=True)


class Tenant:
    """Pure ASGI: appends "class" to x-order on every HTTP answer."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_marked(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-order", b"class")]
            await send(message)

        await self.app(scope, receive, send_marked)


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-order"] = response.headers.get("x-order", "") + ",fn"
    return response


NOT_A_MIDDLEWARE = 42


def plain(request, call_next):
    return call_next(request)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("site")
    (d / "site_middleware.py").write_text(MODULE)
    return {"PYTHONPATH": os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def test_class_and_function_wrap_every_answer_outside_the_api_key(site, tiny_dir):
    flags = [*BASE, "--api-key", "k-1", "--middleware", "site_middleware.Tenant", "--middleware",
             "site_middleware.stamp"]
    with ServeProcess(flags, extra_env=site) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
        refused = http.get("/v1/models")  # no key: refused inside them, the refusal passes through both
        assert refused.status_code == 401 and refused.headers["x-order"] == "class,fn", refused.headers
        auth = {"Authorization": "Bearer k-1"}
        models = http.get("/v1/models", headers=auth)
        assert models.status_code == 200 and models.headers["x-order"] == "class,fn"
        assert http.get("/no/such/route", headers=auth).headers["x-order"] == "class,fn"
        body = {"model": "tiny-random", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body, headers=auth) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            assert r.status_code == 200 and r.headers["x-order"] == "class,fn"
        assert sum(len(json.loads(c[6:])["choices"][0]["text"]) > 0 for c in chunks) >= 1 and len(chunks) >= 5


def test_every_api_process_imports_them(site, tiny_dir):
    flags = [*BASE, "--api-servers", "2", "--middleware", "site_middleware.Tenant"]
    with ServeProcess(flags, extra_env=site) as server:
        for _ in range(8):  # fresh connections, spread over both processes
            with httpx.Client(base_url=server.base_url, timeout=60) as http:
                r = http.get("/v1/models")
                assert r.status_code == 200 and r.headers["x-order"] == "class", r.headers
        out = server.output()
    # Imported by the serve command's check and by each API process.
    assert out.count("site_middleware imported in") == 3, out[-3000:]


@pytest.mark.parametrize("name, message", [
    ("no_such_module.Thing", "--middleware no_such_module.Thing: cannot import no_such_module: ModuleNotFoundError"),
    ("site_middleware.Missing", "--middleware site_middleware.Missing: module site_middleware has no Missing"),
    ("site_middleware.NOT_A_MIDDLEWARE", "a int, not a middleware"),
    ("site_middleware.plain", "a function, not a middleware"),
    ("Tenant", "want module.Name"),
])
def test_what_is_not_a_middleware_is_one_line(site, name, message, monkeypatch):
    """Checked as `serve` checks its flags before the model loads (in-process; the command's exit below)."""
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.serve_cli import _check_args
    from pdcluster.engine.config import ConfigError

    monkeypatch.syspath_prepend(site["PYTHONPATH"].split(os.pathsep)[0])
    args = build_parser().parse_args(["serve", *BASE, "--port", "0", "--api-servers", "1", "--middleware", name])
    with pytest.raises(ConfigError) as info:
        _check_args(args)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_the_command_says_one_line_and_exits_2(site):
    r = subprocess.run([sys.executable, "-m", "pdcluster.cli", "serve", *BASE, "--port", "0", "--middleware",
                        "site_middleware.plain"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **site})
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 2 and len(errors) == 1 and "a function, not a middleware" in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
