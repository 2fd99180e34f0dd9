"""The OpenAI-compatible HTTP API on the real stack: LocalRouter (one colocated DecodeWorker on
tiny-random) behind a real uvicorn server on 127.0.0.1, driven by the real `openai` client.

Greedy outputs equal LLMEngine.generate token for token; seeded sampling is reproducible; concurrent
streams and client disconnects leave no block behind; every client mistake is a 4xx that says what was
wrong (and the server keeps serving); /metrics and /health say sane things; a schema-guided fuzz finds
no 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_engine
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Detokenizer
from pdcluster.node.events import Tokens

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-random"
API_KEY = "test-key-0123"
NUM_BLOCKS = 512
MAX_MODEL_LEN = 1024
MAX_BODY = 256 * 1024
PROMPTS = ["Hello world", "The capital of France is", "1, 2, 3,", "def fibonacci(n):\n    "]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}],
]


# ================================================================================== fixtures


@contextlib.contextmanager
def serving(app):
    """Run ``app`` on a real uvicorn server in a thread, on a free port of 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class Stack:
    def __init__(self, router: LocalRouter, metrics: Metrics, base_url: str):
        self.router, self.metrics, self.base_url = router, metrics, base_url
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def settled(self, timeout_s: float = 10.0) -> dict:
        """Worker stats once nothing runs, waits or holds a block (bounded wait)."""
        deadline = time.monotonic() + timeout_s
        while True:
            w = self.router.worker.stats()
            if (w["num_running"], w["num_waiting"], w["num_free_blocks"]) == (0, 0, NUM_BLOCKS) \
                    and self.router.num_open_streams == 0:
                return w
            assert time.monotonic() < deadline, f"worker did not settle within {timeout_s} s: {w}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tiny_dir):
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN),
                         request_timeout_s=30)
    metrics = Metrics(MODEL)
    app = build_app(router, MODEL, api_key=API_KEY, max_body_bytes=MAX_BODY, metrics=metrics)
    try:
        with serving(app) as base_url:
            yield Stack(router, metrics, base_url)
    finally:
        router.close()


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)


def _reference(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(**params))[0]


