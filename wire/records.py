"""Typed records over msgpack: frozen dataclasses whose fields are checked against their annotations
when built locally, when encoded and when decoded, and a versioned codec for a family of them. The
per-step records a process makes of its own values (a decode step's ``StepTokens``, the router's
``Deltas`` batches) skip the first of those (``assemble``): they are checked once, as they are encoded.

Used by the KV-transfer control plane (kv_transfer/protocol.py: worker <-> worker), by the worker ->
router event stream (node/events.py), and by the records both carry (logprobs.py). On the wire a
record is ``{"v": version, "t": <class name>, "b": {<field>: <value>, ...}}``; nested records are
maps of their fields. ``Codec.decode`` turns every malformed input into a ``ProtocolError`` (never a
``KeyError``/``TypeError`` from deep inside a handler). No pickle: a decode must not be able to run
code.

Field annotations with a checker: int, float, bool, str, bytes, list[int], list[str],
dict[str, Any] (msgpack-native values), a nested record, and a list of records.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgpack

# msgpack's integer range: anything outside it cannot be packed, so it is refused at construction.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
# Transport descriptors are small nested maps (addresses, ports, keys). A depth bound keeps the
# recursive check and the canonical form in auth.py far away from Python's recursion limit, whatever
# nesting a hostile peer packs (msgpack itself allows ~1000 levels).
_MAX_DESCRIPTOR_DEPTH = 8


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; the text says what was wrong with which value."""


class VersionError(ProtocolError):
    """The envelope carries a version this side does not speak.

    Separate from ``ProtocolError`` so an endpoint can answer a handshake attempt from another version
    with a refusal that names both versions, instead of silently dropping it.
    """

    def __init__(self, peer_version: int, own_version: int):
        super().__init__(f"wrong protocol version {peer_version}: this side speaks version {own_version}")
        self.peer_version = peer_version


def _short(value: Any, limit: int = 60) -> str:
    # Values in errors come from the wire and can be megabytes long; logs get a bounded excerpt.
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- field checkers: one per annotation, each returns the (normalised) value or raises ----------------


def _check_int(value: Any, path: str) -> int:
    if type(value) is int and _INT_MIN <= value <= _INT_MAX:  # most values: a plain int in range
        return value
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
    # Block-id lists can be long, token lists short: one pass when every element is a plain int in range.
    for x in value:
        if type(x) is not int or not _INT_MIN <= x <= _INT_MAX:
            return [_check_int(x, f"{path}[{i}]") for i, x in enumerate(value)]
    return list(value)


def _check_float_list(value: Any, path: str) -> list[float]:
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{path}: expected list of float, got {type(value).__name__} {_short(value)}")
    return [_check_float(x, f"{path}[{i}]") for i, x in enumerate(value)]


def _check_str_list(value: Any, path: str) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{path}: expected list of str, got {type(value).__name__} {_short(value)}")
    # A step's request ids are checked per event: one pass when every element is a plain str (a call per element
    # cost ~6x as much at 128 rows), else element by element, which names the first bad one.
    for x in value:
        if type(x) is not str:
            return [_check_str(x, f"{path}[{i}]") for i, x in enumerate(value)]
    return list(value)


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


def _record_list_checker(cls: type) -> Callable[[Any, str], Any]:
    check_one = _record_checker(cls)

    def check(value: Any, path: str) -> list:
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{path}: expected list of {cls.__name__}, got {type(value).__name__}")
        return [check_one(x, f"{path}[{i}]") for i, x in enumerate(value)]

    return check


