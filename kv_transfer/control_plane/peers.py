"""The peers an endpoint completed a handshake with, and what became of the others: declared dead
after ``peer_timeout_s`` of silence, or left on request. Also each peer's liveness: when we last
heard from it, and the number of the next heartbeat we send it.

Only the I/O thread writes the table, and it reads it without the lock (nobody else writes);
callers' threads read it under the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..protocol import Hello
from ..session import Session


class PeerNotConnectedError(LookupError):
    """``send`` named a peer that has no completed handshake (never connected, dead, or closed)."""


@dataclass(eq=False)
class Peer:
    hello: Hello  # the peer's verified Hello
    route: Any  # how to reach it: a ROUTER routing id (bytes) or a DecodeEndpoint connection
    last_seen: float  # monotonic time of its last valid message
    seq: int = 0  # next heartbeat sequence number we send it
    # Seals every message after the handshake (session.py); keyed by this connection's two nonces.
    session: Session | None = None


class PeerTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Peer] = {}
        self._dead: set[str] = set()
        self._left: set[str] = set()  # of ``_dead``: the peers we left on request (disconnect), not lost

    # --- any thread ------------------------------------------------------------------------------------

    def hellos(self) -> dict[str, Hello]:
        with self._lock:
            return {pid: p.hello for pid, p in self._live.items()}

    def dead(self) -> set[str]:
        with self._lock:
            return set(self._dead)

    def lost(self) -> set[str]:
        with self._lock:
            return self._dead - self._left

    def require(self, peer_id: str, owner: str) -> None:
        """Raise PeerNotConnectedError, naming ``owner``, unless ``peer_id`` is connected."""
        with self._lock:
            if peer_id not in self._live:
                raise PeerNotConnectedError(
                    f"{owner}: no connected peer {peer_id!r} (connected: {sorted(self._live)}, "
                    f"dead: {sorted(self._dead)})"
                )

    # --- the I/O thread --------------------------------------------------------------------------------

    def get(self, peer_id: str | None) -> Peer | None:
        return self._live.get(peer_id) if peer_id is not None else None

    def all(self) -> list[Peer]:
        return list(self._live.values())

    def add(self, peer: Peer) -> Peer | None:
        """Register a peer that completed its handshake; returns the connection it replaces, if any."""
        pid = peer.hello.worker_id
        with self._lock:
            old = self._live.get(pid)
            self._live[pid] = peer
            self._dead.discard(pid)
            self._left.discard(pid)
        return old

    def silent(self, now: float, timeout_s: float) -> list[tuple[Peer, float]]:
        """Peers not heard from for over ``timeout_s``, with how long they have been silent."""
        return [(p, now - p.last_seen) for p in self._live.values() if now - p.last_seen > timeout_s]

    def declare_dead(self, peer_id: str) -> None:
        with self._lock:
            del self._live[peer_id]
            self._dead.add(peer_id)

    def leave(self, peer_id: str) -> Peer | None:
        """We leave ``peer_id`` on request: it counts as dead, and as left rather than lost."""
        with self._lock:
            peer = self._live.pop(peer_id, None)
            if peer is not None:
                self._dead.add(peer_id)
                self._left.add(peer_id)
        return peer

    def forget(self, peer_id: str) -> None:
        """Drop a connection whose caller gave up on it (neither dead nor left)."""
        with self._lock:
            del self._live[peer_id]

    def clear(self) -> None:
        """The endpoint closed: nothing is reachable any more (the dead keep their record)."""
        with self._lock:
            self._live.clear()
