"""POST /invocations (vLLM's and SageMaker's one inference path, cluster/api/invocations.py): each body shape gets
the answer its own route gives, on a real server over the real engine (tiny-random), behind the API key; a body
that names no route, or is not a JSON object, is a 400 that says what to send.
"""

from __future__ import annotations

import httpx
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.invocations import route_for
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.config import EngineConfig
from test_api import serving

pytestmark = pytest.mark.timeout(300)

MODEL, KEY = "tiny-random", "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def base_url(tiny_dir):
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=128, max_model_len=512), request_timeout_s=30)
    try:
        with serving(build_app(router, MODEL, api_key=KEY)) as url:
            yield url
    finally:
        router.close()


def _comparable(path: str, body: dict) -> object:
    """What must agree between the two answers (ids and timestamps differ by design, and the second request finds
    the first's prompt in the prefix cache)."""
    if path.endswith("completions"):
        usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
        return [(c.get("text"), c.get("message"), c["finish_reason"]) for c in body["choices"]], usage
    return body["data"] if "data" in body else body.get("results", body)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                              "temperature": 0}),
    ("/v1/completions", {"model": MODEL, "prompt": "The quick brown", "max_tokens": 6, "temperature": 0}),
    ("/v1/embeddings", {"model": MODEL, "input": ["a red apple", "a green pear"]}),
    ("/score", {"model": MODEL, "text_1": "a red apple", "text_2": ["fruit", "cars"]}),
    ("/rerank", {"model": MODEL, "query": "a red apple", "documents": ["fruit", "cars"]}),
])
def test_each_body_gets_its_routes_answer(base_url, path, body):
    direct = httpx.post(base_url + path, json=body, headers=AUTH, timeout=60)
    via = httpx.post(base_url + "/invocations", json=body, headers=AUTH, timeout=60)
    assert via.status_code == direct.status_code, (via.text, direct.text)
    if direct.status_code == 200:
        assert _comparable(path, via.json()) == _comparable(path, direct.json())
    else:  # a route this model does not serve says so the same way
        assert via.json()["error"]["message"] == direct.json()["error"]["message"]


def test_a_streamed_chat(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", base_url + "/invocations", json=body, headers=AUTH, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 2


def test_the_key_and_bad_bodies(base_url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(base_url + "/invocations", json=body, timeout=30).status_code == 401
    r = httpx.post(base_url + "/invocations", json={"model": MODEL, "foo": 1}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "name no route" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/invocations", content=b"[1, 2]", headers=AUTH, timeout=30)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/invocations", content=b"{nope", headers=AUTH, timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/invocations", json={**body, "max_tokens": "many"}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]  # the route's own validation


def test_route_for():
    assert route_for({"messages": [], "prompt": "x"}) == "chat"  # messages first, as vLLM tries chat first
    assert route_for({"input": "x", "task": "embed"}) == "pooling"
    assert route_for({"prompt_embeds": "AAAA"}) == "completions"  # vLLM's prompt embeddings alone
    assert route_for({"items": ["a"]}) == "score" and route_for({"queries": "a", "documents": ["b"]}) == "score"
    assert route_for({"query": "a", "documents": ["b"]}) == "rerank"
