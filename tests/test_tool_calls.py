"""Tool calls (issue 22): tool_choice "auto" read by a tool-call parser (cluster/api/tool_parsers/), and
streamed tool calls for every tool choice.

- parser units: each format (hermes with SmolLM2's list form, llama3_json, pythonic, and the forced
  outputs of "required" and a named function) on plain text, one call, several calls and malformed
  calls; a stream fed one character (or a few) at a time adds up to the whole-text parse;
- the prompt: tools reach a template that ignores them (SmolLM2's ChatML) as a system prompt in the
  parser's format, past calls as text; the parser is picked from the chat template;
- the API alone (tests/test_api_openai.py's scripted router, real HTTP, the `openai` client): what a
  model's text becomes, whole and streamed, and that the stream's deltas reassemble to the whole answer;
- the real stack (LocalRouter on tiny-random): a tool call the engine generates (a response_format
  grammar makes the random model write llama3_json calls), read with tool_choice "auto", streamed and
  not; "required" and a named function streamed equal their whole answers.
"""

from __future__ import annotations

import contextlib
import json
import random

import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.protocol import ChatMessage, Tool
from pdcluster.cluster.api.tool_parsers import (NamedParser, RequiredParser, ToolCallStream, parser_for_template,
                                            select_parser)
from pdcluster.cluster.api.tool_parsers.hermes import HermesParser
from pdcluster.cluster.api.tool_parsers.llama3_json import Llama3JsonParser
from pdcluster.cluster.api.tool_parsers.mistral import MistralParser
from pdcluster.cluster.api.tool_parsers.openai_harmony import OpenAIHarmonyParser
from pdcluster.cluster.api.tool_parsers.pythonic import PythonicParser
from pdcluster.cluster.api.tool_parsers.qwen3_coder import Qwen3CoderParser
from pdcluster.cluster.api.validation import chat_prompt_text
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.tokenizer import Tokenizer
from test_api import API_KEY, MAX_MODEL_LEN, MODEL, NUM_BLOCKS, serving
from test_api_openai import CHAT, TIME_TOOL, WEATHER_TOOL, Script, ScriptedRouter, _sse_events, scripted

pytestmark = pytest.mark.timeout(120)

TOOLS = [WEATHER_TOOL, TIME_TOOL]
ALARM_TOOL = {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
    "hour": {"type": "integer"}, "loud": {"type": "boolean"}, "tags": {"type": "array"}, "note": {"type": "string"},
    "ratio": {"type": "number"}}}}}
QWEN3_CODER = Qwen3CoderParser().for_tools([Tool.model_validate(t) for t in TOOLS + [ALARM_TOOL]])
PARIS, CET = ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})

