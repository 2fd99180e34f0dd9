"""KV-transfer control-plane messages and their msgpack codec.

Every message is a frozen dataclass. On the wire a message is the msgpack map
``{"v": PROTOCOL_VERSION, "t": <class name>, "b": {<field>: <value>, ...}}``; nested records
(``KVLayout`` inside ``Hello``, ``Hello`` inside ``HelloAck``) are maps of their fields. The record
machinery and the codec are in wire/records.py (shared with the worker -> router events).

Field types are checked against the dataclass annotations both when a message is built locally and
when one is decoded, so a message that encodes here always decodes on the peer, and ``decode`` turns
every malformed input into a ``ProtocolError`` (never a ``KeyError``/``TypeError`` from deep inside a
handler). No pickle: the peer is untrusted until the handshake says otherwise, and even then a
decode must not be able to run code.

Handshake messages (``Challenge``, ``Hello``, ``HelloAck``) are driven by the endpoints in
``control_plane/`` (prefill.py, decode.py); the proof inside them is computed in ``auth.py``.

A request's transfer, D = decode (which owns the request), P = prefill:

    D -> P  TransferRequest(request, prompt, sampling, D's reserved blocks, blocks D already holds)
    P -> D  FirstToken(request, token)       as soon as P sampled it (TTFT does not wait for the KV)
    P -> D  TransferDone(request, ok, ...)   from post_forward, once D acked every chunk (S2)
    either  AbortTransfer(request, reason)   stop; each side frees its blocks

A request its first token ends (max_tokens 1: scoring, classification, a beam search's step) asks with
``first_token_only``: no blocks reserved on D, no KV sent; P's FirstToken is the whole answer, and P sends
nothing after it (D abandons the ask with AbortTransfer when it is given up first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.wire.records import (  # noqa: F401 - re-exported: the control plane's callers import them from here
    Codec,
    ProtocolError,
    Record,
    VersionError,
    _check_fields,
    _require,
    _short,
    to_wire,
)

# Fields added with a default (TransferRequest.prompt_token_ids, .sampling, .num_reused_blocks, .first_token_only;
# TransferDone.num_bytes, .seconds, .num_offloaded_tokens; FirstToken.num_offloaded_tokens, .pooled) and new message types do not change the version; a changed meaning would.
PROTOCOL_VERSION = 1
ROLES = ("prefill", "decode")


class HandshakeError(ConnectionError):
    """Two workers cannot be paired: refused, unauthenticated, incompatible, or no answer in time."""



# --- records and messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout(Record):
    """Shape of one worker's paged KV cache; prefill and decode must agree on every field."""

    num_layers: int  # including the draft (MTP) layers, whose KV is transferred too
    num_draft_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # Hybrid models: the Mamba state that travels in ``num_state_blocks`` blocks after the prompt's
    # (engine/mamba_state_blocks.py). All zero for attention-only models.
    num_state_blocks: int = 0
    state_num_layers: int = 0
    state_conv_dim: int = 0
    state_conv_width: int = 0
    state_num_heads: int = 0
    state_head_dim: int = 0
    state_size: int = 0
    num_planes: int = 2  # K and V; 1 where V is K (MLA's latent cache)
    # Ranks the model is split across (tensor parallelism): each holds num_kv_heads of them in its own cache, and
    # rank r's KV goes to the peer's rank r (kv_transfer/transports/ranked.py).
    tensor_parallel_size: int = 1

    def _check_values(self, path: str) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "tensor_parallel_size"):
            _require(getattr(self, name) > 0, f"{path}.{name}", "must be > 0", getattr(self, name))
        _require(
            0 <= self.num_draft_layers < self.num_layers,
            f"{path}.num_draft_layers",
            f"must be in [0, num_layers={self.num_layers})",
            self.num_draft_layers,
        )
        _require(bool(self.dtype), f"{path}.dtype", "must be a non-empty dtype name", self.dtype)

    def diff(self, other: KVLayout) -> list[str]:
        """Names of the fields whose values differ between ``self`` and ``other``."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class Challenge(Record):
    """First handshake message in each direction: the nonce the peer must sign over."""

    nonce: bytes


@dataclass(frozen=True)
class Hello(Record):
    """Who a worker is and what its KV cache looks like, with its proof of the cluster secret.

    ``hmac`` = HMAC(secret, canonical bytes of every other field + the peer's nonce); see auth.py.
    """

    worker_id: str
    role: str  # "prefill" or "decode"
    layout: KVLayout
    model_fingerprint: str
    transport: str  # data-plane transport name, e.g. "tcp", "shm", "ucx"
    transport_descriptor: dict[str, Any]  # what the peer needs to reach this worker's data plane
    nonce: bytes
    hmac: bytes
    protocol_version: int = PROTOCOL_VERSION
    # Which arithmetic the worker's kernels do (kernels/numerics.py; "" = not said). Not a compatibility field:
    # workers that differ here pair, with a warning (numerics_note).
    numerics: str = ""

    def _check_values(self, path: str) -> None:
        _require(bool(self.worker_id), f"{path}.worker_id", "must be non-empty", self.worker_id)
        _require(self.role in ROLES, f"{path}.role", f"must be one of {ROLES}", self.role)


@dataclass(frozen=True)
class HelloAck(Record):
    """The listener's verdict on a Hello; when accepted, ``hello`` is its own signed Hello."""

    accepted: bool
    reason: str  # why it was refused; empty when accepted
    hello: Hello


@dataclass(frozen=True)
class TransferRequest(Record):
    """Decode -> prefill: prefill this prompt and write its KV into these pre-allocated blocks.

    ``sampling`` is the request's SamplingParams as a map (engine/sampling_params.py), so the first
    token is drawn from the same per-position stream the decode worker continues.

    ``num_reused_blocks``: leading prompt blocks the decode worker already holds (its own prefix cache:
    engine/remote_admission.py). The prefill worker still computes the whole prompt but sends only the
    blocks from that one on; ``dst_block_ids[0]`` is where prompt block ``num_reused_blocks`` lands.
    A peer that does not send the field asks for every block (0).

    ``first_token_only``: the first token ends the request; no blocks (``dst_block_ids`` empty), no KV."""

    request_id: str
    dst_block_ids: list[int]
    num_tokens: int
    deadline_unix_s: float
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_reused_blocks: int = 0
    first_token_only: bool = False

    def _check_values(self, path: str) -> None:
        _require(self.num_tokens >= 0, f"{path}.num_tokens", "must be >= 0", self.num_tokens)
        _require(self.num_reused_blocks >= 0, f"{path}.num_reused_blocks", "must be >= 0", self.num_reused_blocks)
        _require(not (self.first_token_only and self.dst_block_ids), f"{path}.dst_block_ids",
                 "must be empty when first_token_only (no KV is sent)", len(self.dst_block_ids))
        if self.dst_block_ids:
            low = min(self.dst_block_ids)
            _require(low >= 0, f"{path}.dst_block_ids", "block ids must be >= 0", low)


@dataclass(frozen=True)
class TransferDone(Record):
    """Prefill -> decode: the KV of ``request_id`` is in place (sent from post_forward only, S2)."""

    request_id: str
    ok: bool
    error: str  # empty when ok
    num_tokens: int
    first_token_id: int
    draft_token_ids: list[int]  # the MTP proposer's drafts for the first decode step
    num_bytes: int = 0  # what the data plane moved for this request (metrics)
    seconds: float = 0.0  # from the first chunk sent to the last one acknowledged
    num_cached_tokens: int = 0  # prompt tokens the prefill worker took from its prefix cache
    num_offloaded_tokens: int = 0  # of those, loaded back from its offload tiers (host, disk)
    # With the request's logprobs / prompt_logprobs (repeated from FirstToken, which it may overtake).
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)

    def _check_values(self, path: str) -> None:
        _require(self.num_tokens >= 0, f"{path}.num_tokens", "must be >= 0", self.num_tokens)


