"""Late writes: a receiver lands a chunk only for a transfer it expects, only into that transfer's
blocks, and nothing of a transfer after revoking it (kv_transfer/transports/common/admission.py).

Real transports on 127.0.0.1; most pairs live in this process (independent objects with their own
sockets, UCX workers and gloo groups), the frozen-sender case runs the sender in a child process so
it can be stopped with SIGSTOP. shm is run in all four modes: push+pull (both caches shared), push
(only the receiver's), pull (only the sender's) and ring (neither). Every negative test checks the
receiving cache byte for byte, and the revoke tests fill the revoked blocks with a sentinel the moment
they may be reused and check that nothing of the transfer overwrote it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch

from transport_helpers import ALL_LAYERS, SENTINEL, SHAPE, as_bytes, assert_landed, fill, wait_sent, wait_until
from transport_helpers import check_revoke_waits_for_a_frozen_sender, serve_sends
from pdcluster.kv_transfer.transports import TransportConfig, available_transports, get_transport_class
from pdcluster.kv_transfer.transports.common.admission import Admission
from pdcluster.kv_transfer.transports.base import ShmOptions

AVAILABLE = available_transports()
# variant -> (transport, sender cache plain, receiver cache plain)
VARIANTS = {
    "tcp": ("tcp", False, False),
    "ucx": ("ucx", False, False),
    "nccl": ("nccl", False, False),
    "shm-push+pull": ("shm", False, False),
    "shm-push": ("shm", True, False),
    "shm-pull": ("shm", False, True),
    "shm-ring": ("shm", True, True),
}
PUSHING = {"shm-push+pull", "shm-push"}  # the sender writes into the receiver's memory itself


def variant_params(names=VARIANTS):
    reasons = {v: AVAILABLE[VARIANTS[v][0]] for v in names}
    return [pytest.param(v, marks=pytest.mark.skipif(r is not None, reason=str(r))) for v, r in reasons.items()]


pytestmark = pytest.mark.timeout(60)


def config(**kw) -> TransportConfig:
    base = dict(timeout_s=5.0, chunk_bytes=16 << 10, max_inflight_chunks=2, shm=ShmOptions(ring_bytes=64 << 10))
    base.update(kw)
    return TransportConfig(**base)


@pytest.fixture
def pair():
    """``pair(variant, **config) -> (rx, rx_cache, tx, tx_cache)``, connected; all closed at the end."""
    made = []

    def _pair(variant: str, **kw):
        name, tx_plain, rx_plain = VARIANTS[variant]
        cls = get_transport_class(name)

        def cache(plain: bool, seed: int) -> torch.Tensor:
            c = torch.empty(SHAPE, dtype=torch.float32) if plain else cls.allocate_kv_cache(SHAPE, torch.float32)
            fill(c, seed)
            return c

        rx_cache, tx_cache = cache(rx_plain, 1), cache(tx_plain, 2)
        rx = cls(rx_cache, "receiver", config(**kw))
        made.append(rx)
        tx = cls(tx_cache, "sender", config(**kw))
        made.append(tx)
        tx.connect("d0", rx.local_descriptor())
        if name == "shm":
            want = {"shm-push+pull": "push+pull", "shm-push": "push", "shm-pull": "pull", "shm-ring": "ring"}[variant]
            assert tx.peer_mode("d0") == want
        return rx, rx_cache, tx, tx_cache

    yield _pair
    for t in reversed(made):
        t.close()


# ------------------------------------------------------------------ every transport and shm mode


@pytest.mark.parametrize("variant", variant_params())
def test_expected_transfer_lands_byte_equal(pair, variant):
    rx, rx_cache, tx, tx_cache = pair(variant)
    before = as_bytes(rx_cache).clone()
    src, dst = [1, 2, 3, 9], [5, 6, 7, 40]
    rx.expect("t", dst)
    tx.send("d0", "t", ALL_LAYERS, np.array(src), np.array(dst))
    assert wait_sent(tx, {"t"}, 10.0) == ({"t"}, {})
    rx.complete("t")
    assert_landed(rx_cache, before, tx_cache, src, dst)
    assert rx.poll_received() == [("t", ALL_LAYERS)]
    assert rx.num_refused == 0 and rx.num_rejected == 0


@pytest.mark.parametrize("variant", variant_params())
def test_unexpected_transfer_lands_nothing(pair, variant):
    rx, rx_cache, tx, tx_cache = pair(variant)
    before = as_bytes(rx_cache).clone()
    tx.send("d0", "ghost", ALL_LAYERS, np.array([1, 2, 3]), np.array([10, 11, 12]))
    done, failed = wait_sent(tx, {"ghost"}, 10.0)
    assert "ghost" in failed and not done, (done, failed)
    assert "refused" in failed["ghost"] or "not granted" in failed["ghost"], failed
    if variant != "shm-push":  # a pushing sender refuses itself: no grant, no write
        # shm push+pull: the sender posts the pull notice first, then fails its own push for want of
        # a grant, so the send can fail before the receiver has read (and refused) that notice.
        assert wait_until(lambda: rx.num_refused > 0, 5.0), "the receiver never refused a chunk"
    assert rx.poll_received() == []
    assert torch.equal(as_bytes(rx_cache), before), "a chunk of an unexpected transfer landed"
    # The receiver goes on serving expected transfers.
    rx.expect("real", [20])
    tx.send("d0", "real", ALL_LAYERS, np.array([4]), np.array([20]))
    assert wait_sent(tx, {"real"}, 10.0) == ({"real"}, {})
    assert torch.equal(as_bytes(rx_cache)[:, :, 20], as_bytes(tx_cache)[:, :, 4])


@pytest.mark.parametrize("variant", variant_params())
def test_chunk_outside_the_expected_blocks_is_refused(pair, variant):
    # One chunk (the ring holds two): blocks 5, 6 and 8 together, all refused with the one outside.
    rx, rx_cache, tx, _ = pair(variant, chunk_bytes=1 << 20, shm=ShmOptions(ring_bytes=2 << 20))
    before = as_bytes(rx_cache).clone()
    rx.expect("t", [5, 6, 7])
    tx.send("d0", "t", ALL_LAYERS, np.array([1, 2, 3]), np.array([5, 6, 8]))
    done, failed = wait_sent(tx, {"t"}, 10.0)
    assert "t" in failed and not done, (done, failed)
    assert torch.equal(as_bytes(rx_cache), before), "a chunk naming a block outside the reservation landed"
    if variant not in PUSHING:
        assert rx.num_refused == 1
        assert "refused" in failed["t"], failed  # nccl's fixed-size ack carries a status, not the text


@pytest.mark.parametrize("variant", variant_params())
def test_nothing_lands_after_revoke(pair, variant):
    """Revoke while the sender still has hundreds of chunks queued: once revoke returned True (or,
    for a pushing sender, once poll_revoked listed the transfer), the blocks are reused (sentinel)
    and no later chunk of the transfer may touch them."""
    rx, rx_cache, tx, _ = pair(variant, max_inflight_chunks=1)
    src, dst = np.arange(32), np.arange(32, 64)
    rx.expect("big", dst)
    for _ in range(20):  # 20 sends x 32 one-block chunks
        tx.send("d0", "big", ALL_LAYERS, src, dst)
    assert wait_until(lambda: rx.poll_received() != [], 10.0), "the first send never landed"
    safe = rx.revoke("big")
    if variant in PUSHING:
        assert safe is False, "a live pushing sender may still write: revoke must not report it safe"
        assert wait_until(lambda: rx.poll_revoked() == ["big"], 5.0), "the sender never confirmed"
    else:
        assert safe is True
        assert rx.poll_revoked() == []
    as_bytes(rx_cache)[:, :, dst] = SENTINEL  # the blocks now belong to someone else
    done, failed = wait_sent(tx, {"big"}, 15.0)
    assert "big" in failed and not done, f"the transfer was not cut short by the revoke: {done, failed}"
    # A sender that never hears of the abort (a partitioned prefill) sends its next layers anyway.
    tx.send("d0", "big", ALL_LAYERS, src, dst)
    done, failed = wait_sent(tx, {"big"}, 15.0)
    assert "big" in failed and not done, (done, failed)
    time.sleep(0.05)  # let anything still on its way arrive
    assert bool((as_bytes(rx_cache)[:, :, dst] == SENTINEL).all()), "a chunk landed after the revoke"


# ------------------------------------------------------------------ shm push: a frozen sender


def frozen_sender_child(conn, desc) -> None:
    """Sender in its own process: pushes transfer after transfer into the parent's cache until told."""
    cls = get_transport_class("shm")
    cache = cls.allocate_kv_cache(SHAPE, torch.float32)
    fill(cache, 3)
    t = cls(cache, "sender", config(max_inflight_chunks=1))
    t.connect("d0", desc)
    conn.send("connected")
    serve_sends(t, conn)


