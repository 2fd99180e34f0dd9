"""The external prefill/decode protocol's settings and request fields: what vLLM's disaggregated serving
(``--kv-transfer-config``, a request's ``kv_transfer_params``) asks of an instance, so a proxy written for
vLLM (its toy_proxy_server, llm-d's routing sidecar, Ray Serve LLM's PD app) drives two pdcluster
instances as it drives two vLLM ones.

The proxy sends the request to the prefill instance first, with ``kv_transfer_params.do_remote_decode`` and
``max_tokens`` 1; that instance computes the prompt, keeps its full KV blocks (the *hold*) and answers with
``kv_transfer_params`` naming where they are (``remote_host``, ``remote_port``, ``remote_request_id``, a
one-time ``remote_token``). The proxy then sends the same request to the decode instance with those
parameters (``do_remote_prefill``); that instance pulls the blocks before its first step and computes only
what they do not cover (the prompt's last partial block), token-exact against computing it all (the KV
is bitwise what it would compute: deterministic kernels, the same model checked by its layout key).

Plain data only (no torch): the CLI, the API and the engine's config read it before anything heavy loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdcluster.wire.json_config import parse_json_object

# vLLM's connector names a proxy's manifests carry; every one means this protocol here (the wire between
# the two instances is ours: a pdcluster instance pairs with a pdcluster instance).
CONNECTOR_NAMES = ("PdclusterConnector", "NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1",
                   "MooncakeConnector")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
WILDCARDS = ("0.0.0.0", "::")
EXTRA_KEYS = {"advertise_host": str, "hold_timeout_s": (int, float), "fetch_timeout_s": (int, float)}


class ExternalKVError(ValueError):
    """A setting or a request's kv_transfer_params is malformed; the text names the key."""


@dataclass(frozen=True)
class ExternalKVConfig:
    connector: str = "PdclusterConnector"
    role: str = "kv_both"
    host: str = "127.0.0.1"  # where the KV export server binds (kv_ip)
    port: int = 0  # kv_port: the first worker's; worker i binds port + i (0: any free port for each)
    # What the answers name: default kv_ip, or where kv_ip is a wildcard (0.0.0.0, ::) "auto": this machine's
    # address as its host name resolves (a pod's IP on Kubernetes).
    advertise_host: str = ""
    # A held prompt's blocks go back to the pool after this, pulled or not (a proxy that dropped the decode
    # leg must not strand them; vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT is 480 s).
    hold_timeout_s: float = 120.0
    fetch_timeout_s: float = 10.0  # a decode instance's pull; past it, the prompt is computed here

    @property
    def public_host(self) -> str:
        host = self.advertise_host or ("auto" if self.host in WILDCARDS else self.host)
        if host == "auto":
            import socket

            return socket.gethostbyname(socket.gethostname())
        return host

    @property
    def produces(self) -> bool:
        return self.role in ("kv_both", "kv_producer")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_both", "kv_consumer")


