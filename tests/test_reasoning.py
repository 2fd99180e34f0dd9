"""Reasoning output (serve --reasoning-parser, cluster/api/reasoning.py): a thinking model's
``<think>...</think>`` comes back as ``message.reasoning`` / ``reasoning_content`` beside its answer, whole and
streamed (the stream's pieces join into the whole answer's fields, a tag cut anywhere between tokens), with
tool calls read from the answer, structured output left alone, the Responses API's reasoning item, and an
earlier turn's reasoning handed back to the chat template.

The parser on every cut of the text; the API through a real server and the `openai` client, over the
scripted router of test_api_openai (one token a delta, so tags arrive in pieces: "<", "think", ">").
"""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.protocol import ChatMessage
from pdcluster.cluster.api.reasoning import ReasoningStream, reasoning_stream, split_reasoning, thinking_markers
from pdcluster.cluster.api.validation import chat_prompt_text
from pdcluster.engine.tokenizer import Tokenizer
from test_api import serving
from test_api_openai import Script, ScriptedRouter, _sse_events

pytestmark = pytest.mark.timeout(120)

CASES = [
    # parser, text, reasoning, content
    ("qwen3", "<think>Paris is in France.</think>\n\nParis.", "Paris is in France.", "\n\nParis."),
    ("qwen3", "Paris.", "", "Paris."),  # enable_thinking false: no tags, all answer
    ("qwen3", "<think>still thinking", "still thinking", ""),  # cut by max_tokens inside the reasoning
    ("qwen3", "<thin", "", "<thin"),  # not the tag after all
    ("qwen3", "a <think>b</think>", "", "a <think>b</think>"),  # only an opening tag opens it
    ("qwen3", "<think></think>Hi", "", "Hi"),
    ("qwen3", "<think>a</th", "a</th", ""),
    ("deepseek_r1", "First, 2+2.</think>\n4", "First, 2+2.", "\n4"),  # <think> was in the prompt
    ("deepseek_r1", "<think>First.</think>4", "First.", "4"),
    ("deepseek_r1", "no end yet", "no end yet", ""),
    ("deepseek_r1", "x</think>", "x", ""),
    # gpt-oss's harmony channels: analysis is reasoning, final (and commentary) content, markers never shown
    ("openai_gptoss", "<|channel|>analysis<|message|>It is Paris.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>Paris.", "It is Paris.", "Paris."),
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b"
                      "<|return|>", "a", "b"),
    ("openai_gptoss", "<|channel|>analysis<|message|>still thinking", "still thinking", ""),  # cut by max_tokens
    ("openai_gptoss", "<|channel|>analysis<|message|>a < b, x <|e", "a < b, x <|e", ""),  # not a marker after all
    ("openai_gptoss", "<|channel|>final<|message|>Hi", "", "Hi"),  # reasoning effort low: straight to the answer
    ("openai_gptoss", "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary<|message|>"
                      "Let me check.<|end|><|start|>assistant<|channel|>final<|message|>Done.", "x",
     "Let me check.Done."),
    ("openai_gptoss", "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|chan", "x", ""),  # a header cut
    ("openai_gptoss", "Plain text.", "", "Plain text."),  # no harmony at all: all answer
    # a call (a message with a recipient) goes to the content whole, for the tool-call parser
    ("openai_gptoss", "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary "
                      "to=functions.f<|message|>{}<|call|>", "x",
     "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{}<|call|>"),
    ("openai_gptoss", "<|cha", "", "<|cha"),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_split_and_every_stream_cut_agree(parser, text, reasoning, content):
    whole = split_reasoning(parser, text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cut in range(len(text) + 1):  # two pieces, anywhere (inside a tag too)
        stream = reasoning_stream(parser)
        parts = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert (parts.reasoning, parts.content) == (reasoning, content), cut
    stream = reasoning_stream(parser)  # one character at a time
    parts = [stream.feed(ch) for ch in text] + [stream.finish()]
    parts = sum(parts[1:], parts[0])
    assert (parts.reasoning, parts.content) == (reasoning, content)


@contextlib.contextmanager
def _server(tiny_dir, texts: dict[int, str], parser: str | None):
    router = ScriptedRouter(Tokenizer(tiny_dir), Script(texts))
    with serving(build_app(router, "scripted", reasoning_parser=parser)) as base_url:
        yield router, httpx.Client(base_url=base_url, timeout=30), \
            openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)


