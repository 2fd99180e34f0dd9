"""Book-keeping shared by all transports: which sends are still in flight (sender side) and which
send() calls have fully landed (receiver side). Thread-safe: IO threads update, callers poll."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class _TransferState:
    outstanding_sends: int = 0
    error: str | None = None


@dataclass
class _SendState:
    transfer_id: str
    peer_id: str
    transfer: _TransferState  # by reference: survives the transfer's removal from the table
    chunks_left: int
    deadline_s: float  # time.monotonic() after which the send counts as lost


class SendTracker:
    """Sender side. A transfer id is done when none of its sends is outstanding *at poll time*."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_seq = 0
        self._sends: dict[int, _SendState] = {}
        self._transfers: dict[str, _TransferState] = {}

    def begin(self, transfer_id: str, peer_id: str, num_chunks: int, timeout_s: float) -> int:
        """Register one send() call; returns its sequence number."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            transfer = self._transfers.setdefault(transfer_id, _TransferState())
            transfer.outstanding_sends += 1
            self._sends[seq] = _SendState(
                transfer_id, peer_id, transfer, num_chunks, time.monotonic() + timeout_s
            )
            return seq

    def is_live(self, seq: int) -> bool:
        """False once the send (or another send of its transfer) failed: skip its remaining work."""
        with self._lock:
            s = self._sends.get(seq)
            return s is not None and s.transfer.error is None

    def chunk_acked(self, seq: int, error: str | None = None) -> None:
        with self._lock:
            s = self._sends.get(seq)
            if s is None:
                return  # a late ack for a send that already failed
            if error is not None:
                self._fail_locked(seq, error)
                return
            s.chunks_left -= 1
            if s.chunks_left <= 0:
                del self._sends[seq]
                s.transfer.outstanding_sends -= 1

    def fail_send(self, seq: int, error: str) -> None:
        with self._lock:
            if seq in self._sends:
                self._fail_locked(seq, error)

    def fail_peer(self, peer_id: str, error: str) -> None:
        """Fail every outstanding send to ``peer_id`` (peer gone)."""
        with self._lock:
            for seq in [q for q, s in self._sends.items() if s.peer_id == peer_id]:
                self._fail_locked(seq, error)

    def fail_all(self, error: str) -> None:
        """Fail every outstanding send (the transport closed, or its IO thread died)."""
        with self._lock:
            for seq in list(self._sends):
                self._fail_locked(seq, error)

    def outstanding_for_peer(self, peer_id: str) -> int:
        with self._lock:
            return sum(1 for s in self._sends.values() if s.peer_id == peer_id)

    def _fail_locked(self, seq: int, error: str) -> None:
        s = self._sends.pop(seq)
        if s.transfer.error is None:
            s.transfer.error = error

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        now = time.monotonic()
        with self._lock:
            for seq in [q for q, s in self._sends.items() if now > s.deadline_s]:
                self._fail_locked(seq, "timed out waiting for the receiver's acknowledgement")
            done: list[str] = []
            failed: list[tuple[str, str]] = []
            for transfer_id, t in list(self._transfers.items()):
                if t.error is not None:
                    failed.append((transfer_id, t.error))
                    del self._transfers[transfer_id]
                elif t.outstanding_sends == 0:
                    done.append(transfer_id)
                    del self._transfers[transfer_id]
            return done, failed


class ReceiveTracker:
    """Receiver side: counts the chunks of each send() call; reports the call when all landed.

    Senders are told apart by their authenticated nonce (sealing.py), not by the id in the header:
    a sender restarted under the same id numbers its sends from zero again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks_left: dict[tuple[bytes, int], int] = {}
        self._ready: list[tuple[str, list[int]]] = []

    def chunk_landed(
        self, sender_nonce: bytes, send_seq: int, num_chunks: int, transfer_id: str, layer_ids: list[int]
    ) -> None:
        key = (sender_nonce, send_seq)
        with self._lock:
            left = self._chunks_left.get(key, num_chunks) - 1
            if left > 0:
                self._chunks_left[key] = left
                return
            self._chunks_left.pop(key, None)
            self._ready.append((transfer_id, list(layer_ids)))

    def drop_sender(self, sender_nonce: bytes) -> None:
        """Forget half-received sends of a sender that went away."""
        with self._lock:
            for key in [k for k in self._chunks_left if k[0] == sender_nonce]:
                del self._chunks_left[key]

    def poll(self) -> list[tuple[str, list[int]]]:
        with self._lock:
            ready, self._ready = self._ready, []
            return ready