@pytest.mark.timeout(120)
@pytest.mark.skipif(AVAILABLE["shm"] is not None, reason=str(AVAILABLE["shm"]))
def test_shm_revoke_waits_for_a_frozen_pushing_sender():
    """A sender frozen mid-transfer (SIGSTOP) may resume and finish the copy it was in: its blocks
    stay quarantined (revoke False, nothing in poll_revoked) until it confirms after SIGCONT; one
    that dies while frozen releases them through its closed connection."""
    cls = get_transport_class("shm")
    rx_cache = cls.allocate_kv_cache(SHAPE, torch.float32)
    fill(rx_cache, 1)
    rx = cls(rx_cache, "receiver", config())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=frozen_sender_child, args=(child, rx.local_descriptor()), daemon=True)
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "connected"
        check_revoke_waits_for_a_frozen_sender(rx, rx_cache, parent, proc, frozen_s=0.5,
                                               refusals=("not granted", "not expected"))
    finally:
        proc.kill()
        proc.join(10)
        rx.close()


# ------------------------------------------------------------------ pieces


def test_admission_gives_a_block_to_one_transfer_at_a_time():
    a = Admission(8, owner="test receiver")
    a.expect("x", [1, 2])
    with pytest.raises(ValueError, match="still writable by transfer 'x'"):
        a.expect("y", [2, 3])
    a.expect("x", [3])  # the same transfer may grow
    with a.gate("x", np.array([1, 3])) as refusal:
        assert refusal is None
    assert a.check("x", np.array([1, 4])) is not None  # outside its blocks
    assert a.check("y", np.array([5])) is not None  # never expected
    assert a.revoke("x") is True and a.revoke("x") is False
    assert a.check("x", np.array([1])) is not None  # revoked
    a.expect("y", [2, 3])  # the blocks are free again
    assert a.num_refused == 3


