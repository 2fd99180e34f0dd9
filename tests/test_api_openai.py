"""The OpenAI surface real clients use (issue 14), at the HTTP API: logprobs, echo and scoring, n > 1,
batches of prompts, penalties and the other sampling extensions, structured output and tools, usage,
/tokenize and /detokenize, and the 400s for what is still unsupported.

Three kinds of test:
- formatting units on hand-made TokenLogprobs records (no server);
- a scripted router behind a real uvicorn server: the API's side alone (what it shows for what a
  router sends, aborts, usage), whatever the engine does;
- the real stack (LocalRouter on tiny-random, the `openai` client), with a recording wrapper that keeps
  every TokenDelta the API got and the SamplingParams it sent.

Tests that need the engine's issue-14 work (logprob values, penalties and grammars applied) say so in
their docstring ("Needs the engine: ...").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest

from conftest import make_engine
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.logprobs import Positions, TokenStrings, chat_logprobs, completion_logprobs
from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.cluster.api.structured import ToolCalls, tool_calls_from_text
from pdcluster.cluster.api.text import AlignedText
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.config import EngineConfig
from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer
from test_api import API_KEY, MAX_MODEL_LEN, MODEL, NUM_BLOCKS, PROMPTS, Stack, serving

pytestmark = pytest.mark.timeout(120)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


# ================================================================================== fixtures


class Recording:
    """A router that passes everything to ``inner`` and keeps what went through: the parameters of each
    request and every TokenDelta handed to the API (request id -> list)."""

    def __init__(self, inner):
        self.inner = inner
        self.params: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.deltas: dict[str, list[TokenDelta]] = {}
        self.aborted: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, prompt_token_ids, params):
        self.params[request_id], self.prompts[request_id] = params, list(prompt_token_ids)
        async with contextlib.aclosing(self.inner.generate(request_id, prompt_token_ids, params)) as stream:
            async for delta in stream:
                self.deltas.setdefault(request_id, []).append(delta)
                yield delta

    async def abort(self, request_id):
        self.aborted.append(request_id)
        await self.inner.abort(request_id)

    def records(self, request_id: str) -> list[TokenLogprobs]:
        return [r for d in self.deltas[request_id] for r in d.logprobs]

    def output_ids(self, request_id: str) -> list[int]:
        return [t for d in self.deltas[request_id] for t in d.new_token_ids]


@pytest.fixture(scope="module")
def stack(tiny_dir):
    local = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN),
                        request_timeout_s=30)
    recording = Recording(local)
    metrics = Metrics(MODEL)
    app = build_app(recording, MODEL, api_key=API_KEY, metrics=metrics)
    try:
        with serving(app) as base_url:
            s = Stack(local, metrics, base_url)
            s.recording = recording
            yield s
    finally:
        local.close()


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def _chunks_by_choice(chunks) -> dict[int, list]:
    out: dict[int, list] = {}
    for c in chunks:
        for ch in c.choices:
            out.setdefault(ch.index, []).append(ch)
    return out


def _stream_texts(chunks) -> dict[int, str]:
    return {i: "".join((ch.text if hasattr(ch, "text") else ch.delta.content) or "" for ch in chs)
            for i, chs in _chunks_by_choice(chunks).items()}


# ================================================================================== formatting units


def _rec(token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprobs:
    return TokenLogprobs(token_id=token_id, logprob=logprob, rank=1 + sum(lp > logprob for _, lp in top),
                         top_token_ids=[t for t, _ in top], top_logprobs=[lp for _, lp in top])


def test_completion_logprobs_layout(tok):
    strings = TokenStrings(tok)
    hello, world, comma, eos = tok.encode("Hello")[0], tok.encode(" world")[0], tok.encode(",")[0], 0
    pos = Positions(
        [hello, world, eos],
        [None, _rec(world, -0.5, [(world, -0.5), (comma, -1.5), (eos, -2.0)]),
         _rec(eos, float("-inf"), [(comma, -0.1), (world, -3.0)])],
        [0, 5, 11])
    lp = completion_logprobs(pos, 2, strings)
    assert lp["tokens"] == ["Hello", " world", "<|endoftext|>"]  # decoded alone, special tokens spelled out
    assert lp["token_logprobs"] == [None, -0.5, -9999.0]  # -inf is JSON's -9999.0, as vLLM
    assert lp["top_logprobs"][0] is None
    assert list(lp["top_logprobs"][1].items()) == [(" world", -0.5), (",", -1.5)]  # N most likely, sorted
    # The sampled token is always there, after the N most likely when it is not among them (N + 1).
    assert list(lp["top_logprobs"][2].items()) == [(",", -0.1), (" world", -3.0), ("<|endoftext|>", -9999.0)]
    assert lp["text_offset"] == [0, 5, 11]
    assert completion_logprobs(pos, 0, strings)["top_logprobs"][1] == {" world": -0.5}  # logprobs=0
    json.dumps(lp, allow_nan=False)  # no infinity reaches the wire


def test_chat_logprobs_layout(tok):
    strings = TokenStrings(tok)
    e_acute = tok.encode("é")
    world, comma = tok.encode(" world")[0], tok.encode(",")[0]
    pos = Positions([world, e_acute[0]], [_rec(world, -0.25, [(world, -0.25), (comma, -2.0), (0, -7.0)]),
                                          _rec(e_acute[0], -1.0, [(comma, -0.5), (e_acute[0], -1.0)])], [0, 6])
    lp = chat_logprobs(pos, 2, strings)
    first = lp["content"][0]
    assert (first["token"], first["logprob"], first["bytes"]) == (" world", -0.25, list(b" world"))
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [(" world", -0.25), (",", -2.0)]
    assert all(t["bytes"] == list(t["token"].encode()) for t in first["top_logprobs"])
    second = lp["content"][1]
    assert second["bytes"] == list(tok.token_bytes(e_acute[0]))
    assert [t["logprob"] for t in second["top_logprobs"]] == [-0.5, -1.0]  # exactly N, most likely first
    assert chat_logprobs(pos, 0, strings)["content"][0]["top_logprobs"] == []


def test_chat_logprobs_bytes_are_the_tokens_own_bytes(tok):
    """OpenAI's ``bytes``: joined over a text's tokens they give its UTF-8, also where a character spans
    tokens. The token decoded alone shows U+FFFD there (its ``token`` string, as vLLM); vLLM's ``bytes``
    are that U+FFFD's UTF-8, which join into something else."""
    text = "Hi \U0001F631 w\u00f6rld \u2014 \u65e5\u672c\u8a9e"
    ids = tok.encode(text)
    strings = TokenStrings(tok)
    pos = Positions(ids, [_rec(t, -1.0, [(t, -1.0)]) for t in ids], [0] * len(ids))
    content = chat_logprobs(pos, 1, strings)["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8") == text
    assert all(entry["top_logprobs"][0]["bytes"] == entry["bytes"] for entry in content)
    split = [entry for entry in content if "\ufffd" in entry["token"]]
    assert split, "the text was meant to split a character across tokens"
    assert all(entry["bytes"] != list("\ufffd".encode()) and b"\xef\xbf\xbd" not in bytes(entry["bytes"])
               for entry in split)
    # Every token of the vocabulary: special tokens are their text, the rest join back as above.
    for token_id in range(tok.vocab_size):
        raw = tok.token_bytes(token_id)
        decoded = tok.decode([token_id], skip_special_tokens=False)
        assert raw.decode("utf-8", errors="replace") == decoded, (token_id, raw, decoded)


