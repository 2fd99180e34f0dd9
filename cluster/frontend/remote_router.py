"""RemoteRouter: the router contract (cluster/api/router_contract.py) in an API process, over the
router process's RouterService (service.py). The app cannot tell it from the router itself.

``handshake`` (blocking, before the app is built) learns the model's name, length and tokenizer
directory. Then, on the server's event loop and started on first use, a DEALER socket to the router
process and a PULL socket it answers on (``reply_endpoint``): one reader task hands each request's
deltas to its queue. Every wait is bounded: the router process sends its stats
every ``STATS_INTERVAL_S``; once nothing came for ``SILENCE_LIMIT_S`` every open stream ends with
finish_reason "error" and new requests get 503 until it speaks again.
"""

from __future__ import annotations

import asyncio
import json
import itertools
import logging
import time
from typing import AsyncIterator

import zmq
import zmq.asyncio

from pdcluster.cluster.api.router_contract import RouterError, TokenDelta
from pdcluster.cluster.delta_queue import DeltaQueue
from pdcluster.cluster.frontend.protocol import (FRONTEND_CODEC, MAX_FRONTEND_BYTES, SILENCE_LIMIT_S, Abort,
                                                 AdminCall, AdminReply, Deltas, Generate, Hello, Refused, Stats,
                                                 LORA_NAMES_KEY, Welcome, from_delta, sampling_map)
from pdcluster.cluster.token_deltas import can_merge, merge_queued
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.wire.records import ProtocolError

log = logging.getLogger(__name__)


class _Silent:
    """Queued to every stream once the router process has been silent for SILENCE_LIMIT_S."""


