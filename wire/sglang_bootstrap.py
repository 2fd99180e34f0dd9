"""SGLang's prefill/decode protocol as its router (sglang-router, the SGLang model gateway) speaks it: the router
sends each request to a prefill server and a decode server at once, both with the same ``bootstrap_host``,
``bootstrap_port`` (the prefill server's, given to the router with ``--prefill URL PORT``) and ``bootstrap_room`` (a
random 63-bit number naming this request's KV). The prefill server computes the prompt; the decode server takes its
KV from there and decodes.

Here that is the external protocol of wire/external_kv.py under other names: an instance started with
``--kv-transfer-config '{"kv_role": "kv_producer", "kv_port": PORT}'`` is a prefill server (its KV export server on
the bootstrap port), one with ``kv_role`` ``kv_consumer`` a decode server. A request's bootstrap fields become its
``kv_transfer_params``: on the prefill side ``do_remote_decode`` (one token, the prompt's blocks held under the
room), on the decode side ``do_remote_prefill`` from the bootstrap host and port, which waits for the hold to appear
(the prefill side may not have finished: both legs start together) until the pull's timeout, then computes the
prompt itself. The room is the pull's only key: it is random and known to the router and the two servers alone.

Plain data only: the API checks a request with it before anything heavy runs."""

from __future__ import annotations

from typing import Any

from pdcluster.wire.external_kv import ExternalKVError, RemotePrefill

ROOM_PREFIX = "sglang-room-"
MAX_ROOM = (1 << 64) - 1
# A bootstrap pull takes every full block of the prompt the prefill side holds (the decode side does not know how
# many it kept; the pull stops at the first that differs).
ALL_BLOCKS = 1 << 31


def room_key(room: int) -> str:
    """The name a held prompt goes by in the export server (wire/external_kv.py RemotePrefill.request_id)."""
    return f"{ROOM_PREFIX}{room}"


def is_bootstrap_pull(params: dict | None) -> bool:
    """Whether a request's ``kv_transfer_params`` are a decode leg's from SGLang's router (``bootstrap_kv_params``)."""
    return bool(params) and params.get("do_remote_prefill") is True and "bootstrap_room" in params


def bootstrap_remote(params: dict) -> RemotePrefill:
    """The pull a decode server's translated ``kv_transfer_params`` asks for (``bootstrap_kv_params``' output);
    ExternalKVError where they are not well formed."""
    params = bootstrap_kv_params(params.get("bootstrap_host"), params.get("bootstrap_port"),
                                 params.get("bootstrap_room"), "kv_consumer")
    return RemotePrefill(host=params["bootstrap_host"], port=params["bootstrap_port"],
                         request_id=room_key(params["bootstrap_room"]), token="", engine_id="sglang-bootstrap",
                         num_blocks=ALL_BLOCKS, wait_for_hold=True)


def bootstrap_kv_params(host: Any, port: Any, room: Any, role: str) -> dict:
    """A request's SGLang bootstrap fields as its ``kv_transfer_params`` on an instance of ``role`` (its
    --kv-transfer-config kv_role, "" without one). ExternalKVError (a 400) naming the field that is wrong."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ExternalKVError(f"bootstrap_room: must be an integer in [0, 2^64), got {str(room)[:40]!r}")
    if role == "kv_producer":
        return {"do_remote_decode": True, "bootstrap_room": room}
    if role == "kv_consumer":
        if not isinstance(host, str) or not host:
            raise ExternalKVError(f"bootstrap_host: must be the prefill server's host, got {str(host)[:60]!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ExternalKVError(f"bootstrap_port: must be a port in [1, 65535], got {str(port)[:20]!r}")
        return {"do_remote_prefill": True, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if not role:
        raise ExternalKVError("bootstrap_room: this server takes no part in a prefill/decode split: start the prefill "
                              "server with --kv-transfer-config '{\"kv_role\": \"kv_producer\", \"kv_port\": PORT}' "
                              "and the decode server with kv_role kv_consumer")
    raise ExternalKVError("bootstrap_room: SGLang's router sends a request to a prefill and a decode server; this "
                          f"server's kv_role is {role}: start it with kv_role kv_producer (the router's --prefill) or "
                          "kv_consumer (its --decode)")
