"""KV data-plane transports between real processes on 127.0.0.1.

Every available transport moves several requests at once, layer by layer, with random source and
destination blocks, between processes that each own their cache; the destination blocks must end up
byte-equal to the source blocks and every other block untouched. A peer killed mid-session must turn
into an error in poll_sent, never a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from conftest import slow_params
from transport_helpers import wait_sent
from pdcluster.kv_transfer.transports import (
    TransportConfig,
    available_transports,
    get_transport_class,
    transport_names,
)
from pdcluster.kv_transfer.transports.base import ShmOptions
from pdcluster.kv_transfer.transports.common.block_copy import (blocks_view, copy_blocks, gather_rows, rows_view,
                                                              scatter_rows)
from pdcluster.kv_transfer.transports.common.layout import KVLayout
from pdcluster.kv_transfer.transports.common.tracking import ReceiveTracker, SendTracker
from pdcluster.kv_transfer.transports.shm.ring import RingAllocator
from pdcluster.kernels.reference import gather_blocks, scatter_blocks

CTX = mp.get_context("spawn")
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 4, 64, 16, 2, 16
SHAPE = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
WAIT_S = 30.0  # generous bound for one phase in a child; tests fail rather than hang past it

# Small chunks and a small shm ring, so a request spans several chunks and the ring wraps.
# Receivers admit every transfer: these tests are about moving bytes; admission (expect/revoke) is
# tested in test_late_writes.py.
TEST_CONFIG = dict(
    timeout_s=10.0, chunk_bytes=8 << 10, max_inflight_chunks=4, shm=ShmOptions(ring_bytes=64 << 10), admit_unexpected=True
)

AVAILABLE = available_transports()
TRANSPORTS = [
    pytest.param(n, marks=pytest.mark.skipif(AVAILABLE[n] is not None, reason=str(AVAILABLE[n])))
    for n in transport_names()
]


def pattern(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A cache full of seed-determined bytes (any dtype; compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(SHAPE, dtype=dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    return t


def new_cache(cls, seed: int, dtype: torch.dtype, plain: bool = False) -> torch.Tensor:
    """``plain``: ordinary memory instead of the transport's allocate_kv_cache (shm ring mode)."""
    cache = torch.empty(SHAPE, dtype=dtype) if plain else cls.allocate_kv_cache(SHAPE, dtype)
    cache.copy_(pattern(seed, dtype))
    return cache


@dataclass
class Send:
    peer: str
    transfer_id: str
    layers: list[int]
    src: np.ndarray
    dst: np.ndarray


@dataclass
class Request:
    sender: int
    receiver: str
    transfer_id: str
    src: np.ndarray
    dst: np.ndarray
    sends: list[Send] = field(default_factory=list)


def make_requests(num_senders: int, receivers: list[str], per_pair: int, seed: int) -> list[Request]:
    """Random blocks; destination blocks disjoint per receiver; the first request of each sender goes
    in one send of all layers, the others layer by layer, interleaved across requests."""
    rng = np.random.default_rng(seed)
    free_dst = {r: list(rng.permutation(NUM_BLOCKS)) for r in receivers}
    reqs = []
    for s in range(num_senders):
        for r in receivers:
            for i in range(per_pair):
                n = int(rng.integers(1, 7))
                src = rng.choice(NUM_BLOCKS, size=n, replace=False)
                dst = np.array([free_dst[r].pop() for _ in range(n)])
                reqs.append(Request(s, r, f"req-s{s}-{r}-{i}", src, dst))
    for s in range(num_senders):
        mine = [q for q in reqs if q.sender == s]
        whole, layerwise = mine[0], mine[1:]
        whole.sends.append(Send(whole.receiver, whole.transfer_id, list(range(NUM_LAYERS)), whole.src, whole.dst))
        for layer in range(NUM_LAYERS):
            for q in layerwise:
                q.sends.append(Send(q.receiver, q.transfer_id, [layer], q.src, q.dst))
    return reqs


# ------------------------------------------------------------------ worker processes
# Spawned processes pay ~3-5 s importing torch on our shared 2 cores, so a module-wide pool of
# workers runs one role per test. A role gets its worker's result queue ``out`` and reads the
# parent's signals ("stop", "go") from its task queue ``signals``. Queues, not mp.Event: Event.set()
# blocks forever once a waiter has been killed.