def test_aligned_text_releases_tokens_with_their_text(tok):
    """Streamed one token at a time: a token never comes out before all of its text (its text may come
    out before it: a token ending inside a character waits for the token that completes it); all
    tokens come out once, in order, with offsets where their text starts."""
    text = "naïve café — 日本語のテキスト 🙂 end"
    ids = tok.encode(text)
    aligned = AlignedText(tok, [], track_tokens=True, base_offset=7)
    shown, released, offsets = "", [], []
    for i, t in enumerate(ids):
        piece = aligned.add([t], [], final=i == len(ids) - 1)
        shown += piece.text
        released += piece.positions.token_ids
        offsets += piece.positions.text_offsets
        assert "\ufffd" not in tok.decode(released) and shown.startswith(tok.decode(released))
    assert shown == tok.decode(ids) and released == ids
    assert offsets == [7 + len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]


def test_aligned_text_drops_tokens_cut_by_a_stop_string(tok):
    ids = tok.encode("Hello wonderful world. Bye now")
    aligned = AlignedText(tok, ["world"], track_tokens=True)
    pieces = [aligned.add([t], [_rec(t, -float(i), [])], final=False) for i, t in enumerate(ids)]
    shown = "".join(p.text for p in pieces)
    released = [t for p in pieces for t in p.positions.token_ids]
    assert shown == "Hello wonderful " and aligned.hit_stop
    # " world" straddles the cut (its space is shown): kept; "." and the rest start after it: dropped.
    assert [tok.decode([t]) for t in released] == ["Hello", " wonderful", " world"]
    assert [r.logprob for p in pieces for r in p.positions.records] == [0.0, -1.0, -2.0]


