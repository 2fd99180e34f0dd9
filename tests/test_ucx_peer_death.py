"""A UCX peer killed mid-transfer must never take the surviving process down with it.

With endpoint error handling off and CMA in UCX_TLS, a rendezvous put into a receiver that has just
died made UCX log ``process_vm_writev(pid=...) returned -1: No such process`` at FATAL level and abort
the *sender* (bench/recovery.py: 2 of 12 decode kills took the prefill down). UCXOptions now defaults
to a configuration without that path (see its comment in transports/base.py).

One sender process streams transfer after transfer to one receiver process at a time; the receiver
is SIGKILLed at a random moment mid-stream, and the sender must stay alive and report the loss in
poll_sent. Children come from a forkserver that has torch and ucxx imported already, so a new
receiver is up in well under a second.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest

from pdcluster.kv_transfer.transports import available_transports

REASON = available_transports()["ucx"]
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))

SHAPE = (8, 2, 256, 16, 8, 32)  # float32: 16 KiB rows; a 128-block send of all layers is 32 MiB
SEND_BLOCKS = 128
TIMEOUT_S = 3.0  # the sender's ack deadline: the bound on noticing a receiver that died silently
WAIT_S = 60.0


def transport_config(ucx_options: dict | None):
    from pdcluster.kv_transfer.transports import TransportConfig
    from pdcluster.kv_transfer.transports.base import UCXOptions

    ucx = UCXOptions(**ucx_options) if ucx_options is not None else UCXOptions()
    # No reservations here: the receiver lands whatever the sender sends.
    return TransportConfig(timeout_s=TIMEOUT_S, ucx=ucx, admit_unexpected=True)


def receiver_child(conn, ucx_options) -> None:
    """Receive (the IO thread does it all) until killed."""
    import torch

    from pdcluster.kv_transfer.transports import get_transport_class

    cls = get_transport_class("ucx")
    t = cls(torch.zeros(SHAPE, dtype=torch.float32), "receiver", transport_config(ucx_options))
    conn.send(t.local_descriptor())
    time.sleep(3600)


def sender_child(conn, ucx_options) -> None:
    """For each ("stream", peer id, descriptor): connect, then send transfer after transfer (two in
    flight) until one fails; report ("streaming",) after the first delivery and ("failed", reason,
    seconds since the first failure could have happened) at the end. ("stop",) closes and exits."""
    import torch

    from pdcluster.kv_transfer.transports import get_transport_class

    cls = get_transport_class("ucx")
    cache = torch.ones(SHAPE, dtype=torch.float32)
    t = cls(cache, "sender", transport_config(ucx_options))
    src = np.arange(SEND_BLOCKS)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            t0 = time.monotonic()
            t.close()
            conn.send(("closed", time.monotonic() - t0))
            return
        _, peer_id, desc = cmd
        t.connect(peer_id, desc)
        in_flight, k, reported = set(), 0, False
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            while len(in_flight) < 2:
                tid = f"{peer_id}-{k}"
                k += 1
                t.send(peer_id, tid, range(SHAPE[0]), src, src)
                in_flight.add(tid)
            done, failed = t.poll_sent()
            in_flight -= set(done)
            if done and not reported:
                conn.send(("streaming",))
                reported = True
            failed = [f for f in failed if f[0] in in_flight]  # not a late report about an earlier peer
            if failed:
                conn.send(("failed", failed[0][1]))
                break
            time.sleep(0.001)
        else:
            conn.send(("no failure", k))


def recv(conn, timeout_s: float, what: str, sender=None):
    """The next message on ``conn``; fails at once if ``sender`` dies meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.05):
        if sender is not None and not sender.is_alive():
            raise AssertionError(f"the sender died (exit code {sender.exitcode}) while waiting for {what}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
    return conn.recv()


def kill_receivers_mid_transfer(
    num_kills: int, ucx_options: dict | None = None, seed: int = 0
) -> list[tuple[str, float]]:
    """Run the scenario; returns, per kill, the failure the sender reported and how long after the
    kill. Asserts the sender survived every kill and closes cleanly at the end."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "numpy", "ucxx._lib.libucxx", "pdcluster.kv_transfer.transports.ucx.transport"]
    )
    rng = random.Random(seed)
    s_parent, s_child = ctx.Pipe()
    sender = ctx.Process(target=sender_child, args=(s_child, ucx_options), daemon=True)
    sender.start()
    reasons = []
    receiver = None
    try:
        for i in range(num_kills):
            r_parent, r_child = ctx.Pipe()
            receiver = ctx.Process(target=receiver_child, args=(r_child, ucx_options), daemon=True)
            receiver.start()
            desc = recv(r_parent, WAIT_S, "receiver descriptor")
            s_parent.send(("stream", f"d{i}", desc))
            assert recv(s_parent, WAIT_S, "first delivery", sender) == ("streaming",)
            time.sleep(rng.uniform(0.0, 0.05))  # somewhere inside the stream
            os.kill(receiver.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            receiver.join(10)
            msg = recv(s_parent, 4 * TIMEOUT_S, f"the failure report of kill {i + 1}", sender)
            assert msg[0] == "failed", f"kill {i + 1}: {msg}"
            reasons.append((msg[1], time.monotonic() - killed_at))
        s_parent.send(("stop",))
        assert recv(s_parent, WAIT_S, "close", sender)[0] == "closed"
    finally:
        if receiver is not None:
            receiver.kill()
        sender.join(5)
        if sender.is_alive():
            sender.kill()
    assert sender.exitcode == 0, f"the sender exited with {sender.exitcode}"
    return reasons


@pytest.mark.timeout(120)
def test_sender_survives_three_receiver_kills():
    reasons = kill_receivers_mid_transfer(3)
    assert len(reasons) == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sender_survives_twelve_receiver_kills():
    reasons = kill_receivers_mid_transfer(12, seed=1)
    assert len(reasons) == 12