def worker_loop(task_q, out_q) -> None:
    import traceback

    out_q.put(("ready",))  # torch is imported by now (this module imports it)
    while True:
        task = task_q.get()
        if task is None:
            return
        if not isinstance(task, tuple):
            continue  # a signal left over from a role that ended early
        fn, args = task
        try:
            fn(out_q, task_q, *args)
        except BaseException:  # noqa: BLE001 - report to the parent, keep serving
            out_q.put(("error", traceback.format_exc()))


class Worker:
    def __init__(self) -> None:
        self.task_q, self.out_q = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=worker_loop, args=(self.task_q, self.out_q), daemon=True)
        self.proc.start()
        self.booted = False

    def is_booted(self) -> bool:
        if not self.booted:
            try:
                self.booted = self.out_q.get_nowait() == ("ready",)
            except Exception:  # noqa: BLE001 - queue.Empty: still importing
                pass
        return self.booted

    def run(self, fn, *args) -> None:
        if not self.booted:  # several workers importing torch at once on 2 busy cores can be slow
            assert self.out_q.get(timeout=2 * WAIT_S) == ("ready",)
            self.booted = True
        while True:  # drop leftovers of an earlier, failed test
            try:
                self.out_q.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty
                break
        self.task_q.put((fn, args))

    def signal(self, what: str) -> None:
        self.task_q.put(what)

    def get(self, kind: str, timeout: float = WAIT_S + 15):
        msg = self.out_q.get(timeout=timeout)
        assert msg[0] == kind, msg
        return msg[1:]


class WorkerPool:
    def __init__(self, size: int) -> None:
        self.workers = [Worker() for _ in range(size)]

    def take(self, n: int) -> list[Worker]:
        """``n`` live workers, booted ones first (a replacement may still be importing torch)."""
        self.workers = [w if w.proc.is_alive() else Worker() for w in self.workers]
        return sorted(self.workers, key=lambda w: not w.is_booted())[:n]

    def kill(self, worker: Worker) -> None:
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.join(10)
        # Replace at once: the newcomer imports torch while the rest of this test runs.
        self.workers[self.workers.index(worker)] = Worker()

    def close(self) -> None:
        for w in self.workers:
            w.task_q.put(None)
        deadline = time.monotonic() + 2.0
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()  # e.g. a spare still importing torch


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4)  # 3 per topology test; a spare boots while a receiver gets killed
    yield p
    p.close()


def wait_signal(q) -> None:
    try:
        q.get(timeout=WAIT_S)
    except Exception:  # noqa: BLE001 - a missing signal only means: finish now
        pass


def receiver_role(out, signals, name, dtype, seed, expected, plain=False):
    cls = get_transport_class(name)
    cache = new_cache(cls, seed, dtype, plain)
    t = cls(cache, "receiver", TransportConfig(**TEST_CONFIG))
    out.put(("descriptor", t.local_descriptor()))
    layers_seen: dict[str, set[int]] = {tid: set() for tid in expected}
    deadline = time.monotonic() + WAIT_S
    while any(layers_seen[tid] != set(range(NUM_LAYERS)) for tid in expected) and time.monotonic() < deadline:
        for tid, layers in t.poll_received():
            layers_seen.setdefault(tid, set()).update(layers)
        time.sleep(0.002)
    out.put(("received", {k: sorted(v) for k, v in layers_seen.items()}, cache.view(torch.uint8).numpy().tobytes()))
    wait_signal(signals)  # stay up until the senders have their acks
    t0 = time.monotonic()
    t.close()
    out.put(("closed", time.monotonic() - t0))


def sender_role(out, signals, name, dtype, seed, peers, sends, plain=False):
    cls = get_transport_class(name)
    cache = new_cache(cls, seed, dtype, plain)
    t = cls(cache, "sender", TransportConfig(**TEST_CONFIG))
    for peer_id, desc in peers.items():
        t.connect(peer_id, desc)
    for s in sends:
        t.send(s.peer, s.transfer_id, s.layers, s.src, s.dst)
    done, failed = wait_sent(t, {s.transfer_id for s in sends}, WAIT_S)
    modes = {p: t.peer_mode(p) for p in peers} if hasattr(t, "peer_mode") else {}
    out.put(("sent", sorted(done), failed, modes))
    wait_signal(signals)
    t0 = time.monotonic()
    t.close()
    out.put(("closed", time.monotonic() - t0))


