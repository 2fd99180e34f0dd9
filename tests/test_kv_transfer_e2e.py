"""KV transfer between real prefill and decode workers on 127.0.0.1: token-exact against a single
engine for every transport, and no stranded blocks when either side dies mid-transfer."""

import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from conftest import engine_config, make_engine, slow_params, usable_transports
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.transports import available_transports
from pdcluster.node.events import ADMITTED, Admission, Failed, Tokens, expand

TRANSPORTS = usable_transports()
NUM_BLOCKS = 128

_engine_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=1536, prefill_chunk_size=16)


class Events:
    def __init__(self):
        self.items = []
        self.lock = threading.Lock()

    def __call__(self, event):
        with self.lock:
            self.items.extend(expand(event))  # a step's StepTokens as its requests' Tokens

    def wait_for(self, pred, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                hits = [e for e in self.items if pred(e)]
            if hits:
                return hits[0]
            time.sleep(0.01)
        return None


def _collect_tokens(events, request_ids, timeout_s=60):
    tokens = {rid: [] for rid in request_ids}
    done = set()
    deadline = time.monotonic() + timeout_s
    seen = 0
    while len(done) < len(request_ids) and time.monotonic() < deadline:
        with events.lock:
            new, seen = events.items[seen:], len(events.items)
        for e in new:  # the decode worker's one stream: the first token, then every decode step
            if isinstance(e, Tokens):
                tokens[e.request_id].extend(e.new_token_ids)
                if e.finished:
                    done.add(e.request_id)
            elif isinstance(e, Failed) or (isinstance(e, Admission) and e.verdict != ADMITTED):
                raise AssertionError(f"request {e.request_id} failed: {e}")
        time.sleep(0.01)
    assert len(done) == len(request_ids), f"only {sorted(done)} finished within {timeout_s}s"
    return tokens


def _wait_free(worker, expected, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = worker.stats()
        if st["num_free_blocks"] == expected:
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{worker.worker_id}: free blocks {worker.stats()} never returned to {expected}")


def _through_pair(p, d, events: Events, prompts, params, num_blocks: int = NUM_BLOCKS) -> list[list[int]]:
    """Each prompt through the pair (D reserves, asks P for the KV, streams every token): the tokens in prompt order,
    once every block of both workers is back. ``params``: one SamplingParams for all, or one per prompt."""
    ids = [f"r{i}" for i in range(len(prompts))]
    each = params if isinstance(params, list) else [params] * len(prompts)
    for rid, prompt, prompt_params in zip(ids, prompts, each):
        d.submit(rid, prompt, prompt_params, "p0")
    tokens = _collect_tokens(events, ids)
    _wait_free(p, num_blocks, 5)
    _wait_free(d, num_blocks, 5)
    return [tokens[rid] for rid in ids]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disagg_equals_single_engine(tiny_dir, transport):
    cfg = _engine_config()
    prompts = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 16, 17, 45, 100])]
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    expected = [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(prompts, params)]
    events = Events()
    with connected_pair(cfg, TransferConfig(transport=transport, secret="s3cret"), events) as (p, d):
        assert _through_pair(p, d, events, prompts, params) == expected
        assert p.stats()["bytes_sent"] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", slow_params([t for t in ("tcp", "shm", "ucx", "nccl") if t in TRANSPORTS],
                                                  slow=("ucx", "nccl")))
def test_workers_split_over_two_ranks_move_each_ranks_kv_and_equal_single_engine(tiny_dir, transport):
    """Prefill and decode workers each split over two ranks (tensor parallelism): each rank's KV heads go from the
    prefill worker's rank to the decode worker's same rank through one transport per rank, driven as one
    (kv_transfer/transports/ranked.py); tokens equal the unsplit engine's and every block comes back. Over shm, every
    rank's caches are the transport's own shared memory on both sides, so each part copies once (push+pull)."""
    cfg = _engine_config(tensor_parallel_size=2)
    prompts = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 17, 45, 100])]
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    expected = [o.token_ids for o in make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(prompts, params)]
    events = Events()
    with connected_pair(cfg, TransferConfig(transport=transport, secret="s3cret"), events) as (p, d):
        assert [t.name for t in (p.transport, d.kv.transport)] == [f"{transport} x2 ranks"] * 2
        assert _through_pair(p, d, events, prompts, params) == expected
        one_rank = p.transport.inner.parts[0].block_layer_bytes()
        assert p.stats()["bytes_sent"] > 0 and p.transport.block_layer_bytes() == 2 * one_rank
        if transport == "shm":  # rank 0's prefill cache is plain memory (push); the others are shm's own
            assert [part.peer_mode("d0") for part in p.transport.inner.parts] == ["push", "push+pull"]


