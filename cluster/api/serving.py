"""Serving a validated request (cluster/api/validation.py ``Prepared``): its choices' router streams
(cluster/api/fanout.py, one cluster/api/choice.py ``ChoiceRun`` each) become one JSON response or one
SSE stream, with the text, the logprobs, tool calls, the usage and the finish reasons. A chat choice
that may hold tool calls is read by the request's tool-call parser (cluster/api/tool_parsers/): whole, or
piece by piece into OpenAI's ``delta.tool_calls``; its finish reason is then "tool_calls".

A client that goes away aborts every router request of its response; so does a choice that fails.
Usage counts each prompt's tokens once (not once per choice) and sums the completion tokens of every
choice; ``cached_tokens`` of a prompt is the fewest any of its choices found in the prefix cache (its
choices run concurrently and may find each other's blocks: the smallest is what one prefill would get).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pdcluster.cluster.api import protocol as wire
from pdcluster.cluster.api.choice import ChoiceRun
from pdcluster.cluster.api.tracing import trace_of
from pdcluster.cluster.api.fanout import choice_requests, collect_all, interleaved, start_all
from pdcluster.cluster.api.logprobs import (Positions, TokenIdStrings, TokenStrings, chat_logprobs,
                                            completion_logprobs, vllm_prompt_logprobs)
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.reasoning import reasoning_fields, reasoning_stream, split_reasoning
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.api.tool_parsers import ToolCallStream
from pdcluster.cluster.api.validation import Prepared
from pdcluster.cluster.metrics import Metrics

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    pass


async def unless_disconnected(awaitable, request: Request):
    """Await ``awaitable``; raise ClientGone (cancelling it) if the client goes away first."""
    task = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class Reply:
    """What every part of one response shares: the request, its runs, the token strings."""

    def __init__(self, prep: Prepared, runs: list[ChoiceRun], strings: TokenStrings):
        self.prep, self.runs = prep, runs
        self.strings = TokenIdStrings(strings) if prep.output.tokens_as_ids else strings
        mode = prep.output.tool_calls if prep.object_kind == wire.CHAT_COMPLETION else None
        # Per choice index, the parser of its stream (only for a request whose text may hold tool calls).
        self.tool_streams = {} if mode is None else {
            run.index: ToolCallStream(mode.reader(), mode.max_calls) for run in runs}
        # Per choice index, its reasoning parser's stream (chat with --reasoning-parser: cluster/api/reasoning.py).
        parser = prep.output.reasoning_parser
        self.reasoning_streams = {} if parser is None else {run.index: reasoning_stream(parser) for run in runs}

    def header(self, chunk: bool) -> dict:
        p = self.prep
        return wire.header(p.response_id, p.object_kind, p.created, p.model, chunk)

    def logprobs(self, positions: Positions | None) -> dict | None:
        num_top = self.prep.output.num_logprobs
        if positions is None or num_top is None:  # tokens tracked for return_token_ids only
            return None
        if self.prep.object_kind == wire.TEXT_COMPLETION:
            return completion_logprobs(positions, num_top, self.strings)
        return chat_logprobs(positions, num_top, self.strings)

    def usage(self) -> dict:
        num_prompt = sum(len(p.token_ids) for p in self.prep.prompts)
        num_output = sum(run.num_shown_output for run in self.runs)
        cached: dict[int, int] = {}
        for run in self.runs:
            i = run.request.prompt_index
            cached[i] = min(cached.get(i, run.num_cached), run.num_cached)
        return wire.usage(num_prompt, num_output, sum(cached.values()))

    def prompt_logprobs(self, run: ChoiceRun) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` of ``run``'s prompt (asked for: ``prep.output.num_prompt_logprobs``)."""
        return vllm_prompt_logprobs(run.request.prompt.token_ids, run.prompt_records or [],
                                    self.prep.output.num_prompt_logprobs, self.strings)

    def json_extras(self) -> dict:
        """Response-level fields beside a chat response's choices (vLLM puts them there: every choice has
        the one prompt): ``prompt_logprobs``, ``prompt_token_ids``."""
        out = self.prep.output
        if self.prep.object_kind != wire.CHAT_COMPLETION:
            return {}
        extras: dict = {}
        if out.num_prompt_logprobs is not None:
            extras["prompt_logprobs"] = self.prompt_logprobs(self.runs[0])
        if out.return_token_ids:
            extras["prompt_token_ids"] = list(self.runs[0].request.prompt.token_ids)
        return extras

    def _with_ids(self, choice: dict, run: ChoiceRun, positions: Positions | None, first: bool = False) -> dict:
        """``choice`` with vLLM's ``token_ids`` (the tokens of its text: with echo the prompt's too, as vLLM)
        and, on a completion's first, ``prompt_token_ids``."""
        if self.prep.output.return_token_ids:
            choice["token_ids"] = list(positions.token_ids) if positions is not None else []
            if first and self.prep.object_kind == wire.TEXT_COMPLETION:
                choice["prompt_token_ids"] = list(run.request.prompt.token_ids)
        return choice

    def choice(self, run: ChoiceRun) -> dict:
        """A choice of the JSON response."""
        return self._with_ids(self._choice(run), run, run.positions, first=True)

    def _choice(self, run: ChoiceRun) -> dict:
        logprobs = self.logprobs(run.positions)
        if self.prep.object_kind == wire.TEXT_COMPLETION:
            choice = wire.completion_choice(run.index, run.text, logprobs, run.finish_reason)
            if self.prep.output.num_prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs(run)
            return choice
        text, reasoning = run.text, None
        if self.prep.output.reasoning_parser is not None:  # the answer is what follows the reasoning
            split = split_reasoning(self.prep.output.reasoning_parser, text)
            text, reasoning = split.content, split.reasoning or None
        choice = self._chat_choice(run, text, logprobs)
        if self.prep.output.chat_echo:  # vLLM's chat echo: the reply the client began, then its continuation
            choice["message"]["content"] = self.prep.output.chat_echo + (choice["message"]["content"] or "")
        if self.prep.output.reasoning_parser is not None:
            message = choice["message"]
            message["content"] = message["content"] or None  # as vLLM: no answer yet is null
            if self.prep.output.include_reasoning:
                message.update(reasoning_fields(reasoning))
        return choice

    def _chat_choice(self, run: ChoiceRun, text: str, logprobs: dict | None) -> dict:
        mode, role = self.prep.output.tool_calls, self.prep.output.role
        if mode is None:
            return wire.chat_choice(run.index, text, logprobs, run.finish_reason, role=role)
        content, calls = mode.reader().parse(text, mode.max_calls)
        if calls:
            return wire.chat_choice(run.index, content or None, logprobs, "tool_calls", calls, role=role)
        return wire.chat_choice(run.index, content, logprobs, run.finish_reason, role=role)

    def opening(self, run: ChoiceRun) -> bytes | None:
        """A choice's first stream chunk, before its text: chat's role chunk (with the response-level
        ``prompt_token_ids`` when asked), a completion's ``prompt_token_ids`` chunk when asked; else None."""
        if self.prep.object_kind == wire.CHAT_COMPLETION:
            ids = self.prep.output.return_token_ids
            extra = {"prompt_token_ids": list(run.request.prompt.token_ids)} if ids else {}
            echoed = self.prep.output.chat_echo  # chat's echo goes out with the role
            first = wire.chat_chunk_choice(run.index, echoed, None, None, True, self.prep.output.role)
            return self._sse(self._with_ids(first, run, None), extra)
        if not self.prep.output.return_token_ids:
            return None
        return self._sse(self._with_ids(wire.completion_choice(run.index, "", None, None), run, None, first=True))

    def chunk(self, run: ChoiceRun, text: str, positions: Positions | None, finish_reason: str | None) -> bytes:
        logprobs = self.logprobs(positions)
        if self.prep.object_kind == wire.TEXT_COMPLETION:
            choice = wire.completion_choice(run.index, text, logprobs, finish_reason)
        else:
            choice = wire.chat_chunk_choice(run.index, text, logprobs, finish_reason)
        return self._sse(self._with_ids(choice, run, positions))

    def chunks(self, run: ChoiceRun, text: str, positions: Positions | None, finish_reason: str | None) -> list[bytes]:
        """The chunks for a piece of a choice: one, or with reasoning or tool calls one per delta of their
        parsers (the piece's reasoning first; its logprobs on the first, the finish reason on the last)."""
        stream = self.tool_streams.get(run.index)
        reasoning_stream = self.reasoning_streams.get(run.index)
        if stream is None and reasoning_stream is None:
            return [self.chunk(run, text, positions, finish_reason)]
        deltas = []
        if reasoning_stream is not None:
            split = reasoning_stream.feed(text)
            if finish_reason is not None:
                split = split + reasoning_stream.finish()
            text = split.content
            if split.reasoning and self.prep.output.include_reasoning:
                deltas.append(reasoning_fields(split.reasoning))
        if stream is None:
            deltas += [{"content": text}] if text else []
        else:
            deltas += stream.feed(text)
            if finish_reason is not None and finish_reason != "error":
                deltas += stream.finish()
                finish_reason = "tool_calls" if stream.num_final_calls else finish_reason
        has_tokens = positions is not None and bool(positions.token_ids)
        if not deltas and (has_tokens or finish_reason is not None):
            deltas = [{}]  # held-back text: its logprobs still go out, and so does the finish reason
        out = []
        for i, delta in enumerate(deltas):
            logprobs = self.logprobs(positions) if i == 0 else None
            reason = finish_reason if i == len(deltas) - 1 else None
            choice = wire.chat_delta_choice(run.index, delta, logprobs, reason)
            out.append(self._sse(self._with_ids(choice, run, positions if i == 0 else None)))
        return out

    def _sse(self, choice: dict, extra: dict | None = None) -> bytes:
        if self.prep.continuous_usage:
            usage_field = {"usage": self.usage()}  # so far: every prompt's tokens, the tokens shown until now
        else:
            usage_field = {"usage": None} if self.prep.include_usage else {}
        return wire.sse({**self.header(True), "choices": [choice], **usage_field, **(extra or {})})


