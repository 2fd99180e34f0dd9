"""zmq endpoints that carry control-plane messages between a prefill and a decode worker.

A prefill worker runs one ``PrefillEndpoint`` (a ROUTER that binds); a decode worker runs one
``DecodeEndpoint`` that opens one DEALER per prefill peer (a DEALER round-robins over its
connections, so sharing one would scatter a peer's messages). Handshake, D = decode, P = prefill:

    D -> P  Challenge(nonce_d)
    P -> D  Challenge(nonce_p)
    D -> P  Hello(D's fields, nonce=nonce_d, hmac=proof(D's fields, nonce_p))
    P -> D  HelloAck(accepted, reason, Hello(P's fields, nonce=nonce_p, hmac=proof(P's fields, nonce_d)))

Two round trips because each proof must cover a nonce its verifier chose (auth.py), and D cannot
know P's nonce before it asks. P checks D's proof, then compatibility (check_compatible); a refusal
is logged on P and comes back to D as HelloAck(accepted=False, reason), which ``connect()`` raises as
``HandshakeError``. D checks P's proof the same way (mutual authentication).

Threads: zmq sockets are not thread-safe, so one I/O thread per endpoint owns every socket. Callers'
threads hand it work through a queue plus a wake-up socketpair; it hands decoded messages back
through a queue (``poll``) or a callback. Every wait in the loop is bounded by ``_POLL_CAP_S``, so
heartbeats, dead-peer checks and ``close()`` are never late by more than that. Callbacks
(``on_message``, ``on_peer_dead``) run on the I/O thread: keep them short (a slow one delays
heartbeats); they may call ``send``/``close`` but not ``connect``.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import zmq

from . import auth
from .session import Session, SessionError
from .protocol import (
    PROTOCOL_VERSION,
    Challenge,
    HandshakeError,
    Heartbeat,
    Hello,
    HelloAck,
    KVLayout,
    Message,
    ProtocolError,
    VersionError,
    check_compatible,
    decode,
    encode,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # a prompt's logprobs (top-20 of 4k positions) take ~1 MB
_POLL_CAP_S = 0.1  # longest the I/O thread sleeps
_RECV_BATCH = 256  # messages read from one socket per loop turn, so one busy peer cannot starve the rest
_MAX_PENDING_HANDSHAKES = 256  # unauthenticated state a listener keeps; bounds what a flood can cost
_HANDSHAKE_TYPES = (Challenge, Hello, HelloAck)

OnMessage = Callable[[str, Message], None]
OnPeerDead = Callable[[str], None]


def _clip(text: str, limit: int = 200) -> str:
    # Strings from unauthenticated peers end up in logs and exceptions; a hostile one can be 1 MiB long.
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class PeerNotConnectedError(LookupError):
    """``send`` named a peer that has no completed handshake (never connected, dead, or closed)."""


@dataclass
class EndpointConfig:
    """What an endpoint says about itself in the handshake, and its timing and size limits."""

    worker_id: str
    layout: KVLayout
    model_fingerprint: str
    transport: str = "tcp"
    transport_descriptor: dict[str, Any] = field(default_factory=dict)
    secret: bytes | str | None = field(default=None, repr=False)  # never in a repr or a log line
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 2.5
    handshake_timeout_s: float = 5.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "peer_timeout_s", "handshake_timeout_s", "max_message_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EndpointConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"EndpointConfig.peer_timeout_s ({self.peer_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or live peers are declared dead between heartbeats"
            )


@dataclass(eq=False)
class _Peer:
    hello: Hello  # the peer's verified Hello
    route: Any  # how to reach it: a ROUTER routing id (bytes) or a DecodeEndpoint _Conn
    last_seen: float  # monotonic time of its last valid message
    seq: int = 0  # next heartbeat sequence number we send it
    # Seals every message after the handshake (session.py); keyed by this connection's two nonces.
    session: Session | None = None


class _Endpoint:
    """The I/O loop, heartbeats, liveness and delivery shared by both roles."""

    role = ""

    def __init__(self, config: EndpointConfig, on_message: OnMessage | None, on_peer_dead: OnPeerDead | None):
        self.config = config
        self._name = f"{self.role} endpoint {config.worker_id!r}"
        self._secret = auth.normalize_secret(config.secret)
        if not self._secret:
            log.warning(
                "%s: no cluster secret configured; only peers without a secret can connect, and anyone "
                "who can reach the port can (configure a secret outside a single machine)", self._name
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
        )
        # What a refusal carries: nothing an unauthenticated stranger should learn (no descriptor).
        self._public_hello = replace(self._local, transport_descriptor={})
        self._on_message = on_message
        self._on_peer_dead = on_peer_dead
        # zmq cuts a connection that sends a frame over MAXMSGSIZE without telling us. Twice the limit
        # lets a slightly oversized message arrive so it can be logged with its sender and dropped,
        # while still bounding the memory any single frame can take.
        self._frame_cap = 2 * config.max_message_bytes
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # pyzmq's poller reports a plain socket by its fd, so the fd is what is registered and compared.
        self._wake_fd = self._wake_r.fileno()
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _peers, _dead and _left: written by the I/O thread, read by callers
        self._peers: dict[str, _Peer] = {}
        self._dead: set[str] = set()
        self._left: set[str] = set()  # of ``_dead``: the peers we left on request (disconnect), not lost
        self.num_rejected = 0  # messages from established peers that failed their session seal
        self._closing = threading.Event()
        # daemon: an endpoint someone forgot to close must not keep the worker process from exiting.
        self._thread = threading.Thread(
            target=self._run, name=f"kv-control-{self.role}-{config.worker_id}", daemon=True
        )

    # --- public API (any thread) ---------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    def peers(self) -> dict[str, Hello]:
        """Peers with a completed handshake, by worker id, with the Hello each one sent."""
        with self._lock:
            return {pid: p.hello for pid, p in self._peers.items()}

    def dead_peers(self) -> set[str]:
        """Peers declared dead after ``peer_timeout_s`` of silence (and not reconnected since)."""
        with self._lock:
            return set(self._dead)

    def lost_peers(self) -> set[str]:
        """Of ``dead_peers``, those lost to silence rather than left on request (``disconnect``): a
        peer that was only frozen (SIGSTOP, a long GC pause) is one of these when it speaks again,
        and nothing re-handshakes by itself: whoever wired the pair must connect it again."""
        with self._lock:
            return self._dead - self._left

    def send(self, peer_id: str, msg: Message) -> None:
        """Queue ``msg`` for ``peer_id``. Raises if the message is invalid or too big, or the peer unknown."""
        if self._closing.is_set():
            raise RuntimeError(f"{self._name} is closed")
        if isinstance(msg, _HANDSHAKE_TYPES + (Heartbeat,)):
            raise ValueError(f"{type(msg).__name__} is sent by the endpoint itself, not through send()")
        payload = encode(msg)
        if len(payload) > self.config.max_message_bytes:
            raise ProtocolError(
                f"{type(msg).__name__} encodes to {len(payload)} bytes, over max_message_bytes "
                f"{self.config.max_message_bytes}; the peer would drop it"
            )
        with self._lock:
            if peer_id not in self._peers:
                raise PeerNotConnectedError(
                    f"{self._name}: no connected peer {peer_id!r} (connected: {sorted(self._peers)}, "
                    f"dead: {sorted(self._dead)})"
                )
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

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the I/O thread and close every socket (linger 0). Idempotent."""
        self._closing.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("%s: I/O thread still running %.1f s after close()", self._name, timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- hand-off to the I/O thread ------------------------------------------------------------------

    def _post(self, command: str, *args: Any) -> None:
        if self._closing.is_set() or not self._thread.is_alive():
            raise RuntimeError(f"{self._name} is closed")
        self._commands.put((command, args))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # buffer full (a wake-up is already pending) or already closed: both fine
            pass

    def _start(self) -> None:
        self._thread.start()

    # --- the I/O thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_beat = time.monotonic()
        try:
            while not self._closing.is_set():
                wait = min(max(next_beat - time.monotonic(), 0.0), _POLL_CAP_S)
                backlog = False
                for sock, _ in self._poller.poll(wait * 1000):
                    if sock == self._wake_fd:
                        self._drain_wakeups()
                    else:
                        backlog |= self._receive(sock)
                self._run_commands()
                now = time.monotonic()
                if now >= next_beat:
                    self._send_heartbeats()
                    next_beat = now + interval
                if not backlog:  # unread messages may hold a peer's heartbeat: judge liveness after reading them
                    self._check_liveness(now)
                self._housekeeping(now)
        except Exception:
            log.exception("%s: control-plane I/O thread crashed; the endpoint is unusable", self._name)
        finally:
            self._closing.set()
            with self._lock:
                self._peers.clear()  # nothing is reachable any more; dead_peers() keeps its record
            self._on_shutdown()
            self._ctx.destroy(linger=0)
            self._wake_r.close()
            self._wake_w.close()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _run_commands(self) -> None:
        while True:
            try:
                command, args = self._commands.get_nowait()
            except queue.Empty:
                return
            getattr(self, f"_cmd_{command}")(*args)

    def _cmd_send(self, peer_id: str, payload: bytes) -> None:
        peer = self._peers.get(peer_id)
        if peer is None:  # died or was replaced after send() checked
            log.warning("%s: dropped a message for %r: the peer is gone", self._name, peer_id)
            return
        self._send_payload(peer, payload)

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
        if isinstance(msg, _HANDSHAKE_TYPES):
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
                            self._name, peer.hello.worker_id, _clip(msg.worker_id))
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
        """Why the peer's ``hello`` must be refused, or None. Authentication first, then compatibility."""
        who = f"{hello.role} {_clip(repr(hello.worker_id))}"
        if hello.nonce != expected_nonce:
            return f"authentication failed: {who} signed a Hello whose nonce is not the one it sent in its Challenge"
        if not auth.verify_hello(self._secret, hello, my_nonce):
            return (
                f"authentication failed: {who} did not prove knowledge of the cluster secret "
                "(configure both workers with the same secret)"
            )
        try:
            check_compatible(self._local, hello)
        except HandshakeError as exc:
            return str(exc)
        return None

    def _register(self, peer: _Peer) -> None:
        pid = peer.hello.worker_id
        with self._lock:
            old = self._peers.get(pid)
            self._peers[pid] = peer
            self._dead.discard(pid)
            self._left.discard(pid)
        if old is not None:
            # Same worker id, new connection: the worker restarted (or reconnected) before we noticed.
            log.warning("%s: peer %r reconnected; dropping its previous connection", self._name, pid)
            self._drop_route(old)

    def _send_heartbeats(self) -> None:
        for peer in list(self._peers.values()):
            beat = Heartbeat(worker_id=self.worker_id, seq=peer.seq, time=time.time())
            peer.seq += 1
            self._send_payload(peer, encode(beat))

    def _check_liveness(self, now: float) -> None:
        for peer in list(self._peers.values()):
            silent = now - peer.last_seen
            if silent <= self.config.peer_timeout_s:
                continue
            pid = peer.hello.worker_id
            with self._lock:
                del self._peers[pid]
                self._dead.add(pid)
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

    # --- role-specific hooks ---------------------------------------------------------------------------

    def _receive(self, sock: zmq.Socket) -> bool:
        """Read up to _RECV_BATCH messages from ``sock``; True when more may be waiting."""
        raise NotImplementedError

    def _peer_for(self, origin: Any) -> _Peer | None:
        raise NotImplementedError

    def _describe(self, origin: Any) -> str:
        raise NotImplementedError

    def _on_handshake(self, origin: Any, msg: Message) -> None:
        raise NotImplementedError

    def _on_version_mismatch(self, origin: Any, exc: VersionError) -> None:
        raise NotImplementedError

    def _send_payload(self, peer: _Peer, payload: bytes) -> None:
        raise NotImplementedError

    def _drop_route(self, peer: _Peer) -> None:
        """Forget how to reach a peer that died or was replaced."""
        raise NotImplementedError

    def _housekeeping(self, now: float) -> None:
        """Expire handshakes that stalled."""

    def _on_shutdown(self) -> None:
        """Last words before the sockets close (in the I/O thread)."""

    def _new_socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._frame_cap)
        return sock


