"""The OpenAI-compatible HTTP API over any router of cluster/router_api.py.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming SSE or not), GET /v1/models,
GET /health, GET /metrics. Every client mistake is a 4xx in OpenAI's error format
``{"error": {"message", "type", "param", "code"}}`` whose message names the field and the value;
only our own faults are 5xx (a generic message, the details in the log).

One prompt per request: ``prompt`` may be a string, a list of token ids, or a list holding exactly one
of those; a batch of several prompts is a 400 (send them as concurrent requests), and so is ``n > 1``.

Text is detokenised incrementally by decoding the whole output and emitting the new suffix, holding
back an unfinished UTF-8 character (decoded as U+FFFD) and any tail that could begin a stop string, so
a stream never shows half a character or text at or past a stop string.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError, WrapValidator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcluster.cluster.metrics import Metrics
from pdcluster.cluster.router_api import RouterError, TokenDelta
from pdcluster.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STOP_STRINGS = 16
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): 1/T would overflow the logits
DISCONNECT_POLL_S = 0.25


# ================================================================================== errors


class APIError(Exception):
    """A request we answer with an error status; ``message`` says what was wrong and with which value."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


class BodyTooLarge(StarletteHTTPException):
    """Raised from the request's receive channel; FastAPI re-raises HTTPExceptions from body reading."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(status: int, message: str, kind: str | None = None, param: str | None = None,
                    code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _param_name(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    name = ""
    for p in parts:
        name += f"[{p}]" if isinstance(p, int) else (f".{p}" if name else str(p))
    return name or None


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable sentence for pydantic's errors, and the first bad field (OpenAI's ``param``)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first["loc"][-1] if first.get("loc") else "?"
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')} " \
               f"(at character {where})", None
    messages, seen = [], set()
    for e in errors:
        param = _param_name(tuple(e.get("loc", ())))
        if param is None:
            messages.append("request body must be a JSON object (send Content-Type: application/json)")
            continue
        if param in seen:  # a union reports each of its branches: one message per field is enough
            continue
        seen.add(param)
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if e.get("type") == "missing":
            messages.append(f"{param}: field required")
        elif e.get("type") == "value_error":
            messages.append(f"{param}: {msg}")
        else:
            messages.append(f"{param}: {msg}, got {_short(e.get('input'))}")
        if len(messages) == 3:
            break
    more = len({_param_name(tuple(e.get("loc", ()))) for e in errors}) - len(messages)
    text = "; ".join(messages) + (f" (and {more} more)" if more > 0 else "")
    return text, _param_name(tuple(first.get("loc", ())))


# ================================================================================== request models


def _one_of(hint: str) -> WrapValidator:
    """Replace a union's one-error-per-branch by one message that says what is accepted."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {hint}, got {_short(value)}") from None

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


class _SamplingFields(_Strict):
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


class CompletionRequest(_SamplingFields):
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = True  # extension (as vLLM)


# ================================================================================== validation


@dataclass
class Prepared:
    """A validated request, ready for the router."""

    request_id: str
    object_kind: str  # "text_completion" | "chat.completion"
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)


def _reject_unsupported(body: _SamplingFields) -> None:
    def no(param: str, what: str) -> None:
        raise APIError(400, f"{param}: {what}", param=param, code="unsupported_parameter")

    if body.n not in (None, 1):
        no("n", f"only n=1 is supported, got {body.n}: send {body.n} requests (with different seeds) instead")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            no(name, f"penalties are not supported, got {value!r} (leave it out or send 0)")
    if body.logit_bias:
        no("logit_bias", "logit_bias is not supported (leave it out)")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            no("logprobs", f"logprobs are not supported, got {body.logprobs!r} (leave it out)")
        if body.echo:
            no("echo", "echo is not supported (leave it out or send false)")
        if body.best_of not in (None, 1):
            no("best_of", f"only best_of=1 is supported, got {body.best_of}")
        if body.suffix:
            no("suffix", "suffix (insertion) is not supported (leave it out)")
    else:
        if body.logprobs or body.top_logprobs:
            no("logprobs", "logprobs are not supported (leave logprobs and top_logprobs out)")
        if body.tools:
            no("tools", "tool calling is not supported (leave tools out)")
        if body.response_format is not None and body.response_format.type != "text":
            no("response_format", f"only response_format type 'text' is supported, got {body.response_format.type!r}")


def _check_model(body: _SamplingFields, served_model_name: str) -> None:
    if body.model != served_model_name:
        raise APIError(404, f"The model {body.model!r} does not exist: this server serves {served_model_name!r}",
                       param="model", code="model_not_found")


