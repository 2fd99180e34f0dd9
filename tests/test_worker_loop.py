"""The engine thread's loop (engine/worker_loop.py): a health check must tell a stuck step from a long
one without waiting for the thread (stalled_s), and a failing posted command must not kill the loop."""

import threading
import time

from pdcluster.node.worker_loop import WorkerLoop


class _BlockingLoop(WorkerLoop):
    """A real WorkerLoop whose tick blocks while ``gate`` is clear: a step that does not return."""

    def __init__(self):
        super().__init__("test-loop")
        self.gate = threading.Event()
        self.gate.set()
        self.ticks = 0

    def tick(self) -> bool:
        self.gate.wait(10.0)
        self.ticks += 1
        return False


def test_stalled_s_grows_while_a_step_is_stuck_and_resets_after():
    loop = _BlockingLoop()
    loop.start()
    try:
        time.sleep(0.1)
        assert loop.stalled_s() < 0.1, "an idle loop goes round every few milliseconds"
        loop.gate.clear()
        time.sleep(0.6)
        assert loop.stalled_s() >= 0.5 and loop.is_running()
        loop.gate.set()
        time.sleep(0.1)
        assert loop.stalled_s() < 0.1
    finally:
        loop.gate.set()
        loop.stop()


def test_a_failing_posted_command_leaves_the_loop_running():
    loop = _BlockingLoop()
    loop.start()
    try:
        loop.post(lambda: 1 / 0)
        assert loop.call(lambda: 42) == 42 and loop.is_running()
    finally:
        loop.stop()
