"""What both sides of the handshake check in the other's Hello, and the texts of what they refuse.

The message order (Challenge both ways, then Hello and HelloAck) is in this package's docstring;
each role's half is in prefill.py and decode.py.
"""

from __future__ import annotations

from .. import auth
from ..protocol import PROTOCOL_VERSION, Challenge, HandshakeError, Hello, HelloAck, VersionError, check_compatible

HANDSHAKE_TYPES = (Challenge, Hello, HelloAck)  # the endpoint sends these itself, never through send()


def clip(text: str, limit: int = 200) -> str:
    # Strings from unauthenticated peers end up in logs and exceptions; a hostile one can be 1 MiB long.
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def vet(secret: bytes, local: Hello, hello: Hello, expected_nonce: bytes, my_nonce: bytes) -> str | None:
    """Why the peer's ``hello`` must be refused, or None. Authentication first, then compatibility
    with our own ``local`` Hello. ``expected_nonce``: the one the peer sent in its Challenge;
    ``my_nonce``: ours, which its proof must cover."""
    who = f"{hello.role} {clip(repr(hello.worker_id))}"
    if hello.nonce != expected_nonce:
        return f"authentication failed: {who} signed a Hello whose nonce is not the one it sent in its Challenge"
    if not auth.verify_hello(secret, hello, my_nonce):
        return (
            f"authentication failed: {who} did not prove knowledge of the cluster secret "
            "(configure both workers with the same secret)"
        )
    try:
        check_compatible(local, hello)
    except HandshakeError as exc:
        return str(exc)
    return None


def version_mismatch(endpoint: str, sender: str, exc: VersionError) -> str:
    return (
        f"protocol version mismatch: {endpoint} speaks version {PROTOCOL_VERSION}, "
        f"{sender} sent version {exc.peer_version}"
    )
