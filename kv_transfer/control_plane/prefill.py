"""The prefill side of the control plane: a ROUTER that decode workers join, and the listener's half
of the handshake (answer a Challenge with ours, check the Hello, accept or refuse with a reason)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import zmq

from .. import auth
from ..protocol import Challenge, Hello, HelloAck, Message, VersionError, encode, numerics_note
from ..session import Session
from .config import EndpointConfig
from .endpoint import Endpoint, OnMessage, OnPeerDead
from .handshake import clip, version_mismatch
from .io_loop import RECV_BATCH
from .peers import Peer

log = logging.getLogger(__name__)

MAX_PENDING_HANDSHAKES = 256  # unauthenticated state a listener keeps; bounds what a flood can cost


@dataclass(eq=False)
class _Pending:
    """A listener's half-finished handshake with one unauthenticated connection."""

    peer_nonce: bytes
    nonce: bytes
    expires: float


class PrefillEndpoint(Endpoint):
    """The prefill side: a ROUTER bound to ``host:port`` (port 0 = any free port) that decode workers join.

    ``address`` is what decode workers pass to ``DecodeEndpoint.connect``. Peer ids are the decode
    workers' ``worker_id``s.
    """

    role = "prefill"

    def __init__(
        self,
        config: EndpointConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        on_message: OnMessage | None = None,
        on_peer_dead: OnPeerDead | None = None,
    ):
        super().__init__(config, on_message, on_peer_dead)
        self._by_route: dict[bytes, str] = {}  # routing id -> worker id, for completed handshakes
        self._pending: dict[bytes, _Pending] = {}
        try:
            self._sock = self._new_socket(zmq.ROUTER)
            # Without ROUTER_MANDATORY a send to a vanished peer is dropped silently; with it we can log it.
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.bind(f"tcp://{host}:{port or '*'}")
        except Exception:
            self._release()
            raise
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._sock, zmq.POLLIN)
        self._start()
        log.info("%s listening on %s", self._name, self.address)

    def _receive(self, sock: zmq.Socket) -> bool:
        for _ in range(RECV_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if len(frames) != 2:  # [routing id, payload]: anything else is not from our DEALER
                log.warning(
                    "%s: dropped a %d-frame message from %s: expected exactly one payload frame",
                    self._name, len(frames) - 1, self._describe(frames[0]),
                )
                continue
            self._handle(frames[0], frames[1])
        return True

    def _peer_for(self, routing_id: bytes) -> Peer | None:
        return self._peers.get(self._by_route.get(routing_id))

    def _describe(self, routing_id: bytes) -> str:
        pid = self._by_route.get(routing_id)
        if pid is not None:
            return f"decode peer {pid!r}"
        return f"unauthenticated connection {routing_id.hex()}"

    # --- the listener's half of the handshake ----------------------------------------------------------

    def _on_handshake(self, routing_id: bytes, msg: Message) -> None:
        if routing_id in self._by_route:
            log.warning("%s: dropped %s from %s: its handshake is already done",
                        self._name, type(msg).__name__, self._describe(routing_id))
        elif isinstance(msg, Challenge):
            self._on_challenge(routing_id, msg)
        elif isinstance(msg, Hello):
            self._on_hello(routing_id, msg)
        else:
            log.warning("%s: dropped HelloAck from %s: a listener only answers handshakes",
                        self._name, self._describe(routing_id))

    def _on_challenge(self, routing_id: bytes, msg: Challenge) -> None:
        if len(msg.nonce) != auth.NONCE_BYTES:
            self._refuse(routing_id, None, f"Challenge nonce must be {auth.NONCE_BYTES} bytes, got {len(msg.nonce)}")
            return
        now = time.monotonic()
        self._housekeeping(now)
        if len(self._pending) >= MAX_PENDING_HANDSHAKES and routing_id not in self._pending:
            log.warning("%s: %d handshakes already in progress; dropped a Challenge from %s",
                        self._name, len(self._pending), self._describe(routing_id))
            return
        nonce = auth.new_nonce()
        self._pending[routing_id] = _Pending(msg.nonce, nonce, now + self.config.handshake_timeout_s)
        self._send_raw(routing_id, encode(Challenge(nonce=nonce)))

    def _on_hello(self, routing_id: bytes, hello: Hello) -> None:
        pending = self._pending.pop(routing_id, None)
        if pending is None:
            self._refuse(routing_id, hello, "Hello without a preceding Challenge (or after the handshake timed out)")
            return
        reason = self._vet(hello, pending.peer_nonce, pending.nonce)
        if reason is not None:
            self._refuse(routing_id, hello, reason)
            return
        session = Session(self._secret, prefill_nonce=pending.nonce, decode_nonce=hello.nonce, role="prefill")
        self._register(Peer(hello=hello, route=routing_id, last_seen=time.monotonic(), session=session))
        self._by_route[routing_id] = hello.worker_id
        signed = auth.sign_hello(self._secret, replace(self._local, nonce=pending.nonce), hello.nonce)
        self._send_raw(routing_id, encode(HelloAck(accepted=True, reason="", hello=signed)))
        log.info("%s: accepted decode peer %r", self._name, hello.worker_id)
        if note := numerics_note(self._local, hello):
            log.warning("%s: %s", self._name, note)

    def _on_version_mismatch(self, routing_id: bytes, exc: VersionError) -> None:
        self._pending.pop(routing_id, None)
        self._refuse(routing_id, None, version_mismatch(self._name, "the peer", exc))

    def _refuse(self, routing_id: bytes, hello: Hello | None, reason: str) -> None:
        if hello is None:
            who = self._describe(routing_id)
        else:
            who = f"{hello.role} {clip(repr(hello.worker_id))} ({routing_id.hex()})"
        log.warning("%s refused the handshake of %s: %s", self._name, who, reason)
        self._send_raw(routing_id, encode(HelloAck(accepted=False, reason=reason, hello=self._public_hello)))

    def _housekeeping(self, now: float) -> None:
        for routing_id in [r for r, p in self._pending.items() if p.expires < now]:
            del self._pending[routing_id]
            log.info("%s: handshake with %s timed out", self._name, self._describe(routing_id))

    # --- the ROUTER ------------------------------------------------------------------------------------

    def _send_raw(self, routing_id: bytes, payload: bytes) -> None:
        try:
            self._sock.send_multipart([routing_id, payload], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: dropped an outgoing message to %s: its send queue is full",
                        self._name, self._describe(routing_id))
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the connection is gone
            log.warning("%s: could not send to %s: %s", self._name, self._describe(routing_id), exc)

    def _drop_route(self, peer: Peer) -> None:
        self._by_route.pop(peer.route, None)
