"""The decode side of the control plane: one DEALER per prefill peer, and the connecting half of the
handshake (send our Challenge, sign a Hello over the listener's nonce, check its HelloAck)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import zmq

from .. import auth
from ..protocol import Challenge, HandshakeError, Hello, HelloAck, Message, VersionError, encode, numerics_note
from ..session import Session
from .config import EndpointConfig
from .endpoint import Endpoint, OnMessage, OnPeerDead
from .handshake import clip, version_mismatch
from .io_loop import RECV_BATCH
from .peers import Peer

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Conn:
    """One DEALER connection from a decode endpoint to a prefill endpoint."""

    address: str
    sock: zmq.Socket
    future: Future  # resolves to the peer's Hello, or HandshakeError
    nonce: bytes  # ours, sent in our Challenge
    expires: float  # backstop for a handshake nobody waits for any more
    peer_nonce: bytes = b""  # the listener's, from its Challenge
    peer_id: str | None = None  # set when the handshake succeeds


class DecodeEndpoint(Endpoint):
    """The decode side: ``connect(address)`` joins a prefill endpoint; one connection per prefill peer.

    Peer ids are the prefill workers' ``worker_id``s, as returned in the Hello from ``connect``.
    """

    role = "decode"

    def __init__(
        self,
        config: EndpointConfig,
        *,
        on_message: OnMessage | None = None,
        on_peer_dead: OnPeerDead | None = None,
    ):
        super().__init__(config, on_message, on_peer_dead)
        self._conns: dict[zmq.Socket, _Conn] = {}
        self._start()

    # --- public API (any thread but the I/O thread) ----------------------------------------------------

    def connect(self, address: str, timeout_s: float | None = None) -> Hello:
        """Handshake with the prefill endpoint at ``address``; returns its verified Hello.

        Raises ``HandshakeError`` with the listener's reason if refused, or if nothing completes
        within ``timeout_s`` (default ``config.handshake_timeout_s``).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("connect() called from the endpoint's own callback would deadlock its I/O thread")
        timeout = self.config.handshake_timeout_s if timeout_s is None else timeout_s
        future: Future = Future()
        self._post("connect", address, future, timeout)
        try:
            return future.result(timeout)
        except TimeoutError:
            self._post("abandon", future)
            raise HandshakeError(
                f"no handshake with {address} within {timeout} s: is a prefill endpoint listening there?"
            ) from None

    def disconnect(self, peer_id: str) -> bool:
        """Leave the prefill peer ``peer_id`` (drain / scale-down): its connection is closed and it
        counts as dead here, so transfers expected from it fail at once; the prefill side sees us go
        silent and declares us dead after its peer timeout. False if it was not connected."""
        if peer_id not in self.peers():
            return False
        self._post("disconnect", peer_id)
        return True

    # --- commands (the I/O thread) ---------------------------------------------------------------------

    def _cmd_disconnect(self, peer_id: str) -> None:
        peer = self._peers.leave(peer_id)
        if peer is not None:
            log.warning("%s: disconnected from prefill peer %r on request", self._name, peer_id)
            self._close_conn(peer.route)

    def _cmd_connect(self, address: str, future: Future, timeout: float) -> None:
        sock = self._new_socket(zmq.DEALER)
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            future.set_exception(HandshakeError(f"cannot connect to {address!r}: {exc}"))
            return
        conn = _Conn(address, sock, future, auth.new_nonce(), time.monotonic() + timeout + 1.0)
        self._conns[sock] = conn
        self._poller.register(sock, zmq.POLLIN)
        self._send_raw(conn, encode(Challenge(nonce=conn.nonce)))

    def _cmd_abandon(self, future: Future) -> None:
        # The caller gave up (timeout): tear the connection down even if it completed meanwhile, so the
        # caller's view (failed) and ours agree.
        for conn in [c for c in self._conns.values() if c.future is future]:
            peer = self._peer_for(conn)
            if peer is not None:
                self._peers.forget(peer.hello.worker_id)
            self._close_conn(conn)

    # --- the DEALERs -----------------------------------------------------------------------------------

    def _receive(self, sock: zmq.Socket) -> bool:
        for _ in range(RECV_BATCH):
            conn = self._conns.get(sock)
            if conn is None:  # the previous message closed this connection
                return False
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if len(frames) != 1:
                log.warning("%s: dropped a %d-frame message from %s: expected exactly one frame",
                            self._name, len(frames), self._describe(conn))
                continue
            self._handle(conn, frames[0])
        return True

    def _peer_for(self, conn: _Conn) -> Peer | None:
        peer = self._peers.get(conn.peer_id)
        return peer if peer is not None and peer.route is conn else None

    def _describe(self, conn: _Conn) -> str:
        if conn.peer_id is not None:
            return f"prefill peer {conn.peer_id!r} at {conn.address}"
        return f"{conn.address} (handshake in progress)"

    def _send_raw(self, conn: _Conn, payload: bytes) -> None:
        try:
            conn.sock.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # Again: send queue full
            log.warning("%s: dropped an outgoing message to %s: %s", self._name, self._describe(conn), exc)

    def _drop_route(self, peer: Peer) -> None:
        # A dead or replaced prefill peer's socket is closed rather than left reconnecting: a restarted
        # listener would not know it, so the caller connects again instead.
        self._close_conn(peer.route)

    def _close_conn(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None:
            self._poller.unregister(conn.sock)
            conn.sock.close(linger=0)

    # --- the connecting half of the handshake ----------------------------------------------------------

    def _on_handshake(self, conn: _Conn, msg: Message) -> None:
        if conn.peer_id is not None:
            log.warning("%s: dropped %s from %s: its handshake is already done",
                        self._name, type(msg).__name__, self._describe(conn))
        elif isinstance(msg, HelloAck) and not msg.accepted:
            self._fail(conn, f"{conn.address} refused the handshake: {clip(msg.reason, 2000)}")
        elif isinstance(msg, Challenge) and not conn.peer_nonce:
            if len(msg.nonce) != auth.NONCE_BYTES:
                self._fail(conn, f"{conn.address} sent a {len(msg.nonce)}-byte Challenge nonce, "
                                 f"expected {auth.NONCE_BYTES}")
                return
            conn.peer_nonce = msg.nonce
            hello = auth.sign_hello(self._secret, replace(self._local, nonce=conn.nonce), msg.nonce)
            self._send_raw(conn, encode(hello))
        elif isinstance(msg, HelloAck) and conn.peer_nonce:
            self._on_ack(conn, msg)
        else:
            self._fail(conn, f"{conn.address} broke the handshake order: sent {type(msg).__name__}")

    def _on_ack(self, conn: _Conn, ack: HelloAck) -> None:
        reason = self._vet(ack.hello, conn.peer_nonce, conn.nonce)
        if reason is not None:
            self._fail(conn, f"refused the prefill peer at {conn.address}: {reason}")
            return
        conn.peer_id = ack.hello.worker_id
        session = Session(self._secret, prefill_nonce=conn.peer_nonce, decode_nonce=conn.nonce, role="decode")
        self._register(Peer(hello=ack.hello, route=conn, last_seen=time.monotonic(), session=session))
        log.info("%s: connected to prefill peer %r at %s", self._name, conn.peer_id, conn.address)
        if note := numerics_note(self._local, ack.hello):
            log.warning("%s: %s", self._name, note)
        if not conn.future.done():
            conn.future.set_result(ack.hello)

    def _on_version_mismatch(self, conn: _Conn, exc: VersionError) -> None:
        self._fail(conn, version_mismatch(self._name, conn.address, exc))

    def _fail(self, conn: _Conn, reason: str) -> None:
        log.warning("%s: handshake failed: %s", self._name, reason)
        self._close_conn(conn)
        if not conn.future.done():
            conn.future.set_exception(HandshakeError(reason))

    def _housekeeping(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.peer_id is None and c.expires < now]:
            self._fail(conn, f"handshake with {conn.address} timed out")

    def _on_shutdown(self) -> None:
        super()._on_shutdown()
        for conn in list(self._conns.values()):
            if not conn.future.done():
                conn.future.set_exception(HandshakeError(f"{self._name} closed during the handshake"))