# (parser, text, expected content, expected calls as (name, arguments object))
CASES = [
    # hermes: one block a call, SmolLM2's list in one block, text around (whitespace next to a block is not
    # content), malformed blocks are text
    (HermesParser(), "The capital of France is Paris.", "The capital of France is Paris.", []),
    (HermesParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call>', "Let me check.", [PARIS]),
    (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                     '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>', "", [PARIS, CET]),
    (HermesParser(), '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
                     '{"name": "get_time", "arguments": {"zone": "CET"}}\n]</tool_call>', "", [PARIS, CET]),
    (HermesParser(), "<tool_call>[]</tool_call>", "", []),  # SmolLM2's "no call"
    (HermesParser(), 'a <tool_call>{"name": "f", "arguments": {"s": "</tool_call> }"}}</tool_call> b', "ab",
     [("f", {"s": "</tool_call> }"})]),
    (HermesParser(), "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    (HermesParser(), '<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}'
                                                                          "</tool_call>", []),
    (HermesParser(), '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', []),
    (HermesParser(), "I use <tool_c tags", "I use <tool_c tags", []),
    # llama3_json: the whole answer is the calls
    (Llama3JsonParser(), "Paris is the capital.", "Paris is the capital.", []),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                         '{"name": "get_time", "arguments": {"zone": "CET"}}', "", [PARIS, CET]),
    (Llama3JsonParser(), '{"answer": 42}', '{"answer": 42}', []),
    (Llama3JsonParser(), '{"name": "f", "parameters": {"x": 1}} and more', '{"name": "f", "parameters": {"x": 1}} '
                                                                            "and more", []),
    # pythonic
    (PythonicParser(), "Just text (with parentheses).", "Just text (with parentheses).", []),
    (PythonicParser(), '[get_weather(city="Paris")]', "", [PARIS]),
    (PythonicParser(), "[get_weather(city='Paris'), get_time(zone=\"CET\")]\n", "", [PARIS, CET]),
    (PythonicParser(), '[f(a=[1, {"k": (2)}], b=None, c="x, y)")]', "", [("f", {"a": [1, {"k": 2}], "b": None,
                                                                              "c": "x, y)"})]),
    (PythonicParser(), "[1, 2, 3]", "[1, 2, 3]", []),
    (PythonicParser(), "[f(x=open('a'))]", "[f(x=open('a'))]", []),
    # mistral: [TOOL_CALLS] then a JSON array (v0.3 tokenizers) or name[ARGS]{...} per call (v11 on)
    (MistralParser(), "Paris is the capital.", "Paris is the capital.", []),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),
    (MistralParser(), 'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                      '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Let me look.", [PARIS, CET]),
    (MistralParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "",
     [PARIS, CET]),
    (MistralParser(), "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
    (MistralParser(), "I write [TOOL tags", "I write [TOOL tags", []),
    (MistralParser(), '[TOOL_CALLS]f[ARGS]"x"', '[TOOL_CALLS]f[ARGS]"x"', []),
    # qwen3_coder: XML blocks, values typed by the request's tools
    (QWEN3_CODER, "Paris is the capital.", "Paris is the capital.", []),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call>", "", [PARIS]),
    (QWEN3_CODER, "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n"
                  "</parameter>\n</function>\n</tool_call>", "Checking.", [PARIS, CET]),
    (QWEN3_CODER, "<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n<parameter=loud>\n"
                  "true\n</parameter>\n<parameter=tags>\n[\"a\", 2]\n</parameter>\n<parameter=note>\n5\n"
                  "</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=extra>\nline one\nline two\n"
                  "</parameter>\n</function>\n</tool_call>", "",
     [("set_alarm", {"hour": 7, "loud": True, "tags": ["a", 2], "note": "5", "ratio": 0.5,
                     "extra": "line one\nline two"})]),
    (QWEN3_CODER, "<tool_call>\n<function=set_alarm>\n<parameter=hour>\nseven\n</parameter>\n</function>\n"
                  "</tool_call>", "", [("set_alarm", {"hour": "seven"})]),  # not an integer: the text, as vLLM
    (QWEN3_CODER, "x <tool_call>\nhello\n</tool_call> y", "x <tool_call>\nhello\n</tool_call> y", []),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\nDone.",
     "Done.", [PARIS]),  # no closing tag: the block ends with its function, the text after it is content
    # forced outputs (grammar-made): "required" and a named function
    (RequiredParser(), '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":'
                       '{"zone":"CET"}}]', "", [PARIS, CET]),
    (RequiredParser(), '[{"name":"get_weather"}]', '[{"name":"get_weather"}]', []),
    (RequiredParser(), "[]", "[]", []),
    (NamedParser("get_weather"), '{"city":"Paris"}', "", [PARIS]),
    (NamedParser("get_weather"), '{"city":"Par', '{"city":"Par', []),
    # openai (gpt-oss's harmony): a message to functions.NAME is a call, its recipient after the channel or the role;
    # other messages are content as they are (the reasoning parser takes their markers off first)
    (OpenAIHarmonyParser(), '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                            '<|message|>{"city": "Paris"}<|call|>', "", [PARIS]),
    (OpenAIHarmonyParser(), 'Let me look.<|start|>assistant to=functions.get_weather<|channel|>commentary json'
                            '<|message|>{"city": "Paris"}<|call|><|start|>assistant<|channel|>commentary '
                            'to=functions.get_time<|message|>{"zone": "CET"}<|call|>', "Let me look.", [PARIS, CET]),
    (OpenAIHarmonyParser(), "<|channel|>final<|message|>Paris.", "<|channel|>final<|message|>Paris.", []),
    # the output stopped on <|call|> (an end-of-turn token), which the text does not show
    (OpenAIHarmonyParser(), '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                            '{"city": "Paris"}', "", [PARIS]),
    (OpenAIHarmonyParser(), "a < b <|start|>assistant", "a < b <|start|>assistant", []),
    (OpenAIHarmonyParser(), '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Par',
     '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Par', []),  # cut short: text
]


def _reassemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str, str]]]:
    """Content and (id, name, arguments) per call index from OpenAI-style deltas, checking their layout."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            if tc["index"] not in calls:  # a call's first delta: index, id, type, name
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"].startswith("chatcmpl-tool-")
                calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[tc["index"]][2] += tc["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]


def _stream(parser, text: str, sizes) -> list[dict]:
    stream, deltas, i = ToolCallStream(parser), [], 0
    while i < len(text):
        n = next(sizes)
        deltas += stream.feed(text[i:i + n])
        i += n
    return deltas + stream.finish()


# Malformed only after the call went out (its name and the start of its arguments): a stream cannot take
# it back, so it shows the call (as vLLM); the whole answer shows the text.
STREAM_KEEPS_CALL = {'{"name": "f", "parameters": {"x": 1}} and more', '{"city":"Par',
                     '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Par'}


@pytest.mark.parametrize("parser, text, content, calls", CASES,
                         ids=[f"{i}-{type(c[0]).__name__}" for i, c in enumerate(CASES)])
def test_parse_and_stream(parser, text, content, calls):
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got_calls)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]
    rng = random.Random(len(text))
    for sizes in (iter(lambda: 1, None), iter(lambda: rng.randint(1, 7), None)):  # characters; token-like pieces
        streamed_content, streamed_calls = _reassemble(_stream(parser, text, sizes))
        if text in STREAM_KEEPS_CALL:
            assert streamed_content == "" and len(streamed_calls) == 1 and streamed_calls[0][2] in text
            continue
        assert streamed_content == got_content
        assert [(name, args) for _, name, args in streamed_calls] == whole


def test_stream_sends_a_call_before_it_ends():
    """Arguments stream as they are written: the name comes first, then argument deltas."""
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Checking. <tool_") == [{"content": "Checking."}]  # the tag's start is held back
    assert stream.feed('call>{"name": "get_weather", "argu') == []
    (first,) = stream.feed('ments": {"city": "Pa')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    assert first["tool_calls"][0]["index"] == 0 and first["tool_calls"][0]["type"] == "function"
    assert stream.feed('ris"}}</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert stream.finish() == [] and stream.num_final_calls == 1


def test_a_call_cut_short_is_not_sent_again_as_text():
    stream = ToolCallStream(NamedParser("f"))
    sent = stream.feed('{"city":"Ro')
    assert stream.finish() == [] and stream.num_final_calls == 0
    assert _reassemble(sent)[1][0][1:] == ("f", '{"city":"Ro')


def test_parser_picked_from_the_chat_template(tiny_dir):
    smollm2_template = Tokenizer(tiny_dir).chat_template  # tiny-random carries SmolLM2's tokenizer
    assert "<|im_start|>" in smollm2_template and "tool" not in smollm2_template
    assert parser_for_template(smollm2_template) == "hermes"
    assert parser_for_template("{% if tools %}...<tool_call>{{ tool }}</tool_call>{% endif %}") == "hermes"
    llama = ("<|start_header_id|>system<|end_header_id|>Respond in the format {\"name\": function name, "
             "\"parameters\": dictionary of argument name and its value}")
    assert parser_for_template(llama) == "llama3_json"
    assert parser_for_template("{{ bos_token }}[INST] {{ message['content'] }} [/INST]") is None
    assert parser_for_template(None) is None
    assert isinstance(select_parser("pythonic", smollm2_template), PythonicParser)
    assert select_parser("auto", "[INST]") is None
    assert parser_for_template("{{ bos_token }}[AVAILABLE_TOOLS]...[TOOL_CALLS]{{ calls }}") == "mistral"
    assert parser_for_template("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>") == "qwen3_coder"
    assert isinstance(select_parser("mistral", None), MistralParser)
    gpt_oss = "{{- '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.name + '<|message|>' }}"
    assert parser_for_template(gpt_oss) == "openai" and isinstance(select_parser("openai", None), OpenAIHarmonyParser)
    with pytest.raises(ValueError, match="'xml'"):
        select_parser("xml", smollm2_template)


def test_tools_reach_a_template_that_ignores_them(tiny_dir):
    """SmolLM2's template renders no tools: they come as a system prompt in the <tool_call> format it was
    trained on, before the client's system text; past calls are written in that format."""
    tok = Tokenizer(tiny_dir)
    parser = HermesParser()
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    plain = chat_prompt_text(messages, True, tok)
    text = chat_prompt_text(messages, True, tok, TOOLS, parser)
    assert "get_weather" not in plain and "You are a helpful AI assistant named SmolLM" in plain
    assert text.startswith("<|im_start|>system\n" + parser.system_prompt(TOOLS) + "<|im_end|>\n")
    assert json.dumps(TOOLS) in text and "<tool_call>[" in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    history = [ChatMessage(role="system", content="Be brief."), *messages,
               ChatMessage(role="assistant", tool_calls=[{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
               ChatMessage(role="tool", tool_call_id="c1", content="sunny")]
    text = chat_prompt_text(history, True, tok, TOOLS, parser)
    assert text.startswith("<|im_start|>system\n" + parser.system_prompt(TOOLS) + "\n\nBe brief.<|im_end|>")
    assert '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]' \
           "</tool_call><|im_end|>" in text
    assert chat_prompt_text(history, True, tok, [], parser) == chat_prompt_text(history, True, tok)


# ================================================================================== the API alone: scripted text


def _chat_stream(client, **kw) -> tuple[str | None, list, str, list]:
    """A streamed chat answer: its content, its tool calls (id, name, arguments), its finish reason, chunks."""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    content, calls = _reassemble([{**d, "tool_calls": d.get("tool_calls")} for d in deltas])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and chunks[-1].choices[0].finish_reason == finish[0]
    return content, calls, finish[0], chunks


def _whole(r) -> tuple[str | None, list, str]:
    msg = r.choices[0].message
    return msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls or []], r.choices[0].finish_reason


@contextlib.contextmanager
def _scripted_with(tiny_dir, script: Script, tool_call_parser: str):
    router = ScriptedRouter(Tokenizer(tiny_dir), script)
    with serving(build_app(router, "scripted", tool_call_parser=tool_call_parser)) as base_url:
        yield router, openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)


def test_mistral_calls_keep_special_tokens(tiny_dir):
    """[TOOL_CALLS] is a special token in Mistral's vocabulary: a request the mistral parser reads keeps special
    tokens in its text (else the marker would vanish and the call read as text)."""
    answer = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    with _scripted_with(tiny_dir, Script({0: answer}), "mistral") as (router, client):
        r = client.chat.completions.create(model="scripted", messages=CHAT, tools=TOOLS, max_tokens=100)
        content, calls, finish = _whole(r)
        assert (content, finish) == (None, "tool_calls") and [(n, json.loads(a)) for n, a in calls] == [PARIS]
        assert router.params[r.id + "-0"].skip_special_tokens is False
        client.chat.completions.create(model="scripted", messages=CHAT, max_tokens=5)  # no tools: as asked
        assert list(router.params.values())[-1].skip_special_tokens is True


def test_qwen3_coder_types_values_by_the_request_tools(tiny_dir):
    answer = ("<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n<parameter=note>\n5\n"
              "</parameter>\n</function>\n</tool_call>")
    with _scripted_with(tiny_dir, Script({0: answer}, delay_s=0.001), "qwen3_coder") as (_, client):
        kw = dict(model="scripted", messages=CHAT, tools=TOOLS + [ALARM_TOOL], max_tokens=100)
        content, calls, finish = _whole(client.chat.completions.create(**kw))
        assert finish == "tool_calls" and [(n, json.loads(a)) for n, a in calls] == [("set_alarm", {"hour": 7,
                                                                                                    "note": "5"})]
        s_content, s_calls, s_finish, _ = _chat_stream(client, **kw)
        assert (s_finish, [(n, a) for _, n, a in s_calls]) == (finish, calls)


HERMES_ANSWER = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_reads_calls_from_the_text(tiny_dir, tool_choice):
    """tool_choice "auto" (also by default): the scripted model's hermes blocks come back as tool_calls with
    finish_reason "tool_calls" and the text around them as content; streamed, the deltas add up to that."""
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with scripted(tiny_dir, Script({0: HERMES_ANSWER}, delay_s=0.001)) as (router, http, client):
        kw = dict(model="scripted", messages=CHAT, tools=TOOLS, max_tokens=200, **extra)
        r = client.chat.completions.create(**kw)
        content, calls, finish = _whole(r)
        assert (content, finish) == ("I will look both up.", "tool_calls")
        assert [(n, json.loads(a)) for n, a in calls] == [PARIS, CET]
        assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in r.choices[0].message.tool_calls)
        assert router.params[r.id + "-0"].structured_output is None  # free text: no grammar
        s_content, s_calls, s_finish, chunks = _chat_stream(client, **kw)
        assert (s_content, s_finish) == (content, "tool_calls")
        assert [(n, a) for _, n, a in s_calls] == calls
        assert len({i for i, _, _ in s_calls}) == 2
        # Arguments arrive in pieces (one token a delta from the router), after a first delta with the name.
        arg_deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [] if tc.id is None]
        assert len(arg_deltas) > 2