def _metric_samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value}"""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    want = {("model_name", MODEL), *labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


# ================================================================================== correctness


def test_completions_greedy_equal_engine(stack, engine):
    for prompt in PROMPTS:
        ref = _reference(engine, prompt, max_tokens=12, temperature=0.0)
        r = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text, prompt
        assert r.choices[0].finish_reason == ref.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

        chunks = list(stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.text, prompt
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        # A prompt of token ids is the same request.
        r = stack.client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text


def test_chat_greedy_equal_engine(stack, engine):
    for messages in CHATS:
        prompt = engine.tokenizer.apply_chat_template(messages)
        ref = _reference(engine, prompt, max_tokens=10, temperature=0.0)
        r = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.text
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
        r = stack.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 temperature=0)
        assert r.choices[0].message.content == ref.text

        chunks = list(stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                           temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_stop_strings_truncate(stack, engine):
    plain = _reference(engine, PROMPTS[1], max_tokens=16, temperature=0.0)
    words = plain.text.split()
    assert len(words) >= 4, plain.text
    stop = words[2][:3]  # a stop string that starts inside the output
    ref = _reference(engine, PROMPTS[1], max_tokens=16, temperature=0.0, stop=[stop])
    assert ref.finish_reason == "stop" and stop not in ref.text
    r = stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
    assert r.choices[0].text == plain.text[: plain.text.find(stop)]
    chunks = list(stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                                  stop=[stop, "never-appears"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    stack.settled()  # the API ends a request at its stop string: the worker must free it


def test_seeded_sampling_is_reproducible(stack, engine):
    ref = _reference(engine, PROMPTS[0], max_tokens=12, temperature=1.0, seed=1234)
    texts = [stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0,
                                             seed=1234).choices[0].text for _ in range(2)]
    streamed = "".join(c.choices[0].text for c in stack.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=1234, stream=True))
    assert texts == [ref.text, ref.text] and streamed == ref.text
    others = {stack.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0,
                                              seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(others | {ref.text}) > 1, "different seeds gave the same sample every time"


def test_detokenizer_never_splits_a_character(tiny_dir):
    from pdcluster.engine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir)
    text = "naïve café — 日本語のテキスト 🙂👍🏽 end"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids))), "no multi-token character here"
    detok = Detokenizer(tok, [])
    pieces = [detok.add([t], final=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    # A stop string is never shown, not even the part of it that arrives first.
    detok = Detokenizer(tok, ["テキスト"])
    pieces = [detok.add([t], final=False) for t in ids]
    assert "".join(pieces) == tok.decode(ids)[: tok.decode(ids).find("テキスト")]
    assert detok.hit_stop


_DETOK_TEXT = ("naïve café — 日本語のテキスト 🙂👍🏽 end. The quick brown fox jumps over the lazy dog.\n\n"
               "def f(x):\n    return x ** 2  # ünïcödé ")


def _stream(detok: Detokenizer, ids: list[int], chunk_sizes: list[int], valid_text: bool = True) -> str:
    """``ids`` fed in chunks (never final), then the final flush: the text a client saw. ``valid_text``:
    the tokens spell valid UTF-8 (random ids may not: their invalid bytes decode to U+FFFD for good)."""
    pieces, i = [], 0
    for k in chunk_sizes:
        if i >= len(ids):
            break
        pieces.append(detok.add(ids[i : i + k], final=False))
        assert not valid_text or "\ufffd" not in pieces[-1], "a stream showed half a character"
        i += k
    if i < len(ids):
        pieces.append(detok.add(ids[i:], final=False))
    return "".join(pieces) + detok.add([], final=True)


def test_detokenizer_decodes_a_bounded_window_per_token(tiny_dir):
    """One token at a time, the Detokenizer decodes a few tokens per step, not the whole output (which
    made a stream O(n^2) in the API process), and still gives decode()'s text and each token's end."""
    from pdcluster.engine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir)
    ids = tok.encode(_DETOK_TEXT * 12)
    num_decoded = []
    real_decode = tok.decode
    tok.decode = lambda token_ids, **kw: num_decoded.append(len(token_ids)) or real_decode(token_ids, **kw)
    detok = Detokenizer(tok, [])
    for t in ids:
        detok.add([t], final=False)
    tok.decode = real_decode
    assert len(ids) > 400 and sum(num_decoded) <= 8 * len(ids), (
        f"{sum(num_decoded)} tokens decoded for {len(ids)}: not incremental")
    detok.add([], final=True)
    assert detok.text == tok.decode(ids)
    ends = [len(tok.decode(ids[: i + 1]).rstrip("\ufffd")) for i in range(len(ids))]
    assert detok.token_ends == [max(ends[: i + 1]) for i in range(len(ids))]
    assert detok.token_complete == [not tok.decode(ids[: i + 1]).endswith("\ufffd") for i in range(len(ids))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detokenizer_streams_decodes_text_cut_at_the_first_stop(tiny_dir, data):
    """Any tokens (real text or random ids), any stop strings, any chunking: the streamed text is
    decode()'s text cut before its earliest stop string; the tokenizer that cleans up spaces over the
    whole text (decoded whole each time) gives the same."""
    from pdcluster.engine.tokenizer import find_stop

    tok = _detok_tokenizer(tiny_dir)
    text_ids = tok.encode(_DETOK_TEXT)
    # A start on a character boundary (a slice that starts inside one is invalid UTF-8 for good).
    start = data.draw(st.sampled_from([i for i in range(len(text_ids))
                                       if not tok.decode(text_ids[:i]).endswith("\ufffd")]))
    valid_text = data.draw(st.booleans())
    ids = (text_ids[start : start + 40] if valid_text
           else data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=30)))
    stops = data.draw(st.lists(st.sampled_from(["e", "テキ", " the", "\n\n", "👍", "é", "🏽 end", "x **"]),
                               max_size=2, unique=True))
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=len(ids)))
    whole = tok.decode(ids)
    found = find_stop(whole, stops)
    want = whole[: found[0]] if found else whole
    assert _stream(Detokenizer(tok, stops), ids, chunks, valid_text) == want
    tok.cleans_up_spaces = True  # the whole-output path
    try:
        assert _stream(Detokenizer(tok, stops), ids, chunks, valid_text) == want
    finally:
        tok.cleans_up_spaces = False


_TOKENIZERS: dict = {}


def _detok_tokenizer(model_dir):
    from pdcluster.engine.tokenizer import Tokenizer

    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = Tokenizer(model_dir)
    return _TOKENIZERS[model_dir]


# ================================================================================== load and lifecycle


def test_16_concurrent_streams_complete_and_free_everything(stack, engine):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " + "word " * (i * 3) for i in range(16)]
    refs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    start = stack.settled()

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def main():
        client = stack.async_client()
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == [ref.text for ref in refs]
    assert [r[1] for r in results] == [ref.finish_reason for ref in refs]
    end = stack.settled()
    assert end["num_free_blocks"] == start["num_free_blocks"] == NUM_BLOCKS


def test_local_router_merges_the_deltas_a_slow_consumer_left_queued(stack, engine):
    """Tokens that reach a request's stream while its consumer is busy go out as one delta (one SSE chunk), as
    vLLM's output collector merges them: a consumer that reads the first token, then reads again only after the
    engine finished the request, gets everything else in one final delta: the same tokens and logprobs in order,
    the final counts, the first token's TTFT parts kept."""
    prompt = PROMPTS[1]
    ref = _reference(engine, prompt, max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    prompt_ids = ref.prompt_token_ids
    stack.settled()

    async def run(request_id: str = "merge-1", **extra):
        stream = stack.router.generate(request_id, prompt_ids, SamplingParams(max_tokens=16, temperature=0.0,
                                                                              logprobs=2, ignore_eos=True, **extra))
        deltas = [await stream.__anext__()]
        _, queue = stack.router._streams[request_id]
        deadline = time.monotonic() + 30
        # The engine ends the request meanwhile: its events are queued, the last one finished.
        while queue.empty() or not queue._items[-1].finished:
            assert time.monotonic() < deadline, "the request did not finish on the worker"
            await asyncio.sleep(0.02)
        deltas += [d async for d in stream]
        return deltas

    deltas = asyncio.run(run())
    assert len(deltas) == 2, [len(d.new_token_ids) for d in deltas]
    first, rest = deltas
    # The first read takes what has arrived by then: the first token, or (on a loaded machine, where the engine's
    # thread ran a step before this loop read) the first few, already merged.
    num_first = len(first.new_token_ids)
    assert 1 <= num_first <= 8, num_first
    assert first.new_token_ids == ref.token_ids[:num_first] and first.ttft_breakdown.keys() >= {"queue", "prefill"}
    assert rest.new_token_ids == ref.token_ids[num_first:]
    assert [lp.token_id for lp in first.logprobs + rest.logprobs] == ref.token_ids
    assert [lp.top_token_ids for lp in first.logprobs + rest.logprobs] == [lp.top_token_ids for lp in ref.logprobs]
    assert (rest.finished, rest.finish_reason, rest.num_output_tokens) == (True, "length", 16)
    assert rest.num_prompt_tokens == len(prompt_ids) and not rest.ttft_breakdown
    stack.settled()
    # With stop strings nothing merges: the API counts a request's tokens through the delta whose text reached
    # one, which must be one step's (as offline generate and vLLM count them).
    stopped = asyncio.run(run("merge-2", stop=["never appears"]))
    assert [len(d.new_token_ids) for d in stopped] == [1] * 16
    assert [t for d in stopped for t in d.new_token_ids] == ref.token_ids
    stack.settled()


def test_local_router_deliver_pushes_each_delta_and_frees_a_failed_consumers_request(stack, engine):
    """The push form (API processes' router service): every delta reaches the callback as the engine makes it,
    deliver returns after the last; a callback that raises ends deliver with its error and the request is
    aborted on the worker (its blocks freed); cancelling deliver aborts too."""
    ref = _reference(engine, PROMPTS[0], max_tokens=12, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    stack.settled()
    got: list[TokenDelta] = []

    def broken(delta):
        if delta.new_token_ids:
            raise RuntimeError("consumer broke")

    async def run():
        await stack.router.deliver("push-1", ref.prompt_token_ids, params, got.append)
        with pytest.raises(RuntimeError, match="consumer broke"):
            await stack.router.deliver("push-2", ref.prompt_token_ids, replace(params, max_tokens=1000), broken)
        task = asyncio.ensure_future(stack.router.deliver("push-3", ref.prompt_token_ids,
                                                          replace(params, max_tokens=1000), lambda d: None))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    ended_by_length = []  # the worker's final events: an aborted request never reaches its max_tokens
    worker, listener = stack.router.worker, stack.router.worker.on_event

    def record(event):
        if isinstance(event, Tokens) and event.finished and event.finish_reason == "length":
            ended_by_length.append(event.request_id)
        listener(event)

    worker.on_event = record
    try:
        asyncio.run(run())
        stack.settled(timeout_s=30.0)
    finally:
        worker.on_event = listener
    assert [t for d in got for t in d.new_token_ids] == ref.token_ids
    assert got[-1].finished and got[-1].finish_reason == "length" and not any(d.finished for d in got[:-1])
    assert got[0].ttft_breakdown.keys() >= {"queue", "prefill"}
    assert ended_by_length == ["push-1"]  # push-2 and push-3 were aborted on the worker


def test_local_router_hands_rows_of_a_stream_under_way_to_on_row(stack, engine):
    """With ``on_row`` (the router process's frontend service), the local router hands a step's row of a stream whose
    first token went out to it as its parts, without a ``Tokens`` event or TokenDelta; the first and the last delta
    still come to ``on_delta``. Over the same prompt, what a consumer gets equals what one streamed by deltas alone
    gets, part for part and in order. A row ``on_row`` declines (False) comes to ``on_delta`` as the same delta; an
    ``on_row`` that raises ends deliver with its error and frees the request."""
    max_tokens = 10
    ref = _reference(engine, PROMPTS[1], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stack.settled()
    got: dict[str, list] = {"rows": [], "deltas": [], "declined": []}  # ("delta" | "row", parts, finished), in order

    def parts(delta: TokenDelta):
        return ("delta", (delta.new_token_ids, delta.num_output_tokens, delta.num_draft_tokens,
                          delta.num_accepted_tokens), delta.finished)

    def on_delta(rid):
        return lambda delta: got[rid].append(parts(delta))

    def on_row(rid, accept=True):
        def take(token_ids, num_output_tokens, num_draft_tokens, num_accepted_tokens):
            got[rid].append(("row", (list(token_ids), num_output_tokens, num_draft_tokens, num_accepted_tokens),
                             False))
            return accept
        return take

    def broken(*_):
        raise RuntimeError("row consumer broke")

    async def run():
        await asyncio.gather(*(stack.router.deliver(rid, ref.prompt_token_ids, params, on_delta(rid), take)
                               for rid, take in (("rows", on_row("rows")), ("deltas", None),
                                                 ("declined", on_row("declined", False)))))
        with pytest.raises(RuntimeError, match="row consumer broke"):
            await asyncio.wait_for(stack.router.deliver("row-broken", ref.prompt_token_ids,
                                                        replace(params, max_tokens=1000), lambda d: None, broken), 30)

    async def long_rows():
        # Rows keep the request's watchdog quiet, as deltas do: a stream of rows outlives request_timeout_s.
        rows: list = []
        stack.router.request_timeout_s = 0.3
        try:
            started = time.monotonic()
            await asyncio.wait_for(stack.router.deliver("row-long", ref.prompt_token_ids,
                                                        replace(params, max_tokens=1000), got["long"].append,
                                                        lambda *row: rows.append(row) or True), 60)
            return rows, time.monotonic() - started
        finally:
            stack.router.request_timeout_s = 30

    asyncio.run(run())
    got["long"] = []
    long_rows_got, long_s = asyncio.run(long_rows())
    assert got["long"][-1].finish_reason == "length", (got["long"][-1], long_s)
    assert len(long_rows_got) == 1000 - 2
    stack.settled(timeout_s=30.0)  # the broken consumer's request was aborted, its blocks freed
    as_deltas = [("delta", p, f) for _, p, f in got["rows"]]
    assert as_deltas == got["deltas"]  # the same parts, in the same order, whichever way they came
    assert [t for _, (ids, *_), _ in got["deltas"] for t in ids] == ref.token_ids
    assert [kind for kind, _, _ in got["rows"]] == ["delta"] + ["row"] * (max_tokens - 2) + ["delta"]
    assert got["deltas"][-1][2] and not any(f for _, _, f in got["deltas"][:-1])
    # Declined: each row offered, then the same delta.
    offered = [entry for entry in got["declined"] if entry[0] == "row"]
    assert offered == [entry for entry in got["rows"] if entry[0] == "row"]
    assert [entry for entry in got["declined"] if entry[0] == "delta"] == got["deltas"]


def test_merged_token_deltas_keep_order_counts_and_the_first_deltas_fields():
    from pdcluster.cluster.token_deltas import merged
    from pdcluster.wire.logprobs import TokenLogprobs

    lp = [TokenLogprobs(token_id=t, logprob=-0.5 * t, rank=1) for t in (5, 6, 7)]
    a = TokenDelta([5], num_prompt_tokens=9, num_output_tokens=1, num_cached_tokens=4, logprobs=lp[:1],
                   prompt_logprobs=[], ttft_breakdown={"queue": 0.1, "prefill": 0.2}, weight_version="step-3")
    b = TokenDelta([6, 7], num_prompt_tokens=9, num_output_tokens=3, num_draft_tokens=4, num_accepted_tokens=1,
                   num_cached_tokens=4, logprobs=lp[1:], ttft_breakdown={"kv_transfer": 0.3})
    m = merged(a, b)
    assert m.new_token_ids == [5, 6, 7] and m.logprobs == lp
    assert (m.num_prompt_tokens, m.num_output_tokens, m.num_draft_tokens, m.num_accepted_tokens,
            m.num_cached_tokens) == (9, 3, 4, 1, 4)
    assert m.prompt_logprobs == [] and m.ttft_breakdown == {"queue": 0.1, "prefill": 0.2, "kv_transfer": 0.3}
    assert m.weight_version == "step-3"  # SGLang's /generate shows it: a consumer that fell behind must not lose it
    assert not m.finished and a.new_token_ids == [5] and b.new_token_ids == [6, 7]  # inputs left as they were
    end = merged(m, TokenDelta([], finished=True, finish_reason="stop", num_output_tokens=3))
    assert (end.finished, end.finish_reason, end.new_token_ids) == (True, "stop", [5, 6, 7])


def test_client_disconnect_aborts_and_frees(stack):
    stack.settled()
    before = _metric_samples(stack.http.get("/metrics").text)
    stream = stack.client.completions.create(model=MODEL, prompt="Hello", max_tokens=1000, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    assert stack.router.worker.stats()["num_running"] == 1
    closed_at = time.monotonic()
    stream.close()
    stack.settled(timeout_s=5.0)  # 1000 tokens would take far longer: it was aborted
    assert time.monotonic() - closed_at < 5.0
    deadline = time.monotonic() + 5
    while True:  # the abort is recorded by the server once its stream task unwinds
        after = _metric_samples(stack.http.get("/metrics").text)
        aborted = _value(after, "pdcluster:request_success_total", finished_reason="abort") \
            - _value(before, "pdcluster:request_success_total", finished_reason="abort")
        if aborted == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 1
    generated = _value(after, "pdcluster:request_generation_tokens_sum") \
        - _value(before, "pdcluster:request_generation_tokens_sum")
    assert 2 <= generated < 1000


def test_request_deadline_ends_a_stuck_request(tiny_dir):
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=256), request_timeout_s=0.5)
    try:
        router.worker.stop()  # the engine thread is gone: nothing will ever arrive

        async def run():
            return [d async for d in router.generate("stuck", [1, 2, 3], SamplingParams(max_tokens=4))]

        started = time.monotonic()
        deltas = asyncio.run(run())
        assert time.monotonic() - started < 3
        assert [(d.finished, d.finish_reason) for d in deltas] == [(True, "error")]
        assert "no progress" in deltas[0].error
        assert router.num_open_streams == 0
    finally:
        router.close()


def test_local_router_watchdog_expires_only_after_silence():
    """The local router's per-request inactivity timeout (cluster/local_router.py _Watchdog): events that
    keep coming for longer than the timeout never trip it; silence does, once, about the timeout after
    the last event."""
    from pdcluster.cluster.local_router import _Watchdog

    async def scenario():
        loop = asyncio.get_running_loop()
        expired = []
        dog = _Watchdog(loop, 0.2, lambda: expired.append(loop.time()))
        started = loop.time()
        for _ in range(10):  # 0.5 s of events, 0.05 s apart
            await asyncio.sleep(0.05)
            dog.kick()
        last_kick = loop.time()
        assert not expired, f"expired {expired[0] - started:.2f} s in, while events kept coming"
        await asyncio.sleep(0.6)
        dog.cancel()
        return expired, last_kick

    expired, last_kick = asyncio.run(scenario())
    assert len(expired) == 1 and 0.19 <= expired[0] - last_kick < 0.5, (expired, last_kick)

    async def slow_consumer():
        # Events queued for a consumer that has not read them are progress: no expiry while any wait.
        loop = asyncio.get_running_loop()
        expired, pending = [], [True]
        dog = _Watchdog(loop, 0.1, lambda: expired.append(loop.time()), pending=lambda: pending[0])
        await asyncio.sleep(0.35)
        assert not expired
        pending[0] = False
        await asyncio.sleep(0.3)
        dog.cancel()
        return expired

    assert len(asyncio.run(slow_consumer())) == 1


# ================================================================================== client mistakes

_OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
_CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _without(body, key):
    return {k: v for k, v in body.items() if k != key}


BAD_REQUESTS = [
    # (path, body, status, words the message must contain)
    ("/v1/completions", _without(_OK, "model"), 400, ["model", "required"]),
    ("/v1/completions", _without(_OK, "prompt"), 400, ["prompt", "required"]),
    ("/v1/chat/completions", _without(_CHAT_OK, "messages"), 400, ["messages", "required"]),
    ("/v1/completions", {**_OK, "max_tokens": "5"}, 400, ["max_tokens", "integer", "'5'"]),
    ("/v1/completions", {**_OK, "max_tokens": 2.5}, 400, ["max_tokens", "integer"]),
    ("/v1/completions", {**_OK, "temperature": "hot"}, 400, ["temperature", "'hot'"]),
    ("/v1/completions", {**_OK, "prompt": 42}, 400, ["prompt", "42"]),
    ("/v1/completions", {**_OK, "stream": "yes"}, 400, ["stream", "boolean"]),
    ("/v1/chat/completions", {**_CHAT_OK, "messages": "hi"}, 400, ["messages", "list"]),
    ("/v1/chat/completions", {**_CHAT_OK, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     ["messages[0].role", "wizard"]),
    ("/v1/chat/completions", {**_CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, ["messages[0].content", "not supported"]),
    ("/v1/chat/completions", {**_CHAT_OK, "messages": []}, 400, ["messages is empty"]),
    ("/v1/completions", {**_OK, "max_tokens": 0}, 400, ["max_tokens", "at least 1", "got 0"]),
    ("/v1/completions", {**_OK, "max_tokens": -3}, 400, ["max_tokens", "got -3"]),
    ("/v1/completions", {**_OK, "max_tokens": 5000}, 400, ["5000", str(MAX_MODEL_LEN), "max_tokens"]),
    ("/v1/chat/completions", {**_CHAT_OK, "max_completion_tokens": 4000}, 400,
     ["max_completion_tokens", "4000", str(MAX_MODEL_LEN)]),
    ("/v1/completions", {**_OK, "prompt": [5] * 1100}, 400, ["1100 tokens", str(MAX_MODEL_LEN)]),
    ("/v1/completions", {**_OK, "prompt": [5] * 1000, "max_tokens": 100}, 400, ["1000", "100", str(MAX_MODEL_LEN)]),
    ("/v1/completions", {**_OK, "prompt": ""}, 400, ["prompt is empty"]),
    ("/v1/completions", {**_OK, "prompt": []}, 400, ["prompt is empty"]),
    ("/v1/completions", {**_OK, "prompt": ["a"] * 65}, 400, ["prompt", "at most 64 prompts", "got 65"]),
    ("/v1/completions", {**_OK, "prompt": ["a"] * 64, "n": 3}, 400, ["n", "192 choices", "128"]),
    ("/v1/completions", {**_OK, "prompt": ["a", ""]}, 400, ["prompt[1] is empty"]),
    ("/v1/completions", {**_OK, "prompt": [10**9]}, 400, ["out of range"]),
    ("/v1/completions", {**_OK, "model": "gpt-9"}, 404, ["'gpt-9'", f"'{MODEL}'"]),
    ("/v1/chat/completions", {**_CHAT_OK, "model": "gpt-9"}, 404, ["'gpt-9'", f"'{MODEL}'"]),
    ("/v1/completions", {**_OK, "n": 0}, 400, ["n", "[1, 128]", "got 0"]),
    ("/v1/completions", {**_OK, "n": 129}, 400, ["n", "[1, 128]", "got 129"]),
    ("/v1/completions", {**_OK, "logprobs": 21}, 400, ["logprobs", "[0, 20]", "got 21"]),
    ("/v1/chat/completions", {**_CHAT_OK, "top_logprobs": 3}, 400, ["top_logprobs", "logprobs=true"]),
    ("/v1/chat/completions", {**_CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, ["top_logprobs", "got 21"]),
    ("/v1/completions", {**_OK, "temperature": -1}, 400, ["temperature", ">= 0", "-1"]),
    ("/v1/completions", {**_OK, "top_p": 0}, 400, ["top_p", "(0, 1]"]),
    ("/v1/completions", {**_OK, "top_k": -5}, 400, ["top_k", "-5"]),
    ("/v1/completions", {**_OK, "stop": [""]}, 400, ["stop", "non-empty"]),
    ("/v1/completions", {**_OK, "seed": 1 << 70}, 400, ["seed", "64-bit"]),
    ("/v1/completions", [1, 2], 400, ["JSON object"]),
]


@pytest.mark.parametrize("path, body, status, words", BAD_REQUESTS,
                         ids=[f"{i}-{b[0].rsplit('/', 1)[1]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request_is_a_clear_4xx(stack, path, body, status, words):
    r = stack.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], (word, err["message"])


def test_formerly_refused_features_are_served(stack):
    """n, logprobs, chat logprobs and a batch of prompts were 400 "not supported": now they are served
    (tests/test_api_openai.py tests each in depth)."""
    r = stack.http.post("/v1/completions", json={**_OK, "n": 2}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["usage"]["completion_tokens"] == 4
    r = stack.http.post("/v1/completions", json={**_OK, "logprobs": 3}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 2
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    r = stack.http.post("/v1/chat/completions", json={**_CHAT_OK, "logprobs": True}).json()
    assert "".join(e["token"] for e in r["choices"][0]["logprobs"]["content"]) == r["choices"][0]["message"]["content"]
    r = stack.http.post("/v1/completions", json={**_OK, "prompt": ["a", "b"]}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["usage"]["prompt_tokens"] == 2


def test_malformed_bodies_and_limits(stack):
    h = {"Content-Type": "application/json"}
    r = stack.http.post("/v1/completions", content=b'{"model": "tiny-random", "prompt": ', headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = stack.http.post("/v1/completions", content=b"", headers=h)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = stack.http.post("/v1/completions", content=json.dumps({**_OK, "prompt": "x" * MAX_BODY}).encode(), headers=h)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit applies while the body streams in
        yield b'{"model": "tiny-random", "prompt": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"y" * 4096
        yield b'"}'

    r = stack.http.post("/v1/completions", content=chunked(), headers=h)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as e:  # what an openai client sees
        stack.client.completions.create(model=MODEL, prompt="x" * MAX_BODY, max_tokens=2)
    assert e.value.status_code == 413
    r = stack.http.get("/v1/no-such-thing")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = stack.http.get("/v1/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
    # ... and the server still serves.
    assert stack.http.post("/v1/completions", json=_OK).status_code == 200


def test_api_key(stack):
    anon = httpx.Client(base_url=stack.base_url, timeout=30)
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        r = anon.post("/v1/completions", json=_OK, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and "API key" in r.json()["error"]["message"]
    assert anon.get("/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert anon.get("/health").status_code == 200 and anon.get("/metrics").status_code == 200
    assert anon.get("/ping").status_code == 200 and anon.get("/version").status_code == 200
    assert anon.get(f"/v1/models/{MODEL}").status_code == 401
    assert stack.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


@contextlib.contextmanager
def _every_route_server():
    """A served app with every optional route on (LoRA loading, weight updates, trainer weights, sleep mode, load
    tracking) behind API_KEY: (app, base URL, its routes as (method, path), HEAD left out)."""
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN),
                         request_timeout_s=30)
    app = build_app(router, MODEL, api_key=API_KEY, runtime_lora=True, weight_updates=True, sleep_mode=True,
                    server_load_tracking=True)
    routes = [(method, route.path) for route in app.routes for method in sorted(getattr(route, "methods", ()))
              if method != "HEAD"]
    try:
        with serving(app) as base_url:
            yield base_url, routes
    finally:
        router.close()


def _concrete(path: str) -> str:
    return path.replace("{model_id}", MODEL).replace("{response_id}", "resp-x")


def test_every_route_needs_the_key_but_the_open_ones(tiny_dir):
    """Each route of each method of a server with every optional route on answers 401 without the key, but the
    probes and docs of OPEN_PATHS; a route added later must be put in one list or the other (the trainer-weights
    routes were once in neither: open)."""
    from pdcluster.cluster.api.middleware import OPEN_PATHS

    with _every_route_server() as (base_url, routes):
        anon = httpx.Client(base_url=base_url, timeout=30)
        assert ("POST", "/update_weights_from_distributed") in routes and ("POST", "/sleep") in routes
        for method, path in routes:
            r = anon.request(method, _concrete(path), json={})
            if path in OPEN_PATHS:
                assert r.status_code != 401, (method, path)
            else:
                assert r.status_code == 401, (method, path, r.status_code)
        assert {path for _, path in routes} >= {"/health", "/metrics", "/get_load"}


# Bodies a client may send by mistake: not JSON, JSON of the wrong shape, fields of the wrong types.
_MALFORMED_BODIES = (b"{not json", b"[1, 2]", b'"text"', b"null", json.dumps({
    "model": 5, "prompt": {}, "messages": 3, "names": "x", "text": 7, "input": [], "lora_name": 1, "model_path": 3,
    "master_port": "x", "request_ids": "a", "rid": 5, "level": "x", "tags": 3, "input_ids": "abc", "token_ids": {},
    "sampling_params": [], "query": 1, "documents": 2}).encode(), json.dumps({
    "model": MODEL, "prompt": ["a", 5], "messages": [{"role": 1}], "input": [{"x": 1}], "sampling_params": {"n": "a"},
    "text": ["a", None], "input_ids": [[1], 2], "image_data": [[1]]}).encode())


def test_every_route_answers_malformed_bodies_without_a_server_error(tiny_dir):
    """Every route of a server with every optional route on, each method, six malformed bodies: never a 5xx (a
    client's mistake is a 4xx naming it, or a route that reads no body answers as usual). The routes that stop
    generation (pause, sleep) are left out: a body they do not read would pause the server for the routes after."""
    from pdcluster.cluster.api.middleware import OPEN_PATHS

    stopping = {"/pause", "/pause_generation", "/sleep", "/release_memory_occupation"}
    with _every_route_server() as (base_url, routes):
        client = httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}",
                                                                      "Content-Type": "application/json"})
        routes = [(method, path) for method, path in routes if path not in OPEN_PATHS and path not in stopping]
        assert ("POST", "/generate") in routes and ("POST", "/init_weights_update_group") in routes
        for method, path in routes:
            for body in _MALFORMED_BODIES:
                r = client.request(method, _concrete(path), content=body)
                assert r.status_code < 500, (method, path, body[:40], r.status_code, r.text[:300])
        assert client.post("/v1/completions", json=_OK).status_code == 200  # and it still serves


def test_openai_client_errors_are_typed(stack):
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        stack.client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"n: must be in \[1, 128\], got 200"):
        stack.client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2, n=200)
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)):
        stack.client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=MAX_MODEL_LEN)
    assert stack.client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2).usage.completion_tokens


# ================================================================================== models, health, metrics


def test_models_and_health(stack):
    models = stack.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = stack.http.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["num_requests_running"] == 0 and 0 <= body["kv_cache_usage_perc"] <= 1
    # OpenAI's retrieve, vLLM's /ping (GET and POST: /health's status) and /version.
    model = stack.client.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        stack.client.models.retrieve("gpt-9")
    assert stack.http.get("/ping").status_code == stack.http.post("/ping").status_code == 200
    import importlib.metadata
    assert stack.http.get("/version").json() == {"version": importlib.metadata.version("pdcluster")}


# ================================================================================== served model names


class _WithAdapter:
    """``router`` listing one LoRA adapter: only the name checks and /v1/models read it (nothing runs on it)."""

    lora_names = ("adapter",)

    def __init__(self, router):
        self._router = router

    def __getattr__(self, name):
        return getattr(self._router, name)


def test_served_model_name_takes_several_names(stack):
    """vLLM's --served-model-name a b: a request's model may be either; /v1/models lists (and retrieves) each, the
    model as each one's root; every answer's model and the metrics' model_name are the first name, whichever one
    the request named (vLLM's model_name()); any other name is a 404 model_not_found that lists both."""
    with serving(build_app(stack.router, "a", served_model_aliases=("b",), runtime_lora=True)) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        http = httpx.Client(base_url=base_url, timeout=60)
        cards = client.models.list().data
        assert [(m.id, m.root, m.parent) for m in cards] == [("a", MODEL, None), ("b", MODEL, None)]
        assert client.models.retrieve("b").model_dump() == cards[1].model_dump()
        for name in ("a", "b"):
            completion = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=3, temperature=0)
            chat = client.chat.completions.create(model=name, messages=CHATS[0], max_tokens=3, temperature=0)
            assert completion.model == chat.model == "a"
        chunks = list(client.chat.completions.create(model="b", messages=CHATS[0], max_tokens=3, stream=True))
        assert chunks and {c.model for c in chunks} == {"a"}
        assert client.responses.create(model="b", input="Hi", max_output_tokens=3).model == "a"
        assert client.embeddings.create(model="b", input=PROMPTS[0]).model == "a"
        assert http.post("/tokenize", json={"model": "b", "prompt": "Hi"}).status_code == 200
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="c", prompt="Hi", max_tokens=2)
        assert e.value.code == "model_not_found" and "serves 'a', 'b'" in e.value.message
        for path, body in (("/v1/embeddings", {"model": "c", "input": "Hi"}),
                           ("/tokenize", {"model": "c", "prompt": "Hi"})):
            r = http.post(path, json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (path, r.text)
        assert http.get("/v1/models/c").status_code == 404
        # No adapter may take a served name: a runtime load is refused before any worker is asked.
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/nowhere"})
        assert r.status_code == 400 and "'b' is the base model's name" in r.text, r.text
        text = http.get("/metrics").text
        assert 'model_name="a"' in text and 'model_name="b"' not in text
        assert _metric_samples(text)[("pdcluster:e2e_request_latency_seconds_count",
                                      frozenset({("model_name", "a")}))] >= 6
    # An adapter's card names the first served name as its parent.
    with serving(build_app(_WithAdapter(stack.router), "a", served_model_aliases=("b",))) as base_url:
        cards = httpx.get(base_url + "/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["parent"]) for m in cards] == \
            [("a", MODEL, None), ("b", MODEL, None), ("adapter", "adapter", "a")]
    # Names that cannot all be served are refused when the app is built.
    for aliases, says in ((("a",), "'a' is given twice"), (("",), "must not be empty"),
                          (("adapter",), "'adapter' is also a LoRA adapter's name")):
        with pytest.raises(ValueError, match=says):
            build_app(_WithAdapter(stack.router), "a", served_model_aliases=aliases)


def test_metrics_after_requests(stack):
    for _ in range(2):
        stack.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    stack.metrics.observe_kv_transfer("tcp", 4096, 0.002)
    text = stack.http.get("/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "request_success_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "ttft_queue_seconds", "ttft_prefill_seconds", "ttft_kv_transfer_seconds",
                 "ttft_first_decode_seconds", "kv_transfer_bytes_total", "kv_transfer_seconds_total"):
        assert f"pdcluster:{name}" in text, name
    s = _metric_samples(text)
    n_ttft = _value(s, "pdcluster:time_to_first_token_seconds_count")
    assert n_ttft >= 2 and 0 < _value(s, "pdcluster:time_to_first_token_seconds_sum") < 30 * n_ttft
    # Colocated TTFT = queue + prefill, observed for every request that produced a token.
    assert _value(s, "pdcluster:ttft_queue_seconds_count") == _value(s, "pdcluster:ttft_prefill_seconds_count") \
        == n_ttft
    assert _value(s, "pdcluster:ttft_kv_transfer_seconds_count") == 0
    assert _value(s, "pdcluster:inter_token_latency_seconds_count") >= 14
    assert _value(s, "pdcluster:request_success_total", finished_reason="length") >= 2
    assert _value(s, "pdcluster:request_generation_tokens_sum") >= 16
    n_done = _value(s, "pdcluster:e2e_request_latency_seconds_count")
    assert _value(s, "pdcluster:request_prompt_tokens_count") == n_done >= 2
    assert _value(s, "pdcluster:num_requests_running") == 0 and _value(s, "pdcluster:num_requests_waiting") == 0
    assert 0 <= _value(s, "pdcluster:kv_cache_usage_perc") <= 1
    assert _value(s, "pdcluster:kv_transfer_bytes_total", transport="tcp") == 4096
    assert _value(s, "pdcluster:kv_transfer_seconds_total", transport="tcp") == pytest.approx(0.002)


# ================================================================================== router failures


class _FailingRouter:
    """A router whose requests fail after one token (or blow up at once), to see what clients get."""

    model_name, max_model_len = "fake", 64
    lora_names, max_images_per_prompt, mm_processor_kwargs = (), 0, ""

    def __init__(self, tokenizer, mode: str):
        self.tokenizer, self.mode, self.aborted = tokenizer, mode, []

    async def generate(self, request_id, prompt_token_ids, params):
        if self.mode == "boom":
            raise RuntimeError("secret internal detail")
        yield TokenDelta(self.tokenizer.encode(" hello"), num_prompt_tokens=len(prompt_token_ids))
        yield TokenDelta([], finished=True, finish_reason="error", error="decode worker died")

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return {"healthy": self.mode != "boom", "num_requests_running": 0}


@pytest.mark.parametrize("mode", ["fail", "boom"])
def test_router_failures_are_server_errors(tiny_dir, mode):
    from pdcluster.engine.tokenizer import Tokenizer

    router = _FailingRouter(Tokenizer(tiny_dir), mode)
    with serving(build_app(router, "fake")) as base_url:
        http = httpx.Client(base_url=base_url, timeout=30)
        r = http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 4})
        if mode == "boom":
            assert r.status_code == 500 and "secret" not in r.text and "internal" in r.json()["error"]["message"]
            assert http.get("/health").status_code == http.get("/ping").status_code == 503
            return
        assert r.status_code == 503 and "decode worker died" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="decode worker died"):
            list(client.completions.create(model="fake", prompt="hi", max_tokens=4, stream=True))
        assert http.get("/health").status_code == 200


