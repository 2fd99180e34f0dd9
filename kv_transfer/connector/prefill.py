"""The producer's KV connector (prefill side): it sends a request's blocks as they become final.

Full blocks of the prompt are sent layer by layer from the forward pass (``save_layer``), overlapping
the rest of the forward. Everything that is only final after the draft proposer has run (the partial
tail block, the draft/MTP layers of every block, a hybrid's state blocks) is sent from
``post_forward(finished_req_ids)`` (invariant S2): only a transfer whose last sends were issued there
(state FLUSHING) can complete. Once the receiver has acknowledged every send, a ``TransferDone``
carrying the first token and the drafts goes to the decode worker and the blocks are released
(``finished_sending``). The acks are polled at the end of every step (``post_forward``), and also
between and during steps (``poll_acks``, the prefill worker's ack poller and loop), so a TransferDone
does not wait for the next step, which can take seconds of prefill; the blocks go back to the
scheduler through the engine thread's next ``poll``. Any failure (transport error, dead peer,
deadline, abort from the peer) ends in ``failed`` and the blocks are freed exactly once.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pdcluster.kv_transfer.protocol import AbortTransfer, TransferDone
from pdcluster.wire.kv_connector import KVConnector, KVConnectorOutput

log = logging.getLogger(__name__)


class SendState(enum.Enum):
    PREFILLING = "prefilling"  # full blocks go out layer by layer as the prompt is computed
    FLUSHING = "flushing"  # last sends issued from post_forward; waiting for the receiver's ack
    SENT = "sent"
    FAILED = "failed"


@dataclass
class SendTask:
    request_id: str
    decode_id: str
    dst_block_ids: list[int]  # dst_block_ids[i] receives prompt block num_reused_blocks + i
    num_prompt_tokens: int
    deadline: float  # time.monotonic()
    # Leading prompt blocks the receiver already holds (its own prefix cache): never sent.
    num_reused_blocks: int = 0
    state: SendState = SendState.PREFILLING
    src_block_ids: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0  # full prompt blocks the receiver has for every target layer (reused or sent)
    finished: bool = False  # the engine finished the request and holds its blocks for us
    first_token_id: int = -1
    draft_token_ids: list[int] = field(default_factory=list)
    num_bytes: int = 0
    t_first_send: float = 0.0
    num_cached_tokens: int = 0
    num_offloaded_tokens: int = 0
    logprobs: list = field(default_factory=list)  # the first token's TokenLogprobs, if asked
    prompt_logprobs: list = field(default_factory=list)

    def pairs(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, destination) block ids of the request's blocks [start, stop) (prompt order, state
        blocks after the prompt's), all at or after the reused ones."""
        skip = self.num_reused_blocks
        assert start >= skip, f"block {start} of {self.request_id} is one the receiver already holds"
        return np.asarray(self.src_block_ids[start:stop]), np.asarray(self.dst_block_ids[start - skip:stop - skip])


