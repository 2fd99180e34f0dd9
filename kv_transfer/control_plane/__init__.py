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
through a queue (``poll``) or a callback. Every wait in the loop is bounded by ``POLL_CAP_S``, so
heartbeats, dead-peer checks and ``close()`` are never late by more than that. Callbacks
(``on_message``, ``on_peer_dead``) run on the I/O thread: keep them short (a slow one delays
heartbeats); they may call ``send``/``close`` but not ``connect``.

One job a module:

* config.py: ``EndpointConfig``, what an endpoint says about itself and its limits.
* io_loop.py: the I/O thread, its poller, wake-ups and command queue (no message knowledge).
* peers.py: the peers with a completed handshake, the dead and the departed; heartbeat numbers and
  silence (liveness).
* endpoint.py: what both roles share above the loop: every inbound message checked (seal, size,
  version, schema, handshake state) before delivery, ``send``/``poll``, heartbeats and dead peers.
* handshake.py: the checks both sides of the handshake make on the other's Hello.
* prefill.py / decode.py: the two roles' sockets and their halves of the handshake.
"""

from .config import DEFAULT_MAX_MESSAGE_BYTES, EndpointConfig
from .decode import DecodeEndpoint
from .peers import PeerNotConnectedError
from .prefill import PrefillEndpoint

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DecodeEndpoint",
    "EndpointConfig",
    "PeerNotConnectedError",
    "PrefillEndpoint",
]