@dataclass(eq=False)
class _Pending:
    """A listener's half-finished handshake with one unauthenticated connection."""

    peer_nonce: bytes
    nonce: bytes
    expires: float


class PrefillEndpoint(_Endpoint):
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
            self._ctx.destroy(linger=0)
            self._wake_r.close()
            self._wake_w.close()
            raise
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._sock, zmq.POLLIN)
        self._start()
        log.info("%s listening on %s", self._name, self.address)

    def _receive(self, sock: zmq.Socket) -> bool:
        for _ in range(_RECV_BATCH):
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

    def _peer_for(self, routing_id: bytes) -> _Peer | None:
        pid = self._by_route.get(routing_id)
        return None if pid is None else self._peers.get(pid)

    def _describe(self, routing_id: bytes) -> str:
        pid = self._by_route.get(routing_id)
        if pid is not None:
            return f"decode peer {pid!r}"
        return f"unauthenticated connection {routing_id.hex()}"

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
        if len(self._pending) >= _MAX_PENDING_HANDSHAKES and routing_id not in self._pending:
            log.warning("%s: %d handshakes already in progress; dropped a Challenge from %s",
                        self._name, len(self._pending), self._describe(routing_id))
            return
        nonce = auth.new_nonce()
        self._pending[routing_id] = _Pending(msg.nonce, nonce, now + self.config.handshake_timeout_s)
        self._send_to(routing_id, encode(Challenge(nonce=nonce)))

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
        self._register(_Peer(hello=hello, route=routing_id, last_seen=time.monotonic(), session=session))
        self._by_route[routing_id] = hello.worker_id
        signed = auth.sign_hello(self._secret, replace(self._local, nonce=pending.nonce), hello.nonce)
        self._send_to(routing_id, encode(HelloAck(accepted=True, reason="", hello=signed)))
        log.info("%s: accepted decode peer %r", self._name, hello.worker_id)

    def _on_version_mismatch(self, routing_id: bytes, exc: VersionError) -> None:
        self._pending.pop(routing_id, None)
        self._refuse(
            routing_id, None,
            f"protocol version mismatch: {self._name} speaks version {PROTOCOL_VERSION}, "
            f"the peer sent version {exc.peer_version}",
        )

    def _refuse(self, routing_id: bytes, hello: Hello | None, reason: str) -> None:
        if hello is None:
            who = self._describe(routing_id)
        else:
            who = f"{hello.role} {_clip(repr(hello.worker_id))} ({routing_id.hex()})"
        log.warning("%s refused the handshake of %s: %s", self._name, who, reason)
        self._send_to(routing_id, encode(HelloAck(accepted=False, reason=reason, hello=self._public_hello)))

    def _send_payload(self, peer: _Peer, payload: bytes) -> None:
        self._send_to(peer.route, peer.session.seal(payload) if peer.session is not None else payload)

    def _send_to(self, routing_id: bytes, payload: bytes) -> None:
        try:
            self._sock.send_multipart([routing_id, payload], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: dropped an outgoing message to %s: its send queue is full",
                        self._name, self._describe(routing_id))
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the connection is gone
            log.warning("%s: could not send to %s: %s", self._name, self._describe(routing_id), exc)

    def _drop_route(self, peer: _Peer) -> None:
        self._by_route.pop(peer.route, None)

    def _housekeeping(self, now: float) -> None:
        for routing_id in [r for r, p in self._pending.items() if p.expires < now]:
            del self._pending[routing_id]
            log.info("%s: handshake with %s timed out", self._name, self._describe(routing_id))


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


