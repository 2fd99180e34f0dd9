"""POST /v1/responses (cluster/api/responses.py) with the real `openai` client: the same tokens as the
chat completion it stands for, its streamed events, earlier turns' items, tool calls, structured output,
and errors that name the Responses fields. The real stack (LocalRouter on tiny-random) and, for tool
calls, the scripted router of test_api_openai.py."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.config import EngineConfig
from test_api import MAX_MODEL_LEN, MODEL, NUM_BLOCKS, serving
from test_api_openai import WEATHER_TOOL, Script, scripted

pytestmark = pytest.mark.timeout(120)

SYSTEM, QUESTION = "Answer in one word.", "What is the capital of France?"
# Responses' function tool: the chat one, flattened.
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
EVENTS_OF_TEXT = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added"]
EVENTS_AFTER_TEXT = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def real(tiny_dir):
    local = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN),
                        request_timeout_s=30)
    try:
        with serving(build_app(local, MODEL, metrics=Metrics(MODEL))) as base_url:
            yield local, openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0), \
                httpx.Client(base_url=base_url, timeout=30)
    finally:
        local.close()


def test_a_response_is_the_chat_completion_it_stands_for(real):
    _, client, _ = real
    r = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                                                 {"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and r.output_text
    [item] = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "completed",
                                                                         "output_text")
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    # Cut by the token limit (chat's finish_reason "length"): incomplete, and why.
    assert chat.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # Message items with text parts (and developer instructions) are the same conversation.
    items = client.responses.create(model=MODEL, input=[
        {"role": "system", "content": [{"type": "input_text", "text": SYSTEM}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=12, temperature=0)
    assert items.output_text == r.output_text and items.usage.input_tokens == r.usage.input_tokens


def test_streamed_events_spell_the_same_response(real):
    local, client, _ = real
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert kinds == EVENTS_OF_TEXT + ["response.output_text.delta"] * num_deltas + EVENTS_AFTER_TEXT + \
        ["response.incomplete"] and num_deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1  # one message item throughout
    # A client that leaves mid-stream frees its request.
    with client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=200, temperature=0,
                                 stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    deadline = time.monotonic() + 10
    while local.stats()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local.stats()["num_requests_running"] == 0


def test_structured_output_completes(real):
    """Needs the engine: ``text.format`` json_schema is chat's response_format (the grammar ends it)."""
    _, client, _ = real
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.status == "completed" and r.incomplete_details is None


def test_an_earlier_turns_function_call_and_its_output_are_the_chat_tool_messages(real):
    _, client, _ = real
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = client.chat.completions.create(model=MODEL, tools=[WEATHER_TOOL], max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    r = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


def test_tool_calls_are_function_call_items(tiny_dir):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with scripted(tiny_dir, Script({0: text})) as (_, _, client):
        r = client.responses.create(model="scripted", input=QUESTION, tools=[WEATHER])
        [item] = r.output
        assert (item.type, item.name, json.loads(item.arguments), item.status) == \
            ("function_call", "get_weather", {"city": "Paris"}, "completed")
        assert item.call_id and r.output_text == ""
        events = list(client.responses.create(model="scripted", input=QUESTION, tools=[WEATHER], stream=True))
        kinds = [e.type for e in events]
        assert "response.output_text.delta" not in kinds  # the call's text is never shown as text
        assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                             "response.function_call_arguments.done", "response.output_item.done",
                             "response.incomplete"]
        done = events[-2].item
        assert (done.name, json.loads(done.arguments)) == ("get_weather", {"city": "Paris"})
    # A forced call by name: the model writes the arguments alone (chat's named tool_choice).
    with scripted(tiny_dir, Script({0: '{"city": "Rome"}'})) as (router, _, client):
        r = client.responses.create(model="scripted", input=QUESTION, tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"})
        [item] = r.output
        assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", {"city": "Rome"})
        assert next(iter(router.params.values())).structured_output  # the grammar of the named call's arguments


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id", "not stored"),
    ({"input": "x", "max_output_tokens": -3}, 400, "max_output_tokens", "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0]", "only text parts"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, 400,
     "input[0].content[0]", "input_image parts with an image_url"),
    # An image for a model that takes none (LLaVA's are served: tests/test_multimodal.py).
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input", "this model takes no images"),
    ({"input": [{"type": "file_search_call"}]}, 400, "input[0].type", "not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role", "robot"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", "only function tools"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format", "json_schema"),
    ({"input": "x", "temperature": "hot"}, 400, "temperature", "hot"),
    ({"input": 5}, 400, "input", "5"),
    ({"input": "x", "model": "gpt-9"}, 404, "model", "gpt-9"),
])
def test_bad_requests_name_the_responses_field(real, body, status, param, words):
    _, _, http = real
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert http.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 1}).status_code == 200