async def close_all(runs: list[ChoiceRun]) -> None:
    await asyncio.gather(*(run.close() for run in runs))


async def guarded_sse(events: AsyncIterator[bytes], runs: list[ChoiceRun], request_id: str) -> AsyncIterator[bytes]:
    """``events`` (a response's SSE events, ending with its ``[DONE]``) as they come; an exception among them is
    reported in the stream, which then ends (the status line is gone); every run is closed at the end, however it
    came (a client disconnect cancels us here: every router request is aborted)."""
    try:
        async with contextlib.aclosing(events):  # closed now, not when collected: it holds the runs' reading tasks
            async for event in events:
                yield event
    except Exception:  # noqa: BLE001 - the status line is gone: report it in the stream
        log.exception("stream of %s failed", request_id)
        yield wire.sse(wire.error_body("internal error while streaming", "server_error"))
        yield wire.sse("[DONE]")
    finally:
        await close_all(runs)


def _sse_stream(resp: Reply, firsts) -> AsyncIterator[bytes]:
    return guarded_sse(_sse_events(resp, firsts), resp.runs, resp.prep.request_id)


async def _sse_events(resp: Reply, firsts) -> AsyncIterator[bytes]:
    prep, runs = resp.prep, resp.runs
    for run in runs:
        opening = resp.opening(run)
        if opening is not None:
            yield opening
    failed = None
    async with interleaved(runs, firsts) as pieces:
        async for run, piece, finish_reason in pieces:
            has_tokens = piece.positions is not None and bool(piece.positions.token_ids)
            if finish_reason == "error":
                if piece.text or has_tokens:
                    for chunk in resp.chunks(run, piece.text, piece.positions, None):
                        yield chunk
                failed = run
            elif finish_reason is not None or piece.text or has_tokens:
                for chunk in resp.chunks(run, piece.text, piece.positions, finish_reason):
                    yield chunk
    if failed is not None:
        yield wire.sse(wire.error_body(f"generation failed: {failed.error}", "server_error"))
    elif prep.include_usage:
        yield wire.sse({**resp.header(True), "choices": [], "usage": resp.usage()})
    yield wire.sse("[DONE]")


