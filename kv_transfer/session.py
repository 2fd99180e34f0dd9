"""Sealing of the control-plane messages that follow the handshake (TransferDone, AbortTransfer,
heartbeats, ...).

The handshake (auth.py) proves both peers hold the cluster secret, but on its own it protects only the
handshake: whoever can inject bytes into the established TCP connection afterwards (an on-path
attacker) could forge a ``TransferDone`` with a wrong first token and make the decode worker continue a
request silently wrongly. So both sides derive a session key from the secret and the two nonces they
exchanged in the handshake (never sent itself), and every later message carries

    message = payload | counter (8 bytes, big-endian) | tag (16 bytes)
    tag     = HMAC-SHA256(session_key, direction | counter | payload)[:16]

``direction`` keeps a message from being reflected back to its sender; ``counter`` strictly increases
per direction, and zmq delivers one connection's messages in order, so a replayed or reordered message
is refused. A new connection (a restarted peer) runs a new handshake, hence new nonces and a new key.
Messages are authenticated, not encrypted: the control plane carries ids and token ids, no secrets.
"""

from __future__ import annotations

import hashlib
import hmac

_DOMAIN = b"pdcluster/kv-control/session/v1"
_TAG_BYTES = 16
_COUNTER_BYTES = 8
TRAILER_BYTES = _COUNTER_BYTES + _TAG_BYTES


class SessionError(ValueError):
    """A sealed message that fails verification: forged, replayed, reordered or truncated."""


class Session:
    """One direction pair of a control-plane connection between a prefill and a decode endpoint."""

    def __init__(self, secret: bytes, prefill_nonce: bytes, decode_nonce: bytes, role: str):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        key = hmac.new(secret, _DOMAIN + bytes(prefill_nonce) + bytes(decode_nonce), hashlib.sha256).digest()
        self._mac = hmac.new(key, digestmod=hashlib.sha256)  # copied per message: no re-keying cost
        self._out_dir, self._in_dir = (b"P", b"D") if role == "prefill" else (b"D", b"P")
        self._next_out = 0
        self._last_in = -1

    def _tag(self, direction: bytes, counter: bytes, payload: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(direction)
        mac.update(counter)
        mac.update(payload)
        return mac.digest()[:_TAG_BYTES]

    def seal(self, payload: bytes) -> bytes:
        counter = self._next_out.to_bytes(_COUNTER_BYTES, "big")
        self._next_out += 1
        return payload + counter + self._tag(self._out_dir, counter, payload)

    def open(self, message: bytes) -> bytes:
        """The payload of a message the peer sealed; raises SessionError otherwise."""
        if len(message) < TRAILER_BYTES:
            raise SessionError(f"{len(message)}-byte message is shorter than the {TRAILER_BYTES}-byte seal")
        payload = message[:-TRAILER_BYTES]
        counter = message[-TRAILER_BYTES:-_TAG_BYTES]
        tag = message[-_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self._in_dir, counter, payload)):
            raise SessionError("bad seal: not sealed with this connection's session key")
        n = int.from_bytes(counter, "big")
        if n <= self._last_in:
            raise SessionError(f"replayed or reordered message (counter {n}, last {self._last_in})")
        self._last_in = n
        return payload
