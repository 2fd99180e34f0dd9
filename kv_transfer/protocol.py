"""KV-transfer control-plane messages and their msgpack codec.

Every message is a frozen dataclass. On the wire a message is the msgpack map
``{"v": PROTOCOL_VERSION, "t": <class name>, "b": {<field>: <value>, ...}}``; nested records
(``KVLayout`` inside ``Hello``, ``Hello`` inside ``HelloAck``) are maps of their fields.

Field types are checked against the dataclass annotations both when a message is built locally and
when one is decoded, so a message that encodes here always decodes on the peer, and ``decode`` turns
every malformed input into a ``ProtocolError`` (never a ``KeyError``/``TypeError`` from deep inside a
handler). No pickle: the peer is untrusted until the handshake says otherwise, and even then a
decode must not be able to run code.

Handshake messages (``Challenge``, ``Hello``, ``HelloAck``) are driven by the endpoints in
``control_plane.py``; the proof inside them is computed in ``auth.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from dataclasses import dataclass
from typing import Any, Callable, Union

import msgpack

PROTOCOL_VERSION = 1
ROLES = ("prefill", "decode")

# msgpack's integer range: anything outside it cannot be packed, so it is refused at construction.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
# Transport descriptors are small nested maps (addresses, ports, keys). A depth bound keeps the
# recursive check and the canonical form in auth.py far away from Python's recursion limit, whatever
# nesting a hostile peer packs (msgpack itself allows ~1000 levels).
_MAX_DESCRIPTOR_DEPTH = 8


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; the text says what was wrong with which value."""


class VersionError(ProtocolError):
    """The envelope carries a protocol version this side does not speak.

    Separate from ``ProtocolError`` so an endpoint can answer a handshake attempt from another version
    with a refusal that names both versions, instead of silently dropping it.
    """

    def __init__(self, peer_version: int):
        super().__init__(
            f"wrong protocol version {peer_version}: this side speaks version {PROTOCOL_VERSION}"
        )
        self.peer_version = peer_version


class HandshakeError(ConnectionError):
    """Two workers cannot be paired: refused, unauthenticated, incompatible, or no answer in time."""


def _short(value: Any, limit: int = 60) -> str:
    # Values in errors come from the wire and can be megabytes long; logs get a bounded excerpt.
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- field checkers: one per annotation, each returns the (normalised) value or raises ----------------


def _check_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ProtocolError(f"{path}: expected int, got {type(value).__name__} {_short(value)}")
    try:
        value = operator.index(value)  # numpy integers become plain ints, which msgpack can pack
    except TypeError:  # e.g. numpy.bool_, which has __index__ but refuses it
        raise ProtocolError(f"{path}: expected int, got {type(value).__name__} {_short(value)}") from None
    if not _INT_MIN <= value <= _INT_MAX:
        raise ProtocolError(f"{path}: int {value} is outside msgpack's 64-bit range")
    return value


def _check_float(value: Any, path: str) -> float:
    # An int is accepted for a float field: a peer written in another language may send 0 for 0.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{path}: expected float, got {type(value).__name__} {_short(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise ProtocolError(f"{path}: {_short(value)} does not fit in a float") from None
    if math.isnan(value):
        raise ProtocolError(f"{path}: expected a number, got nan")
    return value


def _check_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{path}: expected bool, got {type(value).__name__} {_short(value)}")
    return value


def _check_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{path}: expected str, got {type(value).__name__} {_short(value)}")
    return value


