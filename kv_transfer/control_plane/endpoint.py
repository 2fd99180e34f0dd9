"""What both roles share above the I/O loop: every inbound message is checked before anyone sees it
(session seal, size, version, schema, handshake state, sender), then delivered through ``poll`` or
the ``on_message`` callback; ``send``; heartbeats out and dead peers in.

A message that fails a check is dropped and logged with its sender (never raised: a hostile or
broken peer must not stop the loop), and one from an established peer that fails its session seal
is counted in ``num_rejected``.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import replace
from typing import Any, Callable

from .. import auth
from ..protocol import Heartbeat, Hello, Message, ProtocolError, VersionError, decode, encode
from ..session import SessionError
from .config import EndpointConfig
from .handshake import HANDSHAKE_TYPES, clip, vet
from .io_loop import IOLoop
from .peers import Peer, PeerTable

log = logging.getLogger(__name__)

OnMessage = Callable[[str, Message], None]
OnPeerDead = Callable[[str], None]


class Endpoint(IOLoop):
    """The message layer, heartbeats, liveness and delivery shared by both roles."""

    role = ""

    def __init__(self, config: EndpointConfig, on_message: OnMessage | None, on_peer_dead: OnPeerDead | None):
        self.config = config
        name = f"{self.role} endpoint {config.worker_id!r}"
        self._secret = auth.normalize_secret(config.secret)
        if not self._secret:
            log.warning(
                "%s: no cluster secret configured; only peers without a secret can connect, and anyone "
                "who can reach the port can (configure a secret outside a single machine)", name
            )
        self._local = Hello(
            worker_id=config.worker_id,
            role=self.role,
            layout=config.layout,
            model_fingerprint=config.model_fingerprint,
            transport=config.transport,
            transport_descriptor=config.transport_descriptor,
            nonce=b"",
            hmac=b"",
            numerics=config.numerics,
        )
        # What a refusal carries: nothing an unauthenticated stranger should learn (no descriptor).
        self._public_hello = replace(self._local, transport_descriptor={})
        self._on_message = on_message
        self._on_peer_dead = on_peer_dead
        # zmq cuts a connection that sends a frame over MAXMSGSIZE without telling us. Twice the limit
        # lets a slightly oversized message arrive so it can be logged with its sender and dropped,
        # while still bounding the memory any single frame can take.
        super().__init__(
            name,
            thread_name=f"kv-control-{self.role}-{config.worker_id}",
            timer_interval_s=config.heartbeat_interval_s,
            max_frame_bytes=2 * config.max_message_bytes,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._peers = PeerTable()
        self.num_rejected = 0  # messages from established peers that failed their session seal

    # --- public API (any thread) ---------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    def peers(self) -> dict[str, Hello]:
        """Peers with a completed handshake, by worker id, with the Hello each one sent."""
        return self._peers.hellos()

    def dead_peers(self) -> set[str]:
        """Peers declared dead after ``peer_timeout_s`` of silence (and not reconnected since)."""
        return self._peers.dead()

    def lost_peers(self) -> set[str]:
        """Of ``dead_peers``, those lost to silence rather than left on request (``disconnect``): a
        peer that was only frozen (SIGSTOP, a long GC pause) is one of these when it speaks again,
        and nothing re-handshakes by itself: whoever wired the pair must connect it again."""
        return self._peers.lost()

    def send(self, peer_id: str, msg: Message) -> None:
        """Queue ``msg`` for ``peer_id``. Raises if the message is invalid or too big, or the peer unknown."""
        if self._closing.is_set():
            raise RuntimeError(f"{self._name} is closed")
        if isinstance(msg, HANDSHAKE_TYPES + (Heartbeat,)):
            raise ValueError(f"{type(msg).__name__} is sent by the endpoint itself, not through send()")
        payload = encode(msg)
        if len(payload) > self.config.max_message_bytes:
            raise ProtocolError(
                f"{type(msg).__name__} encodes to {len(payload)} bytes, over max_message_bytes "
                f"{self.config.max_message_bytes}; the peer would drop it"
            )
        self._peers.require(peer_id, self._name)
        self._post("send", peer_id, payload)

    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, Message]]:
        """Messages received so far as (peer_id, message), waiting up to ``timeout_s`` for the first.

        Always empty when the endpoint was built with an ``on_message`` callback.
        """
        out = []
        try:
            out.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            return out

    # --- inbound (the I/O thread) ----------------------------------------------------------------------

    def _handle(self, origin: Any, payload: bytes) -> None:
        """Decode one payload from ``origin`` (a routing id or a connection) and act on it."""
        established = self._peer_for(origin)
        if established is not None and established.session is not None:
            try:
                payload = established.session.open(payload)
            except SessionError as exc:
                self.num_rejected += 1
                log.warning("%s: dropped a message from %s: %s", self._name, self._describe(origin), exc)
                return
        try:
            msg = decode(payload, self.config.max_message_bytes)
        except VersionError as exc:
            if self._peer_for(origin) is None:
                self._on_version_mismatch(origin, exc)
            else:
                log.warning("%s: dropped a message from %s: %s", self._name, self._describe(origin), exc)
            return
        except ProtocolError as exc:
            log.warning("%s: dropped a message from %s: %s", self._name, self._describe(origin), exc)
            return
        if isinstance(msg, HANDSHAKE_TYPES):
            self._on_handshake(origin, msg)
            return
        peer = self._peer_for(origin)
        if peer is None:
            log.warning(
                "%s: dropped %s from %s: it has not completed the handshake",
                self._name, type(msg).__name__, self._describe(origin),
            )
            return
        peer.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            if msg.worker_id != peer.hello.worker_id:
                log.warning("%s: heartbeat from peer %r names worker %r",
                            self._name, peer.hello.worker_id, clip(msg.worker_id))
            return
        self._deliver(peer.hello.worker_id, msg)

    def _deliver(self, peer_id: str, msg: Message) -> None:
        if self._on_message is None:
            self._inbox.put((peer_id, msg))
            return
        try:
            self._on_message(peer_id, msg)
        except Exception:
            log.exception("%s: on_message callback failed on %s from %r", self._name, type(msg).__name__, peer_id)

    def _vet(self, hello: Hello, expected_nonce: bytes, my_nonce: bytes) -> str | None:
        """Why the peer's ``hello`` must be refused, or None (handshake.py)."""
        return vet(self._secret, self._local, hello, expected_nonce, my_nonce)

    def _register(self, peer: Peer) -> None:
        old = self._peers.add(peer)
        if old is not None:
            # Same worker id, new connection: the worker restarted (or reconnected) before we noticed.
            pid = peer.hello.worker_id
            log.warning("%s: peer %r reconnected; dropping its previous connection", self._name, pid)
            self._drop_route(old)

    # --- outbound, heartbeats and liveness (the I/O thread) --------------------------------------------

    def _cmd_send(self, peer_id: str, payload: bytes) -> None:
        peer = self._peers.get(peer_id)
        if peer is None:  # died or was replaced after send() checked
            log.warning("%s: dropped a message for %r: the peer is gone", self._name, peer_id)
            return
        self._send_payload(peer, payload)

    def _send_payload(self, peer: Peer, payload: bytes) -> None:
        self._send_raw(peer.route, peer.session.seal(payload) if peer.session is not None else payload)

    def _on_timer(self) -> None:
        for peer in self._peers.all():
            beat = Heartbeat(worker_id=self.worker_id, seq=peer.seq, time=time.time())
            peer.seq += 1
            self._send_payload(peer, encode(beat))

    def _after_turn(self, now: float, backlog: bool) -> None:
        if not backlog:  # unread messages may hold a peer's heartbeat: judge liveness after reading them
            self._check_liveness(now)
        self._housekeeping(now)

    def _check_liveness(self, now: float) -> None:
        for peer, silent in self._peers.silent(now, self.config.peer_timeout_s):
            pid = peer.hello.worker_id
            self._peers.declare_dead(pid)
            self._drop_route(peer)
            log.warning(
                "%s: peer %r silent for %.2f s (peer_timeout_s=%s): declared dead",
                self._name, pid, silent, self.config.peer_timeout_s,
            )
            if self._on_peer_dead is not None:
                try:
                    self._on_peer_dead(pid)
                except Exception:
                    log.exception("%s: on_peer_dead callback failed for %r", self._name, pid)

    def _on_shutdown(self) -> None:
        self._peers.clear()  # nothing is reachable any more; dead_peers() keeps its record

    # --- role-specific hooks ---------------------------------------------------------------------------

    def _peer_for(self, origin: Any) -> Peer | None:
        raise NotImplementedError

    def _describe(self, origin: Any) -> str:
        raise NotImplementedError

    def _on_handshake(self, origin: Any, msg: Message) -> None:
        raise NotImplementedError

    def _on_version_mismatch(self, origin: Any, exc: VersionError) -> None:
        raise NotImplementedError

    def _send_raw(self, route: Any, payload: bytes) -> None:
        """Put ``payload`` (sealed already, or a handshake message) on the wire to ``route``."""
        raise NotImplementedError

    def _drop_route(self, peer: Peer) -> None:
        """Forget how to reach a peer that died or was replaced."""
        raise NotImplementedError

    def _housekeeping(self, now: float) -> None:
        """Expire handshakes that stalled."""
