"""SGLang's native routes (cluster/api/sglang_routes.py, sglang_generate.py, sglang_protocol.py) on the real HTTP server
over a real engine: POST /generate answers what /v1/completions answers for the same request (tokens, text, logprobs,
prompt logprobs past one prefill chunk), in SGLang's layout (batches prompt-major, n samples, cumulative streams,
finish reasons with what matched); /abort_request ends the request it names and no other; /flush_cache empties the
prefix cache and refuses while requests run; the info routes, /health_generate, refusals naming the field, the API
key.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import engine_config

httpx = pytest.importorskip("httpx")

MODEL = "tiny-random"
PROMPT = "The capital of France is"
API_KEY = "k-sglang"
CHUNK = 16


@contextlib.contextmanager
def served_local_router(api_key: str, **config):
    """A LocalRouter over tiny-random (fp32, ``config`` over it) behind the real app on uvicorn, and a client with the
    key: (router, client)."""
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    router = LocalRouter(engine_config(MODEL, dtype="float32", **config), request_timeout_s=60)
    try:
        with serving(build_app(router, MODEL, api_key=api_key)) as base_url, \
                httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {api_key}"}) as client:
            yield router, client
    finally:
        router.close()


@pytest.fixture(scope="module")
def server():
    # Prefill in chunks of 16 tokens: prompt logprobs of longer prompts span chunks (issue 22's shape).
    with served_local_router(API_KEY, prefill_chunk_size=CHUNK, enable_prefix_caching=True) as served:
        yield served


def _generate(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _completion(client, prompt, **fields):
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "return_token_ids": True, **fields}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_generate_answers_as_completions(server):
    _, client = server
    want = _completion(client, PROMPT, max_tokens=8, ignore_eos=True)["choices"][0]
    got = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert got["text"] == want["text"] and got["output_ids"] == want["token_ids"]
    meta = got["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8 and meta["prompt_tokens"] == len(want["prompt_token_ids"])
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0 and meta["id"].startswith("gen-")
    # Token ids in, the same tokens out; the client's rid is the answer's id.
    by_ids = _generate(client, input_ids=want["prompt_token_ids"], rid="mine",
                       sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert by_ids["output_ids"] == want["token_ids"] and by_ids["meta_info"]["id"] == "mine"
    # SGLang's default max_new_tokens is 128; null runs to the context's end.
    default = _generate(client, text=PROMPT, sampling_params={"temperature": 0, "ignore_eos": True})
    assert default["meta_info"]["completion_tokens"] == 128
    whole = _generate(client, input_ids=[5] * 1000, sampling_params={"max_new_tokens": None, "ignore_eos": True})
    assert whole["meta_info"]["completion_tokens"] == 1024 - 1000


def test_batches_and_samples_are_prompt_major(server):
    _, client = server
    prompts = [[11, 12, 13], [21, 22, 23, 24]]
    params = [{"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 7, "n": 2, "ignore_eos": True},
              {"max_new_tokens": 3, "temperature": 0, "n": 2, "ignore_eos": True}]
    got = _generate(client, input_ids=prompts, sampling_params=params, rid=["a", "b"])
    assert [a["index"] for a in got] == [0, 1, 2, 3]
    assert [a["meta_info"]["id"] for a in got] == ["a-0", "a-1", "b-0", "b-1"]
    # Prompt 0's sample j draws with seed 7 + j: as that prompt sent alone with that seed.
    for j in range(2):
        alone = _generate(client, input_ids=prompts[0], sampling_params={**params[0], "n": 1, "sampling_seed": 7 + j})
        assert got[j]["output_ids"] == alone["output_ids"]
    assert got[0]["output_ids"] != got[1]["output_ids"], "two samples drew the same tokens"
    greedy = _completion(client, prompts[1], max_tokens=3, ignore_eos=True)["choices"][0]["token_ids"]
    assert got[2]["output_ids"] == got[3]["output_ids"] == greedy
    assert [len(a["output_ids"]) for a in got] == [5, 5, 3, 3]
    # A one-prompt batch is still a list.
    assert isinstance(_generate(client, text=[PROMPT], sampling_params={"max_new_tokens": 1}), list)


def test_logprobs_as_completions(server):
    _, client = server
    prompt = list(range(100, 100 + 3 * CHUNK + 5))  # prefilled in four chunks
    want = _completion(client, prompt, max_tokens=4, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    choice = want["choices"][0]
    for start in (0, 2 * CHUNK + 1):
        got = _generate(client, input_ids=prompt, return_logprob=True, logprob_start_len=start, top_logprobs_num=2,
                        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        meta = got["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == got["output_ids"] == choice["token_ids"]
        assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(choice["logprobs"]["token_logprobs"])
        assert [e[2] for e in meta["output_token_logprobs"]] == [None] * 4  # no text unless asked
        for top, want_top in zip(meta["output_top_logprobs"], choice["logprobs"]["top_logprobs"]):
            # Greedy: the sampled token is the most likely, so completions' top holds just the two most likely.
            assert [e[0] for e in top] == pytest.approx(sorted(want_top.values(), reverse=True))
        inputs = meta["input_token_logprobs"]
        assert [e[1] for e in inputs] == prompt[start:] and len(inputs) == len(prompt) - start
        want_prompt = choice["prompt_logprobs"]
        for position, (logprob, token_id, _) in enumerate(inputs, start=start):
            if position == 0:
                assert logprob is None and meta["input_top_logprobs"][0] is None
            else:
                assert logprob == pytest.approx(want_prompt[position][str(token_id)]["logprob"])
                top = meta["input_top_logprobs"][position - start]
                ranked = sorted((v for v in want_prompt[position].values() if v["rank"] <= 2), key=lambda v: v["rank"])
                assert [e[0] for e in top] == pytest.approx([v["logprob"] for v in ranked])
    # max_new_tokens 0: the prompt scored alone (SGLang's prefill-only request), streamed or not.
    for stream in (False, True):
        body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 1, "stream": stream,
                "sampling_params": {"max_new_tokens": 0}}
        if stream:
            with client.stream("POST", "/generate", json=body) as r:
                events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            scored = json.loads(events[-2])
        else:
            scored = _generate(client, **body)
        assert scored["text"] == "" and scored["output_ids"] == [] and scored["meta_info"]["completion_tokens"] == 0
        assert scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert scored["meta_info"]["output_token_logprobs"] == []
        assert [e[0] for e in scored["meta_info"]["input_token_logprobs"]] == pytest.approx(
            [want_prompt[p][str(prompt[p])]["logprob"] for p in range(1, len(prompt))])
    # return_text_in_logprobs: each token's own string; logprob_start_len -1 (the default): no prompt positions.
    got = _generate(client, input_ids=prompt, return_logprob=True, return_text_in_logprobs=True,
                    sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert [e[2] for e in got["meta_info"]["output_token_logprobs"]] == choice["logprobs"]["tokens"][:2]
    assert got["meta_info"]["input_token_logprobs"] == [] and "output_top_logprobs" not in got["meta_info"]


def test_finish_reasons_say_what_matched(server):
    _, client = server
    free = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                           "ignore_eos": True})
    ids, text = free["output_ids"], free["text"]
    # A stop string: the text ends before it (SGLang's trim), or after it with no_stop_trim.
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": [stop],
                                                          "ignore_eos": True})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[:text.index(stop)]
    kept = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": stop,
                                                           "no_stop_trim": True, "ignore_eos": True})
    assert kept["text"] == text[:text.index(stop) + len(stop)]
    # A stop token: matched is its id, and it is the last of output_ids.
    by_token = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                               "stop_token_ids": [ids[4]], "ignore_eos": True})
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[4]}
    assert by_token["output_ids"] == ids[:ids.index(ids[4]) + 1]


def test_stream_is_cumulative_and_ends_as_the_answer(server):
    _, client = server
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = _generate(client, text=[PROMPT, "Hello"], sampling_params=sampling, return_logprob=True,
                      logprob_start_len=0)
    with client.stream("POST", "/generate", json={"text": [PROMPT, "Hello"], "sampling_params": sampling,
                                                  "return_logprob": True, "logprob_start_len": 0,
                                                  "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert len(mine) >= 2, "one chunk for a stream of six tokens"
        for before, after in zip(mine, mine[1:]):  # every chunk extends the one before
            assert after["text"].startswith(before["text"])
            assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
            assert before["meta_info"]["finish_reason"] is None
        last = mine[-1]
        assert last["text"] == whole[index]["text"] and last["output_ids"] == whole[index]["output_ids"]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert last["meta_info"][key] == whole[index]["meta_info"][key]


def test_abort_request_ends_only_the_named_request(server):
    router, client = server
    long = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        named = pool.submit(_generate, client, text=PROMPT, rid="job-1", sampling_params=long)
        # "job-1" is a prefix of this one's rid: it must not match.
        other = pool.submit(_generate, client, text=PROMPT, rid="job-10",
                            sampling_params={**long, "max_new_tokens": 300})
        _until(lambda: router.generation.num_in_flight == 2)
        r = client.post("/abort_request", json={"rid": "job-1"})
        assert r.status_code == 200 and r.json() == {"num_aborted": 1}
        got = named.result(60)
        assert got["meta_info"]["finish_reason"]["type"] == "abort" and got["meta_info"]["id"] == "job-1"
        assert other.result(60)["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
        assert client.post("/abort_request", json={"rid": "job-1"}).json() == {"num_aborted": 0}
        # abort_all: every request in flight, OpenAI's too.
        first = pool.submit(_generate, client, text=PROMPT, sampling_params=long)
        second = pool.submit(_completion, client, PROMPT, max_tokens=900, ignore_eos=True)
        _until(lambda: router.generation.num_in_flight == 2)
        assert client.post("/abort_request", json={"abort_all": True}).json() == {"num_aborted": 2}
        assert first.result(60)["meta_info"]["finish_reason"]["type"] == "abort"
        assert second.result(60)["choices"][0]["finish_reason"] == "abort"
    r = client.post("/abort_request", json={})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]


def test_flush_cache_forgets_prefixes_and_waits_for_idle(server):
    router, client = server
    prompt = list(range(300, 300 + 4 * CHUNK))
    sampling = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    first = _generate(client, input_ids=prompt, sampling_params=sampling)
    again = _generate(client, input_ids=prompt, sampling_params=sampling)
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == first["output_ids"]
    for method, path in (("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/reset_prefix_cache")):
        r = client.request(method, path)
        assert r.status_code == 200, r.text
        after = _generate(client, input_ids=prompt, sampling_params=sampling)
        assert after["meta_info"]["cached_tokens"] == 0 and after["output_ids"] == first["output_ids"]
    # Not while a request runs (SGLang's rule): 400, and the cache is still there.
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_generate, client, text=PROMPT, rid="busy",
                              sampling_params={"max_new_tokens": 900, "ignore_eos": True})
        _until(lambda: router.generation.num_in_flight == 1)
        r = client.post("/flush_cache")
        assert r.status_code == 400 and "running" in r.json()["error"]["message"]
        client.post("/abort_request", json={"rid": "busy"})
        running.result(60)
    assert _generate(client, input_ids=prompt, sampling_params=sampling)["meta_info"]["cached_tokens"] > 0


def test_info_and_health_routes(server):
    router, client = server
    info = client.get("/get_model_info").json()
    assert info == client.get("/model_info").json()
    assert info["model_path"] == MODEL and info["is_generation"] is True and info["weight_version"] == "default"
    assert info["architectures"] == ["LlamaForCausalLM"] and info["has_image_understanding"] is False
    server_info = client.get("/get_server_info").json()
    assert server_info["context_length"] == router.max_model_len == 1024
    assert server_info["internal_states"][0]["healthy"] is True
    assert client.get("/server_info").json()["context_length"] == 1024
    assert httpx.get(str(client.base_url) + "/health_generate", timeout=60).status_code == 200  # no key needed
    _until(lambda: router.generation.num_in_flight == 0)


def test_get_load_counts_what_runs(server):
    """SGLang's /get_load (what sglang-router's power-of-two and cache-aware policies poll): idle, no request and no
    KV in use; while a long generation streams, one request holding at least its prompt's tokens in KV; once the
    client leaves (the request aborted), idle again. Behind the API key, as SGLang's."""
    router, client = server
    _until(lambda: router.generation.num_in_flight == 0)

    def load() -> dict:
        (entry,) = client.get("/get_load").json()
        return entry

    idle = load()
    assert set(idle) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"}
    assert (idle["num_reqs"], idle["num_waiting_reqs"], idle["num_tokens"]) == (0, 0, 0), idle
    num_prompt = len(router.tokenizer.encode(PROMPT))
    with client.stream("POST", "/generate", json={"text": PROMPT, "stream": True, "sampling_params": {
            "max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}) as events:
        lines = events.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        _until(lambda: load()["num_reqs"] == 1)
        busy = load()
        assert busy["num_tokens"] >= num_prompt and busy["num_waiting_reqs"] == 0, busy
    _until(lambda: router.generation.num_in_flight == 0 and load()["num_reqs"] == 0)
    assert load()["num_tokens"] == 0
    assert httpx.get(str(client.base_url) + "/get_load", timeout=10).status_code == 401


@pytest.mark.parametrize("body, param, says", [
    ({"text": PROMPT, "input_ids": [1, 2]}, "text", "exactly one of text, input_ids and input_embeds"),
    ({"sampling_params": {}}, "text", "exactly one of text, input_ids and input_embeds"),
    ({"text": PROMPT, "sampling_params": {"max_new_token": 5}}, "sampling_params.max_new_token",
     "not a sampling parameter"),
    ({"text": PROMPT, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "hot"),
    ({"text": PROMPT, "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex", "not served"),
    ({"text": PROMPT, "sampling_params": {"json_schema": "{", "regex": "a"}}, "sampling_params", "at most one"),
    ({"text": PROMPT, "sampling_params": {"json_schema": "{"}}, "sampling_params.json_schema", "not JSON"),
    ({"text": PROMPT, "input_embeds": [[0.1]]}, "text", "exactly one of text, input_ids and input_embeds"),
    ({"input_embeds": [[0.1], [0.1, 0.2]]}, "input_embeds", "a non-empty [num_tokens][hidden_size] list"),
    ({"input_embeds": [[[0.1]], []]}, "input_embeds[1]", "a non-empty [num_tokens][hidden_size] list"),
    ({"input_embeds": [[0.1] * 64]}, "prompt_embeds", "--enable-prompt-embeds"),
    ({"input_embeds": [[0.1]], "image_data": "a"}, "image_data", "holds no images"),
    ({"text": PROMPT, "video_data": "v.mp4"}, "video_data", "video is not served"),
    ({"text": PROMPT, "image_data": "data:image/png;base64,AAAA"}, "image_data", "this model takes no images"),
    ({"text": PROMPT, "image_data": [["a"]]}, "image_data", "a list of lists is for a batch"),
    ({"text": [PROMPT, PROMPT], "image_data": ["a"]}, "image_data", "1 entries for 2 prompts"),
    ({"text": PROMPT, "image_data": ""}, "image_data", "an empty string is not an image"),
    ({"text": PROMPT, "session_params": {"id": "s"}}, "session_params", "sessions"),
    ({"text": PROMPT, "return_entropy": True}, "return_entropy", "not returned"),
    ({"text": PROMPT, "extra_key": "a", "cache_salt": "b"}, "cache_salt", "not two different ones"),
    ({"text": PROMPT, "rid": ["a"]}, "rid", "a list is for a batch"),
    ({"text": PROMPT, "rid": "two words"}, "rid", "letters, digits"),
    ({"text": PROMPT, "rid": ""}, "rid", "letters, digits"),
    ({"text": [PROMPT, PROMPT], "rid": ["a", "a"]}, "rid", "the same rid"),
    ({"text": [PROMPT, PROMPT], "rid": ["a"]}, "rid", "1 values for 2 prompts"),
    ({"text": [PROMPT, PROMPT], "return_logprob": [True, False]}, "return_logprob", "separate requests"),
    ({"text": [PROMPT, PROMPT], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params", "n differs"),
    ({"input_ids": [1, 10 ** 9]}, "prompt", "out of range"),
    ({"input_ids": [5] * 1020, "sampling_params": {"max_new_tokens": 10}}, "max_tokens", "context"),
    ({"text": [PROMPT, ""]}, None, "prompt 1"),
    ({"text": PROMPT, "top_logprobs_num": -1, "return_logprob": True}, "top_logprobs_num", ">= 0"),
])
def test_refusals_name_the_field(server, body, param, says):
    _, client = server
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"], error
    if param is not None:
        assert error["param"] == param or error["message"].startswith(param), error


def test_fields_not_read_are_ignored_and_the_cache_namespace_holds(server):
    _, client = server
    sampling = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    prompt = list(range(600, 600 + 3 * CHUNK))
    plain = _generate(client, input_ids=prompt, sampling_params=sampling)
    # SGLang's routing hints and switches nothing here reads, and a field of a newer SGLang: ignored (and logged).
    hinted = _generate(client, input_ids=prompt, sampling_params=sampling, routed_dp_rank=0, session_id="s",
                       log_metrics=False, return_hidden_states=False, no_such_field=1)
    assert hinted["output_ids"] == plain["output_ids"] and hinted["meta_info"]["cached_tokens"] > 0
    # extra_key (or cache_salt): a namespace of its own in the prefix cache, the same tokens.
    salted = _generate(client, input_ids=prompt, sampling_params=sampling, extra_key="tenant-a")
    assert salted["output_ids"] == plain["output_ids"] and salted["meta_info"]["cached_tokens"] == 0
    again = _generate(client, input_ids=prompt, sampling_params=sampling, cache_salt="tenant-a")
    assert again["meta_info"]["cached_tokens"] > 0


def test_api_key_guards_the_native_routes(server):
    _, client = server
    base = str(client.base_url)
    for method, path in (("POST", "/generate"), ("POST", "/abort_request"), ("POST", "/flush_cache"),
                         ("GET", "/get_model_info"), ("GET", "/get_server_info")):
        assert httpx.request(method, base + path, json={}, timeout=60).status_code == 401, path