# ================================================================================== fuzzing

_LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
_JSON = st.recursive(_LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                     max_leaves=8)
# Bounded so a valid request generates a handful of tokens; junk values still get through.
_MAX_TOKENS = st.integers(-2, 6) | st.sampled_from(["4", 2.5, True, [3], 10**6, 10**30])


def _typed(schema: dict, defs: dict, depth: int = 0):
    """Values that fit a JSON schema of the app's OpenAPI document (roughly), mixed with any JSON."""
    if "$ref" in schema:
        return _typed(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if depth > 3:
        return _LEAF
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_typed(s, defs, depth + 1) for s in schema[key]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]]) | st.text(max_size=8)
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=24) | st.sampled_from(["Hello", "user", "text", MODEL, "日本", "\n"])
    if kind == "integer":
        return st.integers(-5, 50)
    if kind == "number":
        return st.floats(-1, 3) | st.sampled_from([0.0, 1e-300, 1e300, float("inf"), float("nan")])
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(_typed(schema.get("items", {}), defs, depth + 1), max_size=3)
    if kind == "object" and "properties" in schema:
        return _object(schema, defs, depth + 1)
    return _JSON


def _object(schema: dict, defs: dict, depth: int = 0, overrides: dict | None = None):
    props = schema.get("properties", {})
    overrides = overrides or {}
    strat = {name: overrides[name] if name in overrides else _typed(sub, defs, depth) | _JSON
             for name, sub in props.items()}
    required = set(schema.get("required", []))
    return st.fixed_dictionaries({k: v for k, v in strat.items() if k in required},
                                 optional={k: v for k, v in strat.items() if k not in required})