def _completion_prompt(body: CompletionRequest, tokenizer) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: a batch of {len(prompt)} prompts is not supported: send one prompt "
                                "per request (concurrent requests are batched by the server)", param="prompt")
        prompt = prompt[0]
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "prompt is empty: give at least one token of text", param="prompt")
    return ids


def _chat_prompt(body: ChatCompletionRequest, tokenizer) -> list[int]:
    from pdcluster.engine.tokenizer import ChatTemplateError

    if not body.messages:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt is not False)
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages") from e
    ids = tokenizer.encode(text)
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    return ids


def _sampling_params(body: _SamplingFields, max_tokens: int | None, num_prompt: int, max_model_len: int,
                     max_tokens_param: str, default_max_tokens: int | None) -> SamplingParams:
    def bad(param: str, message: str) -> APIError:
        return APIError(400, f"{param}: {message}", param=param)

    if num_prompt >= max_model_len:
        raise APIError(400, f"prompt has {num_prompt} tokens, but this model's context (max_model_len) is "
                            f"{max_model_len} tokens: shorten the prompt to at most {max_model_len - 1} tokens",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:  # the default never overflows the context
        max_tokens = min(default_max_tokens or max_model_len, max_model_len - num_prompt)
    elif max_tokens <= 0:
        raise bad(max_tokens_param, f"must be at least 1, got {max_tokens}")
    if num_prompt + max_tokens > max_model_len:
        raise APIError(
            400, f"prompt ({num_prompt} tokens) + {max_tokens_param} ({max_tokens}) = {num_prompt + max_tokens} "
                 f"tokens exceeds this model's context (max_model_len) of {max_model_len} tokens: lower "
                 f"{max_tokens_param} to at most {max_model_len - num_prompt} or shorten the prompt",
            param=max_tokens_param, code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature < 0:
        raise bad("temperature", f"must be >= 0 (0 = greedy), got {temperature!r}")
    if temperature < GREEDY_EPS:
        temperature = 0.0
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad("top_p", f"must be in (0, 1], got {top_p!r}")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
        raise bad("top_k", f"must be >= 0 (0 or -1 disables it), got {body.top_k!r}")
    if body.seed is not None and not INT64_MIN <= body.seed <= INT64_MAX:
        raise bad("seed", f"must fit in a signed 64-bit integer, got {_short(body.seed)}")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    if any(not s for s in stop):
        raise bad("stop", f"stop strings must be non-empty, got {_short(stop)}")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=body.seed, stop=stop, ignore_eos=bool(body.ignore_eos))
    except ValueError as e:
        raise APIError(400, str(e)) from e


async def prepare(body: _SamplingFields, router, served_model_name: str) -> Prepared:
    _check_model(body, served_model_name)
    _reject_unsupported(body)
    tokenizer = router.tokenizer
    is_chat = isinstance(body, ChatCompletionRequest)
    # Tokenising a long prompt takes a while: keep it off the event loop.
    prompt_fn = _chat_prompt if is_chat else _completion_prompt
    ids = await anyio.to_thread.run_sync(prompt_fn, body, tokenizer)
    if is_chat:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        default = None  # chat: up to the context's end, as OpenAI
    else:
        max_tokens, param, default = body.max_tokens, "max_tokens", 16  # OpenAI's default for completions
    params = _sampling_params(body, max_tokens, len(ids), router.max_model_len, param, default)
    prefix, kind = ("chatcmpl", "chat.completion") if is_chat else ("cmpl", "text_completion")
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return Prepared(f"{prefix}-{uuid.uuid4().hex}", kind, served_model_name, ids, params, bool(body.stream),
                    include_usage)


# ================================================================================== detokenisation


def _truncate_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    cut = min((pos for pos in (text.find(s) for s in stops) if pos != -1), default=-1)
    return (text, False) if cut == -1 else (text[:cut], True)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Detokenizer:
    """Decodes the whole output on every delta and hands out only the new, stable suffix."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.token_ids: list[int] = []
        self.text = ""
        self.num_sent = 0  # characters of ``text`` already handed out
        self.hit_stop = False

    def add(self, token_ids: list[int], final: bool) -> str:
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids)
        if self.stops:
            text, self.hit_stop = _truncate_at_stop(text, self.stops)
            final = final or self.hit_stop
        self.text = text
        end = len(text)
        if not final:
            while end > self.num_sent and text[end - 1] == "\ufffd":  # an unfinished UTF-8 character
                end -= 1
            end -= _stop_prefix_len(text[:end], self.stops)
        if end <= self.num_sent:
            return ""
        new, self.num_sent = text[self.num_sent : end], end
        return new


# ================================================================================== running a request


class _ClientGone(Exception):
    pass


async def _unless_disconnected(awaitable, request: Request):
    """Await ``awaitable``; raise _ClientGone (cancelling it) if the client goes away first."""
    task = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class Run:
    """One request's stream from the router: text, counts, finish, metrics (recorded once)."""

    def __init__(self, prep: Prepared, router, metrics: Metrics):
        self.prep, self.router, self.metrics = prep, router, metrics
        self.detok = Detokenizer(router.tokenizer, prep.params.stop)
        self.stream: AsyncIterator[TokenDelta] | None = None
        self.num_output = self.num_draft = self.num_accepted = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._last_token_at: float | None = None
        self._started = False  # the router admitted it and sent a first delta
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def start(self) -> TokenDelta:
        """Admission and the first delta: a RouterError here is still an HTTP error status."""
        p = self.prep
        self.stream = self.router.generate(p.request_id, p.prompt_token_ids, p.params)
        try:
            first = await self.stream.__anext__()
        except StopAsyncIteration:
            self.finish_reason = "error"
            raise RouterError("the router ended the request without any output", status=503) from None
        except RouterError:
            self.finish_reason = "rejected"  # nothing to abort
            raise
        self._started = True
        return first

    async def next(self) -> TokenDelta:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            return TokenDelta([], finished=True, finish_reason="error",
                              error="the router ended the request without a final status")

    def feed(self, delta: TokenDelta) -> str:
        """Account for ``delta``; return the new text to show."""
        now = time.monotonic()
        n = len(delta.new_token_ids)
        if n:
            if self._last_token_at is None:
                self.metrics.on_first_token(now - self.prep.arrival, delta.ttft_breakdown)
            else:
                self.metrics.on_tokens(now - self._last_token_at, n)
                # Disaggregated TTFT parts known only later (KV transfer, first decode step).
                self.metrics.observe_ttft_parts(delta.ttft_breakdown)
            self._last_token_at = now
        elif delta.ttft_breakdown and self._last_token_at is not None:
            self.metrics.observe_ttft_parts(delta.ttft_breakdown)
        self.num_output = max(self.num_output + n, delta.num_output_tokens)
        self.num_draft = max(self.num_draft, delta.num_draft_tokens)
        self.num_accepted = max(self.num_accepted, delta.num_accepted_tokens)
        text = self.detok.add(delta.new_token_ids, delta.finished)
        if delta.finished:
            self.finish_reason = delta.finish_reason or "stop"
            self.error = delta.error if self.finish_reason == "error" else None
        elif self.detok.hit_stop:  # the router has not stopped it yet: we do
            self.finish_reason = "stop"
        return text

    async def collect(self, first: TokenDelta) -> None:
        self.feed(first)
        while not self.finished:
            self.feed(await self.next())

    async def close(self) -> None:
        """Idempotent: abort in the router unless finished there, close the stream, record metrics."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self.finish_reason is None:
                self.finish_reason = "abort"
            try:
                if self.finish_reason == "abort" or self.detok.hit_stop:
                    await self.router.abort(self.prep.request_id)
                aclose = getattr(self.stream, "aclose", None)
                if aclose is not None:
                    await aclose()
            except Exception:  # noqa: BLE001 - cleanup must not mask the request's outcome
                log.exception("closing request %s failed", self.prep.request_id)
            if self._started:  # a request refused at admission is no finished request
                self.metrics.on_finish(time.monotonic() - self.prep.arrival, len(self.prep.prompt_token_ids),
                                       self.num_output, self.finish_reason, self.num_draft, self.num_accepted)

    def usage(self) -> dict:
        n_prompt = len(self.prep.prompt_token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": self.num_output,
                "total_tokens": n_prompt + self.num_output}


def _header(prep: Prepared, chunk: bool) -> dict:
    kind = prep.object_kind + (".chunk" if chunk and prep.object_kind == "chat.completion" else "")
    return {"id": prep.request_id, "object": kind, "created": prep.created, "model": prep.model}


def _choice(prep: Prepared, text: str, finish_reason: str | None, chunk: bool, first: bool = False) -> dict:
    if prep.object_kind == "text_completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _sse_stream(run: Run, first: TokenDelta) -> AsyncIterator[bytes]:
    prep = run.prep
    usage_field = {"usage": None} if prep.include_usage else {}

    def chunk(text: str, finish_reason: str | None, first_chunk: bool = False) -> bytes:
        return _sse({**_header(prep, True), "choices": [_choice(prep, text, finish_reason, True, first_chunk)],
                     **usage_field})

    try:
        if prep.object_kind == "chat.completion":
            yield chunk("", None, first_chunk=True)
        delta = first
        while True:
            text = run.feed(delta)
            if run.finished:
                break
            if text:
                yield chunk(text, None)
            delta = await run.next()
        if run.finish_reason == "error":
            if text:
                yield chunk(text, None)
            yield _sse(error_body(f"generation failed: {run.error}", "server_error"))
        else:
            yield chunk(text, run.finish_reason)
            if prep.include_usage:
                yield _sse({**_header(prep, True), "choices": [], "usage": run.usage()})
        yield _sse("[DONE]")
    except Exception:  # noqa: BLE001 - the status line is gone: report it in the stream
        log.exception("stream of %s failed", prep.request_id)
        yield _sse(error_body("internal error while streaming", "server_error"))
        yield _sse("[DONE]")
    finally:
        await run.close()  # a client disconnect cancels us here: the router request is aborted


async def serve_request(prep: Prepared, request: Request, router, metrics: Metrics) -> Response:
    run = Run(prep, router, metrics)
    handed_off = False
    try:
        try:
            first = await _unless_disconnected(run.start(), request)
        except RouterError as e:
            raise APIError(e.status, str(e), kind=e.kind) from e
        if prep.stream:
            handed_off = True
            # The stream closes the run when it ends or is cancelled; the background task covers a
            # client that left before the stream even started (close is idempotent).
            return StreamingResponse(_sse_stream(run, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(run.close))
        await _unless_disconnected(run.collect(first), request)
        if run.finish_reason == "error":
            raise APIError(503, f"generation failed: {run.error}", kind="server_error")
        return JSONResponse({**_header(prep, False), "choices": [_choice(prep, run.detok.text, run.finish_reason,
                                                                        False)], "usage": run.usage()})
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it; the request is aborted in close()
    finally:
        if not handed_off:
            await run.close()


# ================================================================================== middleware


class CatchAllMiddleware:
    """An unexpected exception becomes a 500 with a generic message (details go to the log), answered
    here so the connection stays usable (Starlette's last-resort handler re-raises, and uvicorn then
    drops the connection)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # half a response is out: the server has to drop the connection
            response = _error_response(500, "internal server error (details are in the server log)")
            await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over ``max_body_bytes``: at once by Content-Length, else while it streams in."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            response = _error_response(413, f"request body has {int(length)} bytes, more than the limit of "
                                            f"{limit} bytes", code="request_too_large")
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on /v1/*; /health, /metrics and the docs stay open."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                message = ("missing API key: send the header 'Authorization: Bearer <key>'" if not given
                           else "invalid API key in the Authorization header")
                response = _error_response(401, message, code="invalid_api_key",
                                           headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ================================================================================== the app


def build_app(router, served_model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
              metrics: Metrics | None = None) -> FastAPI:
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes!r}")
    metrics = metrics or Metrics(served_model_name)
    app = FastAPI(title="pdcluster", description="OpenAI-compatible API of a disaggregated prefill/decode cluster")
    app.state.router, app.state.metrics = router, metrics
    started = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc.status, exc.message, exc.kind, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(list(exc.errors()))
        return _error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return _error_response(exc.status_code, message, code=exc.status_code, headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serve_request(await prepare(body, router, served_model_name), request, router, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serve_request(await prepare(body, router, served_model_name), request, router, metrics)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": started,
                                            "owned_by": "pdcluster", "root": router.model_name,
                                            "max_model_len": router.max_model_len}]}

    @app.get("/health")
    async def health():
        try:
            stats = router.stats()  # on the loop, as the router's own state lives there; must not block
        except Exception as e:  # noqa: BLE001 - unhealthy, say why
            return JSONResponse({"status": "unhealthy", "error": f"router stats failed: {e!r}"}, status_code=503)
        healthy = bool(stats.get("healthy", True))
        return JSONResponse({"status": "ok" if healthy else "unhealthy", **stats},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            metrics.refresh(router.stats())
        except Exception as e:  # noqa: BLE001 - still serve the counters
            log.warning("router stats failed while scraping metrics: %r", e)
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # outermost: no body is read without a key
    return app
