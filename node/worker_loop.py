"""A worker's engine thread: every engine call happens on this one thread, so nothing in the engine
needs a lock. Other threads (Ray method calls, the HTTP server) hand it work through a queue. After
each turn it publishes the engine's KV events (one ``KVEvents`` record, when there are any), to the router and,
under ``--kv-events-config``, to subscribers outside the cluster as vLLM's (node/kv_event_publisher.py)."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from pdcluster.engine.kv_offload.audit import offload_audit
from pdcluster.node.events import Event, WorkerError, kv_event_records
from pdcluster.node.kv_event_publisher import KVEventPublisher, make_kv_event_publisher

log = logging.getLogger(__name__)


class WorkerLoop:
    def __init__(self, name: str, idle_wait_s: float = 0.002):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.name = name
        self.worker_id = name  # the id the router knows: subclasses set it (their thread's name differs)
        self.engine = None  # the subclass's LLMEngine, once built (its KV events are published each turn)
        self.kv_event_publisher: KVEventPublisher | None = None  # vLLM's KV events, where configured (start)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.on_event: Callable[[Event], None] = lambda event: None
        self.loop_error: BaseException | None = None
        # When the engine thread last went round its loop (monotonic). A health check reads it without
        # waiting for the thread, to tell a long step from a stuck one.
        self.last_turn_s = time.monotonic()

    def start(self) -> None:
        if self.engine is not None:
            self.kv_event_publisher = make_kv_event_publisher(self.engine, self.worker_id)
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
        if self.kv_event_publisher is not None and not self._thread.is_alive():
            self.kv_event_publisher.close()  # after the engine thread's last turn: its batches went out

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
            self.publish_kv_events()

    def publish_kv_events(self) -> None:
        """The engine's KV events since the last turn, as one record (the tiers' threads add to the log
        between turns too: a disk eviction, a failed read)."""
        if self.engine is None:
            return
        publisher = self.kv_event_publisher
        if publisher is None:
            drained = self.engine.kv_events.drain()
        else:
            described = self.engine.kv_events.drain_described()
            if described:
                publisher.publish(time.time(), described)
            drained = [entry[:3] for entry in described]
        if drained:
            for record in kv_event_records(self.worker_id, drained):
                self.emit(record)

    def announce_kv_blocks(self) -> int:
        """Engine thread: every block the engine holds, by tier, as "stored" KV events (published at the
        end of this turn). The router forgets a worker Ray restarted; its disk tier survived the restart,
        so the re-wiring asks it to say again what it holds. Returns how many blocks it announced."""
        engine = self.engine
        held = {"device": engine.scheduler.block_manager.cached_block_hashes()}
        if engine.offload is not None:
            held.update(engine.offload.tiers.held_hashes())
        for tier, block_hashes in held.items():
            if block_hashes:
                engine.kv_events.record("stored", tier, block_hashes)
        return sum(map(len, held.values()))

    def close_kv_offload(self) -> None:
        """After ``stop``: the offload tiers' threads end (the disk writer finishes its queue)."""
        if self.engine is not None and self.engine.offload is not None:
            self.engine.offload.close()


def engine_stats(worker_id: str, engine) -> dict:
    """The figures every worker reports about its engine (its role adds its own)."""
    sched = engine.scheduler
    return {
        "worker_id": worker_id,
        # This process: a load test on the same host signals it (pdcluster loadtest --chaos).
        "pid": os.getpid(),
        "num_free_blocks": sched.num_free_blocks,
        "num_blocks": engine.kv_spec.num_blocks,
        # Ranks its model is split across (prefill and decode workers may differ: kv_transfer/transports/resplit.py).
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        # Hybrid models: blocks a disaggregated prompt's Mamba state arrives in (engine/mamba_state_blocks.py).
        "num_state_blocks": engine.num_state_blocks,
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "kv_tiers": kv_tier_usage(engine),
        # The offload tiers' leak audit (engine/kv_offload/audit.py: problems, in-flight counts, counters).
        "kv_tier_audit": offload_audit(engine),
        # Async scheduling (--async-scheduling): steps queued on the device before the previous one ended.
        "num_steps_launched_ahead": engine.num_steps_launched_ahead,
        **lora_usage(engine),
    }


def lora_usage(engine) -> dict:
    """An engine serving LoRA adapters: the adapters of its running and waiting requests and how many it holds at
    once (the ``lora`` of ``router.stats()``: vLLM's lora_requests_info); {} for one that serves none."""
    config = engine.config
    if not config.serves_lora:
        return {}
    sched = engine.scheduler
    return {"lora": {"max_lora": config.max_loras,
                     "running": sorted({r.sampling_params.lora_name for r in sched.running} - {None}),
                     "waiting": sorted({r.sampling_params.lora_name for r in sched.waiting} - {None})}}


def kv_tier_usage(engine) -> dict[str, dict[str, int]]:
    """Per KV tier: blocks held and capacity. The device pool's held blocks are those in use (a cached
    free block is free); the offload tiers hold only cached blocks. Safe off the engine thread (the
    tiers lock; the pool's count is one read)."""
    num_blocks = engine.kv_spec.num_blocks
    usage = {"device": {"blocks": num_blocks - engine.scheduler.num_free_blocks, "capacity_blocks": num_blocks}}
    if engine.offload is not None:
        usage.update(engine.offload.tiers.usage())
    return usage