def parse_config(text: str) -> ExternalKVConfig | None:
    """``--kv-transfer-config`` (vLLM's JSON: kv_connector, kv_role, kv_ip, kv_port,
    kv_connector_extra_config); "" is None (the protocol is off)."""
    if not text:
        return None
    known = {"kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config", "kv_buffer_device",
             "kv_buffer_size", "kv_rank", "kv_parallel_size", "engine_id", "kv_load_failure_policy"}
    raw = parse_json_object(text, "kv_transfer_config", ExternalKVError, known)
    connector = raw.get("kv_connector", "PdclusterConnector")
    if connector not in CONNECTOR_NAMES:
        raise ExternalKVError(f"kv_transfer_config.kv_connector: {connector!r} is not one of "
                              f"{', '.join(CONNECTOR_NAMES)}")
    role = raw.get("kv_role", "kv_both")
    if role not in ROLES:
        raise ExternalKVError(f"kv_transfer_config.kv_role: {role!r} is not one of {', '.join(ROLES)}")
    host = raw.get("kv_ip", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ExternalKVError(f"kv_transfer_config.kv_ip: must be a host name or address, got {host!r}")
    port = raw.get("kv_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ExternalKVError(f"kv_transfer_config.kv_port: must be an integer in [0, 65535], got {port!r}")
    extra = raw.get("kv_connector_extra_config", {}) or {}
    if not isinstance(extra, dict):
        raise ExternalKVError("kv_transfer_config.kv_connector_extra_config: must be a JSON object")
    values: dict[str, Any] = {}
    for key, value in extra.items():
        kind = EXTRA_KEYS.get(key)
        if kind is None:
            continue  # another connector's settings (a manifest shared with vLLM): not ours to judge
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ExternalKVError(f"kv_transfer_config.kv_connector_extra_config.{key}: wrong type {value!r}")
        if key.endswith("_s") and not (math.isfinite(value) and value > 0):
            raise ExternalKVError(f"kv_transfer_config.kv_connector_extra_config.{key}: must be > 0, got {value!r}")
        values[key] = float(value) if key.endswith("_s") else value
    return ExternalKVConfig(connector=connector, role=role, host=host, port=port, **values)


@dataclass(frozen=True)
class RemotePrefill:
    """A decode instance's request: where its prompt's KV waits (the prefill instance's answer)."""

    host: str
    port: int
    request_id: str
    token: str
    engine_id: str
    num_blocks: int  # the prompt's full blocks the prefill instance holds
    # SGLang's router starts both legs at once (wire/sglang_bootstrap.py): the hold may not be there yet, so the
    # pull asks again until its timeout.
    wait_for_hold: bool = False


def wants_remote_decode(params: dict | None) -> bool:
    return bool(params) and params.get("do_remote_decode") is True


def asks_for_split(params: dict | None) -> bool:
    """Whether the parameters ask this instance to take part (either side): only a server started with
    --kv-transfer-config may serve them."""
    return bool(params) and bool(params.get("do_remote_decode") or params.get("do_remote_prefill"))


def remote_prefill(params: dict | None) -> RemotePrefill | None:
    """The pull a request's ``kv_transfer_params`` asks for, or None (no params, or not do_remote_prefill).
    Raises ExternalKVError naming the key when do_remote_prefill is set and the rest is malformed."""
    if not params or params.get("do_remote_prefill") is not True:
        return None
    def need(key: str, kind, check=lambda v: True, what: str = ""):
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, kind) or not check(value):
            raise ExternalKVError(f"kv_transfer_params.{key}: {what or 'missing or of the wrong type'}, got "
                                  f"{str(value)[:60]!r} (do_remote_prefill needs the prefill instance's answer)")
        return value
    block_ids = params.get("remote_block_ids")
    if not isinstance(block_ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        raise ExternalKVError("kv_transfer_params.remote_block_ids: must be a list of integers (the prefill "
                              "instance's answer)")
    return RemotePrefill(
        host=need("remote_host", str, bool, "must be a host name or address"),
        port=need("remote_port", int, lambda v: 0 < v < 65536, "must be a port in [1, 65535]"),
        request_id=need("remote_request_id", str, bool, "must be the prefill instance's request id"),
        token=need("remote_token", str, lambda v: len(v) <= 128, "must be the prefill instance's token"),
        engine_id=need("remote_engine_id", str, bool, "must be the prefill instance's engine id"),
        num_blocks=len(block_ids))


def check_request_params(params: Any) -> None:
    """The API's check of a request's ``kv_transfer_params`` (ExternalKVError: a 400)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ExternalKVError(f"kv_transfer_params: must be a JSON object, got {type(params).__name__}")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if params.get(key) not in (None, True, False):
            raise ExternalKVError(f"kv_transfer_params.{key}: must be true or false, got {params.get(key)!r}")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ExternalKVError("kv_transfer_params: do_remote_decode and do_remote_prefill are both true; a "
                              "request is prefilled for another instance or decoded here from one, not both")
    remote_prefill(params)