def test_tool_calls_from_text():
    named = tool_calls_from_text(ToolCalls("get_weather"), '{"city": "Paris"}')
    assert [(c["type"], c["function"]) for c in named] == [("function", {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'})]
    required = tool_calls_from_text(ToolCalls(None), '[{"name": "a", "parameters": {"x": 1}}, '
                                                     '{"name": "b", "parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in required] == \
        [("a", {"x": 1}), ("b", {})]
    assert len({c["id"] for c in required}) == 2 and all(c["id"].startswith("chatcmpl-tool-") for c in required)
    for text in ('{"city": "Par', "[]", '[{"name": "a"}]', '{"name": "a"}'):  # cut or not a call list
        assert tool_calls_from_text(ToolCalls(None), text) is None, text
    assert tool_calls_from_text(ToolCalls("f"), '{"city": "Par') is None


# ================================================================================== the API alone: a scripted router


@dataclass
class Script:
    """What the scripted router answers: ``texts[choice index]`` (by request id suffix), one token a
    delta; logprobs made up per position; ``fail``: choice indices that fail after one token;
    ``cached``: num_cached_tokens per choice index."""

    texts: dict[int, str]
    fail: tuple[int, ...] = ()
    cached: dict[int, int] | None = None
    delay_s: float | None = None  # between deltas; None: all at once, ahead of the API's reader


class ScriptedRouter:
    model_name, max_model_len = "scripted", 512
    lora_names, max_images_per_prompt, mm_processor_kwargs = (), 0, ""

    def __init__(self, tokenizer, script: Script):
        self.tokenizer, self.script = tokenizer, script
        self.aborted: list[str] = []
        self.params: dict[str, SamplingParams] = {}
        self.cancelled: list[str] = []

    @staticmethod
    def record(token_id: int, position: int, k: int) -> TokenLogprobs:
        """Position p's made-up record: logprob -(p+1)/8; top-k: ids 100.. with -(i+1)/16 and -inf last."""
        top = [(100 + i, -(i + 1) / 16) for i in range(max(k - 1, 0))] + ([(99, float("-inf"))] if k else [])
        return _rec(token_id, -(position + 1) / 8, top)

    async def generate(self, request_id, prompt_token_ids, params):
        index = int(request_id.rsplit("-", 1)[1])
        self.params[request_id] = params
        ids = self.tokenizer.encode(self.script.texts[index % len(self.script.texts)])
        prompt_lp = None
        if params.prompt_logprobs is not None:
            prompt_lp = [self.record(t, -p - 10, params.prompt_logprobs) for p, t in enumerate(prompt_token_ids[1:])]
        try:
            for p, t in enumerate(ids[: params.max_tokens]):
                if self.script.delay_s is not None:
                    await asyncio.sleep(self.script.delay_s)
                last = p == min(len(ids), params.max_tokens) - 1 and index not in self.script.fail
                lp = [self.record(t, p, params.logprobs)] if params.logprobs is not None else []
                yield TokenDelta([t], finished=last, finish_reason=("length" if last else None),
                                 num_prompt_tokens=len(prompt_token_ids), num_output_tokens=p + 1, logprobs=lp,
                                 prompt_logprobs=prompt_lp if p == 0 else None,
                                 num_cached_tokens=(self.script.cached or {}).get(index, 0))
                if index in self.script.fail:
                    await asyncio.sleep(0.05)
                    yield TokenDelta([], finished=True, finish_reason="error", error=f"choice {index} died")
                    return
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return {"healthy": True}


@contextlib.contextmanager
def scripted(tiny_dir, script: Script):
    router = ScriptedRouter(Tokenizer(tiny_dir), script)
    with serving(build_app(router, "scripted")) as base_url:
        yield router, httpx.Client(base_url=base_url, timeout=30), \
            openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)


def _sse_events(http: httpx.Client, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_logprobs_show_what_the_router_sent(tiny_dir):
    """Values, -inf, echo's prompt first (null first), offsets, and the same in a stream, chunk by chunk."""
    text = "The cat sat on the mat"
    with scripted(tiny_dir, Script({0: text})) as (router, http, client):
        tok = router.tokenizer
        ids = tok.encode(text)
        r = client.completions.create(model="scripted", prompt="Once upon", max_tokens=20, logprobs=3, echo=True)
        lp = r.choices[0].logprobs
        prompt_ids = tok.encode("Once upon")
        assert r.choices[0].text == "Once upon" + text
        assert lp.tokens == [tok.decode([t]) for t in prompt_ids + ids]
        assert lp.token_logprobs == [None] + [-(-p - 10 + 1) / 8 for p in range(len(prompt_ids) - 1)] + \
            [-(p + 1) / 8 for p in range(len(ids))]
        assert lp.top_logprobs[0] is None
        for top in lp.top_logprobs[1:]:
            values = list(top.values())
            assert values[:3] == [-1 / 16, -2 / 16, -9999.0]  # sorted, -inf floored; then the sampled token
        assert lp.text_offset == [len(tok.decode((prompt_ids + ids)[:i])) for i in range(len(prompt_ids + ids))]
        assert router.params[r.id + "-0"].prompt_logprobs == 3 and router.params[r.id + "-0"].logprobs == 3

        events = _sse_events(http, "/v1/completions", {"model": "scripted", "prompt": "Once upon",
                                                       "max_tokens": 20, "logprobs": 3, "echo": True})
        assert events[0]["choices"][0]["text"].startswith("Once upon")
        streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for e in events:
            ch = e["choices"][0]
            assert "".join(ch["logprobs"]["tokens"]) == ch["text"]  # each chunk: the tokens of its text
            for key in streamed:
                streamed[key] += ch["logprobs"][key]
        assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}

        r = client.chat.completions.create(model="scripted", messages=CHAT, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        assert [c.token for c in content] == [tok.decode([t]) for t in ids]
        assert [c.logprob for c in content] == [-(p + 1) / 8 for p in range(len(ids))]
        assert all([t.logprob for t in c.top_logprobs] == [-1 / 16, -9999.0] for c in content)


def test_scoring_with_echo_and_max_tokens_0(tiny_dir):
    with scripted(tiny_dir, Script({0: "generated words"})) as (router, http, client):
        r = client.completions.create(model="scripted", prompt="Score this prompt", max_tokens=0, echo=True,
                                      logprobs=1)
        n_prompt = len(router.tokenizer.encode("Score this prompt"))
        assert r.choices[0].text == "Score this prompt" and r.choices[0].finish_reason == "length"
        assert len(r.choices[0].logprobs.tokens) == n_prompt and r.choices[0].logprobs.token_logprobs[0] is None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 0)
        assert router.params[r.id + "-0"].max_tokens == 1  # the router generates one token, which is dropped
        events = _sse_events(http, "/v1/completions", {"model": "scripted", "prompt": "Score this prompt",
                                                       "max_tokens": 0, "echo": True})
        assert "".join(e["choices"][0]["text"] for e in events) == "Score this prompt"
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_usage_counts_each_prompt_once_and_cached_tokens(tiny_dir):
    with scripted(tiny_dir, Script({0: "a b c", 1: "d e", 2: "f", 3: "g h i j"},
                                   cached={0: 5, 1: 3, 2: 7, 3: 9})) as (router, http, client):
        r = client.completions.create(model="scripted", prompt=["one two", "three"], n=2, max_tokens=10)
        tok = router.tokenizer
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == ["a b c", "d e", "f", "g h i j"]
        assert r.usage.prompt_tokens == len(tok.encode("one two")) + len(tok.encode("three"))
        assert r.usage.completion_tokens == sum(len(tok.encode(t)) for t in ["a b c", "d e", "f", "g h i j"])
        # Per prompt, the fewest cached tokens of its choices (3 and 7), summed over prompts.
        assert r.usage.prompt_tokens_details.cached_tokens == 3 + 7
        events = _sse_events(http, "/v1/completions", {"model": "scripted", "prompt": ["one two", "three"],
                                                       "n": 2, "max_tokens": 10,
                                                       "stream_options": {"include_usage": True}})
        assert events[-1]["choices"] == [] and events[-1]["usage"] == {
            "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
            "total_tokens": r.usage.total_tokens, "prompt_tokens_details": {"cached_tokens": 3 + 7}}


def test_one_failing_choice_aborts_the_others(tiny_dir):
    long = " ".join(["word"] * 60)
    with scripted(tiny_dir, Script({0: long, 1: "short", 2: long}, fail=(1,), delay_s=0.002)) as (router, http,
                                                                                                   client):
        r = http.post("/v1/completions", json={"model": "scripted", "prompt": "hi", "n": 3, "max_tokens": 60})
        assert r.status_code == 503 and "choice 1 died" in r.json()["error"]["message"]
        rid = next(iter(router.params)).rsplit("-", 1)[0]
        assert {f"{rid}-0", f"{rid}-2"} <= set(router.aborted)  # the others did not run to their end
        router.aborted.clear()
        router.params.clear()
        with pytest.raises(openai.APIError, match="choice 1 died"):
            list(client.completions.create(model="scripted", prompt="hi", n=3, max_tokens=60, stream=True))
        rid = next(iter(router.params)).rsplit("-", 1)[0]
        deadline = time.monotonic() + 5  # the aborts land as the server's stream task unwinds
        while not {f"{rid}-0", f"{rid}-2"} <= set(router.aborted) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert {f"{rid}-0", f"{rid}-2"} <= set(router.aborted)


def test_tool_calls_in_the_response(tiny_dir):
    calls = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": ' \
            '{"zone": "CET"}}]'
    with scripted(tiny_dir, Script({0: calls})) as (router, http, client):
        r = client.chat.completions.create(model="scripted", messages=CHAT, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice="required", max_tokens=200)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
            [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"zone": "CET"})]
        spec = json.loads(router.params[r.id + "-0"].structured_output)
        assert spec["type"] == "json_schema" and spec["schema"]["type"] == "array"
        assert spec["schema"]["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
        assert spec["schema"]["items"]["anyOf"][1]["properties"]["parameters"] == TIME_TOOL["function"]["parameters"]
    with scripted(tiny_dir, Script({0: '{"city": "Rome"}'})) as (router, http, client):
        r = client.chat.completions.create(model="scripted", messages=CHAT, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
        assert json.loads(router.params[r.id + "-0"].structured_output) == {
            "type": "json_schema", "schema": WEATHER_TOOL["function"]["parameters"]}
        # tool_choice "none": the tools are ignored, the text is the answer.
        r = client.chat.completions.create(model="scripted", messages=CHAT, tools=[WEATHER_TOOL], tool_choice="none")
        assert r.choices[0].message.content == '{"city": "Rome"}' and not r.choices[0].message.tool_calls
        assert router.params[r.id + "-0"].structured_output is None
    with scripted(tiny_dir, Script({0: '{"city": "Ro'})) as (router, http, client):  # cut by max_tokens
        r = client.chat.completions.create(model="scripted", messages=CHAT, tools=[WEATHER_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert r.choices[0].message.content == '{"city": "Ro' and r.choices[0].message.tool_calls is None


# ================================================================================== the real stack: n, batches, echo


def test_n_with_seed_equals_single_requests(stack):
    """Choice j of n with seed s equals the request sent alone with seed s + j (streaming and not)."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.0)
    singles = [stack.client.completions.create(**kw, seed=500 + j) for j in range(3)]
    r = stack.client.completions.create(**kw, seed=500, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert len({s.choices[0].text for s in singles}) > 1, "three seeds gave one sample"
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert [stack.recording.params[f"{r.id}-{j}"].seed for j in range(3)] == [500, 501, 502]

    chunks = list(stack.client.completions.create(**kw, seed=500, n=3, stream=True,
                                                  stream_options={"include_usage": True}))
    assert _stream_texts(chunks) == {j: s.choices[0].text for j, s in enumerate(singles)}
    for j, chs in _chunks_by_choice(chunks).items():  # each choice ends once, with its own finish reason
        assert [c.finish_reason for c in chs][-1] == singles[j].choices[0].finish_reason
        assert all(c.finish_reason is None for c in chs[:-1])
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    chat = [stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0,
                                                 seed=77 + j).choices[0].message.content for j in range(2)]
    r = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=77, n=2)
    assert [c.message.content for c in r.choices] == chat
    chunks = list(stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0,
                                                       seed=77, n=2, stream=True))
    assert _stream_texts(chunks) == {0: chat[0], 1: chat[1]}
    assert {ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"} == {0, 1}
    stack.settled()


def test_n_computes_the_prompt_once(stack):
    """n=4: the prompt is computed once for all choices (the stat counts prompt tokens computed); each
    further choice recomputes only the tail past the last full KV block (engine/forks.py)."""
    prompt = "The history of computing is a long story of people and machines, of ideas that " * 2
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0)
    stack.settled()
    before = stack.router.worker.stats()["num_prompt_tokens_computed"]
    r = stack.client.completions.create(**kw, seed=900, n=4)  # first: nothing of this prompt is cached yet
    stack.settled()
    computed = stack.router.worker.stats()["num_prompt_tokens_computed"] - before
    num_prompt = r.usage.prompt_tokens
    singles = [stack.client.completions.create(**kw, seed=900 + j).choices[0].text for j in range(4)]
    assert [c.text for c in r.choices] == singles
    block_size = stack.router.worker.engine.config.block_size
    tail = num_prompt - block_size * ((num_prompt - 1) // block_size)
    assert num_prompt > 2 * block_size and computed == num_prompt + 3 * tail < 2 * num_prompt


def test_n_without_seed_samples_each_choice(stack):
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=3)
    assert len({c.text for c in r.choices}) > 1


def test_batch_of_prompts_equals_prompts_one_by_one(stack, tok):
    prompts = PROMPTS[:3]
    kw = dict(model=MODEL, max_tokens=6, temperature=0.8, seed=11, n=2)
    singles = [stack.client.completions.create(prompt=p, **kw) for p in prompts]
    r = stack.client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [c.text for s in singles for c in s.choices]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    by_ids = stack.client.completions.create(prompt=[tok.encode(p) for p in prompts], **kw)
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices]
    chunks = list(stack.client.completions.create(prompt=prompts, stream=True, **kw))
    assert _stream_texts(chunks) == {c.index: c.text for c in r.choices}
    stack.settled()


def test_echo_starts_with_the_prompt(stack):
    plain = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[1] + plain.choices[0].text
    assert r.usage.completion_tokens == plain.usage.completion_tokens
    chunks = list(stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                                  echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPTS[1])
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=0, echo=True)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (PROMPTS[1], "length", 0)


def test_usage_cached_tokens(stack):
    """A prompt sent again is served from the prefix cache: cached_tokens says how much."""
    prompt = "The history of the city goes back many centuries " * 8
    first = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert 0 < again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens
    chunks = list(stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_stop_string_keeps_tokens_and_text_aligned(stack):
    plain = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, logprobs=1)
    words = plain.choices[0].text.split()
    stop = words[2][:3]
    for stream in (False, True):
        res = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                              logprobs=1, stop=stop, stream=stream)
        chs = [c.choices[0] for c in res] if stream else [res.choices[0]]
        text = "".join(c.text for c in chs)
        tokens = [t for c in chs for t in c.logprobs.tokens]
        assert text == plain.choices[0].text[: plain.choices[0].text.find(stop)]
        assert chs[-1].finish_reason == "stop"
        # Every token whose text is shown, and no token wholly past the stop string.
        assert "".join(tokens).startswith(text) and not "".join(tokens[:-1]).startswith(text + stop[0])
    stack.settled()


def test_client_disconnect_aborts_every_choice(stack):
    stack.settled()
    stream = stack.client.completions.create(model=MODEL, prompt="Hello", max_tokens=500, temperature=0, n=3,
                                             stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it), next(it)
    stream.close()
    stack.settled(timeout_s=5.0)  # 3 x 500 tokens would take far longer: all three were aborted


# ================================================================================== logprob values (engine)


def test_completion_logprobs_equal_the_router_records(stack, engine):
    """Needs the engine: logprob records in every TokenDelta. The API shows the router's numbers, top-N
    sorted with the greedy token first, and they equal the offline engine's."""
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=4)
    lp, rid = r.choices[0].logprobs, r.id + "-0"
    records = stack.recording.records(rid)
    ids = stack.recording.output_ids(rid)
    assert len(records) == len(ids) == 8
    assert lp.token_logprobs == [max(rec.logprob, -9999.0) for rec in records]
    assert lp.tokens == [stack.router.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    for top, rec in zip(lp.top_logprobs, records):
        values = list(top.values())
        assert len(top) == 4 and values == sorted(values, reverse=True)
        assert values[0] == rec.logprob and rec.rank == 1  # greedy: the sampled token is the most likely
    ref = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0, logprobs=4))[0]
    assert [round(x.logprob, 4) for x in ref.logprobs] == [round(x, 4) for x in lp.token_logprobs]
    chunks = list(stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                                  logprobs=4, stream=True))
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                                              abs=1e-4)
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_chat_logprobs_equal_the_router_records(stack):
    """Needs the engine: logprob records in every TokenDelta."""
    r = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                             top_logprobs=3)
    content, records = r.choices[0].logprobs.content, stack.recording.records(r.id + "-0")
    assert len(content) == len(records) == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", errors="replace") == r.choices[0].message.content
    for c, rec in zip(content, records):
        assert c.logprob == rec.logprob <= 0 and c.bytes == list(stack.router.tokenizer.token_bytes(rec.token_id))
        assert [t.logprob for t in c.top_logprobs] == rec.top_logprobs[:3] == sorted(rec.top_logprobs[:3], reverse=True)
    chunks = list(stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                       logprobs=True, top_logprobs=3, stream=True))
    # Another run of the same prompt (now from the prefix cache): equal up to float noise.
    assert [x.logprob for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.content] == \
        pytest.approx([c.logprob for c in content], abs=1e-4)