@dataclass(frozen=True)
class FirstToken(Record):
    """Prefill -> decode: the first output token, sent as soon as it is sampled (the decode worker
    streams it to the router at once; TransferDone repeats it)."""

    request_id: str
    token_id: int
    num_cached_tokens: int = 0  # prompt tokens the prefill worker took from its prefix cache
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # the first token's, if asked
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # if asked
    num_offloaded_tokens: int = 0  # of num_cached_tokens, loaded back from its offload tiers (host, disk)
    # An embedding request's vector (SamplingParams.pooling), float32 little-endian (engine/pooling.py); b"": none.
    pooled: bytes = b""


@dataclass(frozen=True)
class AbortTransfer(Record):
    """Either direction: stop working on ``request_id``; its blocks are freed by each side."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Heartbeat(Record):
    """Liveness; any message counts as liveness, heartbeats cover idle periods."""

    worker_id: str
    seq: int
    time: float  # sender's wall clock (informational; liveness uses the receiver's monotonic clock)

    def _check_values(self, path: str) -> None:
        _require(self.seq >= 0, f"{path}.seq", "must be >= 0", self.seq)



MESSAGE_TYPES_LIST = (Challenge, Hello, HelloAck, TransferRequest, FirstToken, TransferDone, AbortTransfer, Heartbeat)
Message = Union[Challenge, Hello, HelloAck, TransferRequest, FirstToken, TransferDone, AbortTransfer, Heartbeat]
_CODEC = Codec(PROTOCOL_VERSION, MESSAGE_TYPES_LIST)
MESSAGE_TYPES: dict[str, type] = _CODEC.types


def encode(msg: Message) -> bytes:
    """msgpack of ``{"v": PROTOCOL_VERSION, "t": type name, "b": fields}``; ProtocolError if invalid."""
    return _CODEC.encode(msg)


def decode(data: bytes, max_size: int) -> Message:
    """Parse one message; raises ``ProtocolError`` (and nothing else) on any malformed input."""
    return _CODEC.decode(data, max_size)


# --- compatibility -----------------------------------------------------------------------------------


# Fields that differ between workers splitting one model different ways (tensor parallelism): the prefill side
# re-lays its KV heads out for the decode side's ranks (kv_transfer/transports/resplit.py).
# A hybrid's per-rank Mamba state widths too (its number of state blocks does not change with the split).
_SPLIT_FIELDS = ("num_kv_heads", "tensor_parallel_size", "state_conv_dim", "state_num_heads")


def total_kv_heads(layout: KVLayout) -> int:
    """KV heads of the whole model: a rank's times the ranks, except MLA's latent (one plane), whole on every rank."""
    return layout.num_kv_heads if layout.num_planes == 1 else layout.num_kv_heads * layout.tensor_parallel_size


def _resplit_refusal(a: KVLayout, b: KVLayout) -> str:
    """Why workers splitting one model ``a.tensor_parallel_size`` and ``b.tensor_parallel_size`` ways cannot
    exchange KV; empty when they can."""
    if total_kv_heads(a) != total_kv_heads(b):
        return f"their caches hold {total_kv_heads(a)} and {total_kv_heads(b)} KV heads in all"
    heads = [layout.state_num_heads * layout.tensor_parallel_size for layout in (a, b)]
    channels = [layout.state_conv_dim * layout.tensor_parallel_size for layout in (a, b)]
    if heads[0] != heads[1] or channels[0] != channels[1]:
        return (f"their Mamba states hold {heads[0]} and {heads[1]} heads, {channels[0]} and {channels[1]} conv "
                "channels in all")
    return ""


def numerics_note(local: Hello, peer: Hello) -> str:
    """What to warn of when two paired workers compute in different arithmetic (say AMX tiles and avx512_bf16 dot
    products: the same values to bf16 precision, summed in other orders), or "" when they do not (or either did
    not say). A disaggregated request is then correct but not bit for bit what a colocated one gives."""
    if not local.numerics or not peer.numerics or local.numerics == peer.numerics:
        return ""
    return (f"{local.role} {local.worker_id!r} computes with {local.numerics!r}, {peer.role} {peer.worker_id!r} with "
            f"{peer.numerics!r}: requests split between them are correct but not bitwise equal to a colocated run "
            "(deterministic mode holds within each worker); PDCLUSTER_CPU_AMX=0 on the AMX machines aligns CPUs")


def check_compatible(local: Hello, peer: Hello) -> None:
    """Raise ``HandshakeError`` naming every field on which the two workers cannot be paired."""
    me, them = f"{local.role} {local.worker_id!r}", f"{peer.role} {peer.worker_id!r}"
    problems = []

    def differs(field: str, mine: Any, theirs: Any) -> None:
        problems.append(f"{field} differs: {me} has {mine!r}, {them} has {theirs!r}")

    if local.protocol_version != peer.protocol_version:
        differs("protocol_version", local.protocol_version, peer.protocol_version)
    if local.role == peer.role:
        problems.append(f"role: both workers are {local.role!r}; a prefill worker pairs with a decode worker")
    resplit = local.layout.tensor_parallel_size != peer.layout.tensor_parallel_size
    for name in local.layout.diff(peer.layout):
        if not (resplit and name in _SPLIT_FIELDS):
            differs(f"layout.{name}", getattr(local.layout, name), getattr(peer.layout, name))
    if resplit and (reason := _resplit_refusal(local.layout, peer.layout)):
        differs("layout.tensor_parallel_size", local.layout.tensor_parallel_size, peer.layout.tensor_parallel_size)
        problems[-1] += f" ({reason})"
    if local.model_fingerprint != peer.model_fingerprint:
        differs("model_fingerprint", local.model_fingerprint, peer.model_fingerprint)
    if local.transport != peer.transport:
        differs("transport", local.transport, peer.transport)
    if problems:
        raise HandshakeError(
            f"{me} and {them} are incompatible: " + "; ".join(problems) + ". Both workers must run the "
            "same model with the same KV-cache layout, transport and pdcluster protocol version."
        )