def _check_bytes(value: Any, path: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise ProtocolError(f"{path}: expected bytes, got {type(value).__name__} {_short(value)}")
    return bytes(value)


def _check_int_list(value: Any, path: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{path}: expected list of int, got {type(value).__name__} {_short(value)}")
    # Block-id lists can be long: take the fast path when every element is already a plain int.
    if all(type(x) is int for x in value) and (
        not value or (min(value) >= _INT_MIN and max(value) <= _INT_MAX)
    ):
        return list(value)
    return [_check_int(x, f"{path}[{i}]") for i, x in enumerate(value)]


def _check_plain(value: Any, path: str, depth: int) -> Any:
    """A msgpack-native value (for transport descriptors): None, bool, int, float, str, bytes, list, map."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return _check_int(value, path)
    if isinstance(value, float):
        return value  # NaN is allowed here: a descriptor is opaque data, not a quantity we compute with
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if depth >= _MAX_DESCRIPTOR_DEPTH:
        raise ProtocolError(f"{path}: nested deeper than {_MAX_DESCRIPTOR_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        # Tuples become lists: that is what msgpack gives back, so round trips compare equal.
        return [_check_plain(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(value)]
    if isinstance(value, dict):
        return _check_str_map(value, path, depth + 1)
    raise ProtocolError(
        f"{path}: {type(value).__name__} {_short(value)} is not a msgpack value "
        "(use None, bool, int, float, str, bytes, list or a map with str keys)"
    )


def _check_str_map(value: Any, path: str, depth: int = 0) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{path}: expected a map, got {type(value).__name__} {_short(value)}")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ProtocolError(f"{path}: map keys must be str, got {type(key).__name__} {_short(key)}")
        out[key] = _check_plain(item, f"{path}[{key!r}]", depth)
    return out


def _record_checker(cls: type) -> Callable[[Any, str], Any]:
    def check(value: Any, path: str) -> Any:
        if isinstance(value, cls):
            _check_fields(value, path)  # re-checked: lists inside a frozen record are still mutable
            return value
        if isinstance(value, dict):
            return _build(cls, value, path)
        raise ProtocolError(f"{path}: expected {cls.__name__}, got {type(value).__name__} {_short(value)}")

    return check


def _checker_for(annotation: Any) -> Callable[[Any, str], Any]:
    simple = {int: _check_int, float: _check_float, bool: _check_bool, str: _check_str, bytes: _check_bytes}
    if annotation in simple:
        return simple[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args == (int,):
        return _check_int_list
    if origin is dict and args[:1] == (str,):
        return _check_str_map
    if dataclasses.is_dataclass(annotation) and issubclass(annotation, _Record):
        return _record_checker(annotation)
    raise TypeError(f"protocol field annotation {annotation!r} has no checker")  # a bug here, not a peer


@functools.cache
def _field_checkers(cls: type) -> tuple[tuple[str, Callable[[Any, str], Any]], ...]:
    # Resolved lazily: the annotations are strings (future import) naming classes defined below.
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _checker_for(hints[f.name])) for f in dataclasses.fields(cls))


def _check_fields(record: _Record, path: str) -> None:
    """Check (and normalise in place) every field of ``record``, then its value rules."""
    for name, check in _field_checkers(type(record)):
        object.__setattr__(record, name, check(getattr(record, name), f"{path}.{name}"))
    record._check_values(path)


def _build(cls: type, body: Any, path: str) -> Any:
    """Construct ``cls`` from a decoded map whose keys must be exactly its field names."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{path}: expected a map of fields, got {type(body).__name__} {_short(body)}")
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in body]
    if missing:
        raise ProtocolError(f"{path}: missing field {missing[0]!r}")
    extra = [k for k in body if k not in names]
    if extra:
        raise ProtocolError(f"{path}: unexpected field {_short(extra[0])}")
    record = cls.__new__(cls)
    for name in names:
        object.__setattr__(record, name, body[name])
    _check_fields(record, path)
    return record


@dataclass(frozen=True)
class _Record:
    """Base of everything that travels: fields are type-checked on construction."""

    def __post_init__(self) -> None:
        _check_fields(self, type(self).__name__)

    def _check_values(self, path: str) -> None:
        """Rules beyond the type (ranges, enums); overridden where a field has them."""


def _require(ok: bool, path: str, what: str, value: Any) -> None:
    if not ok:
        raise ProtocolError(f"{path}: {what}, got {_short(value)}")


# --- records and messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout(_Record):
    """Shape of one worker's paged KV cache; prefill and decode must agree on every field."""

    num_layers: int  # including the draft (MTP) layers, whose KV is transferred too
    num_draft_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def _check_values(self, path: str) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
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
class Challenge(_Record):
    """First handshake message in each direction: the nonce the peer must sign over."""

    nonce: bytes


@dataclass(frozen=True)
class Hello(_Record):
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

    def _check_values(self, path: str) -> None:
        _require(bool(self.worker_id), f"{path}.worker_id", "must be non-empty", self.worker_id)
        _require(self.role in ROLES, f"{path}.role", f"must be one of {ROLES}", self.role)


@dataclass(frozen=True)
class HelloAck(_Record):
    """The listener's verdict on a Hello; when accepted, ``hello`` is its own signed Hello."""

    accepted: bool
    reason: str  # why it was refused; empty when accepted
    hello: Hello