def test_revoke_waits_for_the_scatter_in_progress():
    a = Admission(8, owner="test receiver")
    a.expect("x", [1])
    inside, revoked = threading.Event(), threading.Event()

    def scatter():
        with a.gate("x", np.array([1])) as refusal:
            assert refusal is None
            inside.set()
            time.sleep(0.2)
            assert not revoked.is_set(), "revoke returned while a chunk of the transfer was being scattered"

    t = threading.Thread(target=scatter)
    t.start()
    assert inside.wait(5)
    a.revoke("x")
    revoked.set()
    t.join()


# ------------------------------------------------------------------ decode worker


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", [n for n, r in AVAILABLE.items() if r is None])
def test_decode_abort_mid_transfer_reused_blocks_stay_intact(tiny_dir, transport, caplog):
    """The decode side aborts a request mid-transfer while the prefill never hears of it (a control
    plane partition: its AbortTransfer handler is cut off) and keeps sending every layer. The blocks
    are reused the moment the decode worker frees them (sentinel): no late chunk may overwrite them,
    the prefill's transfer fails on the refusal (it logs why: its requester is the decode worker, which
    has moved on), and every block comes back on both sides."""
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.prefill_node.worker import PrefillWorker

    num_blocks = 128
    caplog.set_level(logging.WARNING, logger="pdcluster.kv_transfer.connector")

    def engine_config(**kw):
        return EngineConfig(model="tiny-random", num_kv_blocks=num_blocks, max_model_len=1536, **kw)

    tc = TransferConfig(transport=transport, secret="s3cret")
    p = PrefillWorker("p0", engine_config(prefill_chunk_size=8), tc)
    d = DecodeWorker("d0", engine_config(prefill_chunk_size=16), tc)
    try:
        assert d.connect_prefill(p.address) == "p0"
        assert wait_until(lambda: "d0" in p.endpoint.peers(), 10.0)
        p.connector.handle_message = lambda peer_id, msg: None  # the partition: aborts never arrive
        prompt = list(range(1, 801))
        params = SamplingParams(max_tokens=4)
        d.submit("a", prompt, params, "p0")  # the decode worker reserves and asks for the KV
        assert wait_until(lambda: p.stats()["bytes_sent"] > 0, 30.0), "the transfer never started"
        blocks = list(p.connector.tasks["a"].dst_block_ids)  # the decode worker's reserved blocks
        assert d.stats()["num_free_blocks"] <= num_blocks - len(blocks)
        d.abort("a")
        # Freed at once, or once a pushing sender confirmed the revoke.
        assert wait_until(lambda: d.stats()["num_free_blocks"] == num_blocks, 10.0), d.stats()
        kv = d.engine.kv_cache.view(torch.uint8)
        kv[:, :, blocks] = SENTINEL  # reused by another request
        assert wait_until(lambda: p.stats()["num_transfers"] == 0, 30.0), "the prefill never gave up"

        def prefill_failure():
            return next((r.getMessage() for r in caplog.records if "KV transfer of a to d0 failed" in r.getMessage()),
                        None)

        assert wait_until(lambda: prefill_failure() is not None, 10.0), "the prefill's transfer did not fail"
        reason = prefill_failure()
        assert "refused" in reason or "not granted" in reason, reason
        assert wait_until(lambda: p.stats()["num_free_blocks"] == num_blocks, 10.0), p.stats()
        time.sleep(0.1)
        assert bool((kv[:, :, blocks] == SENTINEL).all()), "a late chunk overwrote a freed block"
        st = d.stats()
        assert st["num_free_blocks"] == num_blocks and st["num_reserved"] == 0 and st["num_quarantined"] == 0, st
    finally:
        p.close()
        d.close()