def test_echo_prompt_logprobs(stack, engine):
    """Needs the engine: prompt logprobs on the first delta. Scoring a prompt (echo + max_tokens 0)."""
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=2)
    lp, rid = r.choices[0].logprobs, r.id + "-0"
    prompt_ids = stack.recording.prompts[rid]
    assert len(lp.tokens) == len(prompt_ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    records = stack.recording.deltas[rid][0].prompt_logprobs
    assert records is not None and len(records) == len(prompt_ids) - 1
    assert lp.token_logprobs[1:] == [rec.logprob for rec in records]
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    ref = engine.generate([prompt_ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert [round(x.logprob, 4) for x in ref.prompt_logprobs] == [round(x, 4) for x in lp.token_logprobs[1:]]


# ================================================================================== sampling extensions


def test_sampling_fields_reach_the_router(stack, tok):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": -1.5,
            "repetition_penalty": 1.3, "logit_bias": {"42": 5, "7": -100}, "min_tokens": 2, "stop_token_ids": [13],
            "ignore_eos": True, "seed": 9}
    r = stack.http.post("/v1/completions", json=body).json()
    p = stack.recording.params[r["id"] + "-0"]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.stop_token_ids,
            p.ignore_eos, p.seed) == (0.5, -1.5, 1.3, 2, [13], True, 9)
    assert sorted(p.logit_bias) == [[7, -100.0], [42, 5.0]]
    r = stack.http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3,
                                                      "logprobs": True, "top_logprobs": 5}).json()
    assert stack.recording.params[r["id"] + "-0"].logprobs == 5
    r = stack.http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3,
                                                      "response_format": {"type": "json_object"}}).json()
    assert json.loads(stack.recording.params[r["id"] + "-0"].structured_output) == {"type": "json_object"}


