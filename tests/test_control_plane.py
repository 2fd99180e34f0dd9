"""KV-transfer control plane: codec, handshake, hostile input, heartbeats.

Real zmq sockets on 127.0.0.1, real I/O threads, and real child processes for the peer-death tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.kv_transfer import auth
from pdcluster.kv_transfer.session import Session
from pdcluster.kv_transfer.control_plane import (
    DecodeEndpoint,
    EndpointConfig,
    PeerNotConnectedError,
    PrefillEndpoint,
)
from pdcluster.kv_transfer.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROLES,
    AbortTransfer,
    Challenge,
    FirstToken,
    HandshakeError,
    Heartbeat,
    Hello,
    HelloAck,
    KVLayout,
    ProtocolError,
    TransferDone,
    TransferRequest,
    VersionError,
    check_compatible,
    decode,
    encode,
    to_wire,
)

LOGGER = "pdcluster.kv_transfer.control_plane"
SECRET = b"cluster-secret-" + os.urandom(16).hex().encode()  # distinctive, so a wire search is meaningful
LAYOUT = KVLayout(num_layers=5, num_draft_layers=1, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
MiB = 1 << 20


def config(worker_id: str, **overrides) -> EndpointConfig:
    fields = dict(worker_id=worker_id, layout=LAYOUT, model_fingerprint="smollm2-135m@abc123", secret=SECRET)
    fields.update(overrides)
    return EndpointConfig(**fields)


@pytest.fixture
def endpoints():
    """Factory for endpoints that are closed at teardown, whatever the test did."""
    made = []

    def make(kind, cfg, **kwargs):
        ep = kind(cfg, **kwargs)
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def recv_message(sock: zmq.Socket, timeout_s: float = 2.0) -> bytes:
    assert sock.poll(int(timeout_s * 1000)), "no reply from the endpoint"
    return sock.recv_multipart()[-1]


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def raw_dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    return sock


def raw_handshake(sock: zmq.Socket, worker_id: str) -> Session:
    """Play the decode side of the handshake by hand, as another implementation would; returns the
    session that seals what this peer sends afterwards."""
    nonce = auth.new_nonce()
    sock.send(encode(Challenge(nonce=nonce)))
    challenge = decode(recv_message(sock), MiB)
    assert isinstance(challenge, Challenge)
    hello = Hello(worker_id=worker_id, role="decode", layout=LAYOUT, model_fingerprint="smollm2-135m@abc123",
                  transport="tcp", transport_descriptor={}, nonce=nonce, hmac=b"")
    sock.send(encode(auth.sign_hello(SECRET, hello, challenge.nonce)))
    ack = decode(recv_message(sock), MiB)
    assert isinstance(ack, HelloAck) and ack.accepted, ack
    assert auth.verify_hello(SECRET, ack.hello, nonce)
    return Session(SECRET, prefill_nonce=challenge.nonce, decode_nonce=nonce, role="decode")


class TapProxy:
    """A TCP relay on 127.0.0.1 that records every byte crossing it, in both directions, and can play
    an on-path attacker: ``rewrite=(old, new)`` swaps equal-length byte strings in transit."""

    def __init__(self, upstream: str, rewrite: tuple[bytes, bytes] | None = None):
        self._rewrite = rewrite
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            upstream = socket.create_connection(self._upstream, timeout=1.0)
            t = threading.Thread(target=self._relay, args=(client, upstream), daemon=True)
            self._threads.append(t)
            t.start()

    def _relay(self, a: socket.socket, b: socket.socket):
        peer = {a: b, b: a}
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.05)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    with self._lock:
                        self.captured += data
                    if self._rewrite is not None:
                        data = data.replace(*self._rewrite)
                    peer[s].sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def close(self):
        self._stop.set()
        for t in self._threads:
            t.join(1.0)
        self._listener.close()


# --- codec ---------------------------------------------------------------------------------------------

_ints64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_text = st.text(max_size=12)
_scalars = st.none() | st.booleans() | _ints64 | st.floats(allow_nan=False) | _text | st.binary(max_size=12)


def _plain(depth: int):
    if depth == 0:
        return _scalars
    inner = _plain(depth - 1)
    return _scalars | st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3)


_layouts = st.builds(
    KVLayout,
    num_layers=st.integers(2, 128), num_draft_layers=st.integers(0, 1), block_size=st.integers(1, 512),
    num_kv_heads=st.integers(1, 64), head_dim=st.integers(1, 512), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
)
_hellos = st.builds(
    Hello,
    worker_id=st.text(min_size=1, max_size=12), role=st.sampled_from(ROLES), layout=_layouts,
    model_fingerprint=_text, transport=_text, transport_descriptor=st.dictionaries(_text, _plain(3), max_size=4),
    nonce=st.binary(max_size=40), hmac=st.binary(max_size=40), protocol_version=_ints64,
)
MESSAGE_STRATEGIES = {
    "Challenge": st.builds(Challenge, nonce=st.binary(max_size=40)),
    "Hello": _hellos,
    "HelloAck": st.builds(HelloAck, accepted=st.booleans(), reason=_text, hello=_hellos),
    "TransferRequest": st.builds(
        TransferRequest, request_id=_text, dst_block_ids=st.lists(st.integers(0, 2**64 - 1), max_size=50),
        num_tokens=st.integers(0, 2**63), deadline_unix_s=st.floats(allow_nan=False),
    ),
    "FirstToken": st.builds(FirstToken, request_id=_text, token_id=_ints64),
    "TransferDone": st.builds(
        TransferDone, request_id=_text, ok=st.booleans(), error=_text, num_tokens=st.integers(0, 2**63),
        first_token_id=_ints64, draft_token_ids=st.lists(_ints64, max_size=8),
    ),
    "AbortTransfer": st.builds(AbortTransfer, request_id=_text, reason=_text),
    "Heartbeat": st.builds(Heartbeat, worker_id=_text, seq=st.integers(0, 2**64 - 1), time=st.floats(allow_nan=False)),
}
# No example database: CI runs stay independent and nothing is written into the repository.
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.timeout(10)
def test_every_message_type_has_a_round_trip_strategy():
    assert set(MESSAGE_STRATEGIES) == set(MESSAGE_TYPES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("type_name", sorted(MESSAGE_STRATEGIES))
@given(data=st.data())
@FUZZ
def test_encode_decode_round_trips(type_name, data):
    msg = data.draw(MESSAGE_STRATEGIES[type_name])
    assert decode(encode(msg), MiB) == msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("type_name", sorted(MESSAGE_STRATEGIES))
@given(data=st.data())
@FUZZ
def test_wire_map_is_the_records_fields_as_asdict_gives_them(type_name, data):
    """to_wire (what encode packs and the Hello proof covers) builds the map itself instead of
    dataclasses.asdict's deep copy: the same map for every message, nested records included."""
    msg = data.draw(MESSAGE_STRATEGIES[type_name])
    assert to_wire(msg) == dataclasses.asdict(msg)


