"""Serving a validated request (cluster/api_validation.py ``Prepared``): one stream of TokenDeltas from
the router becomes a JSON response or an SSE stream, with the text, the usage, the metrics and the
finish reason.

Text and stop strings are applied here and only here (engine/tokenizer.py ``Detokenizer``): the router
and the engine stream token ids; when the text reaches a stop string the request ends with
finish_reason "stop" and is aborted in the router. A client that goes away aborts its request too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pdcluster.cluster import api_protocol as wire
from pdcluster.cluster.api_middleware import APIError
from pdcluster.cluster.api_validation import Prepared
from pdcluster.cluster.metrics import Metrics
from pdcluster.cluster.router_api import RouterError, TokenDelta
from pdcluster.engine.tokenizer import Detokenizer

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


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
        if delta.finished and delta.finish_reason == "error":
            self.finish_reason, self.error = "error", delta.error
        elif self.detok.hit_stop:  # the text reached a stop string: the request ends here (close aborts it)
            self.finish_reason = "stop"
        elif delta.finished:
            self.finish_reason = delta.finish_reason or "stop"
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
        return wire.usage(len(self.prep.prompt_token_ids), self.num_output)

    def header(self, chunk: bool) -> dict:
        p = self.prep
        return wire.header(p.request_id, p.object_kind, p.created, p.model, chunk)


async def _sse_stream(run: Run, first: TokenDelta) -> AsyncIterator[bytes]:
    prep = run.prep
    usage_field = {"usage": None} if prep.include_usage else {}

    def chunk(text: str, finish_reason: str | None, first_chunk: bool = False) -> bytes:
        return wire.sse({**run.header(True), "choices": [wire.choice(prep.object_kind, text, finish_reason, True,
                                                                     first_chunk)], **usage_field})

    try:
        if prep.object_kind == wire.CHAT_COMPLETION:
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
            yield wire.sse(wire.error_body(f"generation failed: {run.error}", "server_error"))
        else:
            yield chunk(text, run.finish_reason)
            if prep.include_usage:
                yield wire.sse({**run.header(True), "choices": [], "usage": run.usage()})
        yield wire.sse("[DONE]")
    except Exception:  # noqa: BLE001 - the status line is gone: report it in the stream
        log.exception("stream of %s failed", prep.request_id)
        yield wire.sse(wire.error_body("internal error while streaming", "server_error"))
        yield wire.sse("[DONE]")
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
        return JSONResponse({**run.header(False), "choices": [wire.choice(prep.object_kind, run.detok.text,
                                                                          run.finish_reason, False)],
                             "usage": run.usage()})
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it; the request is aborted in close()
    finally:
        if not handed_off:
            await run.close()
