"""POST /v1/responses: OpenAI's Responses API (``client.responses.create``, what the OpenAI Agents SDK
speaks), as vLLM and SGLang serve it, over the chat completions path.

A request becomes a chat completion: ``instructions`` a system message, ``input`` (a string, or message
items and the ``function_call`` / ``function_call_output`` items of an earlier turn) the conversation,
``max_output_tokens``, ``text.format`` (json_schema / json_object) and function ``tools`` the chat
fields they name. It is validated and served by the same code (cluster/api/validation.py, fanout.py), so
every check, the tool-call parsers and structured output hold here too; errors name the Responses field.
The answer is a ``response`` object whose ``output`` holds a ``message`` item with the text, or a
``function_call`` item per tool call; ``status`` is "incomplete" (reason "max_output_tokens") when the
token limit cut it. Streamed: ``response.created``, ``response.in_progress``, the item and content-part
events around ``response.output_text.delta`` per piece of text, then ``response.completed`` (or
``response.incomplete`` / ``response.failed``), each with its ``sequence_number``. A request that may
call tools streams its items once the text is whole (its text is a call or not only at the end).

Not kept: responses are not stored (``store`` is answered false), so ``previous_response_id`` is refused
with a 400 that says to send the conversation in ``input``; ``input_image`` parts (an ``image_url``) go to chat's
image_url parts, for a model that takes images; audio and file inputs are refused as in chat; one output (no ``n``).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from pdcluster.cluster.api import protocol as wire
from pdcluster.cluster.api.choice import ChoiceRun
from pdcluster.cluster.api.fanout import interleaved
from pdcluster.cluster.api.middleware import APIError, validation_message
from pdcluster.cluster.api.protocol import ChatCompletionRequest, StrictModel, one_of
from pdcluster.cluster.api.serving import Reply, close_all, serve_runs
from pdcluster.cluster.api.validation import ServerPolicy, prepare

log = logging.getLogger(__name__)

# Chat fields the conversion fills -> the Responses field a client sent (error messages name the latter).
_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


Input = Annotated[str | list[dict], one_of("a string or a list of input items (messages, function_call, "
                                            "function_call_output)")]


class ResponsesRequest(StrictModel):
    model: str
    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extensions, as in chat (vLLM accepts them here too):
    seed: int | None = None
    top_k: int | None = None


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _content_of(content: Any, where: str) -> str | list[dict]:
    """A message item's content: a string, or text parts (input_text / output_text / text) joined, or with
    ``input_image`` parts (an image_url: a data: or http(s) URL) the chat's text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or a list of content parts, got {wire.short(content)}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            detail = part.get("detail")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"], **(
                {"detail": detail} if detail in ("auto", "low", "high") else {})}})
        else:
            raise _bad(f"{where}[{j}]", f"only text parts (input_text, output_text) and input_image parts with an "
                                        f"image_url are supported, got {wire.short(kind if kind else part)}")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages (an earlier turn's function calls become the
    assistant's tool_calls, their outputs tool messages)."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"must be an input item (an object), got {wire.short(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise _bad(f"{where}.role", f"must be system, developer, user or assistant, got {wire.short(role)}")
            messages.append({"role": role, "content": _content_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"), item.get("arguments"))):
                raise _bad(where, "a function_call item needs call_id, name and arguments (strings)")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # parallel calls of one turn: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise _bad(where, "a function_call_output item needs call_id and output (strings)")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: nothing a chat template takes
        else:
            raise _bad(f"{where}.type", f"{wire.short(kind)} items are not supported (message, function_call, "
                                        "function_call_output)")
    return messages


def _tools(body: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """Function tools and tool_choice in the chat layout (Responses flattens the function object)."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise _bad(f"tools[{i}].type", f"only function tools are supported, got "
                                               f"{wire.short(tool.get('type') if isinstance(tool, dict) else tool)}")
            tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                                 "strict") if k in tool}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": "..."}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format", f'type must be "text", "json_object" or "json_schema", got {wire.short(fmt)}')
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "description", "schema", "strict")
                                                       if k in fmt}}
    return {"type": fmt["type"]}


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise _bad("previous_response_id", "responses are not stored on this server (store is false): send the "
                                           "whole conversation in input")
    tools, tool_choice = _tools(body)
    fields = {"model": body.model, "messages": chat_messages(body), "max_completion_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
              "stream": bool(body.stream), "user": body.user, "response_format": _response_format(body),
              "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": body.parallel_tool_calls}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise APIError(400, message, param=param) from e  # named in Responses terms by serve_response


def in_responses_terms(e: APIError) -> APIError:
    """``e``, raised about the chat request, naming the Responses fields the client sent."""
    message, param = e.message, e.param
    for chat_name, name in _FIELD_NAMES.items():
        message = message.replace(chat_name, name)
        if param is not None and param.startswith(chat_name):
            param = name + param[len(chat_name):]
    return APIError(e.status, message, param=param, code=e.code, kind=e.kind)


# ================================================================================== the answer


class _Output:
    """One response's ids and the layouts of its object and output items."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def message_item(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_text_part(text)]}

    @staticmethod
    def call_item(call: dict) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def items(self, reply: Reply, run: ChoiceRun) -> list[dict]:
        message = reply.choice(run)["message"]
        items = [self.reasoning_item(message["reasoning"])] if message.get("reasoning") else []
        items += [self.message_item(message["content"], "completed")] if message.get("content") else []
        return items + [self.call_item(call) for call in message.get("tool_calls") or []]

    @staticmethod
    def reasoning_item(text: str) -> dict:
        """The chain of thought (serve --reasoning-parser), as vLLM's Responses API gives it."""
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    def response(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature,
                "top_p": b.top_p, "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
                "text": b.text or {"format": {"type": "text"}}, "metadata": b.metadata or {}, "store": False,
                "previous_response_id": None, "reasoning": None, "truncation": "disabled", "user": b.user,
                "usage": usage}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(reply: Reply) -> dict:
    chat = reply.usage()
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def _status(run: ChoiceRun) -> Literal["completed", "incomplete"]:
    return "incomplete" if run.finish_reason == "length" else "completed"


class _Events:
    """Server-sent events of one streamed response: ``event: <type>`` and its JSON, numbered."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return wire.sse(payload, event=kind)


async def _event_stream(out: _Output, reply: Reply, firsts) -> AsyncIterator[bytes]:
    run = reply.runs[0]
    event = _Events()
    # Its text is a call or not only once whole; with a reasoning parser, the answer is what follows the
    # reasoning: both go out as items at the end.
    holds_calls = bool(reply.tool_streams) or bool(reply.reasoning_streams)
    try:
        yield event("response.created", response=out.response("in_progress", []))
        yield event("response.in_progress", response=out.response("in_progress", []))
        def open_message(index: int) -> list[bytes]:
            return [event("response.output_item.added", output_index=index, item=out.message_item("", "in_progress")),
                    event("response.content_part.added", item_id=out.message_id, output_index=index, content_index=0,
                          part=_text_part(""))]

        opened = False
        async with interleaved(reply.runs, firsts) as pieces:
            async for _, piece, _ in pieces:
                if holds_calls or not piece.text:
                    continue
                if not opened:
                    opened = True
                    for chunk in open_message(0):
                        yield chunk
                yield event("response.output_text.delta", item_id=out.message_id, output_index=0, content_index=0,
                            delta=piece.text, logprobs=[])
        if run.finish_reason == "error":
            error = {"code": "server_error", "message": f"generation failed: {run.error}"}
            yield event("response.failed", response=out.response("failed", [], _usage(reply), error=error))
            return
        items = out.items(reply, run)
        for index, item in enumerate(items):
            if item["type"] == "reasoning":
                yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
            elif item["type"] == "message":
                text = item["content"][0]["text"]
                if not opened:
                    for chunk in open_message(index):
                        yield chunk
                    yield event("response.output_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=text, logprobs=[])
                yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[])
                yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=item["content"][0])
            else:
                yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        status = _status(run)
        yield event(f"response.{status}", response=out.response(status, items, _usage(reply)))
    except Exception:  # noqa: BLE001 - the status line is gone: report it in the stream
        log.exception("response stream %s failed", out.id)
        error = {"code": "server_error", "message": "internal error while streaming"}
        yield event("response.failed", response=out.response("failed", [], error=error))
    finally:
        await close_all(reply.runs)


async def serve_response(body: ResponsesRequest, request: Request, router, served_names: tuple[str, ...], metrics,
                         strings, policy: ServerPolicy = ServerPolicy()) -> Response:
    try:
        prep = await prepare(to_chat(body), router, served_names, policy)
    except APIError as e:
        raise in_responses_terms(e) from e
    out = _Output(body, prep.model)

    def json_body(reply: Reply) -> dict:
        run = reply.runs[0]
        return out.response(_status(run), out.items(reply, run), _usage(reply))

    return await serve_runs(prep, request, router, metrics, strings,
                            lambda reply, firsts: _event_stream(out, reply, firsts), json_body)