def test_auto_answers_in_text(tiny_dir):
    text = "The capital of France is Paris. I do not need a tool for that."
    with scripted(tiny_dir, Script({0: text})) as (router, http, client):
        kw = dict(model="scripted", messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=200)
        r = client.chat.completions.create(**kw)
        assert _whole(r) == (text, [], "length")  # the scripted router ends every answer by length
        s_content, s_calls, s_finish, _ = _chat_stream(client, **kw)
        assert (s_content, s_calls, s_finish) == (text, [], "length")


def test_auto_with_parallel_tool_calls_false_keeps_the_first_call(tiny_dir):
    with scripted(tiny_dir, Script({0: HERMES_ANSWER})) as (router, http, client):
        kw = dict(model="scripted", messages=CHAT, tools=TOOLS, parallel_tool_calls=False, max_tokens=200)
        content, calls, finish = _whole(client.chat.completions.create(**kw))
        assert [(n, json.loads(a)) for n, a in calls] == [PARIS] and finish == "tool_calls"
        s_content, s_calls, s_finish, _ = _chat_stream(client, **kw)
        assert [(n, a) for _, n, a in s_calls] == calls and s_finish == "tool_calls"


@pytest.mark.parametrize("tool_choice, text, expected", [
    ("required", '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"zone":"CET"}}]',
     [PARIS, CET]),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city":"Paris"}', [PARIS]),
])
def test_forced_tool_calls_stream(tiny_dir, tool_choice, text, expected):
    with scripted(tiny_dir, Script({0: text})) as (router, http, client):
        kw = dict(model="scripted", messages=CHAT, tools=TOOLS, tool_choice=tool_choice, max_tokens=200)
        content, calls, finish = _whole(client.chat.completions.create(**kw))
        assert content is None and finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in calls] == expected
        s_content, s_calls, s_finish, _ = _chat_stream(client, **kw)
        assert (s_content, s_finish) == ("", "tool_calls")
        assert [(n, a) for _, n, a in s_calls] == calls
        # The raw SSE: the first delta of a call has the OpenAI layout.
        events = _sse_events(http, "/v1/chat/completions", {**kw, "tool_choice": tool_choice})
        first = next(e["choices"][0]["delta"]["tool_calls"][0] for e in events
                     if e["choices"][0]["delta"].get("tool_calls"))
        assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
        assert first["function"]["name"] == expected[0][0]