def _decodes_or_protocol_error(data) -> None:
    try:
        msg = decode(data, MiB)
    except ProtocolError:
        return
    assert type(msg).__name__ in MESSAGE_TYPES


@pytest.mark.timeout(60)
@given(st.binary(max_size=300))
@FUZZ
def test_decode_random_bytes_only_raises_protocol_error(data):
    _decodes_or_protocol_error(data)


_any_msgpack = st.recursive(
    st.none() | st.booleans() | _ints64 | st.floats() | _text | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text | st.binary(max_size=4) | _ints64, inner, max_size=4),
    max_leaves=25,
)


@pytest.mark.timeout(60)
@given(_any_msgpack)
@FUZZ
def test_decode_random_msgpack_only_raises_protocol_error(value):
    _decodes_or_protocol_error(msgpack.packb(value, use_bin_type=True))


def _field_names(cls):
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.timeout(60)
@given(st.data())
@FUZZ
def test_decode_envelopes_with_random_bodies_only_raises_protocol_error(data):
    """Well-formed envelopes whose bodies have the right field names but random values, gaps and extras."""
    name = data.draw(st.sampled_from(sorted(MESSAGE_TYPES) + ["NoSuchType"]))
    names = _field_names(MESSAGE_TYPES.get(name, Challenge))
    small = st.recursive(_scalars | st.floats(), lambda inner: st.lists(inner, max_size=3), max_leaves=4)
    layout_like = st.fixed_dictionaries({n: small for n in _field_names(KVLayout)})
    value = small | layout_like | st.just(dataclasses.asdict(LAYOUT))
    body = {n: data.draw(value) for n in names if data.draw(st.integers(0, 9)) > 0}
    if data.draw(st.booleans()):
        body[data.draw(_text)] = data.draw(value)
    version = data.draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 2, 0, True, "1", None]))
    _decodes_or_protocol_error(msgpack.packb({"v": version, "t": name, "b": body}, use_bin_type=True))


