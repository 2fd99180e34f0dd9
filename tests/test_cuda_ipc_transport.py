"""The cuda_ipc transport (kv_transfer/transports/cuda_ipc/): the prefill side writes straight into
the decode side's cache, mapped through a handle torch's own reduction made.

On CPU (every run) the receiver's cache is shared memory named by a file, and the handle is rebuilt
in another process: the same code as on a GPU except the CUDA driver calls. Real processes and real
sockets throughout: a decode worker here and a prefill worker in a spawned process give the tokens
of a single engine; a sender process frozen mid-transfer keeps the revoked blocks quarantined until it
confirms, and its death releases them; malformed handles are refused and logged. The gpu-marked tests
run the same on CUDA tensors (skipped without CUDA).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import signal
import time

import msgpack
import numpy as np
import pytest
import torch

from conftest import engine_config, make_engine
from transport_helpers import ALL_LAYERS, NUM_BLOCKS, NUM_LAYERS, SHAPE, as_bytes, assert_landed, fill, wait_sent
from transport_helpers import check_revoke_waits_for_a_frozen_sender, serve_sends, wait_until
from pdcluster.kv_transfer.transports import TransportConfig, get_transport_class
from pdcluster.kv_transfer.transports.common.layout import KVLayout
from pdcluster.kv_transfer.transports.cuda_ipc import transport as cuda_ipc
from pdcluster.kv_transfer.transports.cuda_ipc.handle import (
    HandleError,
    export_handle,
    open_handle,
    shared_cpu_cache,
)
from pdcluster.kv_transfer.transports.cuda_ipc.transport import CudaIpcTransport

CTX = mp.get_context("spawn")
HAS_CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.timeout(120)


def config(**kw) -> TransportConfig:
    base = dict(timeout_s=5.0, chunk_bytes=16 << 10, max_inflight_chunks=2, secret="s3cret")
    base.update(kw)
    return TransportConfig(**base)


def receiver_cache(device: str, seed: int) -> torch.Tensor:
    cache = CudaIpcTransport.allocate_kv_cache(SHAPE, torch.float32, device)
    fill(cache, seed)
    return cache


# ------------------------------------------------------------------ a sender in its own process


def sender_child(conn, desc: dict, device: str) -> None:
    """Sender in its own process: pushes what the parent asks for into the parent's cache; reports
    its cache's bytes once so the parent can check what landed."""
    cache = torch.empty(SHAPE, dtype=torch.float32, device=device)
    fill(cache, 3)
    t = CudaIpcTransport(cache, "sender", config(max_inflight_chunks=1))
    t.connect("d0", desc)
    conn.send(("connected", as_bytes(cache).cpu().numpy().tobytes()))
    serve_sends(t, conn)


def run_sender_process_checks(device: str) -> None:
    """Blocks land byte-equal from another process; then, per ending: a sender frozen (SIGSTOP)
    mid-transfer keeps a revoked transfer's blocks quarantined (revoke False, nothing in
    poll_revoked) until it confirms after SIGCONT, and nothing of the transfer lands after; a sender
    killed while frozen releases them through its closed connection."""
    rx_cache = receiver_cache(device, 1)
    rx = CudaIpcTransport(rx_cache, "receiver", config())
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=sender_child, args=(child, rx.local_descriptor(), device), daemon=True)
    proc.start()
    try:
        assert parent.poll(90), "sender process did not start"
        kind, tx_bytes = parent.recv()
        assert kind == "connected"
        tx_cache = torch.frombuffer(bytearray(tx_bytes), dtype=torch.uint8).view(NUM_LAYERS, 2, NUM_BLOCKS, -1)

        # 1. Bytes move, and only into the granted blocks.
        before = as_bytes(rx_cache).cpu().clone()
        src, dst = np.array([1, 2, 3, 9, 17]), np.array([5, 6, 7, 40, 63])
        rx.expect("moved", dst)
        parent.send(("moved", src, dst, 1))
        assert parent.recv() == ("sending", "moved")
        kind, (done, failed) = parent.recv()
        assert done == {"moved"} and not failed, (done, failed)
        rx.complete("moved")
        want = before.view(NUM_LAYERS, 2, NUM_BLOCKS, -1).clone()
        want[:, :, dst] = tx_cache[:, :, src]
        assert torch.equal(as_bytes(rx_cache).cpu().view(NUM_LAYERS, 2, NUM_BLOCKS, -1), want)
        assert rx.poll_received() == [("moved", ALL_LAYERS)]

        # 2. Revoke under a frozen sender: quarantined until it confirms or dies.
        check_revoke_waits_for_a_frozen_sender(rx, rx_cache, parent, proc, frozen_s=0.3, device=device)
    finally:
        proc.kill()
        proc.join(10)
        rx.close()