def dead_peer_sender_role(out, signals, name, desc):
    cls = get_transport_class(name)
    cache = new_cache(cls, 7, torch.float32)
    t = cls(cache, "sender", TransportConfig(**{**TEST_CONFIG, "timeout_s": 3.0}))
    t.connect("d0", desc)
    ids = np.arange(8)
    t.send("d0", "before-kill", range(NUM_LAYERS), ids, ids)
    out.put(("first", wait_sent(t, {"before-kill"}, WAIT_S)))
    wait_signal(signals)  # the parent kills the receiver, then says go
    t0 = time.monotonic()
    t.send("d0", "after-kill", range(NUM_LAYERS), ids, ids)
    # Then layer by layer, so transports that notice a broken connection late are exercised too.
    for layer in range(NUM_LAYERS):
        t.send("d0", "after-kill-2", [layer], ids, ids)
    done, failed = wait_sent(t, {"after-kill", "after-kill-2"}, WAIT_S)
    out.put(("second", done, failed, time.monotonic() - t0))
    t0 = time.monotonic()
    t.close()
    out.put(("closed", time.monotonic() - t0))


# ------------------------------------------------------------------ parent side


def run_topology(
    pool,
    name: str,
    dtype: torch.dtype,
    num_senders: int,
    receivers: list[str],
    seed: int,
    plain_senders: bool = False,
    plain_receivers: bool = False,
) -> dict[str, str]:
    """Run the transfers; check every byte. Returns the first sender's per-peer mode (shm only)."""
    reqs = make_requests(num_senders, receivers, per_pair=3, seed=seed)
    workers = pool.take(len(receivers) + num_senders)
    recv_workers = dict(zip(receivers, workers))
    send_workers = workers[len(receivers) :]
    try:
        for i, (r, w) in enumerate(recv_workers.items()):
            w.run(receiver_role, name, dtype, 100 + i, [q.transfer_id for q in reqs if q.receiver == r], plain_receivers)
        descs = {r: w.get("descriptor")[0] for r, w in recv_workers.items()}
        for s, w in enumerate(send_workers):
            sends = [x for q in reqs if q.sender == s for x in q.sends]
            # All-layer sends first, then layer 0 of every request, layer 1, ...: interleaved.
            order = sorted(sends, key=lambda x: (len(x.layers) != NUM_LAYERS, x.layers[0]))
            w.run(sender_role, name, dtype, 200 + s, descs, order, plain_senders)
        sent = [w.get("sent") for w in send_workers]
        received = {r: w.get("received") for r, w in recv_workers.items()}
    finally:
        for w in workers:
            w.signal("stop")
    close_s = [w.get("closed")[0] for w in workers]

    for s, (done, failed, _) in enumerate(sent):
        assert failed == {}, f"sender {s} failures: {failed}"
        assert set(done) == {q.transfer_id for q in reqs if q.sender == s}
    for i, r in enumerate(receivers):
        layers_seen, cache_bytes = received[r]
        mine = [q for q in reqs if q.receiver == r]
        for q in mine:
            assert layers_seen[q.transfer_id] == list(range(NUM_LAYERS)), q.transfer_id
        got = torch.frombuffer(bytearray(cache_bytes), dtype=torch.uint8).view(NUM_LAYERS, 2, NUM_BLOCKS, -1)
        want = pattern(100 + i, dtype).view(torch.uint8).view(NUM_LAYERS, 2, NUM_BLOCKS, -1).clone()
        for q in mine:
            src = pattern(200 + q.sender, dtype).view(torch.uint8).view(NUM_LAYERS, 2, NUM_BLOCKS, -1)
            want[:, :, torch.from_numpy(q.dst)] = src[:, :, torch.from_numpy(q.src)]
        touched = sorted(int(b) for q in mine for b in q.dst)
        assert torch.equal(got[:, :, touched], want[:, :, touched]), "destination blocks differ from the source"
        assert torch.equal(got, want), "blocks outside the destinations were modified"
    assert max(close_s) < 2.5, f"close() took {close_s}"
    return sent[0][2]


# ------------------------------------------------------------------ tests


def test_registry_names_and_errors():
    assert set(transport_names()) == {"ucx", "nccl", "tcp", "shm", "cuda_ipc"}
    with pytest.raises(ValueError, match="ucx, nccl, tcp, shm, cuda_ipc"):
        get_transport_class("carrier-pigeon")
    for name, reason in available_transports().items():
        assert reason is None or isinstance(reason, str), name


