"""A worker's engine thread: every engine call happens on this one thread, so nothing in the engine
needs a lock. Other threads (Ray method calls, the HTTP server) hand it work through a queue."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from pdcluster.node.events import Event, WorkerError

log = logging.getLogger(__name__)


class WorkerLoop:
    def __init__(self, name: str, idle_wait_s: float = 0.002):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.name = name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.on_event: Callable[[Event], None] = lambda event: None
        self.loop_error: BaseException | None = None
        # When the engine thread last went round its loop (monotonic). A health check reads it without
        # waiting for the thread, to tell a long step from a stuck one.
        self.last_turn_s = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable, *args: Any, timeout_s: float = 30.0) -> Any:
        """Run ``fn(*args)`` on the engine thread and return its result (bounded wait)."""
        if self._stop.is_set():
            raise RuntimeError("worker loop is stopped")
        fut: Future = Future()
        self._commands.put((fn, args, fut))
        return fut.result(timeout=timeout_s)

    def post(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the engine thread; do not wait."""
        self._commands.put((fn, args, None))

    def stalled_s(self) -> float:
        """Seconds since the engine thread last finished a turn of its loop."""
        return time.monotonic() - self.last_turn_s

    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def emit(self, event: Event) -> None:
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 - a broken listener must not kill the engine thread
            log.exception("event listener failed on %s", type(event).__name__)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def tick(self) -> bool:
        """One turn of work; return True if there may be more to do right away."""
        raise NotImplementedError

    def _drain(self, wait_s: float) -> None:
        try:
            item = self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, fut = item
            try:
                result = fn(*args)
                if fut is not None:
                    fut.set_result(result)
            except BaseException as e:  # noqa: BLE001 - the caller gets it; the loop lives on
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.exception("posted command %s failed", getattr(fn, "__name__", fn))
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
        self._stop.set()

    def _run(self) -> None:
        busy = False
        while not self._stop.is_set():
            self.last_turn_s = time.monotonic()
            self._drain(0.0 if busy else self._idle_wait_s)
            if self._stop.is_set():
                break
            try:
                busy = self.tick()
            except BaseException as e:  # noqa: BLE001
                log.exception("worker loop failed")
                self.loop_error = e
                self.emit(WorkerError(worker_id=self.name, error=f"{type(e).__name__}: {e}"[:2000]))
                self._stop.set()


def engine_stats(worker_id: str, engine) -> dict:
    """The figures every worker reports about its engine (its role adds its own)."""
    sched = engine.scheduler
    return {
        "worker_id": worker_id,
        # This process: a load test on the same host signals it (pdcluster loadtest --chaos).
        "pid": os.getpid(),
        "num_free_blocks": sched.num_free_blocks,
        "num_blocks": engine.kv_spec.num_blocks,
        # Hybrid models: blocks a disaggregated prompt's Mamba state arrives in (engine/mamba_state_blocks.py).
        "num_state_blocks": engine.num_state_blocks,
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
    }