def test_sender_process_moves_blocks_and_honours_revokes_cpu():
    run_sender_process_checks("cpu")


# ------------------------------------------------------------------ handles


def _handle_of(cache: torch.Tensor) -> dict:
    return msgpack.unpackb(msgpack.packb(export_handle(cache)))  # what the WELCOME carries


def _mutations(good: dict) -> dict[str, dict]:
    """Malformed variants of a valid CPU handle, each with what the refusal must mention."""

    def edit(fn):
        h = msgpack.unpackb(msgpack.packb(good))
        fn(h)
        return h

    storage = lambda h: h["tensor"]["args"][1]["args"][0]  # noqa: E731 - rebuild_storage_filename's node
    return {
        "not allowed": edit(lambda h: h["tensor"].update(fn="posix.system")),
        "not allowed here": edit(lambda h: h["tensor"]["args"][1].update(fn="rebuild_cuda_tensor")),
        "class": edit(lambda h: h["tensor"]["args"].__setitem__(0, {"class": "Parameter"})),
        "takes 3 arguments": edit(lambda h: h["tensor"]["args"].append(1)),
        "unknown dtype": edit(lambda h: h["tensor"]["args"][1]["args"].__setitem__(1, {"dtype": "Tensor"})),
        "shared memory name": edit(lambda h: storage(h)["args"].__setitem__(2, b"/../../etc/passwd")),
        "shm manager socket": edit(lambda h: storage(h)["args"].__setitem__(1, b"/etc/passwd")),
        "requires_grad": edit(lambda h: h["tensor"]["args"][2].__setitem__(3, True)),
        "non-negative int": edit(lambda h: h["tensor"]["args"][2].__setitem__(0, -4)),
        "sizes": edit(lambda h: h["tensor"]["args"][2].__setitem__(1, "big")),
        "version": edit(lambda h: h.update(version=2)),
        "cannot be rebuilt": edit(lambda h: h.update(device="cuda")),
        "a map": [1, 2, 3],
        # Well formed, but the segment does not exist: torch's open fails, and says so.
        "cannot open": edit(lambda h: storage(h)["args"].__setitem__(2, b"/torch_1_2_3")),
    }


def test_malformed_handles_are_refused():
    cache = shared_cpu_cache(SHAPE, torch.float32)
    layout = KVLayout.of(cache)
    good = _handle_of(cache)
    for must_say, handle in _mutations(good).items():
        with pytest.raises(HandleError, match=must_say):
            open_handle(handle, layout)
    # A handle of another tensor than the announced cache: rebuilt, then refused.
    other = shared_cpu_cache((2, 2, 8, 16, 2, 16), torch.float32)
    with pytest.raises(HandleError, match="announced"):
        open_handle(_handle_of(other), layout)
    # The good one opens onto the same memory.
    mapped = open_handle(good, layout)
    cache.view(torch.uint8)[0, 0, 5] = 7
    assert int(mapped.view(torch.uint8)[0, 0, 5].max()) == 7
    # A plain CPU tensor has no such handle: a receiver must use allocate_kv_cache.
    with pytest.raises(ValueError, match="allocate_kv_cache"):
        CudaIpcTransport(torch.zeros(SHAPE), "receiver", config())