@pytest.mark.timeout(240)
def test_fuzz_openapi_schema_no_5xx(stack):
    spec = stack.http.get("/openapi.json").json()
    defs = spec["components"]["schemas"]
    bodies = []
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = defs[ref.rsplit("/", 1)[1]]
        overrides = {"model": st.sampled_from([MODEL, MODEL, "other"]), "max_tokens": _MAX_TOKENS,
                     "max_completion_tokens": _MAX_TOKENS, "n": st.integers(-1, 4) | st.just(500)}
        # Chat without max_tokens would generate up to the context's end: keep max_tokens in every body.
        typed = _object(schema, defs, overrides=overrides).map(
            lambda b: b if "max_tokens" in b else {**b, "max_tokens": 3})
        bodies.append(st.tuples(st.just(path), typed))
    raw = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), _JSON)
    # Plausible requests with edge-case sampling values, so that many reach the engine.
    knobs = {"temperature": st.floats(0, 2) | st.sampled_from([0.0, 1e-300, 1e-6, 2.0]),
             "top_p": st.floats(1e-9, 1.0), "top_k": st.integers(-1, 100) | st.just(10**12),
             "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.text(min_size=1, max_size=4) | st.lists(
                 st.text(min_size=1, max_size=4), max_size=3), "ignore_eos": st.booleans(),
             "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
             # issue 14: penalties, bias, the vLLM extensions, n
             "presence_penalty": st.floats(-2.5, 2.5), "frequency_penalty": st.floats(-2.5, 2.5),
             "repetition_penalty": st.floats(0, 3) | st.just(1e300), "n": st.integers(0, 3),
             "logit_bias": st.dictionaries(st.integers(-1, 49160).map(str) | st.text(max_size=3),
                                           st.floats(-120, 120), max_size=3),
             "min_tokens": st.integers(-1, 8), "stop_token_ids": st.lists(st.integers(-1, 49160), max_size=3)}
    text = st.text(min_size=1, max_size=40)
    ids = st.lists(st.integers(0, 49151), min_size=1, max_size=8)
    schema = st.sampled_from([{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}},
                              {"type": "array", "items": {"type": "string"}, "maxItems": 2}, {"type": "bogus"},
                              {"$ref": "http://x"}, {"type": "string", "enum": ["x", "y"]}]) | _JSON
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"])}, optional={"parameters": schema})})
    chat_knobs = {
        **knobs, "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 21),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}])
        | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": st.just("s")}, optional={"schema": schema, "strict": st.booleans()})}),
        "tools": st.lists(tool, max_size=2), "parallel_tool_calls": st.booleans(),
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})})}
    completion_knobs = {**knobs, "logprobs": st.integers(-1, 21), "echo": st.booleans(),
                        "best_of": st.integers(0, 2), "suffix": st.sampled_from(["", "x"])}
    plausible = st.one_of(
        st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
            {"model": st.just(MODEL), "max_tokens": st.integers(0, 6),
             "prompt": text | ids | st.lists(text, min_size=1, max_size=3) | st.lists(ids, min_size=1, max_size=3)},
            optional=completion_knobs)),
        st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
            {"model": st.just(MODEL), "max_tokens": st.integers(1, 6),
             "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                         "content": text}), min_size=1, max_size=3)},
            optional=chat_knobs)),
        st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={
            "model": st.sampled_from([MODEL, "x"]), "prompt": text, "add_special_tokens": st.booleans(),
            "return_token_strs": st.booleans(), "messages": st.lists(st.fixed_dictionaries(
                {"role": st.just("user"), "content": text}), max_size=2)})),
        st.tuples(st.just("/detokenize"), st.fixed_dictionaries({"tokens": st.lists(st.integers(-1, 49160),
                                                                                     max_size=5)})),
    )
    seen = {"ok": 0}

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(*bodies, raw, plausible))
    def check(case):
        path, body = case
        # allow_nan: Python's json (and so the server) reads NaN and Infinity: they must be refused too.
        r = stack.http.post(path, content=json.dumps(body, allow_nan=True),
                            headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (path, body, r.status_code, r.text)
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text
        else:
            seen["ok"] += 1
            assert "server_error" not in r.text, (path, body, r.text)

    check()
    print(f"fuzz: {seen['ok']} of 200 bodies were served (the rest got a 4xx)")
    assert seen["ok"] > 0, "the fuzz never got past validation: it tests nothing behind it"
    assert stack.http.get("/health").status_code == 200
    assert stack.http.post("/v1/completions", json=_OK).status_code == 200
    stack.settled()


# ================================================================================== the CLI


def test_serve_flags_parse():
    import argparse

    from pdcluster.cluster.serve_cli import add_serve_parser, serve_main

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["serve"])
    assert (a.host, a.port, a.mode, a.transport, a.router_policy, a.model, a.spec) == \
        ("127.0.0.1", 8000, "auto", "tcp", "least_loaded", "smollm2", "none")
    assert a.func is serve_main and a.max_body_bytes is None  # build_app's: 1 MiB, 32 MiB for a model taking images
    a = parser.parse_args(["serve", "--host", "0.0.0.0", "--port", "9000", "--model", "tiny-random",
                           "--served-model-name", "m", "--api-key", "k", "--mode", "colocated", "--transport", "shm",
                           "--spec", "ngram", "--num-spec-tokens", "2", "--num-prefill", "2", "--num-decode", "3",
                           "--router-policy", "prefix_aware", "--address", "ray://h:10001", "--cluster-secret", "s",
                           "--request-timeout-s", "5", "--max-body-bytes", "100"])
    assert (a.port, a.served_model_name, a.num_prefill, a.num_decode, a.address, a.cluster_secret) == \
        (9000, "m", 2, 3, "ray://h:10001", "s")
    assert a.served_model_aliases == ()


