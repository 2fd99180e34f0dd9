"""Proof of the shared cluster secret for the control-plane handshake.

Each side picks a random nonce and sends it to the peer (``Challenge``). Each side then proves it holds
the cluster secret with

    hmac = HMAC-SHA256(secret, canonical(every Hello field except hmac) + the PEER's nonce)

The secret itself never leaves the process. Signing over the peer's nonce means a recorded Hello
cannot be replayed to a listener (it picks a fresh nonce each time), and signing over every field
means a man in the middle cannot swap the layout or the transport descriptor without breaking the
proof. Proofs are compared with ``hmac.compare_digest``.

No secret configured: the HMAC key is empty. Two workers that both have no secret still complete the
handshake (so a laptop setup needs no configuration); a worker with a secret and one without refuse
each other, because their proofs differ. An empty key authenticates nothing: anyone who can reach the
port can join, so configure a secret whenever the port is reachable from other hosts.

The data plane proves the same secret on its own (kv_transfer/transports/common/sealing.py): every chunk
header and ack is HMAC-sealed to the receiving incarnation's nonce with a replay window, under a key
derived from the secret with its own domain, so a data-plane listener accepts only holders of the
secret as well.

Every control-plane message after the handshake is sealed with a session key derived from the
secret and the two handshake nonces (kv_transfer/session.py): a relaying man in the middle can forward
both handshakes verbatim but cannot alter, inject or replay what follows.

Not covered: nothing is encrypted, and the data plane authenticates headers and acks but not the
payload bytes; loopback and a private cluster network are assumed. Use a private network (or an
encrypted overlay) where confidentiality or payload integrity against an on-path attacker matters.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import replace
from typing import Any

import msgpack

from .protocol import Hello, to_wire

NONCE_BYTES = 32
# Domain separation: these proofs can never be confused with another HMAC made with the same secret.
_DOMAIN = b"pdcluster/kv-control/hello-proof/v1"


def normalize_secret(secret: bytes | str | None) -> bytes:
    """The HMAC key for a configured secret: bytes as given, str as UTF-8, None as empty (see above)."""
    if secret is None:
        return b""
    if isinstance(secret, str):
        return secret.encode("utf-8")
    if isinstance(secret, (bytes, bytearray)):
        return bytes(secret)
    raise TypeError(f"cluster secret must be bytes, str or None, got {type(secret).__name__}")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _canonical(value: Any) -> Any:
    # msgpack packs maps in insertion order; sorting the keys makes equal Hellos pack to equal bytes
    # whatever order a descriptor was built in. Keys are str (the protocol checks it) so they sort.
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def canonical_bytes(hello: Hello, peer_nonce: bytes) -> bytes:
    """What the proof covers: the domain tag, every Hello field but ``hmac``, and the peer's nonce."""
    fields = to_wire(hello)
    del fields["hmac"]
    return msgpack.packb([_DOMAIN, _canonical(fields), bytes(peer_nonce)], use_bin_type=True)


def hello_proof(secret: bytes, hello: Hello, peer_nonce: bytes) -> bytes:
    return hmac.new(secret, canonical_bytes(hello, peer_nonce), hashlib.sha256).digest()


def sign_hello(secret: bytes, hello: Hello, peer_nonce: bytes) -> Hello:
    """``hello`` with its ``hmac`` set to the proof over ``peer_nonce``."""
    return replace(hello, hmac=hello_proof(secret, hello, peer_nonce))


def verify_hello(secret: bytes, hello: Hello, my_nonce: bytes) -> bool:
    """True when ``hello.hmac`` proves the sender holds ``secret`` and signed over ``my_nonce``."""
    return hmac.compare_digest(hello.hmac, hello_proof(secret, hello, my_nonce))