def test_sender_refuses_a_malformed_handle_and_logs_it(monkeypatch, caplog):
    rx_cache = receiver_cache("cpu", 1)
    rx = CudaIpcTransport(rx_cache, "receiver", config())
    before = as_bytes(rx_cache).clone()
    real = cuda_ipc.export_handle

    def tampered(tensor):
        handle = real(tensor)
        handle["tensor"]["fn"] = "builtins.eval"
        return handle

    txs = []
    try:
        caplog.set_level(logging.WARNING, logger="pdcluster.kv_transfer.transports.cuda_ipc.transport")
        monkeypatch.setattr(cuda_ipc, "export_handle", tampered)
        txs.append(CudaIpcTransport(torch.zeros(SHAPE), "sender", config()))
        with pytest.raises(ConnectionError, match="refused the cache handle of d0"):
            txs[-1].connect("d0", rx.local_descriptor())
        assert any("refused the cache handle of d0" in r.getMessage() for r in caplog.records), caplog.text
        # The receiver goes on serving honest senders.
        monkeypatch.setattr(cuda_ipc, "export_handle", real)
        tx_cache = torch.empty(SHAPE)
        fill(tx_cache, 2)
        txs.append(CudaIpcTransport(tx_cache, "sender", config()))
        txs[-1].connect("d0", rx.local_descriptor())
        rx.expect("t", [10, 11])
        txs[-1].send("d0", "t", ALL_LAYERS, np.array([1, 2]), np.array([10, 11]))
        assert wait_sent(txs[-1], {"t"}, 10.0) == ({"t"}, {})
        assert_landed(rx_cache, before, tx_cache, [1, 2], [10, 11])
    finally:
        for t in txs:
            t.close()
        rx.close()


def test_refuses_another_host_and_another_device_kind():
    rx = CudaIpcTransport(receiver_cache("cpu", 1), "receiver", config())
    tx = CudaIpcTransport(torch.zeros(SHAPE), "sender", config())
    try:
        desc = rx.local_descriptor()
        with pytest.raises(ConnectionError, match="another host") as info:
            tx.connect("d0", {**desc, "boot_id": "not-this-boot"})
        assert "\n" not in str(info.value) and "nccl, ucx or tcp" in str(info.value)
        with pytest.raises(ConnectionError, match="both caches must be on CUDA"):
            tx.connect("d0", {**desc, "device": "cuda"})
    finally:
        tx.close()
        rx.close()


def test_registered_where_transports_are_chosen():
    from pdcluster.cluster.serve_cli import TRANSPORTS

    assert get_transport_class("cuda_ipc") is CudaIpcTransport
    assert "cuda_ipc" in TRANSPORTS


# ------------------------------------------------------------------ workers: prefill in its own process

NUM_KV_BLOCKS = 128
_engine_config = functools.partial(
    engine_config, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=1536, prefill_chunk_size=16
)


def prefill_child(conn) -> None:
    """A prefill worker on cuda_ipc in its own process (decode workers reach it over the control plane)."""
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.prefill_node.worker import PrefillWorker

    p = PrefillWorker("p-child", _engine_config(prefill_chunk_size=8), TransferConfig(transport="cuda_ipc", secret="k"))
    conn.send(p.address)
    time.sleep(600)


@pytest.fixture(scope="module")
def prefill_process():
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=prefill_child, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "prefill process did not start"
        yield parent.recv(), proc
    finally:
        proc.kill()
        proc.join(10)


@pytest.fixture
def decode_worker():
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.kv_transfer.config import TransferConfig

    from test_kv_transfer_e2e import Events

    d = DecodeWorker("d0", _engine_config(), TransferConfig(transport="cuda_ipc", secret="k"))
    d.on_event = events = Events()
    yield d, events
    d.close()