class _NoFormatTokenizer:
    """tiny-random's tokenizer with a chat template that shows no tool-call format."""

    chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"[INST] {m['content']} [/INST]" for m in messages)


def test_auto_refused_without_a_parser_for_the_model(tiny_dir):
    router = ScriptedRouter(_NoFormatTokenizer(Tokenizer(tiny_dir)), Script({0: '{"city":"Paris"}'}))
    with serving(build_app(router, "scripted")) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="scripted", messages=CHAT, tools=TOOLS)
        assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body["message"]
        r = client.chat.completions.create(model="scripted", messages=CHAT, tools=TOOLS,  # forced still works
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert r.choices[0].message.tool_calls[0].function.arguments == '{"city":"Paris"}'
    with serving(build_app(router, "scripted", tool_call_parser="llama3_json")) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        router.script = Script({0: '{"name": "get_weather", "parameters": {"city": "Paris"}}'})
        r = client.chat.completions.create(model="scripted", messages=CHAT, tools=TOOLS)
        assert _whole(r)[1:] == ([("get_weather", '{"city": "Paris"}')], "tool_calls")


# ================================================================================== the real stack


@pytest.fixture(scope="module")
def llama3_stack(tiny_dir):
    """LocalRouter on tiny-random behind a server that reads llama3_json calls."""
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN),
                         request_timeout_s=30)
    try:
        with serving(build_app(router, MODEL, api_key=API_KEY, tool_call_parser="llama3_json")) as base_url:
            yield openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    finally:
        router.close()