@pytest.mark.timeout(60)
@given(st.data())
@FUZZ
def test_decode_mutated_valid_messages_only_raises_protocol_error(data):
    wire = bytearray(encode(data.draw(st.one_of(*MESSAGE_STRATEGIES.values()))))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            wire[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del wire[i:]
        else:
            wire[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        if not wire:
            break
    _decodes_or_protocol_error(bytes(wire))


def _envelope(t="TransferRequest", v=PROTOCOL_VERSION, **body):
    fields = dict(request_id="r1", dst_block_ids=[1, 2], num_tokens=20, deadline_unix_s=1.0)
    fields.update(body)
    return msgpack.packb({"v": v, "t": t, "b": {k: x for k, x in fields.items() if x is not ...}}, use_bin_type=True)


_HELLO_FIELDS = dataclasses.asdict(
    Hello(worker_id="d0", role="decode", layout=LAYOUT, model_fingerprint="fp", transport="tcp",
          transport_descriptor={}, nonce=b"n", hmac=b"h")
)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "data, expected",
    [
        (b"x" * 101, "message too big: 101 bytes > max_size 100"),
        (b"\xc1garbage", "not msgpack"),
        (encode(AbortTransfer("r1", "stop"))[:-2], "not msgpack"),
        (msgpack.packb([1, 2, 3]), "envelope must be a map"),
        (msgpack.packb({"v": 1, "t": "Heartbeat"}), "envelope: missing key 'b'"),
        (_envelope(v=2), "wrong protocol version 2: this side speaks version 1"),
        (_envelope(t="Nope"), "unknown message type 'Nope'"),
        (_envelope(num_tokens=...), "TransferRequest: missing field 'num_tokens'"),
        (_envelope(bogus=1), "TransferRequest: unexpected field 'bogus'"),
        (_envelope(dst_block_ids=[1, "7"]), "TransferRequest.dst_block_ids[1]: expected int, got str '7'"),
        (_envelope(num_tokens=True), "TransferRequest.num_tokens: expected int, got bool"),
        (_envelope(deadline_unix_s="soon"), "TransferRequest.deadline_unix_s: expected float, got str"),
        (_envelope(dst_block_ids=[3, -1]), "TransferRequest.dst_block_ids: block ids must be >= 0, got -1"),
        (
            msgpack.packb({"v": 1, "t": "Hello", "b": {**_HELLO_FIELDS, "layout": {**_HELLO_FIELDS["layout"], "block_size": "16"}}}),
            "Hello.layout.block_size: expected int, got str '16'",
        ),
        (
            msgpack.packb({"v": 1, "t": "Hello", "b": {**_HELLO_FIELDS, "transport_descriptor": {"a": {b"k": 1}}}}),
            "Hello.transport_descriptor['a']: map keys must be str, got bytes",
        ),
        (msgpack.packb({"v": 1, "t": "Hello", "b": {**_HELLO_FIELDS, "role": "router"}}), "Hello.role: must be one of"),
    ],
)
def test_decode_errors_say_what_was_wrong(data, expected):
    with pytest.raises(ProtocolError) as info:
        decode(data, 100 if expected.startswith("message too big") else MiB)
    assert expected in str(info.value)


@pytest.mark.timeout(10)
def test_decode_non_bytes_and_version_error_type():
    with pytest.raises(ProtocolError, match="expected bytes"):
        decode(None, MiB)  # type: ignore[arg-type]
    with pytest.raises(VersionError) as info:
        decode(_envelope(v=7), MiB)
    assert info.value.peer_version == 7


@pytest.mark.timeout(10)
def test_construction_and_encode_validate_fields():
    with pytest.raises(ProtocolError, match=r"TransferRequest.dst_block_ids\[0\]: expected int, got str"):
        TransferRequest("r", ["0"], 1, 0.0)  # type: ignore[list-item]
    with pytest.raises(ProtocolError, match="num_draft_layers: must be in"):
        dataclasses.replace(LAYOUT, num_draft_layers=5)
    request = TransferRequest("r", [0, 1], 1, 0.0)
    request.dst_block_ids.append("2")  # lists inside a frozen message are still mutable
    with pytest.raises(ProtocolError, match=r"dst_block_ids\[2\]"):
        encode(request)


@pytest.mark.timeout(10)
def test_layout_diff_and_check_compatible_name_the_field_and_both_values():
    other = dataclasses.replace(LAYOUT, block_size=32, dtype="float16")
    assert LAYOUT.diff(other) == ["block_size", "dtype"]
    assert LAYOUT.diff(LAYOUT) == []
    local = Hello("p0", "prefill", LAYOUT, "fp-a", "tcp", {}, b"", b"")
    peer = Hello("d0", "decode", other, "fp-b", "tcp", {}, b"", b"", protocol_version=2)
    with pytest.raises(HandshakeError) as info:
        check_compatible(local, peer)
    text = str(info.value)
    for part in (
        "protocol_version differs: prefill 'p0' has 1, decode 'd0' has 2",
        "layout.block_size differs: prefill 'p0' has 16, decode 'd0' has 32",
        "layout.dtype differs: prefill 'p0' has 'bfloat16', decode 'd0' has 'float16'",
        "model_fingerprint differs: prefill 'p0' has 'fp-a', decode 'd0' has 'fp-b'",
    ):
        assert part in text
    check_compatible(local, dataclasses.replace(peer, layout=LAYOUT, model_fingerprint="fp-a", protocol_version=1))
    with pytest.raises(HandshakeError, match="both workers are 'prefill'"):
        check_compatible(local, dataclasses.replace(local, worker_id="p1"))


@pytest.mark.timeout(10)
def test_auth_proof_binds_secret_nonce_and_fields():
    hello = Hello("d0", "decode", LAYOUT, "fp", "tcp", {"b": 1, "a": [1, {"y": 2, "x": 3}]}, auth.new_nonce(), b"")
    nonce = auth.new_nonce()
    signed = auth.sign_hello(SECRET, hello, nonce)
    assert auth.verify_hello(SECRET, signed, nonce)
    # Key order in the descriptor does not matter (canonical form)...
    reordered = dataclasses.replace(signed, transport_descriptor={"a": [1, {"x": 3, "y": 2}], "b": 1})
    assert auth.verify_hello(SECRET, reordered, nonce)
    # ...but the secret, the verifier's nonce and every field do.
    assert not auth.verify_hello(b"other", signed, nonce)
    assert not auth.verify_hello(SECRET, signed, auth.new_nonce())
    assert not auth.verify_hello(SECRET, dataclasses.replace(signed, layout=dataclasses.replace(LAYOUT, block_size=8)), nonce)
    assert SECRET not in signed.hmac and SECRET not in auth.canonical_bytes(hello, nonce)
    # str and bytes secrets are the same key; no secret on both sides still verifies, on one side it does not.
    assert auth.normalize_secret(SECRET.decode()) == SECRET
    empty = auth.sign_hello(auth.normalize_secret(None), hello, nonce)
    assert auth.verify_hello(b"", empty, nonce)
    assert not auth.verify_hello(SECRET, empty, nonce)


# --- handshake over real sockets -------------------------------------------------------------------------


@pytest.mark.timeout(15)
def test_handshake_succeeds_and_messages_flow(endpoints):
    prefill = endpoints(PrefillEndpoint, config("p0", transport_descriptor={"host": "127.0.0.1", "port": 5555}))
    decode_ep = endpoints(DecodeEndpoint, config("d0", transport_descriptor={"shm": "/pd-d0"}))
    assert prefill.address.startswith("tcp://127.0.0.1:")

    peer = decode_ep.connect(prefill.address)
    assert peer.worker_id == "p0" and peer.role == "prefill" and peer.layout == LAYOUT
    assert peer.transport_descriptor == {"host": "127.0.0.1", "port": 5555}
    wait_until(lambda: "d0" in prefill.peers(), 2.0, "the prefill side to register d0")
    assert prefill.peers()["d0"].transport_descriptor == {"shm": "/pd-d0"}

    request = TransferRequest("req-1", [3, 4, 9], num_tokens=40, deadline_unix_s=time.time() + 5)
    decode_ep.send("p0", request)
    assert prefill.poll(2.0) == [("d0", request)]
    done = TransferDone("req-1", ok=True, error="", num_tokens=40, first_token_id=42, draft_token_ids=[7, 8])
    prefill.send("d0", done)
    assert decode_ep.poll(2.0) == [("p0", done)]
    decode_ep.send("p0", AbortTransfer("req-2", "client disconnected"))
    assert prefill.poll(2.0) == [("d0", AbortTransfer("req-2", "client disconnected"))]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"layout": dataclasses.replace(LAYOUT, block_size=32)}, "layout.block_size differs: prefill 'p0' has 16, decode 'd0' has 32"),
        ({"layout": dataclasses.replace(LAYOUT, num_layers=4)}, "layout.num_layers differs: prefill 'p0' has 5, decode 'd0' has 4"),
        ({"layout": dataclasses.replace(LAYOUT, tensor_parallel_size=2)},
         "layout.tensor_parallel_size differs: prefill 'p0' has 1, decode 'd0' has 2"),
        ({"model_fingerprint": "llama-8b@ffff"}, "model_fingerprint differs: prefill 'p0' has 'smollm2-135m@abc123', decode 'd0' has 'llama-8b@ffff'"),
        ({"secret": b"not-the-cluster-secret"}, "authentication failed: decode 'd0' did not prove knowledge of the cluster secret"),
        ({"secret": None}, "authentication failed"),
    ],
    ids=["block_size", "num_layers", "tensor_parallel_size", "model_fingerprint", "wrong_secret", "no_secret"],
)
def test_incompatible_or_unauthenticated_peer_is_refused(endpoints, caplog, overrides, expected):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    prefill = endpoints(PrefillEndpoint, config("p0"))
    decode_ep = endpoints(DecodeEndpoint, config("d0", **overrides))
    start = time.monotonic()
    with pytest.raises(HandshakeError) as info:
        decode_ep.connect(prefill.address, timeout_s=3.0)
    assert time.monotonic() - start < 2.0  # the refusal arrives; the caller did not wait for the timeout
    assert expected in str(info.value) and "refused the handshake" in str(info.value)
    wait_until(lambda: f"refused the handshake of decode 'd0'" in caplog.text, 2.0, "the prefill side's log")
    assert expected in caplog.text
    assert prefill.peers() == {} and decode_ep.peers() == {}