CHAT = dict(model="scripted", messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=100)
THOUGHT = "<think>The user asks for the capital. It is Paris.</think>\n\nParis."


def test_chat_reasoning_whole_and_streamed(tiny_dir):
    with _server(tiny_dir, {0: THOUGHT}, "qwen3") as (router, http, client):
        m = client.chat.completions.create(**CHAT).choices[0].message
        assert m.reasoning == m.reasoning_content == "The user asks for the capital. It is Paris."
        assert m.content == "\n\nParis."
        events = _sse_events(http, "/v1/chat/completions", {**CHAT, "logprobs": True})
        deltas = [e["choices"][0] for e in events if e["choices"]]
        reasoning = "".join(d["delta"].get("reasoning") or "" for d in deltas)
        assert reasoning == "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == m.reasoning
        assert "".join(d["delta"].get("content") or "" for d in deltas) == m.content
        assert not any("think>" in (d["delta"].get("content") or "") + (d["delta"].get("reasoning") or "")
                       for d in deltas)
        # Every token's logprob still goes out once, and the stream ends with its finish reason.
        assert sum(len((d.get("logprobs") or {}).get("content") or []) for d in deltas) == \
            len(router.tokenizer.encode(THOUGHT))
        assert deltas[-1]["finish_reason"] == "length"


def test_include_reasoning_false_shows_the_answer_alone(tiny_dir):
    """vLLM's include_reasoning false: the answer without its reasoning, whole and streamed (no reasoning delta, no
    tag); logprobs or token ids, which would show the reasoning's tokens, are refused with it."""
    no_reasoning = {**CHAT, "extra_body": {"include_reasoning": False}}
    with _server(tiny_dir, {0: THOUGHT}, "qwen3") as (router, http, client):
        m = client.chat.completions.create(**no_reasoning).choices[0].message
        assert m.content == "\n\nParis." and getattr(m, "reasoning", None) is None
        assert getattr(m, "reasoning_content", None) is None
        events = _sse_events(http, "/v1/chat/completions", {**CHAT, "include_reasoning": False})
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "\n\nParis."
        assert not any(d.get("reasoning") or d.get("reasoning_content") for d in deltas)
        for extra in ({"logprobs": True}, {"return_token_ids": True}):
            r = http.post("/v1/chat/completions", json={**CHAT, "include_reasoning": False, **extra})
            assert r.status_code == 400 and "include_reasoning" in r.json()["error"]["message"], r.text


def test_without_the_flag_or_the_tag_the_text_is_the_answer(tiny_dir):
    with _server(tiny_dir, {0: THOUGHT}, None) as (_, _, client):
        m = client.chat.completions.create(**CHAT).choices[0].message
        assert m.content == THOUGHT and getattr(m, "reasoning", None) is None
    with _server(tiny_dir, {0: "Paris."}, "qwen3") as (_, http, client):
        m = client.chat.completions.create(**CHAT).choices[0].message
        assert m.content == "Paris." and m.reasoning is None
        events = _sse_events(http, "/v1/chat/completions", CHAT)
        assert not any(e["choices"][0]["delta"].get("reasoning") for e in events if e["choices"])
    # Completions are the raw text: the parser is for chat answers.
    with _server(tiny_dir, {0: THOUGHT}, "qwen3") as (_, _, client):
        assert client.completions.create(model="scripted", prompt="Hi", max_tokens=100).choices[0].text == THOUGHT


def test_deepseek_r1_reasoning_until_the_end_tag(tiny_dir):
    with _server(tiny_dir, {0: "Two and two.</think>4", 1: "Still going"}, "deepseek_r1") as (_, _, client):
        choices = client.chat.completions.create(**CHAT, n=2).choices
        assert (choices[0].message.reasoning, choices[0].message.content) == ("Two and two.", "4")
        assert (choices[1].message.reasoning, choices[1].message.content) == ("Still going", None)