def _locked(method):
    """Run ``method`` under the connector's lock: the engine thread (scheduler and runner hooks) and
    the prefill worker's ack poller (``poll_acks``) both touch the send tasks."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class PrefillKVConnector(KVConnector):
    is_producer = True

    def __init__(self, transport, endpoint, num_target_layers: int, num_layers: int, block_size: int,
                 clock=time.monotonic, num_state_blocks: int = 0):
        self.transport = transport
        self.endpoint = endpoint
        self.num_target_layers = num_target_layers
        self.num_layers = num_layers
        self.block_size = block_size
        # Hybrid models: blocks after the prompt's holding its Mamba state (engine/mamba_state_blocks.py),
        # written after the proposer, so sent whole from post_forward like the draft layers (S2).
        self.num_state_blocks = num_state_blocks
        self.clock = clock
        self.tasks: dict[str, SendTask] = {}
        self._plan: list[tuple[SendTask, np.ndarray, np.ndarray]] = []  # this step's layer-wise sends
        self._to_abort: set[str] = set()  # failed while still running in the engine
        self.bytes_sent = 0
        self._lock = threading.RLock()
        # Sent or failed transfers whose blocks the scheduler holds, found outside the engine thread's
        # poll (the ack poller, a message, an abort), until that poll hands them to the engine.
        self._unreported = KVConnectorOutput()
        # Set while a flushed transfer waits for its receiver's ack: the ack poller sleeps otherwise.
        self.awaiting_acks = threading.Event()

    # ---- requests --------------------------------------------------------------------------------
    @_locked
    def add_transfer(self, request_id: str, decode_id: str, dst_block_ids: list[int], num_prompt_tokens: int,
                     timeout_s: float, num_reused_blocks: int = 0) -> None:
        """``num_reused_blocks``: leading prompt blocks the receiver holds already; the rest are sent."""
        num_blocks = -(-num_prompt_tokens // self.block_size)
        if not 0 <= num_reused_blocks < max(num_blocks, 1):  # the tail block is always sent (S2's last send)
            raise ValueError(f"{request_id}: {num_reused_blocks} reused blocks of a {num_blocks}-block prompt")
        need = num_blocks - num_reused_blocks + self.num_state_blocks
        if len(dst_block_ids) < need:
            raise ValueError(f"{request_id}: {len(dst_block_ids)} destination blocks for {need} prompt "
                             f"(+ {self.num_state_blocks} state) blocks after {num_reused_blocks} reused")
        self.tasks[request_id] = SendTask(request_id, decode_id, list(dst_block_ids), num_prompt_tokens,
                                          self.clock() + timeout_s, num_reused_blocks=num_reused_blocks,
                                          num_blocks_sent=num_reused_blocks)

    @_locked
    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Local abort (client gone): tell the decode side, stop sending."""
        task = self.tasks.get(request_id)
        if task is not None:
            self._fail(task, reason, notify_peer=True)

    @_locked
    def take_aborts(self) -> set[str]:
        """Requests whose transfer failed while the engine still runs them: the worker aborts them."""
        out, self._to_abort = self._to_abort, set()
        return out

    # ---- scheduler hook --------------------------------------------------------------------------
    @_locked
    def request_finished(self, request) -> bool:
        task = self.tasks.get(request.request_id)
        if task is None or task.state in (SendState.FAILED, SendState.SENT):
            return False
        if not request.output_token_ids:  # ended before its first token (aborted): nothing to send
            self._fail(task, "the request ended before its first token", notify_peer=True)
            return False
        task.finished = True
        task.src_block_ids = list(request.block_ids)
        task.first_token_id = request.output_token_ids[0]
        task.num_cached_tokens = request.num_cached_tokens
        task.num_offloaded_tokens = request.num_offloaded_tokens
        task.draft_token_ids = list(request.spec_token_ids)
        return True  # hold the blocks until post_forward has sent them and the receiver acked

    # ---- worker hooks ------------------------------------------------------------------------------
    @_locked
    def pre_forward(self, scheduler_output) -> None:
        self._plan = []
        for s in scheduler_output.scheduled:
            task = self.tasks.get(s.request_id)
            if task is None or task.state != SendState.PREFILLING:
                continue
            task.src_block_ids = list(s.block_ids)
            end = min(s.num_computed_tokens + s.num_scheduled_tokens, task.num_prompt_tokens)
            num_full = end // self.block_size
            if num_full > task.num_blocks_sent:
                self._plan.append((task, *task.pairs(task.num_blocks_sent, num_full)))
                task.num_blocks_sent = num_full

    def wants_layers(self) -> bool:
        return bool(self._plan)  # this step's prompt blocks go out layer by layer

    @_locked
    def save_layer(self, layer_idx: int) -> None:
        if layer_idx >= self.num_target_layers:
            return  # draft layers are final only after the proposer: post_forward sends them
        for task, src, dst in self._plan:
            if task.state == SendState.PREFILLING:
                self._send(task, [layer_idx], src, dst)

    @_locked
    def post_forward(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Called last in sample_tokens, after the draft proposer (S2); always clears the step's plan."""
        self._plan = []
        for request_id in finished_req_ids:
            task = self.tasks.get(request_id)
            if task is not None and task.finished and task.state == SendState.PREFILLING:
                self._flush(task)
        return self.poll()

    # ---- internals ---------------------------------------------------------------------------------
    def _send(self, task: SendTask, layer_ids, src: np.ndarray, dst: np.ndarray, state: bool = False) -> None:
        """``state``: the blocks hold the prompt's Mamba state (all layers of them), not KV."""
        try:
            if not task.t_first_send:
                task.t_first_send = self.clock()
            if state:
                self.transport.send_state(task.decode_id, task.request_id, src, dst)
            else:
                self.transport.send(task.decode_id, task.request_id, layer_ids, src, dst)
            num_bytes = len(src) * len(layer_ids) * self.transport.block_layer_bytes_to(task.decode_id)
            task.num_bytes += num_bytes
            self.bytes_sent += num_bytes
        except Exception as e:  # noqa: BLE001 - any send error fails this request only
            self._fail(task, f"send failed: {e}", notify_peer=True)

    def _flush(self, task: SendTask) -> None:
        num_blocks = -(-task.num_prompt_tokens // self.block_size)
        # The tail (partial) block, plus the last full block again so there is always at least one
        # send after which the receiver's ack means "everything is there" (never a reused block: the
        # receiver's reuse leaves the tail block out, add_transfer checks).
        first = min(task.num_blocks_sent, num_blocks - 1)
        self._send(task, range(0, self.num_target_layers), *task.pairs(first, num_blocks))
        if self.num_layers > self.num_target_layers and task.state != SendState.FAILED:
            # The draft layers of every block the receiver does not hold.
            self._send(task, range(self.num_target_layers, self.num_layers),
                       *task.pairs(task.num_reused_blocks, num_blocks))
        if self.num_state_blocks and task.state != SendState.FAILED:
            self._send(task, range(0, self.num_layers), *task.pairs(num_blocks, num_blocks + self.num_state_blocks),
                       state=True)
        if task.state != SendState.FAILED:
            task.state = SendState.FLUSHING
            self.awaiting_acks.set()

    @_locked
    def poll(self) -> KVConnectorOutput:
        """Engine thread (end of a step, or between steps): check acks, failures and deadlines; the
        returned output (with what ``poll_acks`` found since the last call) frees the held blocks."""
        out, self._unreported = self._unreported, KVConnectorOutput()
        self._check(out)
        return out

    @_locked
    def poll_acks(self) -> None:
        """Any thread, e.g. while the engine runs a step: send the TransferDone of every flushed
        transfer its receiver has acknowledged now (only FLUSHING ones, whose last sends post_forward
        issued after the proposer: S2 holds). Their blocks are freed by the engine thread's next poll."""
        self._check(self._unreported)

    def _check(self, out: KVConnectorOutput) -> None:
        delivered, failed = self.transport.poll_sent()
        for request_id in delivered:
            task = self.tasks.get(request_id)
            if task is None or task.state != SendState.FLUSHING:
                continue  # layer-wise sends drained before the flush: not complete yet
            done = TransferDone(request_id=request_id, ok=True, error="", num_tokens=task.num_prompt_tokens,
                                first_token_id=task.first_token_id, draft_token_ids=task.draft_token_ids,
                                num_bytes=task.num_bytes, seconds=self.clock() - task.t_first_send,
                                num_cached_tokens=task.num_cached_tokens,
                                num_offloaded_tokens=task.num_offloaded_tokens, logprobs=task.logprobs,
                                prompt_logprobs=task.prompt_logprobs)
            try:
                self.endpoint.send(task.decode_id, done)
            except Exception as e:  # noqa: BLE001
                self._fail(task, f"cannot notify decode worker: {e}", notify_peer=False, out=out)
                continue
            task.state = SendState.SENT
            del self.tasks[request_id]
            out.finished_sending.add(request_id)
        for request_id, reason in failed:
            task = self.tasks.get(request_id)
            if task is not None:
                self._fail(task, f"transport: {reason}", notify_peer=True, out=out)
        dead = self.endpoint.dead_peers()
        now = self.clock()
        for task in list(self.tasks.values()):
            if task.decode_id in dead:
                self._fail(task, f"decode worker {task.decode_id} stopped answering", notify_peer=False, out=out)
            elif now > task.deadline:
                self._fail(task, "KV transfer deadline passed", notify_peer=True, out=out)
        if not any(t.state == SendState.FLUSHING for t in self.tasks.values()):
            self.awaiting_acks.clear()

    @_locked
    def handle_message(self, peer_id: str, msg) -> None:
        if isinstance(msg, AbortTransfer):
            task = self.tasks.get(msg.request_id)
            if task is not None and task.decode_id == peer_id:
                self._fail(task, f"aborted by decode worker: {msg.reason}", notify_peer=False)

    def _fail(self, task: SendTask, reason: str, notify_peer: bool, out: KVConnectorOutput | None = None) -> None:
        if task.state in (SendState.FAILED, SendState.SENT):
            return
        log.warning("KV transfer of %s to %s failed: %s", task.request_id, task.decode_id, reason)
        task.state = SendState.FAILED
        self.tasks.pop(task.request_id, None)
        if notify_peer:
            try:
                self.endpoint.send(task.decode_id, AbortTransfer(request_id=task.request_id, reason=reason[:200]))
            except Exception:  # noqa: BLE001 - the peer may be the thing that is gone
                pass
        if task.finished:
            # Blocks are held by the scheduler for us: released through this poll's output or the next.
            (out if out is not None else self._unreported).failed.add(task.request_id)
        else:
            self._to_abort.add(task.request_id)  # still running: the worker aborts it (frees once)