class DecodeEndpoint(_Endpoint):
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

    def _cmd_disconnect(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is not None:
                self._dead.add(peer_id)
                self._left.add(peer_id)
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
        self._send_on(conn, encode(Challenge(nonce=conn.nonce)))

    def _cmd_abandon(self, future: Future) -> None:
        # The caller gave up (timeout): tear the connection down even if it completed meanwhile, so the
        # caller's view (failed) and ours agree.
        for conn in [c for c in self._conns.values() if c.future is future]:
            peer = self._peer_for(conn)
            if peer is not None:
                with self._lock:
                    del self._peers[peer.hello.worker_id]
            self._close_conn(conn)

    def _receive(self, sock: zmq.Socket) -> bool:
        for _ in range(_RECV_BATCH):
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

    def _peer_for(self, conn: _Conn) -> _Peer | None:
        peer = self._peers.get(conn.peer_id) if conn.peer_id is not None else None
        return peer if peer is not None and peer.route is conn else None

    def _describe(self, conn: _Conn) -> str:
        if conn.peer_id is not None:
            return f"prefill peer {conn.peer_id!r} at {conn.address}"
        return f"{conn.address} (handshake in progress)"

    def _on_handshake(self, conn: _Conn, msg: Message) -> None:
        if conn.peer_id is not None:
            log.warning("%s: dropped %s from %s: its handshake is already done",
                        self._name, type(msg).__name__, self._describe(conn))
        elif isinstance(msg, HelloAck) and not msg.accepted:
            self._fail(conn, f"{conn.address} refused the handshake: {_clip(msg.reason, 2000)}")
        elif isinstance(msg, Challenge) and not conn.peer_nonce:
            if len(msg.nonce) != auth.NONCE_BYTES:
                self._fail(conn, f"{conn.address} sent a {len(msg.nonce)}-byte Challenge nonce, "
                                 f"expected {auth.NONCE_BYTES}")
                return
            conn.peer_nonce = msg.nonce
            hello = auth.sign_hello(self._secret, replace(self._local, nonce=conn.nonce), msg.nonce)
            self._send_on(conn, encode(hello))
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
        self._register(_Peer(hello=ack.hello, route=conn, last_seen=time.monotonic(), session=session))
        log.info("%s: connected to prefill peer %r at %s", self._name, conn.peer_id, conn.address)
        if not conn.future.done():
            conn.future.set_result(ack.hello)

    def _on_version_mismatch(self, conn: _Conn, exc: VersionError) -> None:
        self._fail(
            conn,
            f"protocol version mismatch: {self._name} speaks version {PROTOCOL_VERSION}, "
            f"{conn.address} sent version {exc.peer_version}",
        )

    def _fail(self, conn: _Conn, reason: str) -> None:
        log.warning("%s: handshake failed: %s", self._name, reason)
        self._close_conn(conn)
        if not conn.future.done():
            conn.future.set_exception(HandshakeError(reason))

    def _send_payload(self, peer: _Peer, payload: bytes) -> None:
        self._send_on(peer.route, peer.session.seal(payload) if peer.session is not None else payload)

    def _send_on(self, conn: _Conn, payload: bytes) -> None:
        try:
            conn.sock.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # Again: send queue full
            log.warning("%s: dropped an outgoing message to %s: %s", self._name, self._describe(conn), exc)

    def _drop_route(self, peer: _Peer) -> None:
        # A dead or replaced prefill peer's socket is closed rather than left reconnecting: a restarted
        # listener would not know it, so the caller connects again instead.
        self._close_conn(peer.route)

    def _close_conn(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None:
            self._poller.unregister(conn.sock)
            conn.sock.close(linger=0)

    def _housekeeping(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.peer_id is None and c.expires < now]:
            self._fail(conn, f"handshake with {conn.address} timed out")

    def _on_shutdown(self) -> None:
        for conn in list(self._conns.values()):
            if not conn.future.done():
                conn.future.set_exception(HandshakeError(f"{self._name} closed during the handshake"))
