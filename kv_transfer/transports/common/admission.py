"""Receiver-side admission: which transfers may still write which blocks of the cache.

The decode side reserves destination blocks for a request and frees them the moment it gives up on
the transfer (abort, deadline, prefill declared dead). Chunks already in flight, or still being sent
by a prefill that has not heard of the abort yet, keep arriving; scattered blindly they would land
in blocks that by then belong to another request. So a receiver writes a chunk only while its
transfer is *expected* and only into the blocks expected for it:

* ``expect(transfer_id, dst_block_ids)`` opens a transfer for those blocks. A block is writable by
  at most one transfer at a time (asserted: two reservations never share a block).
* ``revoke(transfer_id)`` closes it. The check and the scatter of one chunk happen under one lock
  (``gate``), so once ``revoke`` returns, the chunk that was being scattered has finished and every
  later one is refused: no byte of the transfer is written into the cache any more.
* Anything else (a transfer never expected, revoked, completed, or a chunk naming a block outside
  the expected set) is refused: not scattered, acked with the reason, counted in ``num_refused`` and
  logged at most once a second.

Transports whose sender writes into the receiver's memory itself (shm push) cannot be stopped by
this lock alone; they add a revoke handshake with the sender (see shm/transport.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

log = logging.getLogger(__name__)

_LOG_INTERVAL_S = 1.0
_NO_TRANSFER = 0  # owner token of a block no transfer may write


class Admission:
    """Thread-safe. ``gate`` is entered by IO threads; ``expect``/``revoke`` by the caller."""

    def __init__(self, num_blocks: int, owner: str, admit_unexpected: bool = False) -> None:
        # Per block: the token of the one transfer allowed to write it (0: none).
        self._owner_np = np.zeros(num_blocks, dtype=np.int64)
        self._tokens: dict[str, int] = {}  # expected transfer id -> its token
        self._blocks: dict[str, np.ndarray] = {}  # expected transfer id -> its blocks
        self._next_token = 1
        self._admit_unexpected = admit_unexpected  # benchmarks without reservations only
        self._lock = threading.Lock()
        self._owner = owner  # for log lines, e.g. "tcp receiver"
        self.num_refused = 0
        self._last_log_s = -_LOG_INTERVAL_S
        self._unlogged = 0

    def expect(self, transfer_id: str, dst_block_ids: np.ndarray | list[int]) -> None:
        """Let ``transfer_id`` write ``dst_block_ids`` (again: add blocks to its set)."""
        blocks = np.unique(np.asarray(dst_block_ids, dtype=np.int64).reshape(-1))
        if blocks.size and (blocks[0] < 0 or blocks[-1] >= self._owner_np.size):
            raise ValueError(f"expected block ids out of range [0, {self._owner_np.size})")
        with self._lock:
            token = self._tokens.get(transfer_id)
            if token is None:
                token = self._next_token
                self._next_token += 1
            owners = self._owner_np[blocks]
            taken = blocks[(owners != _NO_TRANSFER) & (owners != token)]
            if taken.size:
                holder = self._holder_locked(int(self._owner_np[taken[0]]))
                raise ValueError(
                    f"blocks {taken[:8].tolist()} are still writable by transfer {holder!r}: revoke it "
                    f"(and wait for poll_revoked if it returned False) before expecting {transfer_id!r}"
                )
            self._tokens[transfer_id] = token
            self._owner_np[blocks] = token
            old = self._blocks.get(transfer_id)
            self._blocks[transfer_id] = blocks if old is None else np.union1d(old, blocks)

    def revoke(self, transfer_id: str) -> bool:
        """Close ``transfer_id``; returns whether it was expected. Waits for a scatter in progress."""
        with self._lock:
            token = self._tokens.pop(transfer_id, None)
            blocks = self._blocks.pop(transfer_id, None)
            if token is None:
                return False
            self._owner_np[blocks] = _NO_TRANSFER
            return True

    @property
    def admits_unexpected(self) -> bool:
        return self._admit_unexpected

    def expected(self) -> list[tuple[str, np.ndarray]]:
        """Every open transfer and its blocks (shm hands them to a sender that joins)."""
        with self._lock:
            return list(self._blocks.items())

    @contextmanager
    def gate(self, transfer_id: str, dst_block_ids: np.ndarray) -> Iterator[str | None]:
        """``with admission.gate(tid, dst) as refusal:`` — None: scatter now, inside the block (the
        lock is held, so a concurrent ``revoke`` waits for it); else why the chunk is refused."""
        with self._lock:
            refusal = self._refusal_locked(transfer_id, dst_block_ids)
            if refusal is not None:
                self.num_refused += 1
            yield refusal
        if refusal is not None:
            self._maybe_log(refusal)

    def check(self, transfer_id: str, dst_block_ids: np.ndarray) -> str | None:
        """The same verdict as ``gate``, for a chunk whose bytes are already in place (shm push)."""
        with self.gate(transfer_id, dst_block_ids) as refusal:
            return refusal

    def _refusal_locked(self, transfer_id: str, dst_block_ids: np.ndarray) -> str | None:
        token = self._tokens.get(transfer_id)
        if token is None:
            if self._admit_unexpected:
                return None
            return (
                f"receiver refused a chunk of transfer {transfer_id!r}: not expected (never reserved "
                "here, revoked after an abort or deadline, or already complete)"
            )
        # The caller checked the ids are in range (layout.chunk_problem) before asking.
        outside = dst_block_ids[self._owner_np[dst_block_ids] != token]
        if outside.size:
            return (
                f"receiver refused a chunk of transfer {transfer_id!r}: blocks {outside[:8].tolist()} "
                "are not among the blocks reserved for it"
            )
        return None

    def _holder_locked(self, token: int) -> str:
        return next((t for t, k in self._tokens.items() if k == token), "?")

    def _maybe_log(self, refusal: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_log_s < _LOG_INTERVAL_S:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._last_log_s = self._unlogged, 0, now
        more = f" ({unlogged} more refused since the last report)" if unlogged else ""
        log.warning("%s: %s%s", self._owner, refusal, more)
