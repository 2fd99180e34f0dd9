"""The decode worker: an engine in the consumer role, and the owner of every request the router hands
it (``submit``). For a request prefilled elsewhere it reserves blocks and asks that prefill worker for
the KV (remote_kv.py: TransferRequest over the control plane), streams the first token as soon as the
prefill worker sends it, and decodes once the KV has landed (WAITING_FOR_KV -> READY | FAILED), with
continuous batching and speculative decoding. It also runs requests start to finish itself (colocated
mode, or conditional disaggregation for short prompts). Every event of a request goes to the router
on this worker's one typed stream (node/events.py), in order.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine, RequestOutput
from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.protocol import FirstToken
from pdcluster.kv_transfer.transports import get_transport_class
from pdcluster.node.events import ADMITTED, FULL, INVALID, UNREACHABLE, Admission, Failed, KVReady, Tokens
from pdcluster.node.worker_loop import WorkerLoop, engine_stats
from pdcluster.decode_node.remote_kv import NoRemoteKV, RemoteKV, UnreachablePrefill

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    """A request whose prompt is prefilled elsewhere, until its KV has landed."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_id: str
    first_token_sent: bool = False


class DecodeWorker(WorkerLoop):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig | None = None):
        super().__init__(f"decode-{worker_id}")
        self.worker_id = worker_id
        transport_cls = get_transport_class(transfer.transport) if transfer is not None else None
        allocator = transport_cls.allocate_kv_cache if transport_cls is not None else None
        model = LoadedModel.load(engine_config, progress=False, kv_cache_allocator=allocator)
        self.kv = (RemoteKV(worker_id, model, transfer, transport_cls, self._on_first_token)
                   if transfer is not None else NoRemoteKV())
        self.engine = LLMEngine(model)
        self._waiting: dict[str, _Waiting] = {}
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
        self.kv.close()

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
        try:
            blocks = self.engine.reserve_blocks(request_id, len(prompt_token_ids), params)
        except ValueError as e:  # the id is in use here: a caller bug, said clearly
            self._admission(request_id, INVALID, str(e))
            return
        if blocks is None:
            self._admission(request_id, FULL)
            return
        # Under the first-token lock: the prefill worker's FirstToken may arrive (I/O thread) before
        # request_kv returns, and must find the request and go out after its Admission.
        with self._first_token_lock:
            self._waiting[request_id] = _Waiting(prompt_token_ids, params, prefill_id)
            try:
                self.kv.request_kv(request_id, prefill_id, prompt_token_ids, params, blocks)
            except UnreachablePrefill as e:
                self._waiting.pop(request_id, None)
                self._give_back(request_id)
                self._admission(request_id, UNREACHABLE, str(e))
                return
            self._admission(request_id, ADMITTED)

    def _fork_leader(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> str | None:
        """The live sibling this request follows, or None (then it leads its group from now on)."""
        group = params.fork_group
        if group is None or not self.engine.shares_prompts:  # hybrids: every choice fetches its prompt
            return None
        leader = self._fork_leaders.get(group)
        if leader is not None and (leader in self._waiting or leader in self.engine.scheduler.requests):
            lead = self._waiting.get(leader) or self.engine.scheduler.requests[leader]
            if list(lead.prompt_token_ids) == list(prompt_token_ids):
                return leader
        for stale in [g for g, rid in self._fork_leaders.items()
                      if rid not in self._waiting and rid not in self.engine.scheduler.requests]:
            del self._fork_leaders[stale]  # bounded by the live requests
        self._fork_leaders[group] = request_id
        return None

    def _give_back(self, request_id: str) -> None:
        """Free a reservation, unless the transport still holds it (quarantine: freed by tick)."""
        if not self.kv.abort(request_id):
            self.engine.release_reserved(request_id)

    def _abort(self, request_id: str) -> None:
        if self._waiting.pop(request_id, None) is not None:
            self._give_back(request_id)
            self._release_revoked()
            return
        self.engine.abort_request(request_id)

    def _release_revoked(self) -> None:
        """Free the blocks of failed reservations the transport no longer writes (exactly once)."""
        for request_id in self.kv.take_releasable():
            self.engine.release_reserved(request_id)

    def _stats(self) -> dict:
        return {
            **engine_stats(self.worker_id, self.engine),
            "num_reserved": self.engine.num_reserved,
            # Of those, failed ones whose blocks wait for a sender's revoke confirmation (shm push).
            "num_quarantined": self.kv.num_quarantined,
            "num_prompt_tokens_computed": self.engine.scheduler.num_prompt_tokens_computed,
        }

    def _on_first_token(self, peer_id: str, msg: FirstToken) -> None:
        """Control-plane I/O thread: stream the first token now, not after the engine's current step."""
        self._first_token(msg, peer_id)

    def _first_token(self, msg, prefill_id: str | None = None) -> None:
        """``msg``: the prefill worker's FirstToken, or its TransferDone when that came first."""
        request_id = msg.request_id
        token_id = msg.token_id if isinstance(msg, FirstToken) else msg.first_token_id
        with self._first_token_lock:
            waiting = self._waiting.get(request_id)
            if waiting is None or waiting.first_token_sent or prefill_id not in (None, waiting.prefill_id):
                return
            waiting.first_token_sent = True
            self.emit(Tokens(request_id=request_id, worker_id=self.worker_id, new_token_ids=[token_id],
                             num_computed_tokens=len(waiting.prompt_token_ids), num_output_tokens=1,
                             num_cached_tokens=msg.num_cached_tokens, logprobs=list(msg.logprobs),
                             prompt_logprobs=list(msg.prompt_logprobs)))

    def _poll_kv(self) -> None:
        for peer_id, msg in self.kv.poll_messages():
            self.kv.handle_message(peer_id, msg)
        for task in self.kv.take_ready():
            done = task.done
            self._first_token(done)  # FirstToken overtaken
            waiting = self._waiting.pop(task.request_id, None)
            if waiting is None:  # aborted after its KV landed, before this turn took it
                self.engine.release_reserved(task.request_id)
                continue
            self.emit(KVReady(request_id=task.request_id, worker_id=self.worker_id, transport=self.kv.transport_name,
                              num_bytes=done.num_bytes, seconds=done.seconds))
            out = self.engine.add_prefilled_request(task.request_id, waiting.prompt_token_ids, waiting.params,
                                                    done.first_token_id, list(done.draft_token_ids))
            if out is not None:
                self._emit_tokens(out)
        for task in self.kv.take_failed():
            self._waiting.pop(task.request_id, None)
            self.emit(Failed(request_id=task.request_id, worker_id=self.worker_id, reason=task.reason[:2000]))
        self._release_revoked()

    def tick(self) -> bool:
        self._poll_kv()
        if not self.engine.has_pending():
            return False
        for out in self.engine.step():
            self._emit_tokens(out)
        return True

    def _emit_tokens(self, out: RequestOutput) -> None:
        self.emit(Tokens(
            request_id=out.request_id,
            worker_id=self.worker_id,
            new_token_ids=list(out.new_token_ids),
            num_computed_tokens=out.num_computed_tokens,
            num_output_tokens=len(out.token_ids),
            finished=out.finished,
            finish_reason=out.finish_reason or "",
            num_draft_tokens=out.num_draft_tokens,
            num_accepted_tokens=out.num_accepted_tokens,
            num_cached_tokens=out.num_cached_tokens,
            logprobs=list(out.new_logprobs),
            prompt_logprobs=list(out.prompt_logprobs or []),
        ))