@pytest.mark.timeout(20)
def test_workers_of_different_numerics_pair_with_a_warning_on_both_sides(endpoints, caplog):
    """An AMX machine and an avx512_bf16 one (kernels/numerics.py) compute the same values, not the same bits: they
    pair (nothing is refused), and each side says why a split request will not match a colocated one."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    prefill = endpoints(PrefillEndpoint, config("p0", numerics="cpu bfloat16 amx"))
    decode_ep = endpoints(DecodeEndpoint, config("d0", numerics="cpu bfloat16 avx512_bf16"))
    assert decode_ep.connect(prefill.address).numerics == "cpu bfloat16 amx"
    wait_until(lambda: "d0" in prefill.peers(), 2.0, "the prefill side to register d0")
    assert prefill.peers()["d0"].numerics == "cpu bfloat16 avx512_bf16"
    wait_until(lambda: caplog.text.count("not bitwise equal to a colocated run") == 2, 2.0, "both sides' warnings")
    assert "decode 'd0' computes with 'cpu bfloat16 avx512_bf16', prefill 'p0' with 'cpu bfloat16 amx'" in caplog.text
    assert "prefill 'p0' computes with 'cpu bfloat16 amx', decode 'd0' with 'cpu bfloat16 avx512_bf16'" in caplog.text


@pytest.mark.timeout(20)
def test_workers_of_the_same_numerics_pair_without_a_warning(endpoints, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    prefill = endpoints(PrefillEndpoint, config("p0", numerics="cpu bfloat16 amx"))
    decode_ep = endpoints(DecodeEndpoint, config("d0", numerics="cpu bfloat16 amx"))
    decode_ep.connect(prefill.address)
    wait_until(lambda: "d0" in prefill.peers(), 2.0, "the prefill side to register d0")
    assert "bitwise" not in caplog.text


@pytest.mark.timeout(15)
def test_no_secret_on_either_side_still_connects(endpoints):
    prefill = endpoints(PrefillEndpoint, config("p0", secret=None))
    decode_ep = endpoints(DecodeEndpoint, config("d0", secret=""))
    assert decode_ep.connect(prefill.address).worker_id == "p0"


@pytest.mark.timeout(20)
def test_messages_after_the_handshake_cannot_be_forged_on_the_path(endpoints):
    """An on-path attacker rewrites bytes of an established connection (here: which request a
    TransferDone completes). The session seal makes the decode side drop the altered message instead
    of acting on it; untouched messages keep flowing, so the connection survives the attempt."""
    prefill = endpoints(PrefillEndpoint, config("p0"))
    tap = TapProxy(prefill.address, rewrite=(b"victim-0001", b"forged-0001"))
    try:
        decode_ep = endpoints(DecodeEndpoint, config("d0"))
        decode_ep.connect(tap.address)
        prefill.send("d0", TransferDone("victim-0001", True, "", 16, 11, [12]))
        prefill.send("d0", TransferDone("honest-0002", True, "", 16, 21, [22]))
        got = []
        wait_until(lambda: got.extend(decode_ep.poll(0.05)) or got, 5.0, "the untouched TransferDone")
        got += decode_ep.poll(0.3)
        assert b"forged-0001" not in bytes(tap.captured)  # the capture is taken before the rewrite
        assert [m.request_id for _, m in got] == ["honest-0002"], got
        assert decode_ep.num_rejected == 1
        # The other direction is sealed too.
        tap._rewrite = (b"victim-0003", b"forged-0003")
        decode_ep.send("p0", AbortTransfer("victim-0003", "client left"))
        decode_ep.send("p0", AbortTransfer("honest-0004", "client left"))
        got = []
        wait_until(lambda: got.extend(prefill.poll(0.05)) or got, 5.0, "the untouched AbortTransfer")
        got += prefill.poll(0.3)
        assert [m.request_id for _, m in got] == ["honest-0004"] and prefill.num_rejected == 1
    finally:
        tap.close()


@pytest.mark.timeout(15)
def test_secret_never_crosses_the_wire(endpoints):
    """Every byte between the two endpoints is recorded by a TCP relay: a good and a refused handshake."""
    prefill = endpoints(PrefillEndpoint, config("p0"))
    tap = TapProxy(prefill.address)
    try:
        good = endpoints(DecodeEndpoint, config("d0"))
        good.connect(tap.address)
        good.send("p0", TransferRequest("r", [1], 1, 0.0))
        assert prefill.poll(2.0)
        wrong = b"wrong-secret-" + os.urandom(8).hex().encode()
        bad = endpoints(DecodeEndpoint, config("d1", secret=wrong))
        with pytest.raises(HandshakeError, match="authentication failed"):
            bad.connect(tap.address)
        wire = bytes(tap.captured)
    finally:
        tap.close()
    assert b"Hello" in wire and b"HelloAck" in wire and b"d1" in wire  # the capture saw both handshakes
    for secret in (SECRET, wrong):
        assert secret not in wire
        assert secret.hex().encode() not in wire


def _connect_error(endpoint, address):
    try:
        endpoint.connect(address, timeout_s=3.0)
    except HandshakeError as exc:
        return exc
    return None


def _decode_connecting_to_fake_listener(endpoints, zctx):
    """A raw ROUTER posing as a prefill listener, and decode endpoint "d0" connecting to it from a thread.
    Returns (the ROUTER, the endpoint, the started thread, a dict that gets the HandshakeError or None
    under "error")."""
    fake = zctx.socket(zmq.ROUTER)
    fake.linger = 0
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    decode_ep = endpoints(DecodeEndpoint, config("d0"))
    result = {}
    t = threading.Thread(target=lambda: result.update(error=_connect_error(decode_ep, f"tcp://127.0.0.1:{port}")))
    t.start()
    return fake, decode_ep, t, result


@pytest.mark.timeout(15)
def test_decode_side_refuses_a_prefill_peer_that_cannot_prove_the_secret(endpoints, zctx):
    """Mutual authentication, against a raw ROUTER posing as a prefill worker; it sees no secret either."""
    fake, decode_ep, t, result = _decode_connecting_to_fake_listener(endpoints, zctx)
    received = []
    route, payload = fake.recv_multipart() if fake.poll(2000) else pytest.fail("no Challenge")
    received.append(payload)
    challenge = decode(payload, MiB)
    my_nonce = auth.new_nonce()
    fake.send_multipart([route, encode(Challenge(nonce=my_nonce))])
    assert fake.poll(2000)
    route, payload = fake.recv_multipart()
    received.append(payload)
    hello = decode(payload, MiB)
    assert isinstance(hello, Hello) and auth.verify_hello(SECRET, hello, my_nonce)
    impostor = Hello("p-fake", "prefill", LAYOUT, "smollm2-135m@abc123", "tcp", {}, my_nonce, b"")
    impostor = auth.sign_hello(b"guessed-secret", impostor, challenge.nonce)
    fake.send_multipart([route, encode(HelloAck(accepted=True, reason="", hello=impostor))])
    t.join(5.0)
    assert "authentication failed: prefill 'p-fake' did not prove knowledge" in str(result["error"])
    assert decode_ep.peers() == {}
    assert all(SECRET not in p for p in received)


@pytest.mark.timeout(15)
def test_replayed_or_nonce_swapped_hello_is_refused(endpoints, zctx):
    """A recorded Hello is useless on a new connection, and a Hello must carry its own Challenge's nonce."""
    prefill = endpoints(PrefillEndpoint, config("p0"))
    recorder = raw_dealer(zctx, prefill.address)
    nonce = auth.new_nonce()
    recorder.send(encode(Challenge(nonce=nonce)))
    challenge = decode(recv_message(recorder), MiB)
    hello = Hello("d0", "decode", LAYOUT, "smollm2-135m@abc123", "tcp", {}, nonce, b"")
    recorded = auth.sign_hello(SECRET, hello, challenge.nonce)  # what an eavesdropper would capture

    replayer = raw_dealer(zctx, prefill.address)
    replayer.send(encode(Challenge(nonce=nonce)))
    recv_message(replayer)  # a fresh listener nonce, which the recording did not sign
    replayer.send(encode(recorded))
    ack = decode(recv_message(replayer), MiB)
    assert not ack.accepted and "authentication failed" in ack.reason

    swapper = raw_dealer(zctx, prefill.address)  # holds the secret, but signs a nonce it did not announce
    swapper.send(encode(Challenge(nonce=auth.new_nonce())))
    fresh = decode(recv_message(swapper), MiB)
    swapper.send(encode(auth.sign_hello(SECRET, hello, fresh.nonce)))
    ack = decode(recv_message(swapper), MiB)
    assert not ack.accepted and "nonce is not the one it sent in its Challenge" in ack.reason
    assert prefill.peers() == {}


