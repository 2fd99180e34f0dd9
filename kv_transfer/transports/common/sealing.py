"""Authentication of the KV data plane: every control message a transport sends is sealed.

"Control message" means a chunk header (sender -> receiver), an ack (receiver -> sender) and the few
handshake messages some transports exchange; not the payload (see "Not covered" below).

Key. ``data_key = HMAC-SHA256(cluster secret, b"pdcluster/kv-data/v1")``: a key of its own, so a tag
made here can never be confused with a control-plane proof made with the same secret. No secret
means the empty key, as in the control plane (kv_transfer/auth.py): two ends without a secret still
talk, an end with a secret and one without refuse each other.

Nonce. Each transport instance draws a random ``NONCE_BYTES`` nonce when it is built and publishes it
in ``local_descriptor()``; the peer learns it through the authenticated control-plane handshake. A
message is sealed *to* its recipient's nonce, so a message recorded against an earlier incarnation
of a process (a worker Ray restarted) never verifies against the new one.

Envelope (all fixed-width fields, so parsing needs no decoder before the tag is checked)::

    kind (1) | sender's nonce (16) | counter (8, big-endian) | body | tag (16)
    tag = HMAC-SHA256(data_key, DOMAIN | recipient's nonce | everything before the tag)[:16]

The counter comes from one strictly increasing per-instance sequence shared by all peers, so the
messages to any one recipient carry increasing counters. The recipient checks, in this order: the
tag (``hmac.compare_digest``), the kind, the sender's nonce when it knows whom to expect, and then the
counter against a sliding window kept per sender nonce (``ReplayWindow``): a counter seen before, or
older than the window, is a replay. Keying the window on the sender's nonce gives a restarted sender
(same worker id, counting from the start again) a fresh window. One window rule serves all transports:
ucx tag messages may be matched out of order, and threads sealing for different peers (nccl) may
interleave, so strict "greater than the last" would reject honest messages there; the window still
rejects every repeat.

A message that fails any check is dropped, counted in ``Sealer.num_rejected`` and logged (at most
once a second per transport, with a count of what was not logged); it is never acknowledged and never
touches a cache.

Not covered, deliberately: the payload bytes are not MAC'd. Hashing every byte would cost as much as
moving it or more (HMAC-SHA256 ran at 1.0 GB/s on one core of our 2-core bench machine, SHA-NI and
all; the transports move 0.8-6 GB/s there), whereas sealing a header costs ~5 us. A payload is
bound to its authenticated header only by the transport: by length, and by travelling in the same
zmq message (tcp), on a tag named in the header (ucx), on the pair's gloo connection that was set up
after a mutual proof (nccl), or through memory handed out only after a mutual proof (shm). So an
attacker who can inject into or rewrite the stream between two authenticated workers (a man in the
middle on the network, or another process of the same user that can read /proc) can still alter
payloads. Nor is anything encrypted: KV bytes and headers are readable on the wire. Availability is
not protected either: whoever reaches a port can still make a transfer fail (e.g. by filling the
nccl rendezvous store with garbage), though not make a forged one land.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ...auth import normalize_secret

log = logging.getLogger(__name__)

DOMAIN = b"pdcluster/kv-data/v1"
NONCE_BYTES = 16
TAG_BYTES = 16
COUNTER_BYTES = 8
_HEAD_BYTES = 1 + NONCE_BYTES + COUNTER_BYTES  # kind | sender's nonce | counter

# Message kinds. The kind is covered by the tag, so one kind can never be replayed as another.
HEADER = b"H"  # chunk header, sender -> receiver
ACK = b"A"  # chunk ack, receiver -> sender
HELLO = b"C"  # sender's first message on a new link (ucx, shm, nccl)
WELCOME = b"W"  # receiver's answer to a hello (shm, nccl): proves the receiver too
HANDOVER = b"F"  # shm: the sender's memory descriptors, sent only to a receiver that proved itself
GRANT = b"G"  # shm: receiver -> pushing sender, a transfer may write these blocks (admission.py)
REVOKE = b"R"  # shm: receiver -> pushing sender, stop writing a transfer
REVOKED = b"K"  # shm: sender -> receiver, it stopped writing that transfer
SYNC = b"S"  # shm: receiver -> new sender, end of the grants in force when it joined

REPLAY_WINDOW = 1024  # counters accepted out of order behind the newest one seen from a sender
MAX_TRACKED_SENDERS = 4096  # sender incarnations whose windows we remember (least recently used out)
_LOG_INTERVAL_S = 1.0


def data_key(secret: bytes | str | None) -> bytes:
    """The data-plane MAC key for a cluster secret (None = no secret, see the module docstring)."""
    return hmac.digest(normalize_secret(secret), DOMAIN, "sha256")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def sealed_size(body_bytes: int) -> int:
    """Length of an envelope around ``body_bytes`` of body (for fixed-size receive buffers)."""
    return _HEAD_BYTES + body_bytes + TAG_BYTES


def peer_nonce(peer_id: str, descriptor: dict) -> bytes:
    """The nonce a peer published in its descriptor; ValueError if it has none."""
    nonce = descriptor.get("nonce")
    if not isinstance(nonce, (bytes, bytearray)) or len(nonce) != NONCE_BYTES:
        raise ValueError(
            f"descriptor of {peer_id} has no {NONCE_BYTES}-byte data-plane nonce (got {nonce!r}): "
            "the peer runs a pdcluster without data-plane authentication; upgrade it"
        )
    return bytes(nonce)


class ReplayWindow:
    """Counters seen from one sender incarnation: the newest, and a bitmap of the ``size`` before it."""

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        self._size = size
        self._newest = -1
        self._seen = 0  # bit i set: counter newest - i was seen

    def accept(self, counter: int) -> bool:
        """True (and remember it) if ``counter`` is new; False for a repeat or one too old to tell."""
        if counter > self._newest:
            shift = counter - self._newest
            self._seen = ((self._seen << shift) | 1) & ((1 << self._size) - 1) if shift < self._size else 1
            self._newest = counter
            return True
        age = self._newest - counter
        if age >= self._size or (self._seen >> age) & 1:
            return False
        self._seen |= 1 << age
        return True


@dataclass(frozen=True)
class Opened:
    """A message that passed every check."""

    kind: bytes
    from_nonce: bytes  # the sender's incarnation: seal replies to it
    counter: int
    message: Any  # the body, decoded


class Sealer:
    """Seals what one transport instance sends and opens what it receives. Thread-safe."""

    def __init__(self, secret: bytes | str | None, owner: str) -> None:
        self.nonce = new_nonce()
        self.num_rejected = 0
        # Keyed once and copied per message: hmac.digest() re-keys on every call, 3x the cost of a
        # header's hash. The domain is absorbed here too; every tag starts with it.
        self._mac = hmac.new(data_key(secret), DOMAIN, hashlib.sha256)
        self._owner = owner  # for log lines, e.g. "tcp receiver"
        self._lock = threading.Lock()
        self._counter = 0
        self._windows: OrderedDict[bytes, ReplayWindow] = OrderedDict()
        self._last_log_s = -_LOG_INTERVAL_S
        self._unlogged = 0

    def _tag(self, to_nonce: bytes, head_and_body: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(to_nonce)
        mac.update(head_and_body)
        return mac.digest()[:TAG_BYTES]

    def seal(self, kind: bytes, to_nonce: bytes, body: bytes) -> bytes:
        """The envelope carrying ``body`` to the instance whose nonce is ``to_nonce``."""
        with self._lock:
            self._counter += 1
            counter = self._counter
        head_and_body = kind + self.nonce + counter.to_bytes(COUNTER_BYTES, "big") + body
        return head_and_body + self._tag(to_nonce, head_and_body)

    def open(
        self,
        data: bytes | bytearray | memoryview,
        decoders: dict[bytes, Callable[[bytes], Any]],
        expect_from: Collection[bytes] | None = None,
    ) -> Opened | None:
        """Check an envelope addressed to us and decode its body with ``decoders[kind]``. None if it
        is rejected (already counted and logged): the caller drops it and carries on."""
        data = bytes(data)
        if len(data) < _HEAD_BYTES + TAG_BYTES:
            return self.reject(f"message of {len(data)} bytes is shorter than an envelope")
        head_and_body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self.nonce, head_and_body)):
            return self.reject(
                "tag does not verify: the sender holds another cluster secret, sealed it for an "
                "earlier incarnation of this process, or forged it"
            )
        kind = head_and_body[:1]
        from_nonce = head_and_body[1 : 1 + NONCE_BYTES]
        counter = int.from_bytes(head_and_body[1 + NONCE_BYTES : _HEAD_BYTES], "big")
        if kind not in decoders:
            return self.reject(f"unexpected message kind {kind!r} here (expected {sorted(decoders)})")
        if expect_from is not None and from_nonce not in expect_from:
            return self.reject(f"sealed by {from_nonce.hex()[:8]}, not by the peer of this link")
        try:
            message = decoders[kind](head_and_body[_HEAD_BYTES:])
        except Exception as e:  # noqa: BLE001 - a well-sealed but undecodable body is still dropped
            return self.reject(f"undecodable {kind!r} body: {e}")
        if not self._fresh(from_nonce, counter):
            return self.reject(f"replay of counter {counter} from {from_nonce.hex()[:8]}")
        return Opened(kind, from_nonce, counter, message)

    def _fresh(self, from_nonce: bytes, counter: int) -> bool:
        with self._lock:
            window = self._windows.get(from_nonce)
            if window is None:
                window = self._windows[from_nonce] = ReplayWindow()
                if len(self._windows) > MAX_TRACKED_SENDERS:
                    self._windows.popitem(last=False)
            else:
                self._windows.move_to_end(from_nonce)
            return window.accept(counter)

    def reject(self, reason: str) -> None:
        """Count a dropped message and log it, at most once a second. Returns None for ``open``."""
        now = time.monotonic()
        with self._lock:
            self.num_rejected += 1
            if now - self._last_log_s < _LOG_INTERVAL_S:
                self._unlogged += 1
                return None
            unlogged, self._unlogged, self._last_log_s = self._unlogged, 0, now
        more = f" ({unlogged} more dropped since the last report)" if unlogged else ""
        log.warning("%s dropped a data-plane message: %s%s", self._owner, reason, more)
        return None


def decode_raw(body: bytes) -> bytes:
    """Decoder for bodies used as they are."""
    return body