def test_served_model_names_reach_the_app_and_bad_ones_are_one_line(capsys):
    """--served-model-name a b c: the first is served_model_name (what answers and metrics say), the others go to
    every API process's app (ApiOptions, pickled to them); an empty or repeated name, or an adapter's, is one line
    (status 2) before any model loads."""
    import argparse

    from pdcluster.cli.main import main
    from pdcluster.cluster.api.options import ApiOptions
    from pdcluster.cluster.serve_cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["serve", "--served-model-name", "a", "b", "c", "--port", "0"])
    assert (a.served_model_name, a.served_model_aliases) == ("a", ("b", "c"))
    assert ApiOptions.from_args(a, runtime_lora=False).app_kwargs()["served_model_aliases"] == ("b", "c")
    for names, says in ((["a", "a"], "'a' is given twice"), (["a", ""], "must not be empty"),
                        ([""], "must not be empty"), (["a", "x"], "'x' is also a LoRA adapter's name")):
        rc = main(["serve", "--mode", "local", "--model", MODEL, "--port", "0", "--lora-modules", "x=/nowhere",
                   "--served-model-name", *names])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and err.count("\n") == 1, (names, err)


def test_auto_mode_disaggregates_only_when_each_role_gets_a_device():
    from pdcluster.cluster.serve_cli import resolve_auto_mode

    assert resolve_auto_mode(None, 2, False) == "colocated"  # a 2-core box: one worker, every core
    assert resolve_auto_mode(None, 4, False) == "disagg"
    assert resolve_auto_mode(None, 2, 2) == "disagg"  # a GPU per role
    assert resolve_auto_mode(None, 64, 1) == "colocated"  # one GPU: one worker batches both phases
    assert resolve_auto_mode("ray://head:10001", 2, False) == "disagg"
    assert resolve_auto_mode(None, 8, 8, tensor_parallel_size=2) == "colocated"  # GPUs' split caches do not move yet


