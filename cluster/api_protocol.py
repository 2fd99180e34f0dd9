"""The OpenAI wire format the HTTP API speaks: pydantic models of the request bodies, and the JSON of
responses, stream chunks (SSE) and errors.

One prompt per request: ``prompt`` may be a string, a list of token ids, or a list holding exactly one
of those (cluster/api_validation.py refuses a batch of several). Parameters OpenAI defines that we do
not support are accepted here and refused there with a message that says so.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, WrapValidator


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: client values quoted in error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ================================================================================== request bodies


def _one_of(hint: str) -> WrapValidator:
    """Replace a union's one-error-per-branch by one message that says what is accepted."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {hint}, got {short(value)}") from None

    return WrapValidator(validate)


Prompt = Annotated[
    str | list[int] | list[str] | list[list[int]],
    _one_of("a string, a list of token ids, or a list holding one of those"),
]
Stop = Annotated[str | list[str] | None, _one_of("a string or a list of strings")]


class _Strict(BaseModel):
    # Strict: "5" is not 5, 5.0 is not an int, 1 is not true; NaN and infinities are refused.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class SamplingFields(_Strict):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (as vLLM): 0 or -1 = off
    seed: int | None = None
    stop: Stop = None
    n: int | None = 1
    ignore_eos: bool | None = False  # extension (as vLLM)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = Annotated[
    str | list[TextPart] | None,
    _one_of('a string or a list of text parts ({"type": "text", "text": "..."}); '
            "image and audio parts are not supported"),
]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = True  # extension (as vLLM)


# ================================================================================== response bodies

TEXT_COMPLETION, CHAT_COMPLETION = "text_completion", "chat.completion"


def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def header(request_id: str, object_kind: str, created: int, model: str, chunk: bool) -> dict:
    kind = object_kind + (".chunk" if chunk and object_kind == CHAT_COMPLETION else "")
    return {"id": request_id, "object": kind, "created": created, "model": model}


def choice(object_kind: str, text: str, finish_reason: str | None, chunk: bool, first: bool = False) -> dict:
    """The one choice of a response (``chunk``: of a stream chunk; ``first``: the chat stream's first,
    which carries the role)."""
    if object_kind == TEXT_COMPLETION:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def sse(payload: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
