"""vLLM's tokens-in, tokens-out POST /inference/v1/generate (cluster/api/vllm_tokens.py) and its POST /abort_requests
(cluster/api/control_routes.py) on the real HTTP server over a real engine: the tokens, logprobs and prompt logprobs
/v1/completions gives for the same request, in vLLM's layout; samples with seeds; the stream's deltas adding up to the
answer; aborts by id; refusals naming the field; the API key."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_sglang_native import MODEL, _completion, _until, served_local_router

httpx = pytest.importorskip("httpx")

API_KEY = "k-tokens"
CHUNK = 16
PROMPT = list(range(200, 200 + 2 * CHUNK + 3))  # prefilled in three chunks


@pytest.fixture(scope="module")
def server():
    with served_local_router(API_KEY, prefill_chunk_size=CHUNK) as served:
        yield served


def _tokens(client, **body):
    r = client.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokens_logprobs_and_prompt_logprobs_as_completions(server):
    _, client = server
    want = _completion(client, PROMPT, max_tokens=6, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    got = _tokens(client, request_id="r-1", token_ids=PROMPT, sampling_params={
        "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 2, "detokenize": False})
    assert got["request_id"] == "r-1" and got["model"] == MODEL
    choice, want_choice = got["choices"][0], want["choices"][0]
    assert choice["token_ids"] == want_choice["token_ids"] and choice["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 6 and got["usage"]["prompt_tokens"] == len(PROMPT)
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [c["logprob"] for c in content] == pytest.approx(want_choice["logprobs"]["token_logprobs"])
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
    assert got["prompt_logprobs"] == want_choice["prompt_logprobs"]  # vLLM's layout, every chunk's positions
    assert len(got["prompt_logprobs"]) == len(PROMPT) and got["prompt_logprobs"][0] is None
    # max_tokens left out: to the context's end (vLLM's server default), not SamplingParams' 16.
    whole = _tokens(client, token_ids=[5] * 1000, sampling_params={"ignore_eos": True})
    assert len(whole["choices"][0]["token_ids"]) == 1024 - 1000 and whole["choices"][0]["logprobs"] is None


def test_samples_with_seeds(server):
    _, client = server
    params = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    got = _tokens(client, token_ids=PROMPT, sampling_params={**params, "n": 2})
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for j, choice in enumerate(got["choices"]):  # sample j draws with seed 11 + j, as /v1/completions' n does
        alone = _tokens(client, token_ids=PROMPT, sampling_params={**params, "seed": 11 + j})
        assert choice["token_ids"] == alone["choices"][0]["token_ids"]


def test_stream_deltas_add_up_to_the_answer(server):
    _, client = server
    params = {"max_tokens": 7, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    whole = _tokens(client, token_ids=PROMPT, sampling_params=params)["choices"][0]
    with client.stream("POST", "/inference/v1/generate", json={
            "token_ids": PROMPT, "sampling_params": params, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    pieces = [c["choices"][0] for c in chunks[:-1]]
    assert len(pieces) >= 2 and [p["finish_reason"] for p in pieces][-1] == "length"
    assert all(p["finish_reason"] is None for p in pieces[:-1])
    assert sum((p["token_ids"] for p in pieces), []) == whole["token_ids"]
    streamed = [c["logprob"] for p in pieces for c in p["logprobs"]["content"]]
    assert streamed == pytest.approx([c["logprob"] for c in whole["logprobs"]["content"]])


def test_abort_requests_by_id(server):
    router, client = server
    long = {"max_tokens": 900, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        named = pool.submit(_tokens, client, request_id="job-1", token_ids=PROMPT, sampling_params=long)
        other = pool.submit(_tokens, client, request_id="job-10", token_ids=PROMPT,
                            sampling_params={**long, "max_tokens": 300})
        _until(lambda: router.generation.num_in_flight == 2)
        r = client.post("/abort_requests", json={"request_ids": ["job-1", "none-such"]})
        assert r.status_code == 200 and r.json() == {"num_aborted": 1}
        assert named.result(60)["choices"][0]["finish_reason"] == "abort"
        assert other.result(60)["choices"][0]["finish_reason"] == "length"
    assert client.post("/abort_requests", json={"request_ids": []}).json() == {"num_aborted": 0}


@pytest.mark.parametrize("body, says", [
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "no_such": 1}}, "sampling_params.no_such"),
    ({"token_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"token_ids": PROMPT, "sampling_params": {"prompt": [1]}}, "sampling_params.prompt"),
    ({"token_ids": [1, 10 ** 9]}, "out of range"),
    ({"token_ids": []}, "prompt"),
    ({"token_ids": [5] * 1020, "sampling_params": {"max_tokens": 10}}, "context"),
    ({"token_ids": PROMPT, "request_id": "a b"}, "request_id"),
])
def test_refusals_name_the_field(server, body, says):
    _, client = server
    r = client.post("/inference/v1/generate", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"], r.text


def test_api_key_guards_the_routes(server):
    _, client = server
    base = str(client.base_url)
    for path in ("/inference/v1/generate", "/abort_requests"):
        assert httpx.post(base + path, json={}, timeout=60).status_code == 401, path
