"""Small helpers the transport-level tests share: the test cache's shape, random cache contents,
byte views, bounded waits, and a pushing sender in its own process."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import torch

NUM_LAYERS, NUM_BLOCKS = 4, 64
SHAPE = (NUM_LAYERS, 2, NUM_BLOCKS, 16, 2, 16)  # 2 KiB rows: one block of all layers is 16 KiB
ALL_LAYERS = list(range(NUM_LAYERS))
SENTINEL = 0xA5  # fills blocks handed to another request: nothing of a revoked transfer may overwrite it


def fill(cache: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b = cache.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)  # random bytes hold NaNs: always compare bytes


def assert_landed(rx_cache, want_before, tx_cache, src: list[int], dst: list[int]) -> None:
    """``dst`` blocks hold the sender's ``src`` blocks; every other byte is as ``want_before``."""
    want = want_before.clone()
    want[:, :, dst] = as_bytes(tx_cache)[:, :, src]
    assert torch.equal(as_bytes(rx_cache), want)


def wait_sent(t, ids: set[str], timeout_s: float) -> tuple[set[str], dict[str, str]]:
    """Poll a sender until every id in ``ids`` is delivered or failed, or ``timeout_s`` passes."""
    done: set[str] = set()
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while ids - done - set(failed) and time.monotonic() < deadline:
        d, f = t.poll_sent()
        done.update(d)
        failed.update(dict(f))
        time.sleep(0.002)
    return done, failed


def wait_until(pred, timeout_s: float = 5.0) -> bool:
    """True as soon as ``pred()`` is (called once per try: it may consume, e.g. poll_received)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# ------------------------------------------------------------------ a pushing sender in its own process
# shm push and cuda_ipc write into the receiver's memory from the sender's process: a frozen sender
# (SIGSTOP) may resume mid-copy, so its revoked blocks stay quarantined until it confirms or dies.


def serve_sends(t, conn) -> None:
    """Child side: ``t`` (connected to "d0") sends what the parent asks for, ``(transfer_id, src,
    dst, rounds)`` (``transfer_id`` None: stop), then reports ("sending", id) and ("result",
    wait_sent(...)); closes ``t`` at the end."""
    while True:
        transfer_id, src, dst, rounds = conn.recv()
        if transfer_id is None:
            break
        for _ in range(rounds):
            t.send("d0", transfer_id, ALL_LAYERS, src, dst)
        conn.send(("sending", transfer_id))
        conn.send(("result", wait_sent(t, {transfer_id}, 30.0)))
    t.close()


def all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in the stopped state (SIGSTOP is delivered asynchronously)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


def check_revoke_waits_for_a_frozen_sender(rx, rx_cache, parent, proc, *, frozen_s: float, device: str = "cpu",
                                           refusals: tuple[str, ...] = ("not granted",)) -> None:
    """Parent side, with a ``serve_sends`` child connected to ``rx``: per ending, revoke a transfer
    under the frozen sender (SIGSTOP). Its blocks stay quarantined (revoke False, nothing in
    poll_revoked for ``frozen_s``) until it confirms after SIGCONT (then its sends fail with one of
    ``refusals``: "not granted" by the sender's own check; shm's push+pull sender may instead fall back
    to a pulled chunk, which the receiver refuses as "not expected"), or until its death (SIGKILL)
    closes its connection; nothing of the transfer lands after. Ends the child."""
    src, dst = np.arange(32), np.arange(32, 64)
    for tid, end in (("resumed", "SIGCONT"), ("killed", "SIGKILL")):
        rx.expect(tid, dst)
        parent.send((tid, src, dst, 200))
        assert parent.recv() == ("sending", tid)
        assert wait_until(lambda: rx.poll_received() != [], 10.0), "nothing landed"
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: all_threads_stopped(proc.pid), 5.0), "SIGSTOP did not take effect"
        assert rx.revoke(tid) is False, "a live sender may still write: revoke must not report it safe"
        time.sleep(frozen_s)
        assert rx.poll_revoked() == [], "reported safe while the sender is frozen and may resume"
        assert rx.num_pending_revokes == 1
        os.kill(proc.pid, getattr(signal, end))
        if end == "SIGKILL":
            proc.join(10)
        assert wait_until(lambda: rx.poll_revoked() == [tid], 10.0), f"{tid}: never reported safe"
        as_bytes(rx_cache)[:, :, dst] = SENTINEL  # the blocks now belong to another request
        if end == "SIGCONT":
            kind, (done, failed) = parent.recv()
            assert tid in failed and not done, (done, failed)
            parent.send((tid, src, dst, 1))  # it never heard of the abort: it sends on
            assert parent.recv() == ("sending", tid)
            kind, (done, failed) = parent.recv()
            assert tid in failed and not done, (done, failed)
            assert any(reason in failed[tid] for reason in refusals), failed
        time.sleep(0.05)  # let anything still on its way arrive
        if device == "cuda":
            torch.cuda.synchronize()
        assert bool((as_bytes(rx_cache)[:, :, dst] == SENTINEL).all()), f"{tid}: written after the revoke"
    assert rx.num_pending_revokes == 0