CALL_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "enum": ["get_weather"]},
    "parameters": WEATHER_TOOL["function"]["parameters"]}, "required": ["name", "parameters"],
    "additionalProperties": False}


def test_engine_written_call_read_by_auto(llama3_stack):
    """Needs the engine: grammars applied. The random model writes whatever the grammar allows; here a
    llama3_json call, which tool_choice "auto" must read, whole and streamed (greedy: the same text)."""
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}})
    content, calls, finish = _whole(llama3_stack.chat.completions.create(**kw))
    assert finish == "tool_calls" and content is None
    ((name, arguments),) = calls
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
    s_content, s_calls, s_finish, _ = _chat_stream(llama3_stack, **kw)
    assert (s_content, [(n, a) for _, n, a in s_calls], s_finish) == ("", calls, "tool_calls")


def test_engine_text_answer_under_auto(llama3_stack):
    """Free text that is not a call stays content, the same whole and streamed."""
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=12, temperature=0)
    content, calls, finish = _whole(llama3_stack.chat.completions.create(**kw))
    assert calls == [] and finish == "length" and content
    s_content, s_calls, s_finish, _ = _chat_stream(llama3_stack, **kw)
    assert (s_content, s_calls, s_finish) == (content, [], "length")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_engine_forced_calls_stream_as_whole(llama3_stack, tool_choice):
    """Needs the engine: grammars applied. Streamed forced calls reassemble to the whole answer."""
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0)
    content, calls, finish = _whole(llama3_stack.chat.completions.create(**kw))
    assert finish == "tool_calls" and content is None and calls
    s_content, s_calls, s_finish, _ = _chat_stream(llama3_stack, **kw)
    assert (s_content, [(n, a) for _, n, a in s_calls], s_finish) == ("", calls, "tool_calls")
