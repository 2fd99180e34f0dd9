"""Where a decode worker's KV comes from. ``RemoteKV``: a prefill worker, over the control plane
(endpoint) and a transport, tracked by the DecodeKVConnector that the worker's engine is built with.
``NoRemoteKV``: nowhere (colocated: every request is prefilled here; the engine gets the null
connector), so the worker's loop has no ``None`` checks."""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Callable

from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.connector.decode import DecodeKVConnector
from pdcluster.kv_transfer.control_plane import DecodeEndpoint
from pdcluster.kv_transfer.protocol import AbortTransfer, FirstToken, Message, TransferRequest
from pdcluster.node.endpoint import endpoint_config
from pdcluster.node.kv_transport import open_transport
from pdcluster.wire.kv_connector import KVConnector


class UnreachablePrefill(ConnectionError):
    """The named prefill worker is not connected to this decode worker (never, or no longer)."""


class NoRemoteKV:
    transport_name = ""
    num_quarantined = 0
    transfer_timeout_s = 0.0

    def __init__(self) -> None:
        self.connector = KVConnector()

    def request_kv(self, request_id: str, prefill_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   block_ids: list[int], num_reused_blocks: int = 0) -> None:
        raise UnreachablePrefill("this decode worker runs colocated: it has no KV transfer configured")

    def ask_first_token(self, request_id: str, prefill_id: str, prompt_token_ids: list[int],
                        params: SamplingParams) -> None:
        raise UnreachablePrefill("this decode worker runs colocated: it has no KV transfer configured")

    def give_up_first_token(self, request_id: str, prefill_id: str, reason: str) -> None:
        pass

    def dead_peers(self) -> set[str]:
        return set()

    def connect(self, address: str) -> str:
        raise RuntimeError("this decode worker runs colocated: it has no KV transfer configured")

    def disconnect(self, prefill_id: str) -> bool:
        return False

    def lost_peers(self) -> list[str]:
        """Prefill workers this worker was connected to and lost to silence (not left on request)."""
        return []

    def poll_messages(self) -> list[tuple[str, Message]]:
        return []

    def handle_message(self, peer_id: str, msg: Message) -> None:
        pass

    def close(self) -> None:
        pass


class RemoteKV(NoRemoteKV):
    """``on_first_token(peer_id, msg)`` runs on the control plane's I/O thread as soon as a FirstToken
    arrives (the first token does not wait for the engine's current step); every other message waits
    in an inbox for the engine thread (``poll_messages``)."""

    def __init__(self, worker_id: str, model: LoadedModel, transfer: TransferConfig,
                 on_first_token: Callable[[str, FirstToken], None]):
        self.transfer = transfer
        self.transfer_timeout_s = transfer.transfer_timeout_s
        self.transport_name = transfer.transport
        self.transport = open_transport(transfer, model, "receiver")
        self._on_first_token = on_first_token
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.endpoint = DecodeEndpoint(endpoint_config(worker_id, model, transfer, self.transport),
                                       on_message=self._on_message)
        self.connector = DecodeKVConnector(self.transport, self.endpoint)

    def _on_message(self, peer_id: str, msg: Message) -> None:
        if isinstance(msg, FirstToken):
            self._on_first_token(peer_id, msg)
        else:
            self._inbox.put((peer_id, msg))

    @property
    def num_quarantined(self) -> int:
        return len(self.connector.quarantined)

    def request_kv(self, request_id, prefill_id, prompt_token_ids, params, block_ids, num_reused_blocks=0) -> None:
        """Admit the blocks on the transport, then ask the prefill worker for the KV (block ids leave
        this worker only after the transport expects them). ``block_ids``: where the KV of the prompt's
        blocks from ``num_reused_blocks`` on lands (the ones before are this worker's own, shared with
        its prefix cache: never admitted, never named to the sender)."""
        if prefill_id not in self.endpoint.peers():
            raise UnreachablePrefill(f"prefill worker {prefill_id!r} is not connected to this decode worker")
        self.connector.expect(request_id, prefill_id, self.transfer.transfer_timeout_s, block_ids)
        ask = TransferRequest(request_id=request_id, dst_block_ids=list(block_ids), num_tokens=len(prompt_token_ids),
                              deadline_unix_s=time.time() + self.transfer.transfer_timeout_s,
                              prompt_token_ids=list(prompt_token_ids), sampling=dataclasses.asdict(params),
                              num_reused_blocks=num_reused_blocks)
        try:
            self.endpoint.send(prefill_id, ask)
        except Exception as e:  # lost since the check above: give the admission back (revoke) and say so
            self.connector.abort(request_id, "prefill worker unreachable")
            raise UnreachablePrefill(f"prefill worker {prefill_id!r}: {e}") from e

    def ask_first_token(self, request_id: str, prefill_id: str, prompt_token_ids: list[int],
                        params: SamplingParams) -> None:
        """Ask the prefill worker for the request's first token alone (it ends the request): no blocks are
        admitted on the transport, none named to the sender."""
        if prefill_id not in self.endpoint.peers():
            raise UnreachablePrefill(f"prefill worker {prefill_id!r} is not connected to this decode worker")
        ask = TransferRequest(request_id=request_id, dst_block_ids=[], num_tokens=len(prompt_token_ids),
                              deadline_unix_s=time.time() + self.transfer.transfer_timeout_s,
                              prompt_token_ids=list(prompt_token_ids), sampling=dataclasses.asdict(params),
                              first_token_only=True)
        try:
            self.endpoint.send(prefill_id, ask)
        except Exception as e:  # lost since the check above
            raise UnreachablePrefill(f"prefill worker {prefill_id!r}: {e}") from e

    def give_up_first_token(self, request_id: str, prefill_id: str, reason: str) -> None:
        """Tell the prefill worker to stop computing a first-token-only ask (best effort: a peer that is
        gone has dropped it)."""
        try:
            self.endpoint.send(prefill_id, AbortTransfer(request_id=request_id, reason=reason[:200]))
        except Exception:  # noqa: BLE001
            pass

    def dead_peers(self) -> set[str]:
        return self.endpoint.dead_peers()

    def connect(self, address: str) -> str:
        return self.endpoint.connect(address).worker_id

    def disconnect(self, prefill_id: str) -> bool:
        return self.endpoint.disconnect(prefill_id)

    def lost_peers(self) -> list[str]:
        return sorted(self.endpoint.lost_peers())

    def poll_messages(self) -> list[tuple[str, Message]]:
        out = []
        for _ in range(100_000):  # bounded: what has arrived by now
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return out

    def handle_message(self, peer_id: str, msg: Message) -> None:
        self.connector.handle_message(peer_id, msg)

    def close(self) -> None:
        self.endpoint.close()
        self.transport.close()