def test_tool_calls_are_read_from_the_answer(tiny_dir):
    text = ('<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>')
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with _server(tiny_dir, {0: text}, "qwen3") as (_, http, client):
        choice = client.chat.completions.create(**CHAT, tools=tools).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning == "I need the weather."
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
            [("get_weather", '{"city": "Paris"}')]
        events = _sse_events(http, "/v1/chat/completions", {**CHAT, "tools": tools})
        deltas = [e["choices"][0] for e in events if e["choices"]]
        assert "".join(d["delta"].get("reasoning") or "" for d in deltas) == "I need the weather."
        calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
        assert calls and calls[0]["function"]["name"] == "get_weather"
        assert deltas[-1]["finish_reason"] == "tool_calls"


def test_structured_output_is_not_parsed(tiny_dir):
    text = '<think>x</think>{"a": 1}'
    with _server(tiny_dir, {0: text}, "qwen3") as (_, _, client):
        m = client.chat.completions.create(**CHAT, response_format={"type": "json_object"}).choices[0].message
        assert m.content == text and getattr(m, "reasoning", None) is None


def test_responses_api_gives_a_reasoning_item(tiny_dir):
    with _server(tiny_dir, {0: THOUGHT}, "qwen3") as (_, http, client):
        r = client.responses.create(model="scripted", input="Capital of France?", max_output_tokens=100)
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "The user asks for the capital. It is Paris."
        assert r.output_text == "\n\nParis."
        with http.stream("POST", "/v1/responses", json={"model": "scripted", "input": "Hi", "max_output_tokens": 100,
                                                         "stream": True}) as resp:
            body = "".join(resp.iter_text())
        events = [line.removeprefix("event: ") for line in body.splitlines() if line.startswith("event: ")]
        # The scripted router ends on "length": the response is incomplete, its two items whole.
        assert events[2:5] == ["response.output_item.added", "response.output_item.done", "response.output_item.added"]
        assert events[-1] == "response.incomplete" and "<think>" not in body and '"type":"reasoning"' in body


class _RecordingTemplate:
    """A tokenizer stand-in that keeps the messages the chat template gets."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.messages = messages
        return "rendered"


def test_earlier_reasoning_goes_back_to_the_template():
    tok = _RecordingTemplate()
    messages = [ChatMessage(role="user", content="Hi"),
                ChatMessage(role="assistant", content="Hello", reasoning="Greet back."),
                ChatMessage(role="assistant", content="Again", reasoning_content="Older name."),
                ChatMessage(role="user", content="Bye")]
    chat_prompt_text(messages, True, tok)
    assert [m.get("reasoning_content") for m in tok.messages] == [None, "Greet back.", "Older name.", None]
    assert [m.get("thinking") for m in tok.messages] == [None, "Greet back.", "Older name.", None]  # gpt-oss's key


HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
HARMONY_TEXT = ("<|channel|>analysis<|message|>The user asks for the capital. It is Paris.<|end|><|start|>assistant"
                "<|channel|>final<|message|>Paris.")


@pytest.fixture(scope="module")
def harmony_dir(tiny_dir, tmp_path_factory):
    """tiny-random's tokenizer with gpt-oss's harmony markers added as special tokens (as o200k_harmony has them)."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer

    out = tmp_path_factory.mktemp("harmony")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(HARMONY_MARKERS)
    tok.save(str(out / "tokenizer.json"))
    return out


