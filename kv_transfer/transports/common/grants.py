"""Admission across processes for shm push and cuda_ipc (mapped_push.py): a pushing sender copies
straight into the receiver's cache, so the receiver's admission gate (admission.py) cannot stop it;
the sender must hold a grant.

Protocol, on the sender's control socket (every message sealed, sealing.py):

* GRANT(transfer, blocks), receiver -> every pushing sender: sent by ``expect`` before it returns,
  so before the decode side can hand the block ids to anyone. A sender that joins later gets every
  grant in force right after its handshake, followed by SYNC; its ``connect`` returns after SYNC.
* A sender pushes a chunk only if it holds a grant naming the transfer and every destination block;
  before each push it reads what waits on its socket (a grant sent before the reservation was
  answered is there by then, and a REVOKE takes effect before the next copy). Lacking a grant, it
  fails the send without touching the receiver's memory.
* REVOKE(transfer), receiver -> every pushing sender: ``revoke`` and ``complete``. The sender drops
  the grant and answers REVOKED(transfer). Its IO thread copies chunks one at a time and reads the
  socket between them, so when it answers, no copy of that transfer is under way or will start.
* The receiver reports a revoked transfer in ``poll_revoked`` once every sender it sent the REVOKE
  to has answered or closed its connection (the sender's IO thread, the only one that copies, has
  ended: process gone or transport closed).
"""

from __future__ import annotations

from collections.abc import Hashable

import msgpack
import numpy as np


def encode_grant(transfer_id: str, blocks: np.ndarray) -> bytes:
    return msgpack.packb([transfer_id, np.asarray(blocks).astype("<i4").tobytes()])


def decode_grant(body: bytes) -> tuple[str, np.ndarray]:
    transfer_id, raw = msgpack.unpackb(body)
    return str(transfer_id), np.frombuffer(raw, dtype="<i4").astype(np.int64)


def encode_transfer_id(transfer_id: str) -> bytes:
    return msgpack.packb(transfer_id)


def decode_transfer_id(body: bytes) -> str:
    return str(msgpack.unpackb(body))


class Grants:
    """Sender side, per receiver: the transfers it may push and their blocks."""

    def __init__(self, open_receiver: bool = False) -> None:
        self._blocks: dict[str, np.ndarray] = {}
        self._open = open_receiver  # the receiver admits unexpected transfers (benchmarks): no grants

    def add(self, transfer_id: str, blocks: np.ndarray) -> None:
        old = self._blocks.get(transfer_id)
        self._blocks[transfer_id] = np.unique(blocks) if old is None else np.union1d(old, blocks)

    def drop(self, transfer_id: str) -> None:
        self._blocks.pop(transfer_id, None)

    def allows(self, transfer_id: str, dst_block_ids: np.ndarray) -> bool:
        if self._open:
            return True
        blocks = self._blocks.get(transfer_id)
        return blocks is not None and bool(np.isin(dst_block_ids, blocks, assume_unique=False).all())

    def __len__(self) -> int:
        return len(self._blocks)


class PendingRevokes:
    """Receiver side: revoked transfers still waiting for some senders' REVOKED."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[Hashable]] = {}

    def start(self, transfer_id: str, senders: set[Hashable]) -> None:
        self._waiting[transfer_id] = set(senders)

    def confirm(self, transfer_id: str, sender: Hashable) -> bool:
        """A sender answered REVOKED; True once nobody is left for the transfer."""
        waiting = self._waiting.get(transfer_id)
        if waiting is None:
            return False  # a REVOKED for complete(), which waits for nothing
        waiting.discard(sender)
        if waiting:
            return False
        del self._waiting[transfer_id]
        return True

    def sender_gone(self, sender: Hashable) -> list[str]:
        """A sender's connection closed: transfers left with nobody to wait for."""
        done = []
        for transfer_id, waiting in list(self._waiting.items()):
            waiting.discard(sender)
            if not waiting:
                del self._waiting[transfer_id]
                done.append(transfer_id)
        return done

    def __len__(self) -> int:
        return len(self._waiting)
