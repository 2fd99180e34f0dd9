"""The consumer's KV connector (decode side): it tracks the transfers of the prompts whose KV lands in
this worker's reserved blocks.

``DecodeKVConnector`` is keyed by request id and tracks transfers, never requests: the request is the
engine's, in its scheduler from admission with its blocks reserved (WAITING_FOR_REMOTE_KV). A transfer
is expected from ``expect`` until the prefill side's ``TransferDone`` (sent only after delivery was
acknowledged) lands it (``finished_recving``, with the first token and drafts), or a negative
``TransferDone``, an ``AbortTransfer``, a dead prefill peer (heartbeat) or the deadline fails it
(``failed_recving``), or the engine ends the request first (``request_finished``: the router aborted
it). ``poll``, between steps, reports all of that to the engine.

The reserved blocks are admitted on the receiving transport for the request alone (``expect``, see
transports/base.py): chunks that arrive after the decode side gave up, from a prefill that has not
heard of it yet (the abort is an async message; a partitioned or frozen prefill may never hear), are
refused instead of landing in blocks that another request may own by then. A landed transfer is
completed before the engine touches the blocks. A failed or given-up one is revoked; its blocks may go
back to the pool only once the transport guarantees nothing of the transfer is written any more: at
once, or, for a sender that writes into our memory itself (shm push), after it confirmed
(``poll_revoked``). Until then ``request_finished`` keeps them held by the scheduler, *quarantined*:
the request fails for the router at once but its blocks stay out of use, and ``poll`` reports them in
``failed`` when the revoke is confirmed. Each reservation is released exactly once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from pdcluster.kv_transfer.protocol import AbortTransfer, TransferDone
from pdcluster.wire.kv_connector import KVConnector, KVConnectorOutput, LoadedKV

log = logging.getLogger(__name__)


@dataclass
class _Expected:
    prefill_id: str
    deadline: float  # time.monotonic()


class DecodeKVConnector(KVConnector):
    """Keyed by request id; the request itself is the engine's. The transport writes the bytes in the
    background; ``poll`` (engine thread, between steps) reports what landed, what failed, and which
    quarantined blocks may go back."""

    def __init__(self, transport, endpoint, clock=time.monotonic):
        self.transport = transport
        self.endpoint = endpoint
        self.clock = clock
        self.expected: dict[str, _Expected] = {}  # transfers whose KV has not landed yet
        self.quarantined: set[str] = set()  # failed or aborted, waiting for the transport's poll_revoked
        self._out = KVConnectorOutput()  # what the next poll reports

    def expect(self, request_id: str, prefill_id: str, timeout_s: float, dst_block_ids: list[int]) -> None:
        """Track a transfer and admit its blocks on the transport (before the caller hands the block
        ids out: only then can a sender learn them)."""
        self.transport.expect(request_id, np.asarray(dst_block_ids, dtype=np.int64))
        self.expected[request_id] = _Expected(prefill_id, self.clock() + timeout_s)

    def abort(self, request_id: str, reason: str) -> None:
        """Give up a transfer that has not landed (the caller asked: it is not reported as failed)."""
        if request_id in self.expected:
            self._end(request_id, reason, notify_peer=True)

    def request_finished(self, request) -> bool:
        """The engine ended the request (the router aborted it, or its transfer failed): a transfer still
        expected is given up, and the blocks stay held while the transport may still write them."""
        request_id = request.request_id
        self.abort(request_id, "aborted by the router")
        self._out.finished_recving.pop(request_id, None)  # landed before the abort: nothing writes them
        self._out.failed_recving.pop(request_id, None)
        return request_id in self.quarantined

    def handle_message(self, peer_id: str, msg) -> None:
        expected = self.expected.get(msg.request_id) if isinstance(msg, (TransferDone, AbortTransfer)) else None
        if expected is None or expected.prefill_id != peer_id:
            return
        if isinstance(msg, TransferDone) and msg.ok:
            # The KV is final: stray chunks of this transfer are refused before the engine uses it.
            self.transport.complete(msg.request_id)
            del self.expected[msg.request_id]
            self._out.finished_recving[msg.request_id] = LoadedKV(
                msg.first_token_id, list(msg.draft_token_ids), num_bytes=msg.num_bytes, seconds=msg.seconds)
        else:
            reason = msg.error if isinstance(msg, TransferDone) else msg.reason
            self._fail(msg.request_id, f"prefill worker {peer_id}: {reason}", notify_peer=False)

    def poll(self) -> KVConnectorOutput:
        self.transport.poll_received()  # bytes land in the background; TransferDone is authoritative
        for request_id in self.transport.poll_revoked():
            if request_id in self.quarantined:
                self.quarantined.discard(request_id)
                self._out.failed.add(request_id)  # the held blocks go back
        dead = self.endpoint.dead_peers()
        now = self.clock()
        for request_id, expected in list(self.expected.items()):
            if expected.prefill_id in dead:
                self._fail(request_id, f"prefill worker {expected.prefill_id} stopped answering", notify_peer=False)
            elif now > expected.deadline:
                self._fail(request_id, "KV transfer deadline passed", notify_peer=True)
        out, self._out = self._out, KVConnectorOutput()
        return out

    def _fail(self, request_id: str, reason: str, notify_peer: bool) -> None:
        self._end(request_id, reason, notify_peer)
        self._out.failed_recving[request_id] = reason

    def _end(self, request_id: str, reason: str, notify_peer: bool) -> None:
        expected = self.expected.pop(request_id)
        log.warning("KV transfer of %s from %s failed: %s", request_id, expected.prefill_id, reason)
        if not self.transport.revoke(request_id):
            # A sender may still write into the blocks (shm push): keep them reserved until it
            # confirmed it stopped (poll_revoked); bounded by its liveness (a closed link counts).
            self.quarantined.add(request_id)
        if notify_peer:
            try:
                self.endpoint.send(expected.prefill_id, AbortTransfer(request_id=request_id, reason=reason[:200]))
            except Exception:  # noqa: BLE001
                pass