def handshake(endpoint: str, index: int, timeout_s: float) -> Welcome:
    """Ask the router process what it serves (a blocking socket of its own: no event loop runs yet)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(FRONTEND_CODEC.encode(Hello(index)))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                continue
            msg = FRONTEND_CODEC.decode(sock.recv(), MAX_FRONTEND_BYTES)
            if isinstance(msg, Welcome):
                return msg
        raise RouterError(f"the router process did not answer at {endpoint} within {timeout_s:.0f} s")
    finally:
        sock.close(0)


def _is_row(item) -> bool:
    """A queued plain row (token ids, output, draft, accepted tokens): it may join the delta before it."""
    return type(item) is tuple


class RemoteRouter:
    def __init__(self, endpoint: str, reply_endpoint: str, index: int, welcome: Welcome,
                 silence_limit_s: float = SILENCE_LIMIT_S):
        self.endpoint, self.reply_endpoint, self.index = endpoint, reply_endpoint, index
        self.silence_limit_s = silence_limit_s
        self.model_name, self.max_model_len = welcome.model_name, welcome.max_model_len
        self.lora_names = tuple(welcome.lora_names)
        self.max_images_per_prompt = welcome.max_images_per_prompt
        self.mm_processor_kwargs = welcome.mm_processor_kwargs
        self.tokenizer = Tokenizer(welcome.tokenizer_dir)
        self._sock: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._queues: dict[str, DeltaQueue] = {}
        self._admin_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stats: dict = {"healthy": False, "error": "no word from the router process yet"}
        self._last_heard = time.monotonic()
        self._silent = False

    # ---- the contract -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        self._start()
        if self._silent:
            raise RouterError(f"the router process has not answered for over {self.silence_limit_s:g} s", 503)
        if request_id in self._queues:
            raise RouterError(f"request id {request_id!r} is already in use", 400, "invalid_request_error")
        queue = DeltaQueue()
        self._queues[request_id] = queue
        self._send(Generate(request_id, list(prompt_token_ids), sampling_map(params)))
        finished = False
        merge = can_merge(params)
        num_prompt = num_cached = num_offloaded = 0  # from the first delta; rows do not repeat them

        def row_delta(row: tuple) -> TokenDelta:  # a plain row: (token ids, output, draft, accepted tokens)
            return TokenDelta(row[0], num_prompt_tokens=num_prompt, num_output_tokens=row[1], num_draft_tokens=row[2],
                              num_accepted_tokens=row[3], num_cached_tokens=num_cached,
                              num_offloaded_tokens=num_offloaded)

        try:
            while not finished:
                item = await queue.get()
                if _is_row(item):
                    delta = row_delta(item)
                    if merge:  # rows that came while the consumer was busy go out as one delta (one chunk)
                        delta = merge_queued(delta, queue, _is_row, row_delta)
                    yield delta
                    continue
                if isinstance(item, Refused):
                    finished = True  # nothing was placed: nothing to abort
                    raise RouterError(item.message, item.status, item.kind)
                if isinstance(item, _Silent):
                    finished = True
                    yield TokenDelta([], finished=True, finish_reason="error",
                                     error=f"the router process has not answered for over {self.silence_limit_s:g} s")
                    return
                delta = from_delta(item)
                num_prompt, num_cached, num_offloaded = (delta.num_prompt_tokens, delta.num_cached_tokens,
                                                         delta.num_offloaded_tokens)
                finished = delta.finished
                yield delta
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the consumer stopped early: free it in the router
                self._send(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._start()
        self._send(Abort(request_id))

    def stats(self) -> dict:
        if self._silent:
            return {**self._stats, "healthy": False,
                    "error": f"the router process has not answered for over {self.silence_limit_s:g} s"}
        return self._stats

    # ---- the rest -----------------------------------------------------------------------------------
    async def admin(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> AdminReply:
        """An /admin/* request, answered by the router process's admin routes. RouterError (503) when
        that process is silent, or falls silent before it answers."""
        self._start()
        if self._silent:
            raise RouterError(f"the router process has not answered for over {self.silence_limit_s:g} s", 503)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._admin_calls[call_id] = future
        try:
            self._send(AdminCall(call_id, method, path, [k for k, _ in headers], [v for _, v in headers], body))
            return await future
        finally:
            self._admin_calls.pop(call_id, None)

    async def load_lora(self, name: str, path: str) -> str:
        """vLLM's runtime LoRA load, done by the router process (its /v1/load_lora_adapter beside the admin
        routes); this process names the adapter at once, the others from the next Stats."""
        await self._lora_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        self.lora_names = (*self.lora_names, name) if name not in self.lora_names else self.lora_names
        return ""

    async def unload_lora(self, name: str) -> None:
        await self._lora_call("/v1/unload_lora_adapter", {"lora_name": name})
        self.lora_names = tuple(n for n in self.lora_names if n != name)

    async def _lora_call(self, path: str, body: dict) -> None:
        reply = await self.admin("POST", path, [("content-type", "application/json")], json.dumps(body).encode())
        if reply.status != 200:
            try:
                error = json.loads(reply.body)["error"]
                message, kind = error["message"], error.get("type", "invalid_request_error")
            except (ValueError, KeyError, TypeError):
                message, kind = reply.body.decode(errors="replace"), "server_error"
            raise RouterError(message, status=reply.status, kind=kind)

    def announce_ready(self) -> None:
        """The HTTP server listens (the supervisor prints the serving line once every process did)."""
        self._start()
        self._send(Hello(self.index, self.reply_endpoint, ready=True))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for sock in (self._sock, self._pull):
            if sock is not None:
                sock.close(0)

    def _start(self) -> None:
        if self._sock is not None:
            return
        ctx = zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(self.endpoint)
        self._pull = ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self.reply_endpoint)
        self._last_heard = time.monotonic()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch_silence())]
        self._send(Hello(self.index, self.reply_endpoint))  # the router answers on _pull from now on

    def _send(self, msg) -> None:
        sent = self._sock.send(FRONTEND_CODEC.encode(msg))
        sent.add_done_callback(_log_failure)

    async def _read(self) -> None:
        while True:
            data = await self._pull.recv(copy=False)
            try:
                msg = FRONTEND_CODEC.decode(data.buffer, MAX_FRONTEND_BYTES)
            except ProtocolError as e:
                log.warning("dropping malformed message from the router process (%d bytes): %s", len(data.buffer), e)
                continue
            self._last_heard = time.monotonic()
            if self._silent:
                log.warning("the router process answers again")
                self._silent = False
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                log.exception("router message %s failed", type(msg).__name__)

    def _on_message(self, msg) -> None:
        if isinstance(msg, Deltas):  # in the router's order: each full delta before the row at its position
            queues, start, token_ids = self._queues, 0, msg.new_token_ids
            full, positions = msg.full, msg.full_positions
            j, num_full = 0, len(full)
            for i, (rid, n, output, draft, accepted) in enumerate(zip(
                    msg.request_ids, msg.num_new_tokens, msg.num_output_tokens, msg.num_draft_tokens,
                    msg.num_accepted_tokens)):
                while j < num_full and positions[j] <= i:
                    self._put_full(full[j])
                    j += 1
                queue = queues.get(rid)
                if queue is not None:  # else its stream already ended (aborted, consumer gone)
                    queue.put_nowait((token_ids[start:start + n], output, draft, accepted))
                start += n
            for delta in full[j:]:
                self._put_full(delta)
        elif isinstance(msg, Stats):
            stats = dict(msg.stats)
            self.lora_names = tuple(stats.pop(LORA_NAMES_KEY, self.lora_names))
            self._stats = stats
        elif isinstance(msg, Refused):
            queue = self._queues.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)
        elif isinstance(msg, AdminReply):
            future = self._admin_calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif not isinstance(msg, Welcome):
            log.warning("dropping a %s from the router process: not a message it sends", type(msg).__name__)

    def _put_full(self, delta) -> None:
        queue = self._queues.get(delta.request_id)
        if queue is not None:
            queue.put_nowait(delta)

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.silence_limit_s / 4))
            if self._silent or time.monotonic() - self._last_heard <= self.silence_limit_s:
                continue
            log.error("the router process has not answered for over %g s: ending %d streams", self.silence_limit_s,
                      len(self._queues))
            self._silent = True
            for queue in self._queues.values():
                queue.put_nowait(_Silent())
            for future in self._admin_calls.values():
                if not future.done():
                    future.set_exception(RouterError("the router process is not answering", 503))


def _log_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("cannot send to the router process: %s", sent.exception())
