"""vLLM's request extensions at the HTTP API (what vLLM users send in ``extra_body``): each is served with
vLLM's meaning or refused with a 400 naming it; none is silently dropped (a field nothing reads is logged).

The real stack: a LocalRouter on tiny-random behind a real uvicorn server, the `openai` client, and a
recording router that keeps the SamplingParams and prompt ids the API sent and every token it got back.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import jsonschema
import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.tool_parsers import HermesParser
from pdcluster.cluster.api.validation import chat_prompt_text
from pdcluster.cluster.api.protocol import ChatMessage
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer
from test_api import API_KEY, MODEL, Stack, serving
from test_api_openai import engine, stack  # noqa: F401 - fixtures: the engine; LocalRouter on tiny-random, recording, real server

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def _complete(stack, prompt=PROMPT, **extra):
    plain = {k: extra.pop(k) for k in ("max_tokens", "temperature", "seed", "stop", "n") if k in extra}
    plain.setdefault("max_tokens", 12)
    plain.setdefault("temperature", 0.0)
    return stack.client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **plain)


def _bad_request(fn, *words):
    with pytest.raises(openai.BadRequestError) as err:
        fn()
    message = err.value.body["message"] if isinstance(err.value.body, dict) else str(err.value)
    for w in words:
        assert w in message, message
    return message


def _last_request(stack):
    rid = list(stack.recording.params)[-1]
    return rid, stack.recording.params[rid]


# ================================================================================== structured output


@pytest.mark.parametrize("form", ["guided_choice", "structured_outputs"])
def test_choice(stack, form):
    choices = ["yes", "no", "maybe \"so\""]
    body = {"guided_choice": choices} if form == "guided_choice" else {"structured_outputs": {"choice": choices}}
    for seed in range(4):
        r = _complete(stack, temperature=1.0, seed=seed, max_tokens=16, **body)
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("form", ["guided_regex", "structured_outputs"])
def test_regex(stack, form):
    pattern = r"[0-9]{3}-[a-z]{2}"
    body = {"guided_regex": pattern} if form == "guided_regex" else {"structured_outputs": {"regex": pattern}}
    for seed in range(3):
        assert re.fullmatch(pattern, _complete(stack, temperature=1.0, seed=seed, max_tokens=16, **body).choices[0].text)


@pytest.mark.parametrize("body", [{"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                                  {"structured_outputs": {"json": SCHEMA}}])
def test_json_schema(stack, body):
    text = _complete(stack, temperature=1.0, seed=1, max_tokens=40, **body).choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(stack):
    # A random model's keys run long: the answers that end (finish_reason "stop") are whole JSON objects.
    done = [r.choices[0].text for r in (_complete(stack, temperature=1.0, seed=s, max_tokens=100,
                                                  structured_outputs={"json_object": True}) for s in range(4))
            if r.choices[0].finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)


@pytest.mark.parametrize("form", ["guided_grammar", "structured_outputs"])
def test_grammar(stack, form):
    grammar = 'root ::= ("yes" | "no") "!" [0-9]'
    body = {"guided_grammar": grammar} if form == "guided_grammar" else {"structured_outputs": {"grammar": grammar}}
    for seed in range(3):
        assert re.fullmatch(r"(yes|no)![0-9]", _complete(stack, temperature=1.0, seed=seed, **body).choices[0].text)


def test_chat_guided_choice(stack):
    r = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yes or no?"}],
                                             max_tokens=8, temperature=0, extra_body={"guided_choice": ["Yes", "No"]})
    assert r.choices[0].message.content in ("Yes", "No")


def test_structured_refusals(stack):
    _bad_request(lambda: _complete(stack, guided_choice=["a"], guided_regex="b"), "guided_regex", "guided_choice")
    _bad_request(lambda: _complete(stack, guided_json=SCHEMA, response_format={"type": "json_object"}),
                 "guided_json", "response_format")
    _bad_request(lambda: _complete(stack, structured_outputs={"choice": ["a"], "regex": "b"}),
                 "structured_outputs", "one constraint")
    _bad_request(lambda: _complete(stack, guided_grammar="root ::= foo"), "guided_grammar", "not defined")
    _bad_request(lambda: _complete(stack, guided_choice=[]), "guided_choice", "non-empty")
    _bad_request(lambda: _complete(stack, guided_choice=["a", ""]), "guided_choice")
    _bad_request(lambda: _complete(stack, guided_json="{not json"), "guided_json", "JSON")
    _bad_request(lambda: _complete(stack, guided_whitespace_pattern=r"\s*"), "guided_whitespace_pattern")
    _bad_request(lambda: _complete(stack, structured_outputs={"structural_tag": "{}"}), "structural_tag")
    # The backend is xgrammar whatever is asked for: accepted.
    assert _complete(stack, guided_choice=["ok"], guided_decoding_backend="outlines").choices[0].text == "ok"


# ================================================================================== sampling


def test_min_p_one_keeps_only_the_most_likely(stack):
    """min_p 1: only tokens as likely as the best survive, so a sampled request gives the greedy tokens;
    without it the same seeds sample other tokens (tiny-random's distributions are flat)."""
    greedy = _complete(stack, max_tokens=10).choices[0].text
    for seed in range(3):
        assert _complete(stack, temperature=1.0, seed=seed, max_tokens=10, min_p=1.0).choices[0].text == greedy
        assert _last_request(stack)[1].min_p == 1.0
    assert any(_complete(stack, temperature=1.0, seed=s, max_tokens=10).choices[0].text != greedy for s in range(3))


def test_allowed_token_ids(stack, tok):
    allowed = [tok.encode(w)[0] for w in (" a", " b", " c", ",")]
    r = _complete(stack, temperature=1.0, seed=3, max_tokens=10, allowed_token_ids=allowed, ignore_eos=True)
    rid, params = _last_request(stack)
    assert params.allowed_token_ids == allowed
    out = stack.recording.output_ids(rid)
    assert len(out) == 10 and set(out) <= set(allowed), out
    assert r.usage.completion_tokens == 10


def test_bad_words(stack, tok):
    """vLLM's rule: a word is banned as it starts the text and, where that gives as many tokens, after a space.
    A token of the greedy output that is such a word never appears once the word is banned."""
    _complete(stack, max_tokens=12)
    base_ids = stack.recording.output_ids(_last_request(stack)[0])

    def variants(word):
        plain, spaced = tok.encode(word), tok.encode(" " + word)
        return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])

    token = next(t for t in base_ids if tok.decode([t]).strip() and [t] in variants(tok.decode([t]).strip()))
    word = tok.decode([token]).strip()
    _complete(stack, max_tokens=12, bad_words=[word])
    rid, params = _last_request(stack)
    assert params.bad_words_token_ids == variants(word)
    out = stack.recording.output_ids(rid)
    assert token not in out and out != base_ids
    for seq in params.bad_words_token_ids:
        assert not any(out[i : i + len(seq)] == seq for i in range(len(out))), (seq, out)