@pytest.mark.parametrize("num_planes", [2, 1], ids=["kv", "latent"])
def test_row_copies_match_the_reference_kernels(num_planes):
    # The data plane moves rows of bytes; the payload order must be gather_blocks' order so the
    # two agree on what "blocks [3, 9] of layers [1, 2]" means. One plane: MLA's latent cache.
    planes = lambda t: t[:, :num_planes].contiguous()  # noqa: E731
    cache = planes(pattern(5, torch.bfloat16))
    layout = KVLayout.of(cache)
    assert layout.num_planes == num_planes and layout.num_rows == NUM_LAYERS * num_planes * NUM_BLOCKS
    layers, blocks = [1, 2], np.array([9, 3, 40])
    rows = rows_view(cache, layout.block_bytes)
    out = np.empty((len(layers) * num_planes * len(blocks), layout.block_bytes), dtype=np.uint8)
    gather_rows(rows, layout.row_ids(layers, blocks), out)
    ref = gather_blocks(cache[layers], torch.from_numpy(blocks))
    assert torch.equal(torch.from_numpy(out).view(-1), ref.contiguous().view(torch.uint8).view(-1))

    dst = planes(pattern(6, torch.bfloat16))
    want = dst.clone()
    dst_blocks = np.array([0, 63, 7])
    scatter_rows(out, rows_view(dst, layout.block_bytes), layout.row_ids(layers, dst_blocks))
    sub = want[layers]
    scatter_blocks(ref, sub, torch.from_numpy(dst_blocks))
    want[layers] = sub
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))

    direct = planes(pattern(6, torch.bfloat16))
    as_blocks = lambda t: blocks_view(rows_view(t, layout.block_bytes), layout)  # noqa: E731
    copy_blocks(as_blocks(cache), blocks, as_blocks(direct), dst_blocks, layers, num_planes)
    assert torch.equal(direct.view(torch.uint8), want.view(torch.uint8))


def test_layouts_with_other_planes_do_not_pair():
    kv = KVLayout.of(pattern(5, torch.bfloat16))
    latent = KVLayout.of(pattern(5, torch.bfloat16)[:, :1].contiguous())
    assert KVLayout.from_dict(latent.to_dict()) == latent
    assert KVLayout.from_dict({k: v for k, v in kv.to_dict().items() if k != "num_planes"}) == kv  # an older peer
    with pytest.raises(ValueError, match="x 2 planes, peer bfloat16 .* x 1 planes"):
        kv.check_peer(latent)


def test_send_tracker_reports_at_poll_time_once():
    t = SendTracker()
    a1 = t.begin("a", "d0", num_chunks=2, timeout_s=10)
    t.chunk_acked(a1)
    assert t.poll() == ([], [])  # one chunk still out
    a2 = t.begin("a", "d0", num_chunks=1, timeout_s=10)  # next layer of the same transfer
    t.chunk_acked(a1)
    assert t.poll() == ([], [])  # a2 is outstanding at poll time
    t.chunk_acked(a2)
    assert t.poll() == (["a"], [])
    assert t.poll() == ([], [])  # reported once

    b = t.begin("b", "d1", 1, timeout_s=10)
    c = t.begin("c", "d1", 1, timeout_s=0.0)  # already past its deadline
    t.fail_peer("d1", "peer gone")
    t.chunk_acked(b)  # a late ack of a failed send changes nothing
    done, failed = t.poll()
    assert done == [] and sorted(failed) == [("b", "peer gone"), ("c", "peer gone")]
    assert not t.is_live(c)

    d = t.begin("d", "d0", 1, timeout_s=0.0)
    time.sleep(0.01)
    assert t.poll()[1][0][0] == "d" and not t.is_live(d)

    r = ReceiveTracker()
    r.chunk_landed("s", 0, 2, "x", [0])
    assert r.poll() == []
    r.chunk_landed("s", 0, 2, "x", [0])
    assert r.poll() == [("x", [0])]


def test_ring_allocator_never_overlaps_live_chunks():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ring, live = RingAllocator(64 * 4096), {}
        for _ in range(400):
            if live and rng.random() < 0.5:
                off = list(live)[int(rng.integers(len(live)))]
                ring.release(off)
                del live[off]
                continue
            size = int(rng.integers(1, 20 * 4096))
            off = ring.alloc(size)
            if off is None:
                continue
            assert off + size <= 64 * 4096
            assert all(off + size <= o or o + s <= off for o, s in live.items())
            live[off] = size
        for off in list(live):
            ring.release(off)
        assert ring.used_spans == 0 and ring.alloc(64 * 4096) == 0