@pytest.mark.timeout(240)
def test_workers_split_over_two_ranks_in_bf16_equal_the_split_engine(tiny_dir):
    """bf16 in deterministic mode, what a CPU with AVX-512 BF16 serves by default: the disaggregated pair split over
    two ranks gives the tokens of one colocated engine split the same way (two ranks' partial sums can round differently
    from one rank's sum, so the reference is split too). The prefill side's batches differ from the colocated engine's,
    and its KV is the bf16 bytes the decode ranks then read: any difference in either shows here."""
    split_pair_equals_split_engine(_engine_config(tensor_parallel_size=2, dtype="bfloat16", deterministic=True))


def split_pair_equals_split_engine(cfg, num_blocks: int = NUM_BLOCKS, check=None) -> None:
    """Prompts through one colocated engine of ``cfg`` and through a prefill and a decode worker of ``cfg`` (shm, each
    split as ``cfg`` says), sampled with one seed: the same tokens. ``check(p, d)`` first looks at the pair."""
    prompts = [[(13 * i + 5 * j) % 450 + 4 for j in range(n)] for i, n in enumerate([5, 17, 40, 90])]
    params = SamplingParams(max_tokens=16, ignore_eos=True, seed=3)
    split = LLMEngine.from_config(cfg, progress=False)
    try:
        expected = [o.token_ids for o in split.generate(prompts, params)]
    finally:
        split.close()
    events = Events()
    with connected_pair(cfg, TransferConfig(transport="shm", secret="s3cret"), events) as (p, d):
        if check is not None:
            check(p, d)
        assert _through_pair(p, d, events, prompts, params, num_blocks) == expected


@pytest.mark.timeout(120)
def test_workers_split_over_ranks_refuse_cuda_ipc_in_one_line(tiny_dir):
    from pdcluster.prefill_node.worker import PrefillWorker

    with pytest.raises(ValueError, match="cuda_ipc moves one cache on one GPU.*tcp, shm, ucx or nccl"):
        PrefillWorker("p0", _engine_config(tensor_parallel_size=2), TransferConfig(transport="cuda_ipc"))


@contextlib.contextmanager
def connected_pair(cfg, tc: TransferConfig, events: Events, decode_cfg=None):
    """A prefill worker "p0" of ``cfg`` and a decode worker "d0" of ``decode_cfg`` (default ``cfg``; its events to
    ``events``), handshaken both ways; closed afterwards."""
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.prefill_node.worker import PrefillWorker

    p = PrefillWorker("p0", cfg, tc)
    d = DecodeWorker("d0", decode_cfg or cfg, tc)
    d.on_event = events
    try:
        assert d.connect_prefill(p.address) == "p0"
        deadline = time.monotonic() + 10
        while "d0" not in p.endpoint.peers() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield p, d
    finally:
        p.close()
        d.close()


@dataclasses.dataclass
class PairRun:
    tokens: list[list[int]]  # per prompt, in order
    request_ids: list[str]
    events: Events
    stats: tuple[dict, dict]  # the prefill and decode workers' stats once their blocks were back
    prefill_engine: object
    decode_engine: object


def run_on_pair(cfg, tc: TransferConfig, prompts, params, num_blocks: int, timeout_s: float = 120,
                decode_cfg=None) -> PairRun:
    """Every prompt through a real prefill/decode pair (``connected_pair``), its tokens collected; waits
    (bounded) for both workers' blocks to come back before taking their stats."""
    events, ids = Events(), [f"r{i}" for i in range(len(prompts))]
    with connected_pair(cfg, tc, events, decode_cfg) as (p, d):
        for rid, prompt in zip(ids, prompts):
            d.submit(rid, prompt, params, "p0")
        tokens = _collect_tokens(events, ids, timeout_s=timeout_s)
        for worker in (p, d):
            _wait_free(worker, num_blocks, 5)
        return PairRun([tokens[rid] for rid in ids], ids, events, (p.stats(), d.stats()), p.engine, d.engine)