def test_skip_special_tokens(stack, tok):
    eos = tok.eos_token_id
    body = dict(max_tokens=3, allowed_token_ids=[eos], ignore_eos=True)
    assert _complete(stack, **body).choices[0].text == ""
    assert _complete(stack, skip_special_tokens=False, **body).choices[0].text == tok.id_to_token(eos) * 3


def test_include_stop_str_in_output(stack):
    full = _complete(stack, max_tokens=16).choices[0].text
    stop = full[6:9]
    assert stop and full.find(stop) == 6
    assert _complete(stack, max_tokens=16, stop=[stop]).choices[0].text == full[:6]
    assert _complete(stack, max_tokens=16, stop=[stop], include_stop_str_in_output=True).choices[0].text == full[:9]
    for chunk_text in ("".join(c.choices[0].text for c in stack.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True,
            extra_body={"include_stop_str_in_output": True})),):
        assert chunk_text == full[:9]


def test_truncate_prompt_tokens(stack, tok):
    ids = tok.encode(PROMPT)
    r = _complete(stack, truncate_prompt_tokens=3)
    rid = _last_request(stack)[0]
    assert stack.recording.prompts[rid] == ids[-3:] and r.usage.prompt_tokens == 3
    assert r.choices[0].text == _complete(stack, prompt=ids[-3:]).choices[0].text
    _complete(stack, truncate_prompt_tokens=-1)  # max_model_len: the whole prompt
    assert stack.recording.prompts[_last_request(stack)[0]] == ids
    _bad_request(lambda: _complete(stack, truncate_prompt_tokens=0), "truncate_prompt_tokens")
    # vLLM's truncation_side: "right" keeps the first k tokens ("left", the default, the last k); echo shows them.
    r = _complete(stack, truncate_prompt_tokens=3, truncation_side="right", echo=True, max_tokens=1)
    assert stack.recording.prompts[_last_request(stack)[0]] == ids[:3] and r.usage.prompt_tokens == 3
    assert r.choices[0].text.startswith(tok.decode(ids[:3]))
    _complete(stack, truncate_prompt_tokens=3, truncation_side="left")
    assert stack.recording.prompts[_last_request(stack)[0]] == ids[-3:]
    _bad_request(lambda: _complete(stack, truncate_prompt_tokens=3, truncation_side="middle"), "truncation_side")