@pytest.mark.timeout(30)
@pytest.mark.skipif(AVAILABLE["shm"] is not None, reason=str(AVAILABLE["shm"]))
def test_shm_in_one_process_leaves_nothing_in_dev_shm():
    # memfd segments have no name: nothing to unlink, nothing left behind by a crash.
    before = set(os.listdir("/dev/shm"))
    cls = get_transport_class("shm")
    rx_cache, tx_cache = new_cache(cls, 1, torch.float32), new_cache(cls, 2, torch.float32)
    rx = cls(rx_cache, "receiver", TransportConfig(**TEST_CONFIG))
    tx = cls(tx_cache, "sender", TransportConfig(**TEST_CONFIG))
    try:
        tx.connect("d0", rx.local_descriptor())  # one process may be both ends
        assert tx.peer_mode("d0") == "push+pull"
        tx.send("d0", "t", range(NUM_LAYERS), np.array([1, 2, 3]), np.array([5, 6, 7]))
        done, failed = wait_sent(tx, {"t"}, 10)
        assert done == {"t"} and not failed
        as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 - random bytes hold NaNs: compare bytes
        assert torch.equal(as_bytes(rx_cache)[:, :, [5, 6, 7]], as_bytes(tx_cache)[:, :, [1, 2, 3]])
        assert set(os.listdir("/dev/shm")) == before
        # Caller mistakes raise at once instead of failing later.
        with pytest.raises(KeyError):
            tx.send("nobody", "t2", [0], np.array([1]), np.array([1]))
        with pytest.raises(ValueError):
            tx.send("d0", "t2", [0], np.array([1]), np.array([NUM_BLOCKS]))
        with pytest.raises(ValueError):
            tx.send("d0", "t2", [NUM_LAYERS], np.array([1]), np.array([1]))
        with pytest.raises(ValueError):
            tx.send("d0", "t2", [0], np.array([1, 2]), np.array([1]))
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", TRANSPORTS)
def test_one_sender_two_receivers_float32(pool, name):
    modes = run_topology(pool, name, torch.float32, num_senders=1, receivers=["d0", "d1"], seed=1)
    if name == "shm":  # both caches from allocate_kv_cache: each side copies half
        assert set(modes.values()) == {"push+pull"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", TRANSPORTS)
def test_two_senders_one_receiver_bfloat16(pool, name):
    run_topology(pool, name, torch.bfloat16, num_senders=2, receivers=["d0"], seed=2)


@pytest.mark.timeout(90)
@pytest.mark.skipif(AVAILABLE["shm"] is not None, reason=str(AVAILABLE["shm"]))
@pytest.mark.parametrize(
    "plain_senders, plain_receivers, mode",
    [(True, True, "ring"), (True, False, "push"), (False, True, "pull")],
)
def test_shm_modes(pool, plain_senders, plain_receivers, mode):
    # The tests above build every shm cache with allocate_kv_cache (sender and receiver copy half
    # each, "push+pull"); these cover the other combinations, "ring" with a ring that wraps often.
    modes = run_topology(pool, "shm", torch.float32, 2, ["d0", "d1"], 3, plain_senders, plain_receivers)
    assert set(modes.values()) == {mode}


# ucx's (13 s) in the slow pass: a killed ucx receiver is test_ucx_peer_death.py's in the default suite.
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", slow_params(TRANSPORTS, slow=("ucx",)))
def test_killed_receiver_surfaces_error(pool, name):
    receiver, sender = pool.take(2)
    receiver.run(receiver_role, name, torch.float32, 1, ["before-kill"])
    sender.run(dead_peer_sender_role, name, receiver.get("descriptor")[0])
    try:
        ((done, failed),) = sender.get("first")
        assert done == {"before-kill"} and not failed
        receiver.get("received")
        pool.kill(receiver)
    finally:
        sender.signal("go")
    done, failed, elapsed_s = sender.get("second")
    (close_s,) = sender.get("closed")
    assert not done, f"delivered to a dead peer: {done}"
    assert set(failed) == {"after-kill", "after-kill-2"}, failed
    assert elapsed_s < 3.0 + 5.0, f"error took {elapsed_s:.1f}s"
    assert close_s < 2.5


def test_staging_pool_reuses_buffers_of_different_sizes():
    """Two cached buffers of different sizes: taking one must not compare tensors by value (that raised
    in the tcp sender's IO thread, and every transfer after it timed out)."""
    import torch

    from pdcluster.kv_transfer.transports.common.staging import BufferPool

    pool = BufferPool(torch.device("cpu"), max_cached_bytes=64 << 20)
    small, large = pool.take(1 << 20), pool.take(3 << 20)
    pool.give(small)
    pool.give(large)
    again = pool.take(2 << 20)  # only the large one fits
    assert again.numel() == 2 << 20 and again.data_ptr() == large.data_ptr()
    assert pool.take(1 << 20).data_ptr() == small.data_ptr()
