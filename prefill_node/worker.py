"""The prefill worker: an engine in the producer role. A decode worker that owns a request asks it for
the KV over the control plane (``TransferRequest``: prompt, sampling parameters, the decode worker's
reserved blocks); it computes the prompt (chunked), sends the first token at once (``FirstToken``),
runs the draft proposer, and streams the KV into those blocks; the last sends go out from post_forward
(S2), and ``TransferDone`` as soon as the decode side has acknowledged them: the ack is looked for at
the end of each step, between steps (``tick``), and while a step runs (the ack poller thread), so it
does not wait for the next step. Failures go back to that decode worker as ``AbortTransfer``; it
tells the router. A first-token-only ask (max_tokens 1) gets its ``FirstToken`` and nothing else: no KV
leaves this worker for a request that will never decode.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.engine.pooling import pooled_bytes
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.connector.prefill import PrefillKVConnector
from pdcluster.kv_transfer.control_plane import PrefillEndpoint
from pdcluster.kv_transfer.protocol import AbortTransfer, FirstToken, TransferRequest
from pdcluster.node.endpoint import endpoint_config
from pdcluster.kv_transfer.transports.ranked import check_rank_transport
from pdcluster.node.kv_transport import open_transport, rank_cache_allocator
from pdcluster.node.worker_loop import WorkerLoop, engine_stats

log = logging.getLogger(__name__)

_ACK_POLL_S = 0.002  # how often the ack poller looks while a flushed transfer waits for its ack
_ACK_IDLE_S = 0.1  # longest it sleeps otherwise (it also wakes when a transfer is flushed)


class PrefillWorker(WorkerLoop):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        super().__init__(f"prefill-{worker_id}")
        self.worker_id = worker_id
        self.transfer = transfer
        # In stages: the model and its cache, the transfer made on that cache, then the engine with it.
        check_rank_transport(transfer.transport, engine_config.tensor_parallel_size)
        model = LoadedModel.load(engine_config, progress=False, share_rank_caches=True,
                                 rank_cache_allocator=rank_cache_allocator(transfer))
        spec = model.kv_spec
        self.transport = open_transport(transfer, model, "sender")
        self.endpoint = PrefillEndpoint(endpoint_config(worker_id, model, transfer, self.transport),
                                        host=transfer.host, port=transfer.port)
        self.connector = PrefillKVConnector(
            self.transport, self.endpoint, model.arch.num_layers, spec.num_layers, spec.block_size,
            num_state_blocks=model.num_state_blocks,
        )
        self.engine = LLMEngine(model, self.connector, cumulative_outputs=False)  # reads new tokens only
        self._connected: dict[str, dict] = {}  # decode peer id -> the transport descriptor we connected to
        # First-token-only asks (max_tokens 1: no KV goes out) -> the decode worker that owns each; until the
        # first token is sent or the owner gives the ask up.
        self._first_token_only: dict[str, str] = {}
        self._ack_poller = threading.Thread(target=self._poll_acks, name=f"prefill-{worker_id}-acks", daemon=True)
        self.start()
        self._ack_poller.start()

    @property
    def address(self) -> str:
        return self.endpoint.address

    # ---- called from other threads --------------------------------------------------------------
    def stats(self) -> dict:
        return self.call(self._stats)

    def close(self) -> None:
        self.stop()
        self._ack_poller.join(1.0)
        self.close_kv_offload()
        self.endpoint.close()
        self.transport.close()

    def _poll_acks(self) -> None:
        """Ack poller thread: while the engine thread is inside a step (a prefill chunk can take
        seconds), send the TransferDone of each flushed transfer its receiver has acknowledged."""
        while self.is_running():
            if not self.connector.awaiting_acks.wait(_ACK_IDLE_S):
                continue
            try:
                self.connector.poll_acks()
            except Exception:  # noqa: BLE001 - the engine thread's own poll still covers it
                log.exception("polling transfer acks failed")
            time.sleep(_ACK_POLL_S)

    # ---- engine thread ------------------------------------------------------------------------------
    def _on_transfer_request(self, decode_id: str, msg: TransferRequest) -> None:
        request_id = msg.request_id
        try:
            params = SamplingParams(**msg.sampling)
            # Only the first token is produced here; the decode worker continues with the same seed.
            # Checked here (add_request validates) because it came from another process: a bad token id
            # must fail this request, not the engine thread.
            self.engine.add_request(list(msg.prompt_token_ids), replace(params, max_tokens=1), request_id=request_id)
            if msg.first_token_only:  # the first token is the answer: no transfer, the blocks go back at its end
                self._first_token_only[request_id] = decode_id
                return
            timeout_s = min(self.transfer.transfer_timeout_s, max(0.0, msg.deadline_unix_s - time.time()))
            self.connector.add_transfer(request_id, decode_id, msg.dst_block_ids, msg.num_tokens, timeout_s,
                                        num_reused_blocks=msg.num_reused_blocks)  # those the decode side holds
        except Exception as e:  # noqa: BLE001 - a bad request fails alone, and its owner hears why
            log.warning("refusing transfer request %s from %s: %s", request_id, decode_id, e)
            self.engine.abort_request(request_id)
            self._send(decode_id, AbortTransfer(request_id=request_id, reason=f"prefill refused: {e}"[:200]))

    def _send(self, decode_id: str, msg) -> None:
        try:
            self.endpoint.send(decode_id, msg)
        except Exception as e:  # noqa: BLE001 - the peer is gone: its requests fail on the dead-peer path
            log.warning("cannot reach decode worker %s: %s", decode_id, e)

    def _stats(self) -> dict:
        return {
            **engine_stats(self.worker_id, self.engine),
            "num_held": len(self.engine.scheduler.held),
            "num_transfers": len(self.connector.tasks),
            "bytes_sent": self.connector.bytes_sent,
            "num_prompt_tokens_computed": self.engine.scheduler.num_prompt_tokens_computed,
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
            if isinstance(msg, TransferRequest):
                self._on_transfer_request(peer_id, msg)
            elif isinstance(msg, AbortTransfer) and self._first_token_only.get(msg.request_id) == peer_id:
                del self._first_token_only[msg.request_id]  # its owner gave it up: stop computing it
                self.engine.abort_request(msg.request_id)
            else:
                self.connector.handle_message(peer_id, msg)
        # Between steps (or idle): acks that came in since the last step send their TransferDone now,
        # and the blocks of transfers that ended (here, in the ack poller, or failed outside a step: the
        # decode side was told, or is gone) go back.
        self.engine.poll_kv()
        for request_id in self.connector.take_aborts():  # failed while the engine still runs them
            self.engine.abort_request(request_id)
        # Blocks held only for transfers in flight need no step: the poll above frees them once acked.
        # Stepping for them (empty steps, back to back) burnt a core for the whole transfer, taken
        # from the decode worker and the next prompt on a host the workers share.
        if not self.engine.has_work():
            return False
        for out in self.engine.step():
            task = self.connector.tasks.get(out.request_id)
            owner = self._first_token_only.pop(out.request_id, None) if out.new_token_ids or out.finished else None
            if owner is not None and out.new_token_ids:  # the whole answer; nothing follows it
                self._send(owner, _first_token(out))
            elif owner is not None:  # ended here without a token (an error): its owner fails it
                self._send(owner, AbortTransfer(request_id=out.request_id,
                                                reason=f"prefill ended it: {out.finish_reason}"[:200]))
            elif out.new_token_ids and task is not None:
                first = _first_token(out)
                # Kept on the task too: TransferDone repeats them in case it overtakes FirstToken.
                task.logprobs, task.prompt_logprobs = first.logprobs, first.prompt_logprobs
                self._send(task.decode_id, first)
        return True


def _first_token(out) -> FirstToken:
    """The FirstToken of a step output that sampled the request's first token."""
    return FirstToken(request_id=out.request_id, token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
                      num_offloaded_tokens=out.num_offloaded_tokens, logprobs=list(out.new_logprobs),
                      prompt_logprobs=list(out.prompt_logprobs or []), pooled=pooled_bytes(out.pooled))
