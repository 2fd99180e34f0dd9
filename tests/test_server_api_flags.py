"""vLLM's server flags about what answers say and how requests are watched: --response-role, --trust-request-chat-template
(a chat request's own template), --enable-server-load-tracking (GET /load) and --enable-request-id-headers
(X-Request-Id on every response). In process over a real engine and uvicorn (test_api's ``serving``), and once through
`pdcluster serve` with the real openai client."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.config import EngineConfig
from pdcluster.tools.server_process import ServeProcess
from test_api import serving

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-random"
KEY = "k-0123"
CHAT = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def router(tiny_dir):
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=256, max_model_len=1024), request_timeout_s=60)
    yield router
    router.close()


def _chat(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3, **fields})


def test_response_role(router):
    with serving(build_app(router, MODEL, response_role="bot")) as base_url:
        http = httpx.Client(base_url=base_url, timeout=60)
        assert _chat(http).json()["choices"][0]["message"]["role"] == "bot"
        with http.stream("POST", "/v1/chat/completions",
                         json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True}) as r:
            first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
        assert first["choices"][0]["delta"]["role"] == "bot"
        # Continuing the final message (no generation prompt): the answer is that message's role, as vLLM's.
        continued = _chat(http, messages=[*CHAT, {"role": "assistant", "content": "Hel"}], add_generation_prompt=False,
                          continue_final_message=True)
        assert continued.json()["choices"][0]["message"]["role"] == "assistant"
        n2 = _chat(http, n=2, use_beam_search=True)  # beam search answers through its own path
        assert {c["message"]["role"] for c in n2.json()["choices"]} == {"bot"}
    with serving(build_app(router, MODEL)) as base_url:
        assert _chat(httpx.Client(base_url=base_url, timeout=60)).json()["choices"][0]["message"]["role"] == "assistant"
    with pytest.raises(ValueError, match="--response-role: want a role name"):
        build_app(router, MODEL, response_role="")


def test_a_requests_chat_template_only_when_trusted(router):
    own = router.tokenizer.encode("[user]hi", add_special_tokens=False)
    with serving(build_app(router, MODEL)) as base_url:
        r = _chat(httpx.Client(base_url=base_url, timeout=60), chat_template=TEMPLATE)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    with serving(build_app(router, MODEL, trust_request_chat_template=True)) as base_url:
        http = httpx.Client(base_url=base_url, timeout=60)
        r = _chat(http, chat_template=TEMPLATE, return_token_ids=True)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == own
        # The server's own template is untouched for the next request.
        assert _chat(http, return_token_ids=True).json()["prompt_token_ids"] != own
        bad = _chat(http, chat_template="{% for m in messages %}")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
        assert "does not compile" in bad.json()["error"]["message"]


def _load(http: httpx.Client) -> int:
    return http.get("/load").json()["server_load"]


def _until_load(http: httpx.Client, value: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _load(http) != value:
        assert time.monotonic() < deadline, f"/load did not reach {value}"
        time.sleep(0.02)


LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True, "stream": True}


def test_load_tracking_counts_requests_until_their_last_chunk(router):
    with serving(build_app(router, MODEL, server_load_tracking=True, api_key=KEY)) as base_url:
        http = httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        assert _load(httpx.Client(base_url=base_url, timeout=60)) == 0  # /load needs no key, as vLLM's
        with http.stream("POST", "/v1/completions", json=LONG) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert _load(http) == 1  # streaming: 600 tokens still to come
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        _until_load(http, 0)
        # A client that leaves mid-stream: the count drops when the server sees it gone.
        with http.stream("POST", "/v1/completions", json=LONG) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        _until_load(http, 0)
        assert http.get("/v1/models").status_code == 200 and _load(http) == 0  # not a generation route
    with serving(build_app(router, MODEL)) as base_url:  # without the flag: always 0, as vLLM's
        http = httpx.Client(base_url=base_url, timeout=60)
        with http.stream("POST", "/v1/completions", json=LONG) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
            assert _load(http) == 0


def test_request_id_headers(router):
    with serving(build_app(router, MODEL, request_id_headers=True, api_key=KEY)) as base_url:
        http = httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        r = http.post("/v1/chat/completions", headers={"X-Request-Id": "client-7"},
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-request-id"] == "client-7"
        assert r.json()["id"] == "chatcmpl-client-7"  # the same id names the answer
        assert re.fullmatch(r"[0-9a-f]{32}", _chat(http).headers["x-request-id"])
        with http.stream("POST", "/v1/completions", headers={"X-Request-Id": "s-1"},
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}) as s:
            assert s.headers["x-request-id"] == "s-1"
            s.read()
        refused = httpx.post(f"{base_url}/v1/completions", headers={"X-Request-Id": "nokey"}, json={})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "nokey"
    with serving(build_app(router, MODEL)) as base_url:
        assert "x-request-id" not in _chat(httpx.Client(base_url=base_url, timeout=60)).headers


def test_the_flags_through_serve():
    flags = ["--model", MODEL, "--mode", "local", "--num-kv-blocks", "64", "--max-model-len", "512",
             "--response-role", "bot", "--trust-request-chat-template", "--enable-server-load-tracking",
             "--enable-request-id-headers", "--scheduling-policy", "priority",
             "--chat-template-content-format", "string"]
    with ServeProcess(flags, timeout_s=240) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"chat_template": TEMPLATE},
            extra_headers={"X-Request-Id": "via-serve"})
        assert raw.headers["x-request-id"] == "via-serve"
        assert raw.parse().choices[0].message.role == "bot"
        assert httpx.get(f"{server.base_url}/load", timeout=30).json() == {"server_load": 0}
        output = server.output()
    assert "--scheduling-policy: accepted, no effect" in output
    assert "--chat-template-content-format: accepted, no effect" in output
