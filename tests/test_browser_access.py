"""Browser access (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials) and
--disable-fastapi-docs, on a real server over the scripted router.

No origin may call by default (a page the user visits cannot drive their local server); the origins named may, a
preflight needs no API key, and a refusal (401) still carries the CORS headers so the page can read why.
"""

from __future__ import annotations

import httpx
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.options import ApiOptions, CorsPolicy
from pdcluster.engine.tokenizer import Tokenizer
from test_api import serving
from test_api_openai import Script, ScriptedRouter

pytestmark = pytest.mark.timeout(120)

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _server(tiny_dir, **kwargs):
    return serving(build_app(ScriptedRouter(Tokenizer(tiny_dir), Script({0: "ok"})), "scripted", **kwargs))


def test_no_origin_may_call_by_default(tiny_dir):
    with _server(tiny_dir) as base_url:
        r = httpx.options(f"{base_url}/v1/chat/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(f"{base_url}/v1/chat/completions", json=BODY, headers={"Origin": PAGE})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_the_named_origins_may_call_with_the_key(tiny_dir):
    cors = CorsPolicy.from_flags(f'["{PAGE}"]', None, None, False)
    with _server(tiny_dir, cors=cors, api_key="k3y") as base_url:
        r = httpx.options(f"{base_url}/v1/chat/completions", headers=PREFLIGHT)  # no key on a preflight
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        r = httpx.post(f"{base_url}/v1/chat/completions", json=BODY,
                       headers={"Origin": PAGE, "Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        r = httpx.post(f"{base_url}/v1/chat/completions", json=BODY, headers={"Origin": PAGE})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE  # the page reads why
        other = httpx.options(f"{base_url}/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_docs_can_be_left_out(tiny_dir):
    with _server(tiny_dir) as base_url:
        assert httpx.get(f"{base_url}/docs").status_code == 200
        assert httpx.get(f"{base_url}/openapi.json").status_code == 200
    with _server(tiny_dir, fastapi_docs=False) as base_url:
        assert [httpx.get(f"{base_url}{p}").status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
        assert httpx.post(f"{base_url}/v1/chat/completions", json=BODY).status_code == 200


@pytest.mark.parametrize("args,message", [
    (("[not json", None, None), "--allowed-origins: not JSON"),
    (('"*"', None, None), "--allowed-origins: want a non-empty JSON list of strings"),
    (("[]", None, None), "want a non-empty JSON list"),
    ((None, '["GET"]', None), "--allowed-methods: applies with --allowed-origins"),
    (('["*"]', None, "[1]"), "--allowed-headers: want a non-empty JSON list of strings"),
])
def test_bad_cors_flags_name_the_flag(args, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        CorsPolicy.from_flags(*args, False)


def test_the_flags_reach_the_app_options():
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.serve_cli import _check_args

    args = build_parser().parse_args(["serve", "--mode", "local", "--port", "0", "--allowed-origins", '["*"]',
                                      "--allowed-methods", '["POST"]', "--allow-credentials", "--disable-fastapi-docs"])
    _check_args(args)
    options = ApiOptions.from_args(args, runtime_lora=False)
    assert options.cors == CorsPolicy(("*",), ("POST",), ("*",), True) and options.fastapi_docs is False
    default = build_parser().parse_args(["serve", "--mode", "local", "--port", "0"])
    _check_args(default)
    assert ApiOptions.from_args(default, runtime_lora=False).cors is None