def test_cache_salt_separates_prefix_cache(stack):
    prompt = "Salted prompt " + "one two three four five six seven eight nine ten " * 6  # several blocks

    def cached(**extra):
        return _complete(stack, prompt=prompt, max_tokens=2, **extra).usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 16  # the same salt hits
    assert cached(cache_salt="tenant-b") == 0  # another salt does not
    assert cached() == 0  # nor no salt
    assert cached() > 16
    assert _last_request(stack)[1].cache_salt is None


def test_sampling_refusals(stack):
    _bad_request(lambda: _complete(stack, min_p=1.5), "min_p")
    _bad_request(lambda: _complete(stack, allowed_token_ids=[]), "allowed_token_ids")
    _bad_request(lambda: _complete(stack, allowed_token_ids=[10**9]), "allowed_token_ids", "out of range")
    _bad_request(lambda: _complete(stack, bad_words=["  "]), "bad_words")
    _bad_request(lambda: _complete(stack, cache_salt=""), "cache_salt")


@pytest.mark.parametrize("field,value", [
    ("length_penalty", 2.0), ("logits_processors", ["x"]), ("spaces_between_special_tokens", False)])
def test_fields_served_only_at_defaults(stack, field, value):
    _bad_request(lambda: _complete(stack, **{field: value}), field, "only")
    _complete(stack, max_tokens=2, **{field: {"use_beam_search": False, "length_penalty": 1.0,
                                              "logits_processors": None,
                                              "spaces_between_special_tokens": True}[field]})


def test_chat_fields_served_only_at_defaults(stack):
    def chat(**extra):
        return stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=2, extra_body=extra)

    for field, value in (("chat_template", "{{ messages }}"),):
        _bad_request(lambda: chat(**{field: value}), field)
    _bad_request(lambda: chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "messages")
    with_special = chat(add_special_tokens=True).usage.prompt_tokens
    assert with_special >= chat().usage.prompt_tokens


def test_continue_final_message_continues_the_assistants_reply(stack, tiny_dir, engine):
    """vLLM's continue_final_message: the prompt stops right after the final (assistant) message's text, as
    transformers renders it, and the reply is the model's continuation of that text; /tokenize gives the same ids.
    Refused in one line with add_generation_prompt, or a final message with no text."""
    from transformers import AutoTokenizer

    started = "The capital of France is"
    messages = [{"role": "user", "content": "Where is Paris?"}, {"role": "assistant", "content": started}]
    want_text = AutoTokenizer.from_pretrained(tiny_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert want_text.endswith(started)  # no end of turn after the reply begun
    want_ids = Tokenizer(tiny_dir).encode(want_text)
    r = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                             extra_body={"continue_final_message": True,
                                                         "add_generation_prompt": False})
    assert stack.recording.prompts[_last_request(stack)[0]] == want_ids
    greedy = engine.generate([want_ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert r.choices[0].message.content == greedy.text and r.usage.prompt_tokens == len(want_ids)
    tokenized = stack.http.post("/tokenize", json={"messages": messages, "continue_final_message": True,
                                                   "add_generation_prompt": False}).json()
    assert tokenized["tokens"] == want_ids
    # Without it the same chat ends the assistant's turn: a different prompt.
    plain = stack.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert plain["tokens"] != want_ids and plain["tokens"][:len(want_ids)] == want_ids

    def chat(msgs, **extra):
        return stack.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                                    extra_body={"continue_final_message": True, **extra})

    _bad_request(lambda: chat(messages), "continue_final_message", "add_generation_prompt")
    _bad_request(lambda: chat([*messages[:1], {"role": "assistant", "content": ""}], add_generation_prompt=False),
                 "continue_final_message", "no text")
    r = stack.http.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"], r.text


def test_chat_echo_shows_the_reply_the_client_began(stack):
    """vLLM's chat echo: the final assistant message's text comes before the reply's content (with
    continue_final_message, the whole reply), whole and streamed (with the role); a chat ending with the user's turn
    echoes nothing."""
    started = "The capital of France is"
    messages = [{"role": "user", "content": "Where is Paris?"}, {"role": "assistant", "content": started}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 extra_body=extra).choices[0].message.content
    echoed = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                  extra_body={**extra, "echo": True}).choices[0].message.content
    assert echoed == started + plain
    chunks = list(stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                       stream=True, extra_body={**extra, "echo": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == started
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    user_last = [{"role": "user", "content": "Hi"}]
    assert (stack.client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=4, temperature=0,
                                                 extra_body={"echo": True}).choices[0].message.content
            == stack.client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=4,
                                                    temperature=0).choices[0].message.content)


