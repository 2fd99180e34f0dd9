"""The router's own lifecycle, without a cluster: closing one that never served (Ctrl-C on an idle
`pdcluster serve`) and malformed events on its stream (dropped and logged, the router lives on)."""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack
import zmq

from pdcluster.cluster.router import ClusterRouter, RouterConfig
from pdcluster.cluster.router.events import MAX_BURST, EventReceiver
from pdcluster.node.event_pusher import EventPusher
from pdcluster.node.events import EVENTS_VERSION, Failed


def _router() -> ClusterRouter:
    return ClusterRouter({}, {}, tokenizer=None, model_name="m", max_model_len=128, block_size=16,
                         config=RouterConfig(health_interval_s=0.05))


def test_close_before_any_request_does_not_raise():
    router = _router()
    router.close()  # used to raise "cannot join thread before it is started"


def test_close_after_serving_on_a_loop_that_ended():
    router = _router()

    async def serve_briefly():
        router.start(asyncio.get_running_loop())
        await asyncio.sleep(0.1)

    asyncio.run(serve_briefly())
    router.close()


# A step's columnar event whose token count disagrees with its per-row counts (1 + 2).
BAD_STEP = msgpack.packb({"v": EVENTS_VERSION, "t": "StepTokens", "b": {
    "worker_id": "d0", "request_ids": ["a", "b"], "num_new_tokens": [1, 2], "new_token_ids": [5],
    "num_computed_tokens": [10, 11], "num_output_tokens": [1, 2], "num_draft_tokens": [0, 0],
    "num_accepted_tokens": [0, 0], "num_cached_tokens": [0, 0], "num_offloaded_tokens": [0, 0]}})


def test_malformed_events_are_dropped_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="pdcluster.cluster.router.events")
    seen = []
    receiver = EventReceiver("127.0.0.1", seen.append)

    async def main():
        receiver.bind(asyncio.get_running_loop())
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(receiver.address)
        for junk in (b"\xc1", b"not msgpack at all", b"\x93\x01\x02\x03", BAD_STEP):
            sock.send(junk)
        pusher = EventPusher(receiver.address)
        pusher(Failed(request_id="r#1", worker_id="d0", reason="x"))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        sock.close(0)
        pusher.close()

    try:
        asyncio.run(main())
    finally:
        receiver.close()
    assert seen == [Failed(request_id="r#1", worker_id="d0", reason="x")]
    assert caplog.text.count("dropping malformed worker event") == 4
    assert "StepTokens.new_token_ids: expected 3 tokens" in caplog.text


def test_a_burst_of_events_arrives_in_order_and_a_failing_one_does_not_stop_the_rest(caplog):
    """A burst of events (a decode step of a big batch with many finished or logprobs rows; workers in
    turn) is read on the loop a bounded number per turn: every event still arrives, in the order sent, and
    a listener that fails on one of them is logged and sees the others."""
    caplog.set_level(logging.ERROR, logger="pdcluster.cluster.router.events")
    seen = []
    # More than one turn's reading (events.MAX_BURST): the rest must follow on later turns.
    sent = [Failed(request_id=f"r#{i}", worker_id="d0", reason="x") for i in range(2 * MAX_BURST + 300)]

    def listener(event):
        if event.request_id == "r#7":
            raise RuntimeError("listener broke on r#7")
        seen.append(event)

    receiver = EventReceiver("127.0.0.1", listener)
    pusher = EventPusher(receiver.address)

    async def main():
        receiver.bind(asyncio.get_running_loop())
        for event in sent:
            pusher(event)
        deadline = time.monotonic() + 10
        while len(seen) < len(sent) - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        pusher.close()
        receiver.close()
    assert seen == [e for e in sent if e.request_id != "r#7"]
    assert "router failed on a worker event Failed" in caplog.text and "listener broke on r#7" in caplog.text


def test_events_that_arrive_between_two_loops_do_not_stop_the_receiver():
    """A router serves one asyncio loop after another (each ``asyncio.run`` is a new loop); a worker
    event that lands after the first closed is dropped, and the next loop still gets its events. The
    reader thread used to exit on the closed loop, and the next bind() raised "threads can only be
    started once"."""
    seen = []
    receiver = EventReceiver("127.0.0.1", seen.append)
    pusher = EventPusher(receiver.address)
    late = Failed(request_id="r#late", worker_id="d0", reason="x")
    second = Failed(request_id="r#2", worker_id="d0", reason="y")

    async def bind_only():
        receiver.bind(asyncio.get_running_loop())

    async def push_and_wait():
        receiver.bind(asyncio.get_running_loop())  # before the push: the event is this loop's
        pusher(second)
        deadline = time.monotonic() + 10
        while second not in seen and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(bind_only())  # that loop is closed now
        pusher(late)
        time.sleep(1.0)  # the reader thread meets the closed loop (it polls every 0.1 s)
        asyncio.run(push_and_wait())
    finally:
        pusher.close()
        receiver.close()
    assert seen and seen[-1] == second and len(seen) <= 2, seen  # the late one is dropped, as a rule


def test_an_admission_after_the_worker_was_declared_down_is_not_taken():
    """A decode worker admits a placement and dies; the router declares it down (the pending verdict is
    UNREACHABLE) and only then reads the ADMITTED event it sent before dying. The placement loop has moved
    on: the late verdict must not make that placement the request's (a later worker_down would recover
    the request beside the loop, leaving a placement no one forgets: test_soak_long saw one)."""
    from pdcluster.cluster.router.state import Attempt, RequestState
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.node.events import ADMITTED, Admission

    router = _router()

    async def scenario():
        loop = asyncio.get_running_loop()
        r = RequestState("req", [1, 2, 3], SamplingParams(max_tokens=4), asyncio.Queue())
        a = Attempt("req", 1, "decode-0", "prefill-0", 3, loop.create_future())
        router.streams.expect(r, a)
        router.worker_down("decode-0", "submit failed: ActorDiedError")  # the pending verdict: UNREACHABLE
        router._on_admission(Admission(a.wid, "decode-0", ADMITTED))
        return r, a

    r, a = asyncio.run(scenario())
    assert a.admitted.result().verdict != ADMITTED
    assert r.attempt is None and "req" not in router.streams.requests, "the late admission was taken"
    router.close()


def test_close_from_another_thread_leaves_its_loop_running():
    """The receiver is read on its router's loop; closed from another thread while that loop runs, the
    loop stops watching the socket and closes it on its own thread, and goes on serving."""
    import threading

    receiver = EventReceiver("127.0.0.1", lambda event: None)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def bind():
        receiver.bind(asyncio.get_running_loop())

    try:
        asyncio.run_coroutine_threadsafe(bind(), loop).result(5)
        receiver.close()
        assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05, result="alive"), loop).result(5) == "alive"
        assert receiver._pull.closed
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