def _checker_for(annotation: Any) -> Callable[[Any, str], Any]:
    simple = {int: _check_int, float: _check_float, bool: _check_bool, str: _check_str, bytes: _check_bytes}
    if annotation in simple:
        return simple[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args == (int,):
        return _check_int_list
    if origin is list and args == (str,):
        return _check_str_list
    if origin is list and args == (float,):
        return _check_float_list
    if origin is list and len(args) == 1 and dataclasses.is_dataclass(args[0]) and issubclass(args[0], Record):
        return _record_list_checker(args[0])
    if origin is dict and args[:1] == (str,):
        return _check_str_map
    if dataclasses.is_dataclass(annotation) and issubclass(annotation, Record):
        return _record_checker(annotation)
    raise TypeError(f"record field annotation {annotation!r} has no checker")  # a bug here, not a peer


# Scalar annotations whose checker returns a value of exactly that type unchanged: such a value is
# accepted without the call (ints within msgpack's range, floats that are not NaN; bool is not an int here:
# type(True) is bool).
_EXACT_SCALARS = (str, bool, int, float)


@dataclass(frozen=True)
class _Plan:
    """What checking, building and encoding a record class need of its fields, derived once per class
    (lazily: the annotations are strings, under the future import, naming classes defined below)."""

    fields: tuple[dataclasses.Field, ...]
    names: tuple[str, ...]
    name_set: frozenset[str]
    required: tuple[str, ...]  # the names of the fields without a default
    # Per field: (name, checker, its path in a top-level record, the scalar type a value of which
    # passes as it is, or None).
    checks: tuple[tuple[str, Callable[[Any, str], Any], str, type | None], ...]
    values: Callable[[Any], tuple]  # a record's field values at once, in field order
    nested: tuple[str, ...]  # the fields that hold records (a record, or a list of them)


def _holds_records(annotation: Any) -> bool:
    args = typing.get_args(annotation)
    inner = args[0] if typing.get_origin(annotation) is list and len(args) == 1 else annotation
    return dataclasses.is_dataclass(inner) and isinstance(inner, type) and issubclass(inner, Record)


@functools.cache
def _plan(cls: type) -> _Plan:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    if len(names) > 1:
        values = operator.attrgetter(*names)
    else:  # attrgetter of one name gives the value, not a tuple
        def values(record: Any) -> tuple:
            return tuple(getattr(record, name) for name in names)
    return _Plan(
        fields=fields,
        names=names,
        name_set=frozenset(names),
        required=tuple(f.name for f in fields if not _has_default(f)),
        checks=tuple((f.name, _checker_for(hints[f.name]), f"{cls.__name__}.{f.name}",
                      hints[f.name] if hints[f.name] in _EXACT_SCALARS else None) for f in fields),
        values=values,
        nested=tuple(n for n in names if _holds_records(hints[n])),
    )


def _check_fields(record: Record, path: str) -> None:
    """Check (and normalise in place) every field of ``record``, then its value rules. Records are
    checked per message (a worker's events: one per request per step), so the common case is cheap: a
    scalar of its field's exact type is taken without a call, a top-level record's field paths come
    precomputed, and a value the check returns as is is not set again."""
    plan = _plan(type(record))
    top = path == type(record).__name__
    for (name, check, top_path, exact), value in zip(plan.checks, plan.values(record)):
        if type(value) is exact and (exact is str or exact is bool or (
                _INT_MIN <= value <= _INT_MAX if exact is int else value == value)):  # float: not NaN
            continue
        checked = check(value, top_path if top else f"{path}.{name}")
        if checked is not value:
            object.__setattr__(record, name, checked)
    record._check_values(path)


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _build(cls: type, body: Any, path: str) -> Any:
    """Construct ``cls`` from a decoded map whose keys must be exactly its field names."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{path}: expected a map of fields, got {type(body).__name__} {_short(body)}")
    plan = _plan(cls)
    # A field with a default may be left out (one added later: older senders do not know it).
    missing = [name for name in plan.required if name not in body]
    if missing:
        raise ProtocolError(f"{path}: missing field {missing[0]!r}")
    if len(body) > len(plan.names) or not plan.name_set.issuperset(body):
        extra = [k for k in body if k not in plan.name_set]
        raise ProtocolError(f"{path}: unexpected field {_short(extra[0])}")
    record = cls.__new__(cls)
    setattr_ = object.__setattr__
    for f in plan.fields:
        name = f.name
        value = body[name] if name in body else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())
        setattr_(record, name, value)
    _check_fields(record, path)
    return record


def assemble(cls: type, values: dict[str, Any]) -> Any:
    """A record of ``cls`` from field values that were checked already, as fields of another record
    (``StepTokens.rows``: each row of a checked columnar event as the ``Tokens`` it stands for), or that this
    process made of such values or of its engine's (``StepTokens.of_engine_columns``, the router's ``Deltas``
    batches: checked by ``Codec.encode`` as they leave the process): every field given, no check. Never for
    values from anywhere else (a peer, a client)."""
    record = cls.__new__(cls)
    record.__dict__.update(values)  # frozen: its __setattr__ refuses, the instance dict does not
    return record


@dataclass(frozen=True)
class Record:
    """Base of everything that travels: fields are type-checked on construction."""

    def __post_init__(self) -> None:
        _check_fields(self, type(self).__name__)

    def _check_values(self, path: str) -> None:
        """Rules beyond the type (ranges, enums); overridden where a field has them."""


def _require(ok: bool, path: str, what: str, value: Any) -> None:
    if not ok:
        raise ProtocolError(f"{path}: {what}, got {_short(value)}")


def require_token_columns(record: Any, path: str, num_rows: int, count_columns: Iterable[str]) -> None:
    """The rules of a columnar record of token rows (node/events.py StepTokens, cluster/frontend/
    protocol.py Deltas): every column in ``count_columns`` has one value a row, ``num_new_tokens`` are
    counts >= 0, and ``new_token_ids`` holds exactly their sum."""
    for name in count_columns:
        column = getattr(record, name)
        _require(len(column) == num_rows, f"{path}.{name}", f"expected {num_rows} values (one a row)",
                 f"{len(column)} values")
    _require(min(record.num_new_tokens, default=0) >= 0, f"{path}.num_new_tokens", "expected counts >= 0",
             record.num_new_tokens)
    _require(sum(record.num_new_tokens) == len(record.new_token_ids), f"{path}.new_token_ids",
             f"expected {sum(record.num_new_tokens)} tokens (the sum of num_new_tokens)",
             f"{len(record.new_token_ids)} tokens")


# --- codec -------------------------------------------------------------------------------------------


def to_wire(record: Record) -> dict[str, Any]:
    """The msgpack-ready map of a record's fields (nested records, alone or in a list, become maps). A
    new map; field values other than records are the record's own (msgpack only reads them), not deep
    copies as ``dataclasses.asdict`` made: the checked field types hold records nowhere else."""
    plan = _plan(type(record))
    out = dict(zip(plan.names, plan.values(record)))
    for name in plan.nested:
        value = out[name]
        out[name] = to_wire(value) if isinstance(value, Record) else [to_wire(x) for x in value]
    return out


_ENVELOPE_KEYS = ("v", "t", "b")


class Codec:
    """Encode and decode one versioned family of record types (looked up by class name)."""

    def __init__(self, version: int, types: Iterable[type]):
        self.version = version
        self.types: dict[str, type] = {cls.__name__: cls for cls in types}

    def encode(self, msg: Record) -> bytes:
        """msgpack of ``{"v": version, "t": type name, "b": fields}``; ProtocolError if invalid."""
        name = type(msg).__name__
        if self.types.get(name) is not type(msg):
            raise ProtocolError(f"cannot encode {type(msg).__name__}: not a type of this codec")
        _check_fields(msg, name)  # a list mutated after construction is caught here, not on the peer
        return msgpack.packb({"v": self.version, "t": name, "b": to_wire(msg)}, use_bin_type=True)

    def decode(self, data: bytes, max_size: int) -> Any:
        """Parse one message; raises ``ProtocolError`` (and nothing else) on any malformed input."""
        try:
            return self._decode(data, max_size)
        except ProtocolError:
            raise
        except Exception as exc:  # the contract is "only ProtocolError"; a miss in the checks lands here
            raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc

    def _decode(self, data: bytes, max_size: int) -> Any:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"expected bytes, got {type(data).__name__}")
        size = memoryview(data).nbytes
        if size > max_size:
            raise ProtocolError(f"message too big: {size} bytes > max_size {max_size}")
        try:
            # strict_map_key: only str/bytes keys, so a hostile map key cannot be an unhashable list.
            envelope = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated types (ExtraData, FormatError, ...)
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
        if version != self.version:  # checked before the type: another version may name types differently
            raise VersionError(version, self.version)
        name = envelope["t"]
        cls = self.types.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ProtocolError(f"unknown message type {_short(name)} (known: {', '.join(self.types)})")
        return _build(cls, envelope["b"], name)