def test_client_request_id_names_the_response_and_the_router_request(stack):
    """vLLM's request_id (an X-Request-Id header wins): the response's id is "<kind>-<client id>", streamed chunks
    too, and the router's request id starts with it (so every worker's log names the client's id); two requests
    with one client id both run, each under an id of its own. An id that is not 1-128 safe characters is a 400."""
    import concurrent.futures

    r = _complete(stack, max_tokens=2, request_id="trace-7")
    assert r.id == "cmpl-trace-7" and _last_request(stack)[0].startswith("cmpl-trace-7-")
    chat = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, extra_body={"request_id": "trace-8"},
                                                extra_headers={"X-Request-Id": "from-header"})
    assert chat.id == "chatcmpl-from-header" and _last_request(stack)[0].startswith("chatcmpl-from-header-")
    chunks = list(stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                                  extra_body={"request_id": "streamed"}))
    assert chunks and {c.id for c in chunks} == {"cmpl-streamed"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        twins = list(pool.map(lambda _: _complete(stack, max_tokens=4, request_id="twin"), range(2)))
    assert [t.id for t in twins] == ["cmpl-twin", "cmpl-twin"] and twins[0].choices[0].text == twins[1].choices[0].text
    assert len([rid for rid in stack.recording.params if rid.startswith("cmpl-twin-")]) == 2
    assert _complete(stack, max_tokens=1).id.startswith("cmpl-")  # without one: an id of the server's
    _bad_request(lambda: _complete(stack, max_tokens=1, request_id="has space"), "request_id", "1-128")
    _bad_request(lambda: _complete(stack, max_tokens=1, request_id="x" * 129), "request_id")
    _bad_request(lambda: stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                                         extra_headers={"X-Request-Id": "a/b"}), "X-Request-Id")


def test_unknown_fields_are_logged(stack, caplog):
    with caplog.at_level(logging.WARNING, logger="pdcluster.cluster.api.validation"):
        _complete(stack, max_tokens=2, frobnicate=3, top_a=0.5)
    assert any("frobnicate" in r.getMessage() and "top_a" in r.getMessage() for r in caplog.records)


# ================================================================================== vLLM's prompt_logprobs


def _reference_prompt_logprobs(engine, prompt_ids, k):
    """The engine's own prompt records, straight from LLMEngine.generate (no API in between)."""
    return engine.generate([prompt_ids], SamplingParams(max_tokens=1, prompt_logprobs=k))[0].prompt_logprobs