# ---- peers killed mid-transfer --------------------------------------------------------------------

@contextlib.contextmanager
def _peer_child(survivor, target, *args):
    """``target(conn, *args)`` in a spawned daemon process, the peer that ``survivor`` (a worker) must
    outlive: yields (our end of the pipe, the process); afterwards the process is killed and the
    survivor closed."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    try:
        yield parent, proc
    finally:
        proc.kill()
        survivor.close()


def _assert_freed_within_5s(worker, killed_at: float) -> None:
    freed_at = _wait_free(worker, NUM_BLOCKS, 10)
    assert freed_at - killed_at < 5.0, f"blocks freed {freed_at - killed_at:.2f}s after the kill"


def _decode_child(conn, prefill_address, prompt_len, transport):
    """Decode worker in its own process: connect, take the request (it asks the prefill worker for
    the KV), report its admission, then idle until killed."""
    from pdcluster.decode_node.worker import DecodeWorker

    d = DecodeWorker("d-child", _engine_config(), TransferConfig(transport=transport))
    events = Events()
    d.on_event = events
    d.connect_prefill(prefill_address)
    d.submit("victim", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), "p0")
    admission = events.wait_for(lambda e: isinstance(e, Admission), 30)
    conn.send(admission.verdict if admission is not None else None)
    time.sleep(600)


def _prefill_child(conn):
    """Prefill worker in its own process, driven through a pipe."""
    from pdcluster.prefill_node.worker import PrefillWorker

    p = PrefillWorker("p-child", _engine_config(prefill_chunk_size=8), TransferConfig(transport="tcp"))
    conn.send(p.address)
    time.sleep(600)  # decode workers ask it for KV over the control plane


# tcp notices the dropped connection itself; ucx notices only by keepalive (20 s), so there the
# control-plane heartbeat is what reclaims the blocks.
@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport, reason, prefill_ranks", [("tcp", "dropped", 1), ("ucx", "stopped answering", 1),
                                                              ("tcp", "dropped", 2)])
def test_decode_killed_mid_transfer_prefill_reclaims_within_5s(tiny_dir, transport, reason, prefill_ranks, caplog):
    """The prefill worker has no one to tell (the request's owner is dead): it logs why the transfer
    failed and frees its blocks. Split two ways against a whole decode worker, the KV goes through the staging
    caches laid out the decode side's way (kv_transfer/transports/resplit.py): the same."""
    from pdcluster.prefill_node.worker import PrefillWorker

    if transport not in TRANSPORTS:
        pytest.skip(f"{transport} is not available here: {available_transports()[transport]}")
    caplog.set_level(logging.WARNING, logger="pdcluster.kv_transfer.connector")
    # Small chunks make the prefill (and so the layer-wise transfer) long enough to be cut.
    p = PrefillWorker("p0", _engine_config(prefill_chunk_size=8, tensor_parallel_size=prefill_ranks),
                      TransferConfig(transport=transport))
    with _peer_child(p, _decode_child, p.address, 1200, transport) as (parent, proc):
        assert parent.poll(120), "decode child did not start"
        assert parent.recv() == ADMITTED
        deadline = time.monotonic() + 30
        while p.stats()["bytes_sent"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.stats()["bytes_sent"] > 0, "the transfer never started"
        assert p.stats()["num_transfers"] == 1, "transfer finished before the kill"
        assert list(p.transport._splits) == ([1] if prefill_ranks > 1 else [])  # re-laid out for the whole decode
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = time.monotonic() + 10
        while "KV transfer of victim" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        failures = [r.getMessage() for r in caplog.records if "KV transfer of victim" in r.getMessage()]
        assert failures, "the prefill side never gave the transfer up"
        assert reason in failures[0], failures
        _assert_freed_within_5s(p, killed_at)
        assert p.stats()["num_held"] == 0 and p.stats()["num_transfers"] == 0


@pytest.mark.timeout(180)
def test_prefill_worker_waiting_for_acks_does_not_step(tiny_dir):
    """A prefill worker whose only work is blocks held for unacknowledged transfers runs no engine
    steps: it polls for the acks between loop turns. It used to step empty batches back to back for
    the whole transfer, a core burnt that the decode worker and the next prompt needed on a shared host.
    The receiver (a decode worker in its own process) is stopped (SIGSTOP) mid-transfer, so the prompt
    finishes and its blocks stay held with no ack coming; then it is killed and the blocks come back."""
    from pdcluster.prefill_node.worker import PrefillWorker

    # A peer timeout well past the prompt's time: on a loaded host the prompt's last chunks after the first bytes
    # took over 2.5 s (the default), the stopped receiver was declared dead first, and no wait was left to watch.
    peer_timeout_s = 15.0
    p = PrefillWorker("p0", _engine_config(prefill_chunk_size=8),
                      TransferConfig(transport="tcp", peer_timeout_s=peer_timeout_s))
    steps = [0]
    real_step = p.engine.step

    def counted_step():
        steps[0] += 1
        return real_step()

    p.engine.step = counted_step
    with _peer_child(p, _decode_child, p.address, 400, "tcp") as (parent, proc):
        assert parent.poll(120), "decode child did not start"
        assert parent.recv() == ADMITTED
        deadline = time.monotonic() + 30
        while p.stats()["bytes_sent"] == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        deadline = stopped_at + 30
        while (p.engine.has_work() or p.stats()["num_held"] == 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.stats()["num_held"] == 1 and not p.engine.has_work(), p.stats()
        assert time.monotonic() - stopped_at < peer_timeout_s - 2, "the prompt took too long: the peer timeout " \
                                                                    "would end the wait"
        before = steps[0]
        time.sleep(0.5)
        assert p.stats()["num_held"] == 1, "no ack can have come from a stopped receiver"
        assert steps[0] == before, f"{steps[0] - before} engine steps while only waiting for an ack"
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _assert_freed_within_5s(p, killed_at)


@pytest.mark.timeout(180)
def test_prefill_killed_mid_transfer_decode_frees_reserved_blocks(tiny_dir):
    from pdcluster.decode_node.worker import DecodeWorker

    events = Events()
    d = DecodeWorker("d0", _engine_config(), TransferConfig(transport="tcp"))
    d.on_event = events
    with _peer_child(d, _prefill_child) as (parent, proc):
        assert parent.poll(120), "prefill child did not start"
        assert d.connect_prefill(parent.recv()) == "p-child"
        prompt = list(range(1, 1201))
        params = SamplingParams(max_tokens=4)
        time.sleep(0.2)  # the child's heartbeats have been flowing; let the handshake settle
        d.submit("victim", prompt, params, "p-child")
        admission = events.wait_for(lambda e: isinstance(e, Admission), 30)
        assert admission is not None and admission.verdict == ADMITTED, admission
        assert d.stats()["num_free_blocks"] < NUM_BLOCKS  # the prompt's blocks are reserved
        time.sleep(0.05)  # prefill under way
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        failed = events.wait_for(lambda e: isinstance(e, Failed) and e.request_id == "victim", 10)
        assert failed is not None, "the decode side never reported the request failed"
        assert "stopped answering" in failed.reason
        _assert_freed_within_5s(d, killed_at)
        assert d.stats()["num_reserved"] == 0


@pytest.mark.timeout(120)
def test_abort_frees_both_sides(tiny_dir):
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.prefill_node.worker import PrefillWorker

    events = Events()
    tc = TransferConfig(transport="tcp")
    p = PrefillWorker("p0", _engine_config(prefill_chunk_size=8), tc)
    d = DecodeWorker("d0", _engine_config(), tc)
    d.on_event = events
    try:
        d.connect_prefill(p.address)
        prompt = list(range(1, 801))
        params = SamplingParams(max_tokens=4)
        d.submit("a", prompt, params, "p0")
        deadline = time.monotonic() + 30
        while p.stats()["num_transfers"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.stats()["num_transfers"] == 1, "the prefill worker never started the transfer"
        d.abort("a")  # the decode side gives up: tells the prefill side, which stops and frees
        _wait_free(d, NUM_BLOCKS, 5)
        _wait_free(p, NUM_BLOCKS, 5)
        assert p.stats()["num_transfers"] == 0
    finally:
        p.close()
        d.close()
