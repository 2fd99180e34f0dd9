"""The decode worker: an engine in the consumer role, and the owner of every request the router hands
it (``submit``). A request prefilled elsewhere joins the engine at once, its blocks reserved, in
WAITING_FOR_REMOTE_KV; the worker asks that prefill worker for the KV (remote_kv.py: TransferRequest over
the control plane), streams the first token as soon as the prefill worker sends it, and the engine
decodes once its connector reports the KV landed (or ends the request when it failed), with
continuous batching and speculative decoding. It also runs requests start to finish itself (colocated
mode, or conditional disaggregation for short prompts). A request its first token ends (max_tokens 1:
scoring, classification, a beam search's step) never enters this worker's engine: it asks the prefill
worker for the first token only, no blocks reserved and no KV moved, and that token is its answer. Every
event of a request goes to the router on this worker's one typed stream (node/events.py), in order.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine, RequestOutput
from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.engine.pooling import pooled_bytes
from pdcluster.engine.remote_admission import RemoteReservation
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.protocol import AbortTransfer, FirstToken, TransferDone
from pdcluster.kv_transfer.transports import get_transport_class
from pdcluster.kv_transfer.transports.ranked import check_rank_transport
from pdcluster.node.events import (ADMITTED, FULL, INVALID, UNREACHABLE, Admission, Failed, KVReady, StepTokens,
                                   Tokens)
from pdcluster.node.external_kv import make_external_connector
from pdcluster.node.kv_transport import rank_cache_allocator
from pdcluster.node.worker_loop import WorkerLoop, engine_stats
from pdcluster.decode_node.remote_kv import NoRemoteKV, RemoteKV, UnreachablePrefill

log = logging.getLogger(__name__)


@dataclass
class _FirstTokenStream:
    """What the worker still owes the router for a request prefilled elsewhere, until its KV has landed:
    the first token, streamed as soon as it arrives from ``prefill_id``. The request itself is the
    engine's (WAITING_FOR_REMOTE_KV); this is keyed by the same id."""

    prefill_id: str
    num_prompt_tokens: int
    first_token_sent: bool = False
    # A first-token-only ask (the token ends the request, which is not in the engine): its parameters (for
    # the finish reason) and when it is given up (time.monotonic()).
    ends_request: SamplingParams | None = None
    deadline: float = 0.0