def test_logit_bias_and_min_tokens_apply(stack, engine, tok):
    """Needs the engine: logit_bias and min_tokens applied."""
    target = tok.encode(" Paris")[0]
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                        logit_bias={str(target): 100})
    assert stack.recording.output_ids(r.id + "-0") == [target] * 5
    plain = stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    first = stack.recording.output_ids(plain.id + "-0")[0]
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                        logit_bias={str(first): -100})
    assert stack.recording.output_ids(r.id + "-0")[0] != first
    eos = tok.stop_token_ids[0]
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                        logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    ids = stack.recording.output_ids(r.id + "-0")
    assert r.choices[0].finish_reason == "stop" and len(ids) == 5 and ids[-1] == eos and eos not in ids[:4]


def test_penalties_equal_the_offline_engine_and_act(stack, engine, tok):
    """Needs the engine: penalties applied. tiny-random hardly ever repeats a token, so a logit bias
    makes it repeat one (A); the penalties must then push A back, and the API's output equals the
    offline engine's with the same parameters."""
    prompt = "one two three"
    plain = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    a = plain.token_ids[1]
    bias = {"logit_bias": {str(a): 30.0}}
    counts = {}
    for name, kw in [("bias", {}), ("frequency", dict(frequency_penalty=2.0)),
                     ("repetition", dict(repetition_penalty=2.0)), ("presence", dict(presence_penalty=1.0)),
                     ("negative", dict(frequency_penalty=-1.0))]:
        ref = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, logit_bias=[[a, 30.0]],
                                                       **kw))[0]
        body = {k: v for k, v in kw.items() if k != "repetition_penalty"}
        r = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, **body,
                                            extra_body={**bias, **{k: v for k, v in kw.items()
                                                                   if k == "repetition_penalty"}})
        assert r.choices[0].text == ref.text, name
        counts[name] = stack.recording.output_ids(r.id + "-0").count(a)
    assert counts["bias"] >= 8, counts  # the bias makes A the usual choice ...
    assert counts["frequency"] < counts["bias"] and counts["repetition"] < counts["bias"], counts  # ... these fight it
    assert counts["negative"] > counts["bias"], counts