@dataclass(frozen=True)
class TransferRequest(_Record):
    """Decode -> prefill: write request ``request_id``'s KV into these pre-allocated blocks."""

    request_id: str
    dst_block_ids: list[int]
    num_tokens: int
    deadline_unix_s: float

    def _check_values(self, path: str) -> None:
        _require(self.num_tokens >= 0, f"{path}.num_tokens", "must be >= 0", self.num_tokens)
        if self.dst_block_ids:
            low = min(self.dst_block_ids)
            _require(low >= 0, f"{path}.dst_block_ids", "block ids must be >= 0", low)


@dataclass(frozen=True)
class TransferDone(_Record):
    """Prefill -> decode: the KV of ``request_id`` is in place (sent from post_forward only, S2)."""

    request_id: str
    ok: bool
    error: str  # empty when ok
    num_tokens: int
    first_token_id: int
    draft_token_ids: list[int]  # the MTP proposer's drafts for the first decode step

    def _check_values(self, path: str) -> None:
        _require(self.num_tokens >= 0, f"{path}.num_tokens", "must be >= 0", self.num_tokens)


@dataclass(frozen=True)
class AbortTransfer(_Record):
    """Either direction: stop working on ``request_id``; its blocks are freed by each side."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Heartbeat(_Record):
    """Liveness; any message counts as liveness, heartbeats cover idle periods."""

    worker_id: str
    seq: int
    time: float  # sender's wall clock (informational; liveness uses the receiver's monotonic clock)

    def _check_values(self, path: str) -> None:
        _require(self.seq >= 0, f"{path}.seq", "must be >= 0", self.seq)


Message = Union[Challenge, Hello, HelloAck, TransferRequest, TransferDone, AbortTransfer, Heartbeat]
MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (Challenge, Hello, HelloAck, TransferRequest, TransferDone, AbortTransfer, Heartbeat)
}


# --- codec -------------------------------------------------------------------------------------------


def to_wire(record: _Record) -> dict[str, Any]:
    """The msgpack-ready map of a record's fields (nested records become maps)."""
    return dataclasses.asdict(record)


def encode(msg: Message) -> bytes:
    """msgpack of ``{"v": PROTOCOL_VERSION, "t": type name, "b": fields}``; ProtocolError if invalid."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a protocol message type")
    _check_fields(msg, name)  # a list mutated after construction is caught here, not on the peer
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": name, "b": to_wire(msg)}, use_bin_type=True)


def decode(data: bytes, max_size: int) -> Message:
    """Parse one message; raises ``ProtocolError`` (and nothing else) on any malformed input."""
    try:
        return _decode(data, max_size)
    except ProtocolError:
        raise
    except Exception as exc:  # the contract is "only ProtocolError"; a miss in the checks lands here
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc


_ENVELOPE_KEYS = ("v", "t", "b")


def _decode(data: bytes, max_size: int) -> Message:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_size:
        raise ProtocolError(f"message too big: {size} bytes > max_size {max_size}")
    try:
        # strict_map_key: only str/bytes keys, so a hostile map key cannot be an unhashable list.
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, FormatError, UnicodeDecodeError...)
        raise ProtocolError(f"not msgpack ({size} bytes): {type(exc).__name__}: {exc}") from None
    if not isinstance(envelope, dict):
        raise ProtocolError(f"envelope must be a map with keys v, t, b; got {type(envelope).__name__}")
    for key in _ENVELOPE_KEYS:
        if key not in envelope:
            raise ProtocolError(f"envelope: missing key {key!r}")
    extra = [k for k in envelope if k not in _ENVELOPE_KEYS]
    if extra:
        raise ProtocolError(f"envelope: unexpected key {_short(extra[0])}")
    version = envelope["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(f"envelope.v: expected int protocol version, got {_short(version)}")
    if version != PROTOCOL_VERSION:  # checked before the type: another version may name types differently
        raise VersionError(version)
    name = envelope["t"]
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(name)} (known: {', '.join(MESSAGE_TYPES)})")
    return _build(cls, envelope["b"], name)


# --- compatibility -----------------------------------------------------------------------------------


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
    for name in local.layout.diff(peer.layout):
        differs(f"layout.{name}", getattr(local.layout, name), getattr(peer.layout, name))
    if local.model_fingerprint != peer.model_fingerprint:
        differs("model_fingerprint", local.model_fingerprint, peer.model_fingerprint)
    if local.transport != peer.transport:
        differs("transport", local.transport, peer.transport)
    if problems:
        raise HandshakeError(
            f"{me} and {them} are incompatible: " + "; ".join(problems) + ". Both workers must run the "
            "same model with the same KV-cache layout, transport and pdcluster protocol version."
        )