def test_gpt_oss_channels_whole_and_streamed(harmony_dir):
    """The markers are special tokens: the parser gets them only because its requests keep special tokens in their
    text; without the parser they are skipped as usual (and the channel names run into the answer)."""
    assert all(len(Tokenizer(harmony_dir).encode(m)) == 1 for m in HARMONY_MARKERS)
    with _server(harmony_dir, {0: HARMONY_TEXT}, "openai_gptoss") as (_, http, client):
        m = client.chat.completions.create(**CHAT).choices[0].message
        assert (m.reasoning, m.reasoning_content, m.content) == (
            "The user asks for the capital. It is Paris.", "The user asks for the capital. It is Paris.", "Paris.")
        events = _sse_events(http, "/v1/chat/completions", CHAT)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == m.reasoning
        assert "".join(d.get("content") or "" for d in deltas) == "Paris."
        assert not any("<|" in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
        r = client.responses.create(model="scripted", input="Capital of France?", max_output_tokens=100)
        assert [item.type for item in r.output] == ["reasoning", "message"] and r.output_text == "Paris."
    with _server(harmony_dir, {0: HARMONY_TEXT}, None) as (_, _, client):
        assert client.chat.completions.create(**CHAT).choices[0].message.content == (
            "analysisThe user asks for the capital. It is Paris.assistantfinalParis.")


def test_gpt_oss_tool_call_after_its_reasoning(harmony_dir):
    """gpt-oss with both of vLLM's gpt-oss parsers: the analysis is the reasoning, the message to functions.* a
    tool call (whole and streamed), the call's markers in neither."""
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    router = ScriptedRouter(Tokenizer(harmony_dir), Script({0: text}))
    app = build_app(router, "scripted", tool_call_parser="openai", reasoning_parser="openai_gptoss")
    with serving(app) as base_url:
        http = httpx.Client(base_url=base_url, timeout=30)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        choice = client.chat.completions.create(**CHAT, tools=tools).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning == "Need the weather."
        assert choice.message.content is None
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
            [("get_weather", '{"city": "Paris"}')]
        events = _sse_events(http, "/v1/chat/completions", {**CHAT, "tools": tools})
        deltas = [e["choices"][0] for e in events if e["choices"]]
        assert "".join(d["delta"].get("reasoning") or "" for d in deltas) == "Need the weather."
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(c["function"].get("arguments") or "" for c in calls) == '{"city": "Paris"}'
        assert deltas[-1]["finish_reason"] == "tool_calls"


def test_gpt_oss_thinking_markers_are_its_special_tokens(harmony_dir):
    """thinking_token_budget's markers for gpt-oss: its analysis header opens the section, <|end|> (one token)
    closes it; the model heads its final message itself."""
    tok = Tokenizer(harmony_dir)
    start, end = thinking_markers("openai_gptoss", tok)
    assert end == [tok.token_to_id("<|end|>")]
    assert start[0] == tok.token_to_id("<|channel|>") and start[-1] == tok.token_to_id("<|message|>")
    assert tok.decode(start, skip_special_tokens=False) == "<|channel|>analysis<|message|>"


def test_reasoning_effort_reaches_the_chat_template(harmony_dir, tmp_path):
    """OpenAI's reasoning_effort is a template variable (gpt-oss's template writes "Reasoning: high"); a bad value
    is a 400 naming the field."""
    import json
    import shutil

    model_dir = tmp_path / "effort"
    shutil.copytree(harmony_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = ("Reasoning: {{ reasoning_effort | default('medium') }}\n{% for m in messages %}"
                               "{{ m.content }}{% endfor %}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(model_dir)
    with _server(model_dir, {0: "Paris."}, "openai_gptoss") as (_, http, client):
        def prompt_tokens(**kw) -> int:
            return client.chat.completions.create(**CHAT, **kw).usage.prompt_tokens
        for effort in ("low", "medium", "high"):
            want = len(tokenizer.encode(f"Reasoning: {effort}\nCapital of France?"))
            assert prompt_tokens(reasoning_effort=effort) == want
        assert prompt_tokens() == prompt_tokens(reasoning_effort="medium")
        assert prompt_tokens(reasoning_effort="low", extra_body={"chat_template_kwargs": {
            "reasoning_effort": "high"}}) == prompt_tokens(reasoning_effort="high")
        r = http.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "extreme"})
        assert r.status_code == 400 and "reasoning_effort" in r.text


def test_reasoning_parser_flag():
    import argparse

    from pdcluster.cluster.serve_cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).reasoning_parser is None
    assert parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    assert parser.parse_args(["serve", "--reasoning-parser", "openai_gptoss"]).reasoning_parser == "openai_gptoss"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reasoning-parser", "gpt"])
    with pytest.raises(ValueError, match="reasoning parser 'gpt'"):
        build_app(ScriptedRouter(None, Script({0: ""})), "x", reasoning_parser="gpt")