def test_stop_token_ids_end_the_output(stack, engine):
    plain = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    i = next(i for i in range(2, 12) if plain.token_ids[i] not in plain.token_ids[:i])
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [plain.token_ids[i]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == i + 1
    assert stack.recording.output_ids(r.id + "-0") == plain.token_ids[: i + 1]


# ================================================================================== structured output (engine)


def test_json_schema_output_validates(stack):
    """Needs the engine: grammars applied (engine/structured_output.py)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    r = stack.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=1.0, seed=3, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    r = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                             response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_forced_tool_calls_parse(stack):
    """Needs the engine: grammars applied. The model is random: only the grammar makes these calls."""
    r = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0,
                                             tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    r = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0,
                                             tools=[WEATHER_TOOL, TIME_TOOL],
                                             tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])


# ================================================================================== /tokenize, /detokenize


def test_tokenize_detokenize_round_trip(stack, tok):
    r = stack.http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world, naïve café"}).json()
    assert r["tokens"] == tok.encode("Hello world, naïve café", add_special_tokens=True)
    assert (r["count"], r["max_model_len"], r["token_strs"]) == (len(r["tokens"]), MAX_MODEL_LEN, None)
    back = stack.http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world, naïve café"}
    r = stack.http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    # Messages count as chat completions count them.
    chat = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    r = stack.http.post("/tokenize", json={"messages": CHAT}).json()
    assert r["count"] == chat.usage.prompt_tokens
    assert stack.http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"].startswith("<|im_start|>")
    anon = httpx.Client(base_url=stack.base_url, timeout=30)
    assert anon.post("/tokenize", json={"prompt": "hi"}).status_code == 401  # behind the API key, as /v1


# ================================================================================== what is refused

def _deep(levels: int) -> dict:
    """A schema nested ``levels`` deep in "properties" (compiling such grows fast with the depth)."""
    schema: dict = {"type": "object"}
    for _ in range(levels // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


_C = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
_CHAT = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
_NAMED = {"type": "function", "function": {"name": "get_weather"}}

REFUSED = [
    # (path, body, status, param, words the message must contain)
    ("/v1/completions", {**_C, "presence_penalty": 2.5}, 400, "presence_penalty", ["[-2, 2]", "2.5"]),
    ("/v1/completions", {**_C, "frequency_penalty": -3}, 400, "frequency_penalty", ["[-2, 2]", "-3"]),
    ("/v1/completions", {**_C, "repetition_penalty": 0}, 400, "repetition_penalty", ["> 0", "0"]),
    ("/v1/completions", {**_C, "logit_bias": {"abc": 1}}, 400, "logit_bias", ["token ids", "'abc'"]),
    ("/v1/completions", {**_C, "logit_bias": {"99999999": 1}}, 400, "logit_bias", ["99999999", "49152"]),
    ("/v1/completions", {**_C, "logit_bias": {"5": 101}}, 400, "logit_bias", ["[-100, 100]", "101"]),
    ("/v1/completions", {**_C, "min_tokens": 3}, 400, "min_tokens", ["max_tokens=2", "got 3"]),
    ("/v1/completions", {**_C, "stop_token_ids": [1, 10**6]}, 400, "stop_token_ids", ["1000000", "range"]),
    ("/v1/completions", {**_C, "max_tokens": 0}, 400, "max_tokens", ["at least 1", "echo"]),
    ("/v1/completions", {**_C, "logprobs": -1}, 400, "logprobs", ["[0, 20]", "-1"]),
    ("/v1/completions", {**_C, "best_of": 2}, 400, "best_of", ["best_of=1", "got 2"]),
    ("/v1/completions", {**_C, "suffix": "end"}, 400, "suffix", ["not supported"]),
    ("/v1/completions", {**_C, "seed": 2**63 - 2, "n": 3}, 400, "seed", ["n=3", "64-bit"]),
    ("/v1/completions", {**_C, "prompt": [[1, 2], [10**7]]}, 400, "prompt", ["prompt[1]", "out of range"]),
    # tool_choice "auto" (the default with tools) and streaming with tools are served now: tests/test_tool_calls.py
    # (which also checks the 400 for "auto" on a model without a known tool-call format).
    ("/v1/chat/completions", {**_CHAT, "tool_choice": "required"}, 400, "tool_choice", ["needs tools"]),
    ("/v1/chat/completions", {**_CHAT, "tools": [WEATHER_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice.function.name",
     ["'nope'", "get_weather"]),
    ("/v1/chat/completions", {**_CHAT, "tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"}, 400,
     "tools", ["unique", "get_weather"]),
    ("/v1/chat/completions", {**_CHAT, "tools": [WEATHER_TOOL], "tool_choice": _NAMED,
                              "response_format": {"type": "json_object"}}, 400, "response_format", ["one of them"]),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type", ["'yaml'"]),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", ["schema"]),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "uniqueItems": True}}}}, 400, "response_format", ["uniqueItems"]),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": _deep(100)}}}, 400, "response_format.json_schema.schema", ["64 levels"]),
    ("/v1/chat/completions", {**_CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": _deep(100)}}], "tool_choice": "required"}, 400, "tools[0].function.parameters",
     ["64 levels"]),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]}, 400, "messages[0].content", ["audio", "not supported"]),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", ["exactly one"]),
    ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model", ["'gpt-9'"]),
    ("/detokenize", {"tokens": [1, -5]}, 400, "tokens", ["-5", "range"]),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", ["list of token ids"]),
]


@pytest.mark.parametrize("path, body, status, param, words", REFUSED,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(REFUSED)])
def test_refused_with_the_field_named(stack, path, body, status, param, words):
    r = stack.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"], err
    for word in words:
        assert word in err["message"], (word, err["message"])
