"""The KV data plane accepts only peers that prove the cluster secret (kv_transfer/transports/common/sealing.py).

Real transports on 127.0.0.1, both ends in this process (they are independent objects with their own
sockets, UCX workers and gloo groups; in-process keeps the file fast). Forgeries are made with raw
sockets, with a Sealer holding the wrong key, or with one holding the right key but sealing for
another incarnation; replays resend an exact sealed message. Every negative test checks that nothing
landed (the receiving cache byte for byte; for forged acks, the sender's delivery report) and that the
receiver keeps serving a sender that holds the secret.
"""

from __future__ import annotations

import datetime
import hmac
import socket

import msgpack
import numpy as np
import pytest
import torch

from transport_helpers import ALL_LAYERS, NUM_LAYERS, SHAPE, as_bytes, assert_landed, fill, wait_sent, wait_until
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.transports import (
    TransportConfig,
    available_transports,
    get_transport_class,
    transport_names,
)
from pdcluster.kv_transfer.transports.base import ShmOptions
from pdcluster.kv_transfer.transports.common.layout import KVLayout
from pdcluster.kv_transfer.transports.common.sealing import (
    ACK,
    DOMAIN,
    HEADER,
    HELLO,
    NONCE_BYTES,
    ReplayWindow,
    Sealer,
    new_nonce,
)
from pdcluster.kv_transfer.transports.common.wire import ChunkAck, ChunkHeader

SECRET = "the-cluster-secret"
WRONG = "not-the-cluster-secret"

AVAILABLE = available_transports()
TRANSPORTS = [
    pytest.param(n, marks=pytest.mark.skipif(AVAILABLE[n] is not None, reason=str(AVAILABLE[n])))
    for n in transport_names()
]
needs = {n: pytest.mark.skipif(AVAILABLE[n] is not None, reason=str(AVAILABLE[n])) for n in transport_names()}

pytestmark = pytest.mark.timeout(30)


def config(secret: str | None, timeout_s: float) -> TransportConfig:
    # Small chunks, so a send of several blocks is several sealed headers and acks.
    return TransportConfig(
        timeout_s=timeout_s,
        chunk_bytes=16 << 10,
        max_inflight_chunks=4,
        shm=ShmOptions(ring_bytes=64 << 10),
        secret=secret,
        admit_unexpected=True,  # admission (expect/revoke) is tested in test_late_writes.py
    )


def deliver(tx, peer_id: str, transfer_id: str, src: list[int], dst: list[int]) -> None:
    tx.send(peer_id, transfer_id, ALL_LAYERS, np.array(src), np.array(dst))
    done, failed = wait_sent(tx, {transfer_id}, 10.0)
    assert done == {transfer_id} and not failed, (done, failed)


@pytest.fixture
def make():
    """``make(name, role, seed, secret=SECRET, timeout_s=5.0) -> (transport, cache)``; all closed at the end."""
    made = []

    def _make(name, role, seed, secret=SECRET, timeout_s=5.0):
        cls = get_transport_class(name)
        cache = cls.allocate_kv_cache(SHAPE, torch.float32)
        fill(cache, seed)
        t = cls(cache, role, config(secret, timeout_s))
        made.append(t)
        return t, cache

    yield _make
    for t in reversed(made):
        t.close()


def _receiver(make, name: str):
    """A ``name`` receiver (cache seed 1), its cache, its descriptor, and the cache's bytes before anything
    lands (for assert_landed)."""
    rx, cache = make(name, "receiver", 1)
    return rx, cache, rx.local_descriptor(), as_bytes(cache).clone()


@pytest.fixture
def zctx():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


# ------------------------------------------------------------------ every transport


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_same_secret_moves_bytes(make, name, secret):
    rx, rx_cache = make(name, "receiver", 1, secret)
    tx, tx_cache = make(name, "sender", 2, secret)
    before = as_bytes(rx_cache).clone()
    tx.connect("d0", rx.local_descriptor())
    deliver(tx, "d0", "t", [1, 2, 3], [5, 6, 7])
    assert_landed(rx_cache, before, tx_cache, [1, 2, 3], [5, 6, 7])
    assert rx.num_rejected == 0 and tx.num_rejected == 0


