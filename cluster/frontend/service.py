"""RouterService: the router (cluster/router/router.py or cluster/local_router.py) behind a zmq ROUTER
socket, in the process that owns it, for the API processes (remote_router.py).

Each Generate becomes one task running ``router.deliver`` (the contract's push form): the router hands
each delta, from the handler of the worker event that made it, straight to that process's outbox (no
queue or task wake-up per token). A process's queued deltas go out as one ``Deltas`` message once the
loop's current turn is done, so a decode step of a big batch costs each API process one message, not
one per request. Requests arrive on one ROUTER socket (asyncio); everything for a process goes out on a
PUSH socket to it, sent at once (no high-water mark: a send never waits). A malformed message is
dropped and logged; the service lives on. Everything runs on the router's own event loop: the router
is not thread-safe, and needs none.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from pdcluster.cluster.api.router_contract import RouterError, TokenDelta
from pdcluster.cluster.frontend.protocol import (FRONTEND_CODEC, MAX_FRONTEND_BYTES, STATS_INTERVAL_S, Abort,
                                                 AdminCall, AdminReply, Deltas, Generate, Hello, Refused, Stats,
                                                 LORA_NAMES_KEY, Welcome, is_plain, to_delta)
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.wire.records import ProtocolError, assemble

log = logging.getLogger(__name__)

# The longest an admin call may take: a drain waits for its workers up to the timeout it was given, at
# most a day (cluster/api/admin.py DrainRequest.timeout_s).
ADMIN_CALL_TIMEOUT_S = 24 * 3600 + 60
# After an Abort, how long the router has to end the request's stream itself before the service closes it.
ABORT_GRACE_S = 1.0


class _Outbox:
    """One process's deltas since the last send, in order (the fields of a Deltas record)."""

    __slots__ = ("request_ids", "num_new_tokens", "new_token_ids", "num_output_tokens", "num_draft_tokens",
                 "num_accepted_tokens", "full", "full_positions")

    def __init__(self):
        self.request_ids, self.num_new_tokens, self.new_token_ids = [], [], []
        self.num_output_tokens, self.num_draft_tokens, self.num_accepted_tokens = [], [], []
        self.full, self.full_positions = [], []

    def add(self, rid: str, delta: TokenDelta, first: bool) -> None:
        if first or not is_plain(delta):
            self.full.append(to_delta(rid, delta))
            self.full_positions.append(len(self.request_ids))  # before the rows that come after it
        else:
            self.add_row(rid, delta.new_token_ids, delta.num_output_tokens, delta.num_draft_tokens,
                         delta.num_accepted_tokens)

    def add_row(self, rid: str, token_ids: list[int], num_output_tokens: int, num_draft_tokens: int,
                num_accepted_tokens: int) -> None:
        """A plain delta as a row."""
        self.request_ids.append(rid)
        self.num_new_tokens.append(len(token_ids))
        self.new_token_ids.extend(token_ids)
        self.num_output_tokens.append(num_output_tokens)
        self.num_draft_tokens.append(num_draft_tokens)
        self.num_accepted_tokens.append(num_accepted_tokens)

    def record(self) -> Deltas:
        """Built without the construction checks: the rows are the router's own (its request ids; tokens and
        counts of worker events checked as they were decoded, or of the in-process engine) and ``full`` holds
        checked records. ``_send`` encodes it, which checks it (~35 us less a batch of 64 rows)."""
        return assemble(Deltas, {"request_ids": self.request_ids, "num_new_tokens": self.num_new_tokens,
                                 "new_token_ids": self.new_token_ids, "num_output_tokens": self.num_output_tokens,
                                 "num_draft_tokens": self.num_draft_tokens,
                                 "num_accepted_tokens": self.num_accepted_tokens, "full": self.full,
                                 "full_positions": self.full_positions})