class DecodeWorker(WorkerLoop):
    # Requests their first token ends ask for it alone (bench/first_token_only.py turns it off for its A/B).
    ask_first_token_only = True

    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig | None = None):
        super().__init__(f"decode-{worker_id}")
        self.worker_id = worker_id
        transport_cls = get_transport_class(transfer.transport) if transfer is not None else None
        allocator = transport_cls.allocate_kv_cache if transport_cls is not None else None
        # In stages: the model and its cache, the transfer made on that cache, then the engine with its
        # connector.
        if transfer is not None:
            check_rank_transport(transfer.transport, engine_config.tensor_parallel_size)
        external = bool(engine_config.kv_transfer_config)
        if external and transfer is not None:
            raise ValueError("kv_transfer_config (an external proxy's prefill/decode split) runs on colocated "
                             "workers: this cluster disaggregates itself (--mode disagg); use one or the other")
        model = LoadedModel.load(engine_config, progress=False, kv_cache_allocator=allocator,
                                 share_rank_caches=transfer is not None or external,
                                 rank_cache_allocator=rank_cache_allocator(transfer) if transfer else None)
        self.kv = (RemoteKV(worker_id, model, transfer, self._on_first_token)
                   if transfer is not None else NoRemoteKV())
        connector = self.kv.connector
        if external:  # vLLM's external P/D protocol: this worker holds prompts for, and pulls them from, others
            index = re.match(r"decode-(\d+)-", worker_id)
            connector = make_external_connector(model, f"{worker_id}-{uuid.uuid4().hex[:8]}",
                                                int(index.group(1)) if index else 0)
        self.external_kv = connector if external else None
        self.engine = LLMEngine(model, connector, cumulative_outputs=False)  # streams new tokens
        self._first_tokens: dict[str, _FirstTokenStream] = {}
        self._first_token_only: dict[str, _FirstTokenStream] = {}  # of those, the asks whose token ends them
        # Admitted requests loading their prefix from the offload tiers -> the prefill worker to ask once
        # the load ends (prompt and parameters are the engine's Request's). Engine thread only.
        self._asks_after_load: dict[str, str] = {}
        # fork_group -> the request whose prompt its siblings reuse (engine/forks.py): the first choice
        # of an n > 1 request fetches or computes the prompt; the others follow it here.
        self._fork_leaders: dict[str, str] = {}
        # The first token is streamed from the control plane's I/O thread or, if TransferDone overtook
        # it, from the engine thread: this lock makes it go out once and before the request's KVReady.
        self._first_token_lock = threading.Lock()
        self.start()

    # ---- called from other threads ----------------------------------------------------------------
    def connect_prefill(self, address: str) -> str:
        """Handshake with a prefill worker; returns its worker id."""
        return self.kv.connect(address)

    def disconnect_prefill(self, prefill_id: str) -> bool:
        """Leave a prefill worker (drain): KV expected from it fails now, new requests naming it fail."""
        return self.kv.disconnect(prefill_id)

    def lost_prefills(self) -> list[str]:
        """Prefill workers this worker dropped after the control plane's peer timeout (silent: dead, or
        only frozen) and is not connected to again: requests naming one fail until it is re-wired
        (``connect_prefill``). Does not wait for the engine thread."""
        return self.kv.lost_peers()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prefill_id: str | None = None) -> None:
        """Take the request: prefill it here (``prefill_id`` None) or fetch its KV from ``prefill_id``.
        The verdict comes back as an ``Admission`` event, ahead of the request's other events."""
        self.post(self._submit, request_id, list(prompt_token_ids), params, prefill_id)

    def abort(self, request_id: str) -> None:
        self.post(self._abort, request_id)

    def stats(self) -> dict:
        return self.call(self._stats)

    def close(self) -> None:
        self.stop()
        self.close_kv_offload()
        self.kv.close()
        if self.external_kv is not None:
            self.external_kv.close()
        self.engine.close()  # a tensor-parallel model's other ranks

    # ---- engine thread --------------------------------------------------------------------------------
    def _admission(self, request_id: str, verdict: str, reason: str = "") -> None:
        self.emit(Admission(request_id=request_id, worker_id=self.worker_id, verdict=verdict, reason=reason[:2000]))

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                prefill_id: str | None) -> None:
        try:
            self._place(request_id, prompt_token_ids, params, prefill_id)
        except Exception as e:  # noqa: BLE001 - not the request's fault: the router tries another pair
            log.exception("submit of %s failed", request_id)
            self._admission(request_id, UNREACHABLE, f"{type(e).__name__}: {e}")

    def _place(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prefill_id: str | None) -> None:
        # The API validated the request (once, at the edge); the router checked what only it knows.
        # The router seeds every request; a direct caller may not: seed it here, before the prefill
        # worker sees the parameters, so both sides sample the same stream.
        params = self.engine.assign_seed(params)
        leader = self._fork_leader(request_id, prompt_token_ids, params)
        if prefill_id is None or leader is not None:
            self.engine.add_request(prompt_token_ids, params, request_id=request_id, validate=False, follow=leader)
            self._admission(request_id, ADMITTED)
            if prefill_id is not None:  # a forked choice: its KV is its leader's, nothing to transfer
                self.emit(KVReady(request_id=request_id, worker_id=self.worker_id, transport="fork",
                                  num_bytes=0, seconds=0.0))
            return
        # An embedding is always one: its vector is computed where the prompt is, and nothing follows it.
        if params.pooling is not None or (params.max_tokens == 1 and params.fork_group is None
                                          and self.ask_first_token_only):
            self._ask_first_token_only(request_id, prefill_id, prompt_token_ids, params)
            return
        try:
            reserved = self.engine.add_remote_request(request_id, prompt_token_ids, params)
        except ValueError as e:  # the id is in use here (a caller bug), or a grammar refused: said clearly
            self._admission(request_id, INVALID, str(e))
            return
        if reserved is None:
            self._admission(request_id, FULL)
            return
        if reserved.num_loading_blocks:
            # Its prefix continues in this worker's offload tiers: admitted now (its blocks are taken), the
            # prefill worker asked once the load ends (_poll_kv), for the blocks after those that arrived.
            self._asks_after_load[request_id] = prefill_id
            self._admission(request_id, ADMITTED)
            return
        self._ask_prefill(request_id, prefill_id, prompt_token_ids, params, reserved)

    def _ask_prefill(self, request_id: str, prefill_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     reserved: RemoteReservation, admitted: bool = False) -> None:
        """Ask the prefill worker for the KV of the blocks after the ones held here. ``admitted``: the
        Admission went out already (after an offload load), so a prefill worker lost meanwhile is a
        failed request (the router recovers it), not a refused admission."""
        # Under the first-token lock: the prefill worker's FirstToken may arrive (I/O thread) before
        # request_kv returns, and must find the request and go out after its Admission.
        with self._first_token_lock:
            self._first_tokens[request_id] = _FirstTokenStream(prefill_id, len(prompt_token_ids))
            try:
                # Only the blocks after the prefix this worker holds (engine/remote_admission.py).
                self.kv.request_kv(request_id, prefill_id, prompt_token_ids, params, reserved.dst_block_ids,
                                   reserved.num_reused_blocks)
            except UnreachablePrefill as e:
                del self._first_tokens[request_id]
                self.engine.abort_request(request_id)  # its blocks go back, or stay quarantined
                if admitted:
                    self.emit(Failed(request_id=request_id, worker_id=self.worker_id, reason=str(e)[:2000]))
                else:
                    self._admission(request_id, UNREACHABLE, str(e))
                return
            if not admitted:
                self._admission(request_id, ADMITTED)

    def _ask_first_token_only(self, request_id: str, prefill_id: str, prompt_token_ids: list[int],
                              params: SamplingParams) -> None:
        """The prefill worker's first token is the whole answer: ask for it alone (no blocks, no KV)."""
        if request_id in self._first_tokens or request_id in self.engine.scheduler.requests:
            self._admission(request_id, INVALID, f"request id {request_id!r} is in use on this worker")
            return
        deadline = time.monotonic() + self.kv.transfer_timeout_s
        with self._first_token_lock:  # its FirstToken (I/O thread) goes out after the Admission
            stream = _FirstTokenStream(prefill_id, len(prompt_token_ids), ends_request=params, deadline=deadline)
            self._first_tokens[request_id] = self._first_token_only[request_id] = stream
            try:
                self.kv.ask_first_token(request_id, prefill_id, prompt_token_ids, params)
            except UnreachablePrefill as e:
                self._end_first_token_stream(request_id)
                self._admission(request_id, UNREACHABLE, str(e))
                return
            self._admission(request_id, ADMITTED)

    def _expire_first_token_only(self, aborted: dict[str, str]) -> None:
        """First-token-only asks that cannot be answered any more fail (the router places them again):
        ``aborted`` ({request id: reason}) refused by their prefill worker, the others whose prefill worker
        stopped answering or was left, or whose deadline passed (that one is told to stop)."""
        dead = self.kv.dead_peers()
        now = time.monotonic()
        for request_id, stream in list(self._first_token_only.items()):
            reason = aborted.get(request_id)
            if reason is None and stream.prefill_id in dead:
                reason = f"prefill worker {stream.prefill_id} stopped answering"
            elif reason is None and now > stream.deadline:
                reason = "first token deadline passed"
                self.kv.give_up_first_token(request_id, stream.prefill_id, reason)
            if reason is not None and self._end_first_token_stream(request_id):
                self.emit(Failed(request_id=request_id, worker_id=self.worker_id, reason=reason[:2000]))

    def _fork_leader(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> str | None:
        """The live sibling this request follows, or None (then it leads its group from now on)."""
        group = params.fork_group
        if group is None or not self.engine.shares_prompts:  # hybrids: every choice fetches its prompt
            return None
        requests = self.engine.scheduler.requests  # waiting for its KV or not: the engine has it
        leader = self._fork_leaders.get(group)
        lead = requests.get(leader) if leader is not None else None
        if lead is not None and list(lead.prompt_token_ids) == list(prompt_token_ids):
            return lead.request_id
        for stale in [g for g, rid in self._fork_leaders.items() if rid not in requests]:
            del self._fork_leaders[stale]  # bounded by the live requests
        self._fork_leaders[group] = request_id
        return None

    def _abort(self, request_id: str) -> None:
        stream = self._first_token_only.get(request_id)
        if stream is not None:  # not in the engine: the prefill worker is told to stop computing it
            if self._end_first_token_stream(request_id):
                self.kv.give_up_first_token(request_id, stream.prefill_id, "aborted by the router")
            return
        self._asks_after_load.pop(request_id, None)
        # Waiting for its KV or not: the engine ends it, its connector revokes the transfer, tells the
        # prefill worker and keeps the blocks only while a sender may still write them.
        self._end_first_token_stream(request_id)
        self.engine.abort_request(request_id)

    def _end_first_token_stream(self, request_id: str) -> bool:
        """Whether the request still had a stream here (a first-token-only ask: it was still open)."""
        with self._first_token_lock:  # after this, a late FirstToken finds nothing to stream
            self._first_token_only.pop(request_id, None)
            return self._first_tokens.pop(request_id, None) is not None

    def _stats(self) -> dict:
        sched = self.engine.scheduler
        return {
            **engine_stats(self.worker_id, self.engine),
            # Blocks reserved for KV from a prefill worker: waiting for it, or failed with blocks held
            # until nothing can write them (held: this worker's engine holds blocks for nothing else).
            "num_reserved": sched.num_waiting_for_remote_kv + len(sched.held),
            # Of those, failed ones whose blocks wait for a sender's revoke confirmation (shm push).
            "num_quarantined": self.kv.num_quarantined,
            "num_prompt_tokens_computed": self.engine.scheduler.num_prompt_tokens_computed,
            "num_prompt_tokens_reused": sched.num_prompt_tokens_reused,  # held here, not transferred
            # Asks for a first token alone (max_tokens 1) not yet answered: no block held for them.
            "num_first_token_only": len(self._first_token_only),
            # vLLM's external P/D split: prompts held for other instances, pulls made from them.
            **({"external_kv": self.external_kv.stats()} if self.external_kv is not None else {}),
        }

    def _on_first_token(self, peer_id: str, msg: FirstToken) -> None:
        """Control-plane I/O thread: stream the first token now, not after the engine's current step."""
        self._first_token(msg, peer_id)

    def _first_token(self, msg, prefill_id: str) -> None:
        """``msg``: the prefill worker's FirstToken, or its TransferDone when that came first."""
        request_id = msg.request_id
        token_id = msg.token_id if isinstance(msg, FirstToken) else msg.first_token_id
        with self._first_token_lock:
            stream = self._first_tokens.get(request_id)
            if stream is None or stream.first_token_sent or prefill_id != stream.prefill_id:
                return
            stream.first_token_sent = True
            params, finish_reason = stream.ends_request, ""
            if params is not None:  # the answer: the request ends with it, here
                finish_reason = "stop" if self.engine.scheduler.stops_on(params, token_id) else "length"
                del self._first_tokens[request_id], self._first_token_only[request_id]
            self.emit(Tokens(request_id=request_id, worker_id=self.worker_id, new_token_ids=[token_id],
                             num_computed_tokens=stream.num_prompt_tokens, num_output_tokens=1,
                             finished=params is not None, finish_reason=finish_reason,
                             num_cached_tokens=msg.num_cached_tokens,
                             num_offloaded_tokens=msg.num_offloaded_tokens, logprobs=list(msg.logprobs),
                             prompt_logprobs=list(msg.prompt_logprobs), pooled=getattr(msg, "pooled", b"")))

    def _poll_kv(self) -> None:
        refused: dict[str, str] = {}  # first-token-only asks their prefill worker refused
        for peer_id, msg in self.kv.poll_messages():
            stream = self._first_token_only.get(msg.request_id) if isinstance(msg, AbortTransfer) else None
            if stream is not None and stream.prefill_id == peer_id:
                refused[msg.request_id] = f"prefill worker {peer_id}: {msg.reason}"
                continue
            if isinstance(msg, TransferDone) and msg.ok:
                self._first_token(msg, peer_id)  # it overtook FirstToken: the first token goes first
            self.kv.handle_message(peer_id, msg)
        if self._first_token_only:
            self._expire_first_token_only(refused)
        polled = self.engine.poll_kv()  # the connector's news, applied by the engine's scheduler
        for request_id, reserved in polled.ready_to_ask.items():
            prefill_id = self._asks_after_load.pop(request_id, None)
            request = self.engine.scheduler.requests.get(request_id)
            if prefill_id is not None and request is not None:
                self._ask_prefill(request_id, prefill_id, request.prompt_token_ids, request.sampling_params,
                                  reserved, admitted=True)
        for request_id, kv in polled.landed.items():
            self._end_first_token_stream(request_id)
            self.emit(KVReady(request_id=request_id, worker_id=self.worker_id, transport=self.kv.transport_name,
                              num_bytes=kv.num_bytes, seconds=kv.seconds))
        for out in polled.outputs:  # ended by the first token
            self._emit_tokens(out)
        for request_id, reason in polled.failed.items():
            self._end_first_token_stream(request_id)
            self.emit(Failed(request_id=request_id, worker_id=self.worker_id, reason=reason[:2000]))

    def tick(self) -> bool:
        self._poll_kv()
        # Blocks held only for a transfer (a revoke not yet confirmed) need no step: the poll frees them.
        if not self.engine.has_work():
            return False
        self._emit_step(self.engine.step())
        return True

    def _emit_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs: a request's last and any with logprobs as their own ``Tokens``, the rest
        together as one ``StepTokens`` (one event a step, not one a request, at any batch size)."""
        ids, num_new, token_ids, computed, output, draft, accepted, cached, offloaded = [], [], [], [], [], [], [], [], []
        for out in outputs:
            if out.finished or out.new_logprobs or out.prompt_logprobs:
                self._emit_tokens(out)
                continue
            ids.append(out.request_id)
            num_new.append(len(out.new_token_ids))
            token_ids += out.new_token_ids
            computed.append(out.num_computed_tokens)
            output.append(out.num_output_tokens)
            draft.append(out.num_draft_tokens)
            accepted.append(out.num_accepted_tokens)
            cached.append(out.num_cached_tokens)
            offloaded.append(out.num_offloaded_tokens)
        if ids:
            self.emit(StepTokens.of_engine_columns(self.worker_id, ids, num_new, token_ids, computed, output, draft,
                                                   accepted, cached, offloaded))

    def _emit_tokens(self, out: RequestOutput) -> None:
        self.emit(Tokens(
            request_id=out.request_id,
            worker_id=self.worker_id,
            new_token_ids=list(out.new_token_ids),
            num_computed_tokens=out.num_computed_tokens,
            num_output_tokens=out.num_output_tokens,
            finished=out.finished,
            finish_reason=out.finish_reason or "",
            num_draft_tokens=out.num_draft_tokens,
            num_accepted_tokens=out.num_accepted_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_offloaded_tokens=out.num_offloaded_tokens,
            logprobs=list(out.new_logprobs),
            prompt_logprobs=list(out.prompt_logprobs or []),
            pooled=pooled_bytes(out.pooled),
            kv_transfer_params=out.kv_transfer_params or {},
        ))