@pytest.mark.parametrize("bad_secret", [WRONG, None], ids=["wrong-secret", "no-secret"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_wrong_secret_sender_lands_nothing(make, name, bad_secret):
    rx, rx_cache = make(name, "receiver", 1)
    before = as_bytes(rx_cache).clone()
    bad, _ = make(name, "sender", 3, bad_secret, timeout_s=1.0)
    try:
        bad.connect("d0", rx.local_descriptor())
    except ConnectionError:
        pass  # shm and nccl make the sender prove the secret before they hand out memory or a group
    else:
        bad.send("d0", "forged", ALL_LAYERS, np.array([1, 2, 3]), np.array([10, 11, 12]))
        done, failed = wait_sent(bad, {"forged"}, 4.0)
        assert "forged" in failed and "forged" not in done, (done, failed)
    assert rx.num_rejected > 0
    assert rx.poll_received() == []
    assert torch.equal(as_bytes(rx_cache), before)

    good, good_cache = make(name, "sender", 2)
    good.connect("d0", rx.local_descriptor())
    deliver(good, "d0", "honest", [4], [20])
    assert_landed(rx_cache, before, good_cache, [4], [20])


@pytest.mark.parametrize("name", TRANSPORTS)
def test_reconnect_replaces_the_link_to_a_restarted_receiver(make, name):
    rx, _ = make(name, "receiver", 1)
    tx, tx_cache = make(name, "sender", 2)
    desc = rx.local_descriptor()
    tx.connect("d0", desc)
    tx.send("d0", "t1", ALL_LAYERS, np.array([1, 2]), np.array([3, 4]))
    tx.connect("d0", dict(desc))  # the same descriptor again: nothing happens to t1
    done, failed = wait_sent(tx, {"t1"}, 10.0)
    assert done == {"t1"} and not failed, (done, failed)

    rx.close()  # the decode worker dies; Ray brings it back under the same peer id
    tx.send("d0", "t2", ALL_LAYERS, np.array([5]), np.array([6]))
    rx2, rx2_cache = make(name, "receiver", 3)
    before = as_bytes(rx2_cache).clone()
    tx.connect("d0", rx2.local_descriptor())
    tx.send("d0", "t3", ALL_LAYERS, np.array([7, 8]), np.array([9, 10]))
    done, failed = wait_sent(tx, {"t2", "t3"}, 10.0)
    assert "t2" in failed and "t2" not in done, (done, failed)
    assert "t3" in done and "t3" not in failed, (done, failed)
    assert_landed(rx2_cache, before, tx_cache, [7, 8], [9, 10])


@pytest.mark.parametrize("name", TRANSPORTS)
def test_restarted_sender_with_the_same_id_is_accepted(make, name):
    rx, rx_cache = make(name, "receiver", 1)
    before = as_bytes(rx_cache).clone()
    tx1, tx1_cache = make(name, "sender", 2)
    tx1.connect("d0", rx.local_descriptor())
    deliver(tx1, "d0", "t1", [1, 2, 3], [4, 5, 6])
    tx1.close()
    # A restarted worker: same id in its headers, counters and send numbers from the start again.
    tx2, tx2_cache = make(name, "sender", 3)
    tx2._id = tx1._id
    tx2.connect("d0", rx.local_descriptor())
    deliver(tx2, "d0", "t2", [1, 2, 3], [7, 8, 9])
    assert rx.num_rejected == 0
    want = before.clone()
    want[:, :, [4, 5, 6]] = as_bytes(tx1_cache)[:, :, [1, 2, 3]]
    assert_landed(rx_cache, want, tx2_cache, [1, 2, 3], [7, 8, 9])


# ------------------------------------------------------------------ tcp: forged, replayed, acks


def _chunk(transfer_id: str, dst: list[int], seed: int, send_seq: int = 0) -> tuple[ChunkHeader, bytes]:
    """A well-formed single-chunk header for all layers of ``dst`` and a payload of its size."""
    layout = KVLayout.of(torch.empty(SHAPE, dtype=torch.float32))
    nbytes = layout.payload_bytes(NUM_LAYERS, len(dst))
    payload = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    header = ChunkHeader("mallory", send_seq, 0, 1, transfer_id, ALL_LAYERS, np.array(dst), nbytes)
    return header, payload


def _dealer(zctx, desc):
    import zmq

    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{desc['host']}:{desc['port']}")
    return sock


def _acked(sock, peer: Sealer, rx_nonce: bytes, timeout_ms: int = 5000) -> ChunkAck | None:
    """The next ack on ``sock``, checked the way a sender checks it; None if none comes in time."""
    if not sock.poll(timeout_ms):
        return None
    opened = peer.open(sock.recv_multipart()[-1], {ACK: ChunkAck.decode}, (rx_nonce,))
    assert opened is not None, "the receiver's ack must be sealed to the sender"
    return opened.message


def _sync(sock, peer: Sealer, rx_nonce: bytes, transfer_id: str, dst: list[int]) -> None:
    """A message sealed by a holder of the secret, sent after others on the same connection: once it is
    acked, the receiver has handled (and, for forgeries, dropped without an ack) everything before."""
    header, payload = _chunk(transfer_id, dst, seed=99)
    sock.send_multipart([peer.seal(HEADER, rx_nonce, header.encode()), payload])
    ack = _acked(sock, peer, rx_nonce)
    assert ack is not None and ack.error is None and ack.send_seq == header.send_seq


@needs["tcp"]
def test_tcp_forged_headers_are_dropped(make, zctx):
    rx, rx_cache, desc, before = _receiver(make, "tcp")
    header, payload = _chunk("forged", [5, 6], seed=1)
    raw = header.encode()
    forgeries = [
        [raw, payload],  # no seal at all
        [Sealer(WRONG, "mallory").seal(HEADER, desc["nonce"], raw), payload],  # wrong secret
        [Sealer(SECRET, "old").seal(HEADER, new_nonce(), raw), payload],  # for an earlier incarnation
        [b"\x00" * 64],  # neither header nor payload
    ]
    sock = _dealer(zctx, desc)
    for frames in forgeries:
        sock.send_multipart(frames)
    honest = Sealer(SECRET, "test sender")
    _sync(sock, honest, desc["nonce"], "honest", [40])
    assert sock.poll(200) == 0, "a forged chunk was acknowledged"
    assert rx.num_rejected == len(forgeries)
    assert rx.poll_received() == [("honest", ALL_LAYERS)]
    after = as_bytes(rx_cache).clone()
    after[:, :, 40] = before[:, :, 40]
    assert torch.equal(after, before), "a forged chunk touched the cache"
    # The receiver lives on for real senders.
    tx, tx_cache = make("tcp", "sender", 2)
    tx.connect("d0", desc)
    deliver(tx, "d0", "t", [1], [2])
    assert torch.equal(as_bytes(rx_cache)[:, :, 2], as_bytes(tx_cache)[:, :, 1])


@needs["tcp"]
def test_tcp_replayed_header_is_dropped(make, zctx):
    rx, rx_cache = make("tcp", "receiver", 1)
    desc = rx.local_descriptor()
    honest = Sealer(SECRET, "test sender")
    header, first = _chunk("once", [20, 21], seed=1)
    sealed = honest.seal(HEADER, desc["nonce"], header.encode())  # what a real sender puts on the wire
    sock = _dealer(zctx, desc)
    sock.send_multipart([sealed, first])
    assert _acked(sock, honest, desc["nonce"]) is not None
    landed = as_bytes(rx_cache).clone()
    assert torch.equal(landed[:, :, [20, 21]].reshape(-1), torch.frombuffer(bytearray(first), dtype=torch.uint8))

    # The recorded header again, with other bytes behind it (payloads are not MAC'd): on the same
    # connection, then on a new one.
    _, other = _chunk("once", [20, 21], seed=2)
    sock.send_multipart([sealed, other])
    _sync(sock, honest, desc["nonce"], "sync-1", [40])
    sock2 = _dealer(zctx, desc)
    sock2.send_multipart([sealed, other])
    _sync(sock2, honest, desc["nonce"], "sync-2", [41])
    assert sock.poll(200) == 0 and sock2.poll(0) == 0, "a replay was acknowledged"
    assert rx.num_rejected == 2
    assert torch.equal(as_bytes(rx_cache)[:, :, [20, 21]], landed[:, :, [20, 21]]), "a replay touched the cache"


@pytest.fixture
def fake_receiver(zctx):
    """A ROUTER standing in for a tcp receiver whose replies the test writes: ``(socket, sealer, port)``."""
    import zmq

    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, Sealer(SECRET, "test receiver"), port


def _descriptor(sealer: Sealer, port: int) -> dict:
    layout = KVLayout.of(torch.empty(SHAPE, dtype=torch.float32))
    return {"transport": "tcp", "layout": layout.to_dict(), "host": "127.0.0.1", "port": port, "nonce": sealer.nonce}


def _receive_header(router, sealer: Sealer):
    assert router.poll(5000), "the sender sent nothing"
    identity, frame, _ = router.recv_multipart()
    opened = sealer.open(frame, {HEADER: ChunkHeader.decode})
    assert opened is not None, "the sender's header must be sealed to the receiver's nonce"
    return identity, opened


@needs["tcp"]
def test_tcp_forged_acks_do_not_complete_a_send(make, fake_receiver):
    router, receiver, port = fake_receiver
    tx, _ = make("tcp", "sender", 2)
    tx.connect("d0", _descriptor(receiver, port))
    tx.send("d0", "t", ALL_LAYERS, np.array([1]), np.array([3]))  # one block: one chunk
    identity, opened = _receive_header(router, receiver)
    ack = ChunkAck(opened.message.send_seq, opened.message.chunk_index).encode()
    mallory = Sealer(WRONG, "mallory")
    mallory.nonce = receiver.nonce  # claims to be the receiver (its nonce is in its descriptor)
    forgeries = [
        ack,  # no seal
        mallory.seal(ACK, opened.from_nonce, ack),  # wrong secret
        Sealer(SECRET, "another receiver").seal(ACK, opened.from_nonce, ack),  # not the peer of this link
        receiver.seal(ACK, new_nonce(), ack),  # for another incarnation of the sender
    ]
    for f in forgeries:
        router.send_multipart([identity, f])
    assert wait_until(lambda: tx.num_rejected == len(forgeries)), tx.num_rejected
    assert tx.poll_sent() == ([], []), "a forged ack completed the send"
    real = receiver.seal(ACK, opened.from_nonce, ack)
    router.send_multipart([identity, real])
    assert wait_sent(tx, {"t"}, 5.0) == ({"t"}, {})
    router.send_multipart([identity, real])  # the same ack again
    assert wait_until(lambda: tx.num_rejected == len(forgeries) + 1)


@needs["tcp"]
def test_tcp_reconnect_fails_the_old_links_sends_with_a_reason(make, fake_receiver):
    router, receiver, port = fake_receiver
    tx, tx_cache = make("tcp", "sender", 2)
    tx.connect("d0", _descriptor(receiver, port))
    tx.send("d0", "stuck", ALL_LAYERS, np.array([1]), np.array([3]))
    _receive_header(router, receiver)  # in flight, and this receiver never acks
    rx, rx_cache = make("tcp", "receiver", 1)
    before = as_bytes(rx_cache).clone()
    tx.connect("d0", rx.local_descriptor())
    tx.send("d0", "fresh", ALL_LAYERS, np.array([4]), np.array([5]))
    done, failed = wait_sent(tx, {"stuck", "fresh"}, 5.0)
    assert done == {"fresh"}, (done, failed)
    assert "re-connected with a new descriptor" in failed["stuck"], failed
    assert_landed(rx_cache, before, tx_cache, [4], [5])


# ------------------------------------------------------------------ shm and nccl: strangers


@needs["shm"]
def test_shm_stranger_gets_no_memory(make):
    rx, rx_cache, desc, before = _receiver(make, "shm")
    layout = KVLayout.of(rx_cache).to_dict()
    hello = {"sender_id": "mallory", "layout": layout, "ring_bytes": 0, "kv_offset": 0, "kv_bytes": 0}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5.0)
    try:
        sock.connect(b"\0" + desc["socket"].encode())
        sock.send(Sealer(WRONG, "mallory").seal(HELLO, desc["nonce"], msgpack.packb(hello)))
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
    finally:
        sock.close()
    assert (data, fds) == (b"", []), "the receiver answered a stranger (and maybe handed it its cache)"
    assert rx.num_rejected == 1
    tx, tx_cache = make("shm", "sender", 2)
    tx.connect("d0", desc)
    deliver(tx, "d0", "t", [1], [2])
    assert_landed(rx_cache, before, tx_cache, [1], [2])


@needs["nccl"]
def test_nccl_forged_bell_is_dropped(make):
    import torch.distributed as dist

    rx, rx_cache, desc, before = _receiver(make, "nccl")
    tx, tx_cache = make("nccl", "sender", 2)
    tx.connect("d0", desc)  # pair 0; its first bell will be bell0
    # Anyone who reaches the store can write into the pair's keys: a header for blocks 50, 51 where
    # the real sender's first header will go.
    client = dist.TCPStore(desc["host"], desc["port"], None, False, datetime.timedelta(seconds=5))
    store = dist.PrefixStore("pair0/", client)  # the prefix the transport uses
    header, _ = _chunk("forged", [50, 51], seed=1)
    mallory = Sealer(WRONG, "mallory")
    mallory.nonce = store.get("hello")[1 : 1 + NONCE_BYTES]  # claim to be the sender: its nonce is readable
    mallory._counter = 1000  # and a counter the sender has not used yet
    store.set("bell0", mallory.seal(HEADER, desc["nonce"], header.encode()))
    assert wait_until(lambda: rx.num_rejected == 1 and not store.check(["bell0"]))
    deliver(tx, "d0", "t", [1], [9])
    assert_landed(rx_cache, before, tx_cache, [1], [9])
    assert rx.poll_received() == [("t", ALL_LAYERS)]


# ------------------------------------------------------------------ pieces


def test_replay_window_accepts_reordering_and_rejects_repeats():
    w = ReplayWindow(size=8)
    counters = [1, 3, 2, 3, 1, 10, 9, 2, 3, 9, 100, 93, 92]
    # 2 out of order is fine; 3 and 1 again are repeats; after 10, 2 is too old to tell (8 behind)
    # and 3 is a repeat still inside the window; after 100, 93 is new but 92 is out of the window.
    want = [True, True, True, False, False, True, True, False, False, False, True, True, False]
    assert [w.accept(c) for c in counters] == want


def test_envelope_is_what_the_sealing_docstring_says():
    a, b = Sealer(SECRET, "a"), Sealer(SECRET, "b")
    env = a.seal(HEADER, b.nonce, b"body")
    assert env[:1] == HEADER and env[1:17] == a.nonce and env[17:25] == (1).to_bytes(8, "big")
    assert env[25:-16] == b"body"
    key = hmac.digest(SECRET.encode(), DOMAIN, "sha256")
    assert env[-16:] == hmac.digest(key, DOMAIN + b.nonce + env[:-16], "sha256")[:16]
    assert b.open(env, {HEADER: bytes}).message == b"body"
    assert Sealer(SECRET, "c").open(env, {HEADER: bytes}) is None  # sealed for b, not for c


@needs["tcp"]
def test_secret_reaches_the_transport_and_stays_out_of_logs(make):
    assert TransferConfig(secret="s3cret").transport_config().secret == "s3cret"
    assert "s3cret" not in repr(TransportConfig(secret="s3cret"))
    tx, tx_cache = make("tcp", "sender", 1)
    old_peer = {"transport": "tcp", "layout": KVLayout.of(tx_cache).to_dict(), "host": "127.0.0.1", "port": 1}
    with pytest.raises(ValueError, match="nonce"):  # a peer without data-plane authentication
        tx.connect("old-peer", old_peer)
