"""A finished request's ``TransferDone`` does not wait for the prefill engine's next step (issue 16: the
chaos load test measured 0.3-5.5 s between a request's KV landing and its TransferDone, because the
prefill-side connector polled the receiver's acks only in ``post_forward``, at the end of a step).

A real prefill worker in its own process (as in a cluster) and a real decode worker in this one,
talking over 127.0.0.1 (control plane and tcp transport). With both in one interpreter, thread
switches often let an ack come back between the last sends and the poll right after them in the same
post_forward, which hid the bug about half the time. The prefill engine is kept busy: every step is
a full 2048-token batch (0.3-1 s of tiny-random with an MTP head on one torch thread, plus a
0.4 s pause added to the forward so that every machine's step is long). A lead prompt L (2000 tokens) is asked for first,
so every later request is queued before step 2; then A (1500 tokens) and long prompts B1, B2, B3
(2000 tokens each). Whichever way L and A meet the first step:

    step 1: L (finishes), maybe A's head
    step 2: A (finishes: its FirstToken goes out) + B1's head
    step 3: B1's rest (finishes)   post_forward sends A's last blocks (after the proposer: S2)
    step 4: B2's rest (finishes)   the decode side's ack of A's last blocks comes back early in it

and the first tokens of B1 / B2 mark the ends of steps 3 / 4. Before the fix A's TransferDone went
out at the end of step 4, a whole step after its ack (measured here: 0.6-3.8 s, every run); now the
ack poller sends it during step 4, milliseconds after the ack.
"""

import functools
import multiprocessing as mp
import threading
import time

import pytest

from conftest import engine_config
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.events import ADMITTED, Admission, Failed, KVReady, Tokens, expand

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 2048
STEP_PAUSE_S = 0.4  # added to every prefill forward (_prefill_child)
# MTP: A's last sends carry its draft layer for every block (S2), ~0.8 MB: their ack takes a while.
_config = functools.partial(engine_config, num_kv_blocks=1024, max_model_len=2048, prefill_chunk_size=CHUNK,
                            max_num_batched_tokens=CHUNK, spec_method="mtp", num_spec_tokens=1,
                            mtp_checkpoint="random")


class TimedEvents:
    """The decode worker's event stream, each event with the time it arrived here."""

    def __init__(self):
        self.items: list[tuple[float, object]] = []
        self.lock = threading.Lock()

    def __call__(self, event):
        now = time.monotonic()
        with self.lock:
            self.items.extend((now, e) for e in expand(event))  # a step's StepTokens as its requests' Tokens

    def first(self, pred) -> float | None:
        with self.lock:
            return next((t for t, e in self.items if pred(e)), None)

    def failures(self) -> list:
        with self.lock:
            return [e for _, e in self.items
                    if isinstance(e, Failed) or (isinstance(e, Admission) and e.verdict != ADMITTED)]


def _prefill_child(conn):
    """The prefill worker, in its own process: sends its address, then serves until killed."""
    import torch

    from pdcluster.prefill_node.worker import PrefillWorker

    torch.set_num_threads(1)
    p = PrefillWorker("p0", _config(), TransferConfig(transport="tcp"))
    # Every step at least STEP_PAUSE_S longer, whatever the machine (a fast CPU ran the 2048-token step
    # in 0.27 s, too short to tell a TransferDone sent early in a step from one sent at its end). The
    # pause holds no lock, as the forward's torch kernels hold none: the worker's threads run meanwhile.
    model = p.engine.runner.model
    forward = model.forward

    def long_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        time.sleep(STEP_PAUSE_S)
        return out

    model.forward = long_forward
    conn.send(p.address)
    time.sleep(600)


@pytest.mark.timeout(180)
def test_transfer_done_is_sent_while_the_prefill_engine_runs_its_next_step(tiny_dir):
    """Guards: a TransferDone goes out as soon as the receiver acknowledged the request's last sends,
    not at the end of the prefill engine's next step. Here the step after A's flush is a long (forced)
    one; A's KV must be reported ready on the decode side early in that step, well before it ends."""
    from pdcluster.decode_node.worker import DecodeWorker

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_child, args=(child,), daemon=True)
    proc.start()
    d = DecodeWorker("d0", _config(), TransferConfig(transport="tcp"))
    events = TimedEvents()
    d.on_event = events
    long_len = CHUNK - 48
    params = SamplingParams(max_tokens=1, ignore_eos=True, seed=1)
    requests = {"l": (list(range(20000, 20000 + long_len)), params),
                "a": (list(range(100, 1600)), SamplingParams(max_tokens=2, ignore_eos=True, seed=1))}
    for i in range(1, 4):
        requests[f"b{i}"] = (list(range(3000 * i, 3000 * i + long_len)), params)
    try:
        assert parent.poll(120), "the prefill worker did not start"
        assert d.connect_prefill(parent.recv()) == "p0"
        time.sleep(0.2)  # the handshake settles on the prefill side too
        for rid, (prompt, sampling) in requests.items():  # in this order: L, A, B1, B2, B3
            d.submit(rid, prompt, sampling, "p0")

        def first_token(rid):
            return events.first(lambda e: isinstance(e, Tokens) and e.request_id == rid)

        deadline = time.monotonic() + 120
        while first_token("b3") is None or events.first(lambda e: isinstance(e, KVReady) and e.request_id == "a") is None:
            assert not events.failures(), events.failures()
            assert time.monotonic() < deadline, "the requests did not get through within 120 s"
            time.sleep(0.01)
        kv_a = events.first(lambda e: isinstance(e, KVReady) and e.request_id == "a")
        a = first_token("a")
        long_ends = [first_token(f"b{i}") for i in range(1, 4)]
    finally:
        proc.kill()
        proc.join(10)
        d.close()

    flushed, next_end = long_ends[:2]  # the ends of step 3 (A's last blocks sent) and step 4
    assert a < flushed, f"A must finish in a step before B1's: {a:.3f} vs {flushed:.3f}"
    next_step = next_end - flushed
    timeline = f"A's first token {a:.3f}, step ends {[round(t, 3) for t in long_ends]}, A's KV ready {kv_a:.3f}"
    assert next_step > 0.3, f"the forced step was too short ({next_step:.2f} s) to tell anything: {timeline}"
    waited = kv_a - flushed
    print(f"TransferDone {waited * 1000:.0f} ms after the step that flushed A; the next step took "
          f"{next_step * 1000:.0f} ms")
    assert waited < 0.3 * next_step, (
        f"A's KV was ready {waited:.2f} s after the step that flushed it, in a {next_step:.2f} s step: its "
        f"TransferDone waited for that step to end ({timeline})")