@pytest.mark.timeout(15)
def test_protocol_version_mismatch_is_refused_with_both_versions(endpoints, zctx, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    prefill = endpoints(PrefillEndpoint, config("p0"))
    sock = raw_dealer(zctx, prefill.address)
    sock.send(msgpack.packb({"v": 2, "t": "Challenge", "b": {"nonce": auth.new_nonce()}}))
    ack = decode(recv_message(sock), MiB)
    assert isinstance(ack, HelloAck) and not ack.accepted
    assert "protocol version mismatch: prefill endpoint 'p0' speaks version 1, the peer sent version 2" in ack.reason
    assert ack.hello.transport_descriptor == {}  # a stranger learns nothing about the data plane
    wait_until(lambda: "protocol version mismatch" in caplog.text, 2.0, "the refusal in the log")

    # The other direction: a listener that answers in version 2.
    fake, _, t, result = _decode_connecting_to_fake_listener(endpoints, zctx)
    assert fake.poll(2000)
    route, _ = fake.recv_multipart()
    fake.send_multipart([route, msgpack.packb({"v": 2, "t": "Challenge", "b": {"nonce": auth.new_nonce()}})])
    t.join(5.0)
    assert "protocol version mismatch: decode endpoint 'd0' speaks version 1" in str(result["error"])
    assert "sent version 2" in str(result["error"])


@pytest.mark.timeout(15)
def test_connect_times_out_when_nobody_answers(endpoints, zctx):
    silent = zctx.socket(zmq.ROUTER)  # accepts the TCP connection, never answers
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    decode_ep = endpoints(DecodeEndpoint, config("d0"))
    start = time.monotonic()
    with pytest.raises(HandshakeError, match=r"no handshake with tcp://127.0.0.1:\d+ within 0.5 s"):
        decode_ep.connect(f"tcp://127.0.0.1:{port}", timeout_s=0.5)
    assert time.monotonic() - start < 1.5
    assert decode_ep.peers() == {}


# --- hostile input ---------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_garbage_is_dropped_and_logged_while_a_real_exchange_completes(endpoints, zctx, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    limit = 4096
    # A long peer timeout: the hand-driven insider sends no heartbeats, and must not be dropped for that.
    prefill = endpoints(PrefillEndpoint, config("p0", max_message_bytes=limit, peer_timeout_s=30.0))
    decode_ep = endpoints(DecodeEndpoint, config("d0", max_message_bytes=limit))
    decode_ep.connect(prefill.address)
    first = TransferRequest("req-1", list(range(8)), 128, time.time() + 10)
    decode_ep.send("p0", first)  # in flight while the garbage arrives

    stranger = raw_dealer(zctx, prefill.address)  # never handshakes
    insider = raw_dealer(zctx, prefill.address)  # handshakes properly, then misbehaves
    session = raw_handshake(insider, "d-raw")
    garbage = [
        (b"\x00\xffnot msgpack at all", "not msgpack"),
        (encode(first)[:-5], "not msgpack"),
        (msgpack.packb([1, {"x": b"y"}, None]), "envelope must be a map"),
        (msgpack.packb({"v": 1, "t": "Reboot", "b": {}}), "unknown message type 'Reboot'"),
        (_envelope(num_tokens=...), "missing field 'num_tokens'"),
        (_envelope(dst_block_ids="all"), "expected list of int"),
        (msgpack.packb({"v": 1, "t": "Heartbeat", "b": {"pad": b"x" * limit}}), f"bytes > max_size {limit}"),
    ]
    for payload, _ in garbage:
        stranger.send(payload)
        insider.send(session.seal(payload))  # authenticated garbage reaches the decoder
    insider.send(encode(TransferRequest("unsealed", [0], 1, 0.0)))  # valid, but not sealed
    stranger.send(encode(TransferRequest("sneaky", [0], 1, 0.0)))  # valid, but no handshake
    stranger.send_multipart([b"two", b"frames"])
    stranger.send(b"z" * (4 * limit))  # over zmq's MAXMSGSIZE: libzmq cuts that connection itself
    second = TransferRequest("req-2", [9], 16, time.time() + 10)
    decode_ep.send("p0", second)

    got = []
    wait_until(lambda: got.extend(prefill.poll(0.05)) or len(got) >= 2, 5.0, "both real requests")
    assert got == [("d0", first), ("d0", second)]
    for request in (first, second):
        prefill.send("d0", TransferDone(request.request_id, True, "", request.num_tokens, 11, [12, 13]))
    replies = []
    wait_until(lambda: replies.extend(decode_ep.poll(0.05)) or len(replies) >= 2, 5.0, "both TransferDone")
    assert [m.request_id for _, m in replies] == ["req-1", "req-2"]

    def logged():
        lines = [r.getMessage() for r in list(caplog.records)]
        expected = [(f"dropped a message from {who}", reason)
                    for who in ("unauthenticated connection", "decode peer 'd-raw'") for _, reason in garbage]
        expected += [("dropped TransferRequest from unauthenticated connection", "has not completed the handshake"),
                     ("dropped a 2-frame message from unauthenticated connection", "expected exactly one payload frame"),
                     ("dropped a message from decode peer 'd-raw'", "bad seal")]
        return all(any(a in line and b in line for line in lines) for a, b in expected)

    wait_until(logged, 5.0, "a warning for every dropped message")
    assert prefill.poll(0.2) == []  # nothing from the garbage was delivered
    # The frame over zmq's MAXMSGSIZE (2x the limit) never reached the decoder: libzmq refused it.
    assert not any(f"{4 * limit} bytes" in r.getMessage() for r in list(caplog.records))
    assert set(prefill.peers()) == {"d0", "d-raw"}  # the misbehaving insider is dropped message by message, not cut off
    # Still serving after all that.
    decode_ep.send("p0", AbortTransfer("req-3", "done"))
    assert prefill.poll(2.0) == [("d0", AbortTransfer("req-3", "done"))]


@pytest.mark.timeout(15)
def test_send_refuses_unknown_peers_oversized_and_internal_messages(endpoints):
    prefill = endpoints(PrefillEndpoint, config("p0", max_message_bytes=1024))
    with pytest.raises(PeerNotConnectedError, match="no connected peer 'd9'"):
        prefill.send("d9", AbortTransfer("r", "x"))
    decode_ep = endpoints(DecodeEndpoint, config("d0", max_message_bytes=1024))
    decode_ep.connect(prefill.address)
    with pytest.raises(ProtocolError, match="over max_message_bytes 1024"):
        decode_ep.send("p0", TransferRequest("r", list(range(1000)), 1, 0.0))
    with pytest.raises(ValueError, match="sent by the endpoint itself"):
        decode_ep.send("p0", Heartbeat("d0", 0, 0.0))


@pytest.mark.timeout(15)
def test_close_is_prompt_and_final(endpoints):
    prefill = endpoints(PrefillEndpoint, config("p0"))
    decode_ep = endpoints(DecodeEndpoint, config("d0"))
    decode_ep.connect(prefill.address)
    for ep in (decode_ep, prefill):
        start = time.monotonic()
        ep.close()
        assert time.monotonic() - start < 1.0
        assert not [t for t in threading.enumerate() if t.name == f"kv-control-{ep.role}-{ep.worker_id}"]
        with pytest.raises(RuntimeError, match="is closed"):
            ep.send("x", AbortTransfer("r", "x"))
        ep.close()  # idempotent


# --- heartbeats and peer death ---------------------------------------------------------------------------

CHILD = r"""
import json, sys, time
from pdcluster.kv_transfer.control_plane import DecodeEndpoint, EndpointConfig, PrefillEndpoint
from pdcluster.kv_transfer.protocol import KVLayout
role, worker_id, address, secret, layout, interval, timeout = sys.argv[1:]
cfg = EndpointConfig(worker_id=worker_id, layout=KVLayout(**json.loads(layout)), model_fingerprint="smollm2-135m@abc123",
                     secret=secret.encode(), heartbeat_interval_s=float(interval), peer_timeout_s=float(timeout))
if role == "prefill":
    ep = PrefillEndpoint(cfg)
    print(ep.address, flush=True)
else:
    ep = DecodeEndpoint(cfg)
    ep.connect(address)
    print("connected", flush=True)
time.sleep(60)
"""


def spawn(role: str, worker_id: str, address: str, interval: float, timeout: float) -> subprocess.Popen:
    args = [role, worker_id, address, SECRET.decode(), json.dumps(dataclasses.asdict(LAYOUT)), str(interval), str(timeout)]
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"child printed nothing in {timeout_s} s (exit code {proc.poll()})"
    return proc.stdout.readline().strip()


@pytest.mark.timeout(30)
def test_sigkilled_decode_process_is_declared_dead_in_time(endpoints):
    """Default timings (0.5 s heartbeats, 2.5 s timeout): alive while heartbeating, dead <= timeout + 1 s after SIGKILL."""
    prefill = endpoints(PrefillEndpoint, config("p0"))
    cfg = prefill.config
    child = spawn("decode", "d-child", prefill.address, cfg.heartbeat_interval_s, cfg.peer_timeout_s)
    try:
        assert read_line(child, 15.0) == "connected"
        wait_until(lambda: "d-child" in prefill.peers(), 2.0, "the child to register")
        time.sleep(cfg.peer_timeout_s + 0.5)  # idle longer than the timeout: heartbeats keep it alive
        assert "d-child" in prefill.peers() and prefill.dead_peers() == set()
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: "d-child" in prefill.dead_peers(), cfg.peer_timeout_s + 1.0, "d-child declared dead")
        elapsed = time.monotonic() - killed
    finally:
        child.kill()
        child.wait()
    # Never before the timeout counted from its last possible heartbeat.
    assert elapsed >= cfg.peer_timeout_s - cfg.heartbeat_interval_s - 0.05
    assert "d-child" not in prefill.peers()
    with pytest.raises(PeerNotConnectedError, match="dead: \\['d-child'\\]"):
        prefill.send("d-child", AbortTransfer("r", "x"))


