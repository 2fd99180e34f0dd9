"""The prefill worker: an engine in the producer role. It computes a request's prompt (chunked), samples
the first token (and the drafts), and sends the KV to the decode worker the router chose.

Events emitted (dicts, msgpack-friendly) for the router:
  {"type": "first_token", "request_id", "token_id", "worker_id"}   (TTFT)
  {"type": "transfer_done", "request_id", "worker_id", "num_bytes"}
  {"type": "failed", "request_id", "worker_id", "reason"}
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.worker_loop import WorkerLoop
from pdcluster.kv_transfer.config import TransferConfig, kv_layout, model_fingerprint
from pdcluster.kv_transfer.connector import PrefillKVConnector
from pdcluster.kv_transfer.control_plane import EndpointConfig, PrefillEndpoint
from pdcluster.kv_transfer.transports import get_transport_class

log = logging.getLogger(__name__)


class PrefillWorker(WorkerLoop):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        super().__init__(f"prefill-{worker_id}")
        self.worker_id = worker_id
        self.transfer = transfer
        self.engine = LLMEngine(engine_config, progress=False)
        spec = self.engine.kv_spec
        self.transport = get_transport_class(transfer.transport)(self.engine.kv_cache, "sender", transfer.transport_config())
        self.endpoint = PrefillEndpoint(
            EndpointConfig(
                worker_id=worker_id,
                layout=kv_layout(spec),
                model_fingerprint=model_fingerprint(self.engine.model_dir),
                transport=transfer.transport,
                transport_descriptor=self.transport.local_descriptor(),
                secret=transfer.secret,
                heartbeat_interval_s=transfer.heartbeat_interval_s,
                peer_timeout_s=transfer.peer_timeout_s,
            ),
            host=transfer.host,
            port=transfer.port,
        )
        self.connector = PrefillKVConnector(
            self.transport, self.endpoint, self.engine.arch.num_layers, spec.num_layers, spec.block_size
        )
        self.engine.attach_connector(self.connector)
        self._connected: dict[str, dict] = {}  # decode peer id -> the transport descriptor we connected to
        self.start()

    @property
    def address(self) -> str:
        return self.endpoint.address

    # ---- called from other threads --------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, decode_id: str,
               dst_block_ids: list[int]) -> None:
        self.post(self._submit, request_id, prompt_token_ids, params, decode_id, dst_block_ids)

    def abort(self, request_id: str) -> None:
        self.post(self._abort, request_id)

    def stats(self) -> dict:
        return self.call(self._stats)

    def close(self) -> None:
        self.stop()
        self.endpoint.close()
        self.transport.close()

    # ---- engine thread ------------------------------------------------------------------------------
    def _submit(self, request_id, prompt_token_ids, params, decode_id, dst_block_ids) -> None:
        try:
            if decode_id not in self.endpoint.peers():
                raise RuntimeError(f"decode worker {decode_id!r} has not connected to prefill worker {self.worker_id!r}")
            # Only the first token is produced here; the decode worker continues with the same seed.
            self.engine.add_request(prompt_token_ids, replace(params, max_tokens=1), request_id=request_id)
            self.connector.add_transfer(request_id, decode_id, dst_block_ids, len(prompt_token_ids),
                                        self.transfer.transfer_timeout_s)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone
            self.engine.abort_request(request_id)
            self.emit({"type": "failed", "request_id": request_id, "worker_id": self.worker_id, "reason": str(e)})

    def _abort(self, request_id: str) -> None:
        self.connector.abort(request_id, "aborted by the router")
        self.connector.take_aborts()
        self.engine.abort_request(request_id)
        self.engine.scheduler.free_held(self.connector.take_late_failed())

    def _stats(self) -> dict:
        sched = self.engine.scheduler
        return {
            "worker_id": self.worker_id,
            "num_free_blocks": sched.num_free_blocks,
            "num_blocks": self.engine.kv_spec.num_blocks,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_held": len(sched.held),
            "num_transfers": len(self.connector.tasks),
            "bytes_sent": self.connector.bytes_sent,
        }

    def _connect_new_peers(self) -> None:
        # A known peer id with a new descriptor is a restarted decode worker (Ray keeps the id): the
        # transport replaces the old link, failing whatever was still in flight on it.
        for peer_id, hello in self.endpoint.peers().items():
            if self._connected.get(peer_id) != hello.transport_descriptor:
                self.transport.connect(peer_id, hello.transport_descriptor)
                self._connected[peer_id] = hello.transport_descriptor

    def tick(self) -> bool:
        self._connect_new_peers()
        for peer_id, msg in self.endpoint.poll(0.0):
            self.connector.handle_message(peer_id, msg)
        for request_id in self.connector.take_aborts():
            self.engine.abort_request(request_id)
            self._emit_failed(request_id)
        late = self.connector.take_late_failed()
        if late:
            self.engine.scheduler.free_held(late)
            for request_id in late:
                self._emit_failed(request_id)
        if not self.engine.has_pending():
            return False
        for out in self.engine.step():
            if out.new_token_ids:
                self.emit({"type": "first_token", "request_id": out.request_id, "token_id": out.new_token_ids[0],
                           "worker_id": self.worker_id})
        kv = self.engine.last_kv_output
        for request_id in kv.finished_sending:
            num_bytes, seconds = self.connector.completed.pop(request_id, (0, 0.0))
            self.emit({"type": "transfer_done", "request_id": request_id, "worker_id": self.worker_id,
                       "num_bytes": num_bytes, "seconds": seconds, "transport": self.transfer.transport})
        for request_id in kv.failed:
            self._emit_failed(request_id)
        return True

    def _emit_failed(self, request_id: str) -> None:
        reason = self.connector.failure_reason(request_id) or "KV transfer failed"
        self.emit({"type": "failed", "request_id": request_id, "worker_id": self.worker_id, "reason": reason})