def test_workers_share_a_gpu_when_there_are_fewer_gpus_than_workers():
    from pdcluster.cluster.launcher import gpu_share_per_worker

    assert gpu_share_per_worker(1, 2) == 0.5  # disagg 1P + 1D on one GPU
    assert gpu_share_per_worker(1, 3) == 0.33 and 3 * gpu_share_per_worker(1, 3) <= 1
    assert gpu_share_per_worker(2, 2) == 1.0 and gpu_share_per_worker(8, 3) == 1.0
    assert gpu_share_per_worker(2, 3) == 0.66


@pytest.mark.timeout(120)
def test_serve_local_subprocess(tiny_dir):
    code = ("import argparse, sys\n"
            "from pdcluster.cluster.serve_cli import add_serve_parser\n"
            "p = argparse.ArgumentParser(); add_serve_parser(p.add_subparsers())\n"
            "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n")
    env = {**os.environ, "PDCLUSTER_API_KEY": "env-key"}
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--mode", "local", "--model", MODEL, "--port", "0",
                             "--num-kv-blocks", "64", "--max-model-len", "256"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("pdcluster serving"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(90), "".join(lines)
        line = next(x for x in lines if x.startswith("pdcluster serving"))
        m = re.fullmatch(rf"pdcluster serving {MODEL} on (http://127\.0\.0\.1:(\d+))\n", line)
        assert m and int(m.group(2)) > 0, line
        client = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="env-key", max_retries=0, timeout=30)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens >= 1
        assert httpx.get(m.group(1) + "/v1/models").status_code == 401  # the key came from the environment
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(300)
def test_serve_answers_under_every_served_model_name(tiny_dir):
    """`pdcluster serve --served-model-name a b` through the real openai client: /v1/models lists both, a completion
    naming "b" is served and answered as "a" (the first name, as vLLM), and "c" is a 404 model_not_found."""
    from pdcluster.tools.server_process import ServeProcess

    with ServeProcess(["--model", MODEL, "--mode", "local", "--num-kv-blocks", "64", "--max-model-len", "256",
                       "--served-model-name", "a", "b"]) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        completion = client.completions.create(model="b", prompt="Hello", max_tokens=3, temperature=0)
        assert completion.model == "a" and completion.usage.completion_tokens >= 1
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="c", prompt="Hello", max_tokens=3)
        assert e.value.code == "model_not_found" and "'c'" in e.value.message