@pytest.mark.timeout(30)
def test_sigkilled_prefill_process_is_reported_to_on_peer_dead(endpoints):
    interval, timeout = 0.2, 1.0
    child = spawn("prefill", "p-child", "", interval, timeout)
    dead = []
    try:
        address = read_line(child, 15.0)
        decode_ep = endpoints(DecodeEndpoint, config("d0", heartbeat_interval_s=interval, peer_timeout_s=timeout),
                              on_peer_dead=dead.append)
        assert decode_ep.connect(address).worker_id == "p-child"
        time.sleep(timeout + 0.3)
        assert dead == [] and "p-child" in decode_ep.peers()
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: dead == ["p-child"], timeout + 1.0, "on_peer_dead('p-child')")
        assert time.monotonic() - killed >= timeout - interval - 0.05
    finally:
        child.kill()
        child.wait()
    assert decode_ep.dead_peers() == {"p-child"} and decode_ep.peers() == {}


@pytest.mark.timeout(30)
def test_prefill_frozen_past_the_timeout_is_lost_until_connected_again_and_a_left_peer_is_not(endpoints):
    """Guards the control-plane half of re-wiring a frozen prefill worker (issue 16): SIGSTOPped past the
    peer timeout, it is dropped and reported by ``lost_peers`` (what the decode worker's ping tells the
    router); after SIGCONT the same process accepts a new handshake, which clears it. A peer left on
    request (``disconnect``: drain) is dead but not lost, so the router does not re-wire it."""
    interval, timeout = 0.2, 1.0
    child = spawn("prefill", "p-child", "", interval, timeout)
    try:
        address = read_line(child, 15.0)
        decode_ep = endpoints(DecodeEndpoint, config("d0", heartbeat_interval_s=interval, peer_timeout_s=timeout))
        assert decode_ep.connect(address).worker_id == "p-child"
        os.kill(child.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: decode_ep.lost_peers() == {"p-child"}, timeout + 2.0, "the frozen peer lost")
            assert decode_ep.peers() == {}
        finally:
            os.kill(child.pid, signal.SIGCONT)
        time.sleep(timeout)  # resumed, same process: nothing reconnects by itself
        assert decode_ep.lost_peers() == {"p-child"} and decode_ep.peers() == {}
        assert decode_ep.connect(address).worker_id == "p-child"  # what the router's re-wiring does
        assert decode_ep.lost_peers() == set() and "p-child" in decode_ep.peers()
        time.sleep(timeout + 0.3)
        assert "p-child" in decode_ep.peers(), "the re-wired pair must stay up (heartbeats both ways)"
        assert decode_ep.disconnect("p-child")
        wait_until(lambda: decode_ep.dead_peers() == {"p-child"}, 2.0, "the peer left")
        assert decode_ep.lost_peers() == set()
    finally:
        child.kill()
        child.wait()
