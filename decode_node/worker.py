"""The decode worker: an engine in the consumer role. It reserves blocks for a request whose prompt is
prefilled elsewhere, waits for the KV (WAITING_FOR_KV -> READY | FAILED), then decodes with continuous
batching and speculative decoding. It can also run a request start to finish itself (colocated mode,
or conditional disaggregation for short prompts).

Events emitted for the router (dicts):
  {"type": "tokens", "request_id", "worker_id", "new_token_ids", "num_computed_tokens",
   "num_output_tokens", "finished", "finish_reason", "num_draft_tokens", "num_accepted_tokens"}
  {"type": "kv_ready", "request_id", "worker_id"}
  {"type": "failed", "request_id", "worker_id", "reason"}
"""

from __future__ import annotations

import logging

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine, RequestOutput
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.worker_loop import WorkerLoop
from pdcluster.kv_transfer.config import TransferConfig, kv_layout, model_fingerprint
from pdcluster.kv_transfer.connector import DecodeKVConnector
from pdcluster.kv_transfer.control_plane import DecodeEndpoint, EndpointConfig
from pdcluster.kv_transfer.transports import get_transport_class

log = logging.getLogger(__name__)


class DecodeWorker(WorkerLoop):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig | None = None):
        super().__init__(f"decode-{worker_id}")
        self.worker_id = worker_id
        self.transfer = transfer
        allocator = None
        transport_cls = None
        if transfer is not None:
            transport_cls = get_transport_class(transfer.transport)
            allocator = transport_cls.allocate_kv_cache
        self.engine = LLMEngine(engine_config, progress=False, kv_cache_allocator=allocator)
        self.transport = self.endpoint = self.connector = None
        if transfer is not None:
            self.transport = transport_cls(self.engine.kv_cache, "receiver", transfer.transport_config())
            self.endpoint = DecodeEndpoint(
                EndpointConfig(
                    worker_id=worker_id,
                    layout=kv_layout(self.engine.kv_spec),
                    model_fingerprint=model_fingerprint(self.engine.model_dir),
                    transport=transfer.transport,
                    transport_descriptor=self.transport.local_descriptor(),
                    secret=transfer.secret,
                    heartbeat_interval_s=transfer.heartbeat_interval_s,
                    peer_timeout_s=transfer.peer_timeout_s,
                )
            )
            self.connector = DecodeKVConnector(self.transport, self.endpoint)
        self._pending: dict[str, tuple[list[int], SamplingParams]] = {}
        self.start()

    # ---- called from other threads ----------------------------------------------------------------
    def connect_prefill(self, address: str) -> str:
        """Handshake with a prefill worker; returns its worker id."""
        hello = self.endpoint.connect(address)
        return hello.worker_id

    def disconnect_prefill(self, prefill_id: str) -> bool:
        """Leave a prefill worker (drain): KV expected from it fails now, new reservations naming it fail."""
        return self.endpoint.disconnect(prefill_id)

    def reserve(self, request_id: str, prefill_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int] | None:
        """Admission + reservation: destination block ids for the prompt's KV, or None if full."""
        return self.call(self._reserve, request_id, prefill_id, list(prompt_token_ids), params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Run a request here from prefill to finish (colocated / conditional disaggregation)."""
        self.post(self._add_local, request_id, list(prompt_token_ids), params)

    def abort(self, request_id: str) -> None:
        self.post(self._abort, request_id)

    def stats(self) -> dict:
        return self.call(self._stats)

    def close(self) -> None:
        self.stop()
        if self.endpoint is not None:
            self.endpoint.close()
            self.transport.close()

    # ---- engine thread --------------------------------------------------------------------------------
    def _reserve(self, request_id, prefill_id, prompt_token_ids, params) -> list[int] | None:
        self.engine.validate(prompt_token_ids, params)
        blocks = self.engine.reserve_blocks(request_id, len(prompt_token_ids), params)
        if blocks is not None:
            try:
                # Admits the blocks on the transport before their ids leave this worker.
                self.connector.expect(request_id, prefill_id, self.transfer.transfer_timeout_s, blocks)
            except Exception:
                self.engine.release_reserved(request_id)  # nothing can have written them yet
                raise
            self._pending[request_id] = (prompt_token_ids, params)
        return blocks

    def _add_local(self, request_id, prompt_token_ids, params) -> None:
        try:
            self.engine.add_request(prompt_token_ids, params, request_id=request_id)
        except Exception as e:  # noqa: BLE001
            self.emit({"type": "failed", "request_id": request_id, "worker_id": self.worker_id, "reason": str(e)})

    def _abort(self, request_id: str) -> None:
        if self.connector is not None:
            self.connector.abort(request_id, "aborted by the router")  # revokes the transfer
            self._release_revoked()
            if self.connector.holds(request_id):
                self._pending.pop(request_id, None)
                return  # quarantined: its blocks come back once the sender confirms (tick)
        self.engine.release_reserved(request_id)
        self._pending.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _release_revoked(self) -> None:
        """Free the blocks of failed reservations the transport no longer writes (exactly once)."""
        for request_id in self.connector.take_releasable():
            self.engine.release_reserved(request_id)

    def _stats(self) -> dict:
        sched = self.engine.scheduler
        return {
            "worker_id": self.worker_id,
            "num_free_blocks": sched.num_free_blocks,
            "num_blocks": self.engine.kv_spec.num_blocks,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_reserved": self.engine.num_reserved,
            # Of those, failed ones whose blocks wait for a sender's revoke confirmation (shm push).
            "num_quarantined": len(self.connector.quarantined) if self.connector is not None else 0,
        }

    def tick(self) -> bool:
        if self.connector is not None:
            for peer_id, msg in self.endpoint.poll(0.0):
                self.connector.handle_message(peer_id, msg)
            self.connector.check()
            for task in self.connector.take_ready():
                prompt, params = self._pending.pop(task.request_id)
                done = task.done
                self.emit({"type": "kv_ready", "request_id": task.request_id, "worker_id": self.worker_id})
                out = self.engine.add_prefilled_request(task.request_id, prompt, params, done.first_token_id,
                                                        list(done.draft_token_ids))
                if out is not None:
                    self._emit_tokens(out)
            for task in self.connector.take_failed():
                self._pending.pop(task.request_id, None)
                self.emit({"type": "failed", "request_id": task.request_id, "worker_id": self.worker_id,
                           "reason": task.reason})
            self._release_revoked()
        if not self.engine.has_pending():
            return False
        for out in self.engine.step():
            self._emit_tokens(out)
        return True

    def _emit_tokens(self, out: RequestOutput) -> None:
        self.emit({
            "type": "tokens",
            "request_id": out.request_id,
            "worker_id": self.worker_id,
            "new_token_ids": list(out.new_token_ids),
            "num_computed_tokens": out.num_computed_tokens,
            "num_output_tokens": len(out.token_ids),
            "finished": out.finished,
            "finish_reason": out.finish_reason,
            "num_draft_tokens": out.num_draft_tokens,
            "num_accepted_tokens": out.num_accepted_tokens,
        })