async def serve_request(prep: Prepared, request: Request, router, metrics: Metrics,
                        strings: TokenStrings) -> Response:
    def json_body(resp: Reply) -> dict:
        body = {**resp.header(False), "choices": [resp.choice(run) for run in resp.runs], "usage": resp.usage(),
                **resp.json_extras()}
        if prep.prompts[0].params.kv_transfer_params is not None:  # vLLM's field, for its proxies
            body["kv_transfer_params"] = resp.runs[0].kv_transfer_params
        return body

    return await serve_runs(prep, request, router, metrics, strings, _sse_stream, json_body)


async def serve_runs(prep: Prepared, request: Request, router, metrics: Metrics, strings: TokenStrings,
                     stream_body: Callable[[Reply, list], AsyncIterator[bytes]],
                     json_body: Callable[[Reply], dict | list], prompt_ids: list[str] | None = None) -> Response:
    """Start every choice, then answer ``stream_body(reply, first deltas)`` as SSE (``prep.stream``) or
    ``json_body(reply)`` once all ended (503 if one failed): chat and completions here, the Responses API's
    own layout (responses.py), SGLang's /generate and vLLM's tokens route (sglang_generate.py, vllm_tokens.py, whose
    clients name the prompts: ``prompt_ids``, fanout.choice_requests)."""
    trace = trace_of(request)
    runs = [ChoiceRun(prep, c, router, metrics, trace) for c in choice_requests(prep, prompt_ids)]
    resp = Reply(prep, runs, strings)
    handed_off = False
    try:
        try:
            firsts = await unless_disconnected(start_all(runs), request)
        except RouterError as e:
            raise APIError(e.status, str(e), kind=e.kind) from e
        if prep.stream:
            handed_off = True
            # The stream closes the runs when it ends or is cancelled; the background task covers a
            # client that left before the stream even started (close is idempotent).
            return StreamingResponse(stream_body(resp, firsts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(close_all, runs))
        await unless_disconnected(collect_all(runs, firsts), request)
        failed = next((run for run in runs if run.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(503, f"generation failed: {failed.error}", kind="server_error")
        return JSONResponse(json_body(resp))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the requests are aborted in close()
    finally:
        if not handed_off:
            await close_all(runs)