class RouterService:
    """``admin(call) -> AdminReply``: answers /admin/* (None: those routes answer 404 in every process).
    ``on_hello(index, ready)``: a process said hello (the supervisor counts ready processes)."""

    def __init__(self, router, endpoint: str, tokenizer_dir: str,
                 admin: Callable[[AdminCall], Awaitable[AdminReply]] | None = None,
                 on_hello: Callable[[int, bool], None] | None = None):
        self.router, self.endpoint = router, endpoint
        self._welcome = Welcome(router.model_name, router.max_model_len, tokenizer_dir,
                               list(router.lora_names), router.max_images_per_prompt, router.mm_processor_kwargs)
        self._admin, self._on_hello = admin, on_hello
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No high-water marks: a message dropped for a slow process would stall its stream; what a slow
        # process has not read waits here, as it would in the router's own queues.
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(endpoint)
        self._streams: dict[str, tuple[bytes, asyncio.Task]] = {}  # request id -> (its process, its task)
        self._pushes: dict[bytes, zmq.Socket] = {}  # process -> the socket to it (sync: sends never wait)
        self._outboxes: dict[bytes, _Outbox] = {}  # process -> deltas not yet sent
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def run(self) -> None:
        """Serve until cancelled."""
        stats = asyncio.create_task(self._send_stats())
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                if len(frames) != 2:
                    log.warning("dropping a frontend message of %d frames (want identity and body)", len(frames))
                    continue
                identity, data = frames[0].bytes, frames[1].buffer
                try:
                    msg = FRONTEND_CODEC.decode(data, MAX_FRONTEND_BYTES)
                except ProtocolError as e:
                    log.warning("dropping malformed frontend message from %r (%d bytes): %s", identity,
                                len(data), e)
                    continue
                try:
                    self._on_message(identity, msg)
                except Exception:  # noqa: BLE001 - one bad request must not stop the others
                    log.exception("frontend message %s from %r failed", type(msg).__name__, identity)
        finally:
            stats.cancel()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for push in self._pushes.values():
            push.close(0)
        self._sock.close(0)
        self._ctx.term()

    # ---- requests -------------------------------------------------------------------------------------
    def _on_message(self, identity: bytes, msg) -> None:
        if identity not in self._pushes and not isinstance(msg, Hello):
            log.warning("dropping a %s from %r: it has not said hello", type(msg).__name__, identity)
        elif isinstance(msg, Generate):
            self._generate(identity, msg)
        elif isinstance(msg, Abort):
            stream = self._streams.get(msg.request_id)
            if stream is not None and stream[0] == identity:
                self._spawn(self._abort(identity, msg.request_id, stream[1]))
        elif isinstance(msg, Hello):
            self._hello(identity, msg)
        elif isinstance(msg, AdminCall):
            self._spawn(self._admin_call(identity, msg))
        else:
            log.warning("dropping a %s from %r: not a message an API process sends", type(msg).__name__, identity)

    def _hello(self, identity: bytes, msg: Hello) -> None:
        if not msg.endpoint:  # a handshake: what the app needs, on the socket that asked
            reply = self._sock.send_multipart([identity, FRONTEND_CODEC.encode(self._welcome)])
            reply.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                    or log.warning("cannot answer a handshake: %s", f.exception()))
            return
        if identity not in self._pushes:
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(msg.endpoint)
            self._pushes[identity] = push
        if self._on_hello is not None:
            self._on_hello(msg.index, msg.ready)

    def _generate(self, identity: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if rid in self._streams:
            self._send(identity, Refused(rid, f"request id {rid!r} is already in use", 400, "invalid_request_error"))
            return
        try:
            params = SamplingParams(**msg.sampling)
            self._check_request(msg.prompt_token_ids, params)
        except (TypeError, ValueError) as e:
            self._send(identity, Refused(rid, f"request {rid!r}: {e}", 400, "invalid_request_error"))
            return
        task = self._spawn(self._forward(identity, rid, list(msg.prompt_token_ids), params))
        self._streams[rid] = (identity, task)

    def _check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """What the API process checked already (cluster/api/validation.py) and a router takes as given
        (router_contract.py): a message that skipped it must not reach an engine."""
        vocab_size, max_model_len = self.router.tokenizer.vocab_size, self.router.max_model_len
        if not prompt:
            raise ValueError("the prompt is empty")
        for what, ids in (("prompt", prompt), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{what} token id {int(bad)} is outside the vocabulary (0..{vocab_size - 1})")
        if len(prompt) + params.max_tokens > max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len {max_model_len}")

    async def _forward(self, identity: bytes, rid: str, prompt: list[int], params: SamplingParams) -> None:
        any_sent = finished = False

        def on_delta(delta: TokenDelta) -> None:  # called by the router as it makes each delta
            nonlocal any_sent, finished
            self._queue(identity, rid, delta, first=not any_sent)
            any_sent, finished = True, delta.finished

        def on_row(token_ids: list[int], num_output_tokens: int, num_draft_tokens: int, num_accepted_tokens: int) -> bool:
            # Called only once the request's first delta went out (RequestStreams.on_step_tokens).
            self._outbox(identity).add_row(rid, token_ids, num_output_tokens, num_draft_tokens, num_accepted_tokens)
            self._schedule_flush()
            return True

        try:
            await self.router.deliver(rid, prompt, params, on_delta, on_row)
            if not any_sent:
                self._send(identity, Refused(rid, "the router ended the request before admitting it", 503,
                                             "server_error"))
            elif not finished:
                self._queue_error(identity, rid, "the router ended the request without a final status")
        except RouterError as e:
            if any_sent:  # not the contract (refusals come before any delta), but the process must hear the end
                self._queue_error(identity, rid, f"router refused the request after streaming it: {e}")
            else:
                self._send(identity, Refused(rid, str(e), e.status, e.kind))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the process still gets its request's end
            log.exception("request %s failed in the router", rid)
            if not finished:
                self._queue_error(identity, rid, f"router failed: {e!r}")
        finally:
            self._streams.pop(rid, None)

    async def _abort(self, identity: bytes, rid: str, task: asyncio.Task) -> None:
        """Abort in the router, whose final delta then ends the stream; a router that lets the request go
        on (the cluster router before the decode worker admitted it) has its stream closed here instead,
        which frees the request there as a client's disconnect would."""
        await self.router.abort(rid)
        if not task.done():
            await asyncio.wait({task}, timeout=ABORT_GRACE_S)
        if not task.done():
            task.cancel()
            self._queue(identity, rid, TokenDelta([], finished=True, finish_reason="abort"))

    def _queue_error(self, identity: bytes, rid: str, error: str) -> None:
        self._queue(identity, rid, TokenDelta([], finished=True, finish_reason="error", error=error))

    def _queue(self, identity: bytes, rid: str, delta: TokenDelta, first: bool = False) -> None:
        self._outbox(identity).add(rid, delta, first)
        self._schedule_flush()

    def _outbox(self, identity: bytes) -> _Outbox:
        box = self._outboxes.get(identity)
        if box is None:
            box = self._outboxes[identity] = _Outbox()
        return box

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:  # after every task that woke this turn has queued its delta
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outboxes, self._outboxes = self._outboxes, {}
        for identity, box in outboxes.items():
            self._send(identity, box.record())

    # ---- the rest -------------------------------------------------------------------------------------
    async def _admin_call(self, identity: bytes, call: AdminCall) -> None:
        if self._admin is None:
            reply = AdminReply(call.call_id, 404, ["content-type"], ["application/json"],
                               b'{"error": {"message": "no admin routes in this mode", "type": "not_found"}}')
        else:
            try:
                reply = await asyncio.wait_for(self._admin(call), ADMIN_CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the caller gets a 500 with the reason
                log.exception("admin call %s %s failed", call.method, call.path)
                reply = AdminReply(call.call_id, 500, ["content-type"], ["text/plain"], f"admin call failed: {e!r}".encode())
        self._send(identity, reply)

    async def _send_stats(self) -> None:
        while True:
            try:
                stats = self.router.stats()
            except Exception as e:  # noqa: BLE001 - /health then says why
                stats = {"healthy": False, "error": f"router stats failed: {e!r}"}
            # The adapters requests may name change while serving (--enable-lora): each process learns them here.
            message = Stats(_plain({**stats, LORA_NAMES_KEY: list(self.router.lora_names)}))
            for identity in list(self._pushes):
                self._send(identity, message)
            await asyncio.sleep(STATS_INTERVAL_S)

    def _send(self, identity: bytes, msg) -> None:
        push = self._pushes.get(identity)
        if push is None or self._closed:
            return
        try:
            push.send(FRONTEND_CODEC.encode(msg), zmq.NOBLOCK)
        except ProtocolError:  # values the workers' events carried through the same checks: a bug here
            log.exception("cannot encode %s for API process %r", type(msg).__name__, identity)
        except zmq.ZMQError as e:  # not with SNDHWM 0; a dead process is the supervisor's to handle
            log.warning("cannot send %s to API process %r: %s", type(msg).__name__, identity, e)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _plain(value):
    """``stats`` as msgpack-native values (tuples become lists, other objects their repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return repr(value)