def _free_blocks_within(worker, timeout_s: float) -> bool:
    return wait_until(lambda: worker.stats()["num_free_blocks"] == NUM_KV_BLOCKS, timeout_s)


@pytest.mark.timeout(240)
def test_prefill_process_and_decode_worker_tokens_equal_colocated(tiny_dir, prefill_process, decode_worker):
    from pdcluster.engine.sampling_params import SamplingParams
    from test_kv_transfer_e2e import _collect_tokens

    address, _ = prefill_process
    d, events = decode_worker
    prompts = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 16, 17, 45, 100])]
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    expected = [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_KV_BLOCKS).generate(prompts, params)]
    assert d.connect_prefill(address) == "p-child"
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        d.submit(rid, prompt, params, "p-child")
    tokens = _collect_tokens(events, ids)
    assert [tokens[rid] for rid in ids] == expected
    assert _free_blocks_within(d, 5.0), d.stats()
    kv_ready = [e for e in events.items if type(e).__name__ == "KVReady"]
    assert kv_ready and all(e.transport == "cuda_ipc" and e.num_bytes > 0 for e in kv_ready), kv_ready


@pytest.mark.timeout(240)
def test_prefill_process_killed_mid_transfer_decode_reclaims_blocks(tiny_dir, prefill_process, decode_worker):
    """The prefill worker dies while it writes into the decode worker's cache: the request fails,
    and every reserved block comes back (once nothing can write it: the sender's socket closed)."""
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.node.events import ADMITTED, Admission, Failed

    address, proc = prefill_process
    d, events = decode_worker
    assert d.connect_prefill(address) == "p-child"
    time.sleep(0.2)
    d.submit("victim", list(range(1, 1201)), SamplingParams(max_tokens=4), "p-child")
    admission = events.wait_for(lambda e: isinstance(e, Admission), 30)
    assert admission is not None and admission.verdict == ADMITTED, admission
    assert d.stats()["num_free_blocks"] < NUM_KV_BLOCKS
    time.sleep(0.05)  # prefill under way
    os.kill(proc.pid, signal.SIGKILL)
    failed = events.wait_for(lambda e: isinstance(e, Failed) and e.request_id == "victim", 10)
    assert failed is not None, "the decode side never reported the request failed"
    assert _free_blocks_within(d, 5.0), d.stats()
    st = d.stats()
    assert st["num_reserved"] == 0 and st["num_quarantined"] == 0, st


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_sender_process_moves_blocks_and_honours_revokes_cuda():
    run_sender_process_checks("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_in_one_process_and_the_handle_names_the_gpu():
    """Both ends in one process (a process cannot open its own IPC handle: the exported tensor is
    found instead), the handle names the GPU by UUID, and the bytes land on the device."""
    rx_cache = receiver_cache("cuda", 1)
    handle = export_handle(rx_cache)
    assert handle["device"] == "cuda" and handle["tensor"]["fn"] == "rebuild_cuda_tensor"
    assert handle["gpu_uuid"] == str(torch.cuda.get_device_properties(0).uuid)
    tx_cache = torch.empty(SHAPE, device="cuda")
    fill(tx_cache, 2)
    rx = CudaIpcTransport(rx_cache, "receiver", config())
    tx = CudaIpcTransport(tx_cache, "sender", config())
    try:
        tx.connect("d0", rx.local_descriptor())
        rx.expect("t", [5, 6, 7])
        tx.send("d0", "t", ALL_LAYERS, np.array([1, 2, 3]), np.array([5, 6, 7]))
        assert wait_sent(tx, {"t"}, 10.0) == ({"t"}, {})
        assert torch.equal(as_bytes(rx_cache)[:, :, [5, 6, 7]], as_bytes(tx_cache)[:, :, [1, 2, 3]])
    finally:
        tx.close()
        rx.close()