def _check_vllm_layout(entries, prompt_ids, records, k, tok):
    """vLLM's layout: None, then {token_id: {logprob, rank, decoded_token}} with the prompt token first
    and the k most likely (ranks 1..k), numbers equal to the engine's records."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for entry, token_id, rec in zip(entries[1:], prompt_ids[1:], records):
        ids = [int(t) for t in entry]  # JSON keys are strings
        assert ids[0] == token_id == rec.token_id
        top = rec.top_token_ids[:k]
        assert ids[1:] == [t for t in top if t != token_id], (ids, top)  # at most k alternatives
        first = entry[str(token_id)]
        assert first["logprob"] == pytest.approx(rec.logprob, abs=1e-4) and first["rank"] == rec.rank >= 1
        assert first["decoded_token"] == tok.decode([token_id], skip_special_tokens=False)
        for rank, (t, lp) in enumerate(zip(top, rec.top_logprobs), start=1):
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
        assert (str(token_id) in {str(t) for t in top}) == (rec.rank <= k)


def test_prompt_logprobs_completions(stack, engine, tok):
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
    r = _complete(stack, prompt=[PROMPT, long_prompt], max_tokens=1, n=2, prompt_logprobs=3)
    assert len(r.choices) == 4
    for choice in r.choices:
        prompt_ids = stack.recording.prompts[f"{r.id}-{choice.index}"]
        refs = _reference_prompt_logprobs(engine, prompt_ids, 3)
        _check_vllm_layout(choice.prompt_logprobs, prompt_ids, refs, 3, tok)
    assert len(r.choices[2].prompt_logprobs) > 48  # the long prompt's choices have its positions
    # A second time (the prompt's KV now cached): every position still has its numbers (no cache for them).
    again = _complete(stack, prompt=long_prompt, max_tokens=1, prompt_logprobs=0)
    first = [next(iter(e.items())) for e in r.choices[2].prompt_logprobs[1:]]
    assert [list(e.items()) for e in again.choices[0].prompt_logprobs[1:]] == \
        [[(t, {**v, "logprob": pytest.approx(v["logprob"], abs=1e-4)})] for t, v in first]
    plain = _complete(stack, max_tokens=1)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None


def test_prompt_logprobs_with_echo_cut_each_view(stack, engine, tok):
    """echo + logprobs=1 and prompt_logprobs=4: the engine computes 4 alternatives once; each view shows its own."""
    r = _complete(stack, max_tokens=1, echo=True, logprobs=1, prompt_logprobs=4)
    rid, params = _last_request(stack)
    assert params.prompt_logprobs == 4 and params.logprobs == 1
    prompt_ids = stack.recording.prompts[rid]
    _check_vllm_layout(r.choices[0].prompt_logprobs, prompt_ids, _reference_prompt_logprobs(engine, prompt_ids, 4),
                       4, tok)
    assert all(top is None or len(top) <= 2 for top in r.choices[0].logprobs.top_logprobs)
    # The other way round: echo's 5 alternatives computed, prompt_logprobs shows 2.
    r = _complete(stack, max_tokens=1, echo=True, logprobs=5, prompt_logprobs=2)
    assert _last_request(stack)[1].prompt_logprobs == 5
    _check_vllm_layout(r.choices[0].prompt_logprobs, prompt_ids, _reference_prompt_logprobs(engine, prompt_ids, 5),
                       2, tok)
    assert max(len(top) for top in r.choices[0].logprobs.top_logprobs[1:]) >= 5


def test_prompt_logprobs_chat(stack, engine, tok):
    r = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                             max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    rid, _ = _last_request(stack)
    prompt_ids = stack.recording.prompts[rid]
    assert len(prompt_ids) == r.usage.prompt_tokens
    _check_vllm_layout(r.prompt_logprobs, prompt_ids, _reference_prompt_logprobs(engine, prompt_ids, 1), 1, tok)


def test_prompt_logprobs_refusals(stack):
    _bad_request(lambda: _complete(stack, prompt_logprobs=-1), "prompt_logprobs", "whole vocabulary")
    _bad_request(lambda: _complete(stack, prompt_logprobs=21), "prompt_logprobs", "[0, 20]")
    _bad_request(lambda: list(stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                                              extra_body={"prompt_logprobs": 1})),
                 "prompt_logprobs", "stream")
    # 0 in a stream is accepted and shows nothing (as vLLM): the engine is not asked for them.
    chunks = list(stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                                  extra_body={"prompt_logprobs": 0}))
    assert chunks and all(getattr(c.choices[0], "prompt_logprobs", None) is None for c in chunks if c.choices)
    assert _last_request(stack)[1].prompt_logprobs is None


# ================================================================================== vLLM's token-id views


def test_return_token_ids_completions(stack, tok):
    r = _complete(stack, prompt=[PROMPT, "1, 2, 3,"], max_tokens=6, n=2, return_token_ids=True)
    for choice in r.choices:
        rid = f"{r.id}-{choice.index}"
        assert choice.prompt_token_ids == stack.recording.prompts[rid]
        assert choice.token_ids == stack.recording.output_ids(rid) and len(choice.token_ids) == 6
        assert tok.decode(choice.token_ids) == choice.text
    # Streamed: the prompt's ids on each choice's first chunk, then each chunk's own tokens.
    chunks = list(stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == r.choices[0].prompt_token_ids
    streamed = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert streamed == r.choices[0].token_ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    # With echo (vLLM's layout): the choice's ids are the prompt's then the output's, as its text.
    e = _complete(stack, max_tokens=3, echo=True, return_token_ids=True)
    assert e.choices[0].token_ids == e.choices[0].prompt_token_ids + stack.recording.output_ids(_last_request(stack)[0])
    plain = _complete(stack, max_tokens=2)
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_return_token_ids_cut_at_stop_string(stack, tok):
    full = _complete(stack, max_tokens=8, return_token_ids=True)
    stop = tok.decode(full.choices[0].token_ids[3:5]).strip()
    assert stop, full.choices[0].text
    cut = _complete(stack, max_tokens=8, return_token_ids=True, stop=[stop])
    # The shown text's tokens only (a token that straddles the stop string is kept, as its text shows).
    assert cut.choices[0].token_ids == full.choices[0].token_ids[:len(cut.choices[0].token_ids)]
    assert len(cut.choices[0].token_ids) < 8 and tok.decode(cut.choices[0].token_ids).startswith(cut.choices[0].text)


def test_return_token_ids_chat(stack):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=5, temperature=0)
    r = stack.client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    rid, _ = _last_request(stack)
    assert r.prompt_token_ids == stack.recording.prompts[rid]
    assert r.choices[0].token_ids == stack.recording.output_ids(rid)
    chunks = list(stack.client.chat.completions.create(**body, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == r.prompt_token_ids
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == r.choices[0].token_ids


def test_return_tokens_as_token_ids(stack):
    ids = _complete(stack, max_tokens=4, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True).choices[0]
    assert ids.logprobs.tokens == [f"token_id:{t}" for t in ids.token_ids]
    assert all(k.startswith("token_id:") for top in ids.logprobs.top_logprobs for k in top)
    text = _complete(stack, max_tokens=4, logprobs=2).choices[0]
    assert text.logprobs.token_logprobs == ids.logprobs.token_logprobs and text.text == ids.text
    chat = stack.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    assert [c.token for c in chat.logprobs.content] == [f"token_id:{t}" for t in chat.token_ids]
    assert all(t.token.startswith("token_id:") for c in chat.logprobs.content for t in c.top_logprobs)


def test_priority_reaches_the_engine(stack):
    _complete(stack, max_tokens=2, priority=-3)
    assert _last_request(stack)[1].priority == -3
    _complete(stack, max_tokens=2)
    assert _last_request(stack)[1].priority == 0
    _bad_request(lambda: _complete(stack, max_tokens=2, priority=1 << 64), "priority", "64-bit")


def test_continuous_usage_stats(stack):
    chunks = list(stack.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)  # every chunk, as vLLM
    final = usages[-1]
    assert not chunks[-1].choices and final.completion_tokens == 12
    assert [u.completion_tokens for u in usages] == sorted(u.completion_tokens for u in usages)
    assert all(u.prompt_tokens == final.prompt_tokens and u.total_tokens == u.prompt_tokens + u.completion_tokens
               for u in usages)
    plain = list(stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3
    _bad_request(lambda: stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                         stream_options={"include_usage": True}),
                 "stream_options", "stream=true")


# ================================================================================== chat template variables


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
            "{% if documents %}<docs>{% for d in documents %}[{{ d.title }}] {{ d.text }};{% endfor %}</docs>\n"
            "{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no_think>\n{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def templated_dir(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(tiny_dir, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return d


def test_chat_template_kwargs(templated_dir):
    local = LocalRouter(EngineConfig(model=str(templated_dir), num_kv_blocks=64, max_model_len=256),
                        request_timeout_s=30)
    name = "templated"
    try:
        with serving(build_app(local, name, api_key=API_KEY, metrics=Metrics(name))) as base_url:
            s = Stack(local, Metrics(name), base_url)
            messages = [{"role": "user", "content": "Hi"}]
            plain = s.http.post("/tokenize", json={"model": name, "messages": messages}).json()["tokens"]
            off = s.http.post("/tokenize", json={"model": name, "messages": messages,
                                                 "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
            tok = Tokenizer(templated_dir)
            assert tok.decode(off, skip_special_tokens=False).endswith("<no_think>\n<|assistant|>")
            assert len(off) > len(plain)
            r = s.client.chat.completions.create(model=name, messages=messages, max_tokens=2,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert r.usage.prompt_tokens == len(off)
    finally:
        local.close()


def test_documents_reach_a_template_that_renders_them(templated_dir, stack):
    """vLLM's ``documents`` (retrieval-augmented chat) are the chat template's ``documents`` variable; a model whose
    template does not render them answers 400 rather than dropping them, and chat_template_kwargs cannot set them."""
    local = LocalRouter(EngineConfig(model=str(templated_dir), num_kv_blocks=64, max_model_len=256),
                        request_timeout_s=30)
    name = "templated"
    messages = [{"role": "user", "content": "Where is it?"}]
    documents = [{"title": "Paris", "text": "The capital of France."}, {"title": "Rome", "text": "Of Italy."}]
    try:
        with serving(build_app(local, name, api_key=API_KEY, metrics=Metrics(name))) as base_url:
            s = Stack(local, Metrics(name), base_url)
            plain = s.http.post("/tokenize", json={"model": name, "messages": messages}).json()["tokens"]
            r = s.client.chat.completions.create(model=name, messages=messages, max_tokens=2,
                                                 extra_body={"documents": documents})
            text = Tokenizer(templated_dir).apply_chat_template(messages, documents=documents)
            assert "<docs>[Paris] The capital of France.;[Rome] Of Italy.;</docs>" in text
            assert r.usage.prompt_tokens == len(Tokenizer(templated_dir).encode(text)) > len(plain)
    finally:
        local.close()

    def chat(**extra):
        return stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)

    _bad_request(lambda: chat(documents=documents), "documents", "does not render")
    _bad_request(lambda: chat(chat_template_kwargs={"documents": documents}), "chat_template_kwargs", "documents")


def test_template_that_renders_tools_gets_them(templated_dir):
    """A chat template that renders ``tools`` itself gets them (not a system prompt of the parser's format)."""
    tok = Tokenizer(templated_dir)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = chat_prompt_text([ChatMessage(role="user", content="Hi")], True, tok, tools, HermesParser())
    assert text.startswith("<|user|>Hi\n<tools>") and '"name": "f"' in text


def test_chat_takes_vllms_other_part_names(stack, tok):
    """Parts vLLM's chat reads under other names: input_text and output_text (the Responses API's, with its
    annotations) and an assistant's refusal are text parts, the same prompt as plain text parts; a part with a field
    none of them has is a 400 that says what is accepted; input_image to a text model is refused as image_url is."""
    def chat(user, assistant):
        stack.client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0.0, messages=[
            {"role": "user", "content": user}, {"role": "assistant", "content": assistant},
            {"role": "user", "content": [{"type": "text", "text": "And then?"}]}])
        return stack.recording.prompts[_last_request(stack)[0]]

    plain = chat([{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
                 [{"type": "text", "text": "I cannot say."}])
    renamed = chat([{"type": "input_text", "text": "Hello"}, {"type": "text", "text": "there"}],
                   [{"type": "refusal", "refusal": "I cannot say."}])
    replayed = chat([{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}],
                    [{"type": "output_text", "text": "I cannot say.", "annotations": []}])
    assert plain == renamed == replayed
    assert tok.decode(plain).count("I cannot say.") == 1
    _bad_request(lambda: chat([{"type": "input_text", "text": "Hi", "color": "red"}], "ok"), "output_text, refusal")
    _bad_request(lambda: chat([{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}], "ok"),
                 "takes no images")
