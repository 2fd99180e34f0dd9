"""A worker as a Ray actor: Ray places it (its own device, a placement-group bundle) and restarts
it; the router calls its methods, and a worker's events go back over zmq (event_pusher.py): a decode
worker's request events, and every worker's KV events.
Configs cross Ray as the typed dataclasses (EngineConfig, TransferConfig), not as dicts."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid

import torch

from pdcluster.engine import sleep
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.gc_heap import freeze_startup_objects
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.event_pusher import EventPusher
from pdcluster.node.worker_loop import kv_tier_usage


@dataclasses.dataclass(frozen=True)
class Ping:
    """A worker's answer to the router's health check (``WorkerActor.ping``)."""

    alive: bool  # the engine thread still runs
    incarnation: str  # this process's: a new one after Ray restarted the actor
    stalled_s: float  # how long the engine thread has been inside one turn of its loop
    pid: int  # this process (a load test on the same host signals it: pdcluster loadtest --chaos)
    # Decode worker: prefill workers it dropped after the control plane's peer timeout and is not
    # connected to again (a frozen worker that resumed is one of them until the router re-wires the pair).
    lost_peers: tuple[str, ...] = ()
    # Per KV tier (device, host, disk): {"blocks": held, "capacity_blocks": ...} (node/worker_loop.py
    # kv_tier_usage), for /metrics; empty before the engine is built.
    kv_tiers: dict = dataclasses.field(default_factory=dict)
    # Where it publishes vLLM's KV events (node/kv_event_publisher.py source()); None without --kv-events-config.
    kv_event_source: dict | None = None
    # The weights it serves (engine/weight_update.py): the router brings a worker that missed an update back in line.
    weight_version: str = "default"


def worker_engine_config(engine_config: EngineConfig, worker_id: str) -> EngineConfig:
    """The config of worker ``worker_id``: its disk tier in a subdirectory of its own (two workers on one
    host never share block files; a worker Ray restarts keeps its id, so it finds its blocks again)."""
    if not engine_config.kv_offload_disk_dir:
        return engine_config
    return dataclasses.replace(engine_config,
                               kv_offload_disk_dir=os.path.join(engine_config.kv_offload_disk_dir, worker_id))


LORA_LOAD_TIMEOUT_S = 300.0  # reading an adapter's files and packing them, on the engine thread
WEIGHTS_COMMIT_TIMEOUT_S = 120.0  # copying a prepared checkpoint into the served tensors, on the engine thread
COMMIT_IDLE_WAIT_S = 30.0  # aborts still on their way when a commit comes (commit_weights)
FLUSH_TIMEOUT_S = 60.0  # forgetting the cached prefixes on the engine thread (the disk tier waits for its writer)
FLUSH_IDLE_WAIT_S = 5.0  # a request that just ended letting go of its blocks before a flush (reset_prefix_cache)


def flush_when_idle(worker) -> bool:
    """``worker``'s engine forgets every cached prefix, in every KV tier (LLMEngine.reset_prefix_cache): False,
    nothing changed, while a request is there. The routers ask only when none is in flight, but one that just ended
    may hold its blocks a moment longer (until its KV transfer is acknowledged, or an abort on its way arrives: a
    stop string's, or a threaded actor's call, which is not ordered): the engine is given FLUSH_IDLE_WAIT_S to let go
    of them first. Blocks the calling thread (not the engine's)."""
    _wait_idle(worker)
    return worker.call(worker.engine.reset_prefix_cache, timeout_s=FLUSH_TIMEOUT_S)


def _wait_idle(worker) -> None:
    """Up to FLUSH_IDLE_WAIT_S for ``worker``'s engine to hold no request and no block."""
    deadline = time.monotonic() + FLUSH_IDLE_WAIT_S
    while not worker.call(worker.engine.is_idle) and time.monotonic() < deadline:
        time.sleep(0.01)


SLEEP_TIMEOUT_S = 300.0  # giving back or taking back memory on the engine thread (a level-2 wake reads the checkpoint)


def sleep_when_idle(worker, tags: tuple[str, ...], level: int) -> dict:
    """``worker``'s engine gives back the memory of ``tags`` (engine/sleep.py): its sleep state. The router drained
    its requests first, but one that just ended may hold its blocks a moment longer (``flush_when_idle``): the
    engine is given FLUSH_IDLE_WAIT_S to let them go; SleepError (a ValueError) where it still cannot."""
    _wait_idle(worker)
    return {"worker_id": worker.worker_id,
            **worker.call(lambda: sleep.release(worker.engine, tags, level), timeout_s=SLEEP_TIMEOUT_S)}


def wake_worker(worker, tags: tuple[str, ...]) -> dict:
    """``worker``'s engine takes back the memory of ``tags``: its sleep state."""
    return {"worker_id": worker.worker_id,
            **worker.call(lambda: worker.engine.wake_up(tags), timeout_s=SLEEP_TIMEOUT_S)}


class WorkerActor:
    """Subclasses say which worker they run (``make_worker``) and add their role's methods."""

    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig | None,
                 event_address: str | None = None, env: dict | None = None):
        os.environ.update(env or {})
        if transfer is not None and transfer.host == "auto":
            import ray

            transfer = dataclasses.replace(transfer, host=ray.util.get_node_ip_address())
        if engine_config.num_threads:
            torch.set_num_threads(engine_config.num_threads)
        self.worker = self.make_worker(worker_id, worker_engine_config(engine_config, worker_id), transfer)
        self.pusher = EventPusher(event_address) if event_address else None
        if self.pusher is not None:
            self.worker.on_event = self.pusher
            # Disk tier files an earlier run of this worker left (the same folder): the router learns of
            # them now, its events having a listener from here on.
            self.worker.post(self.worker.announce_kv_blocks)
        self.incarnation = uuid.uuid4().hex[:12]
        # The process holds this one engine for its life: its start-up objects leave the collector's sight
        # (engine/gc_heap.py: a batch-128 decode step's host time 20% lower on average).
        freeze_startup_objects()

    def make_worker(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig | None):
        raise NotImplementedError

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> Ping:
        """Health check that does not wait for the engine thread (a long step must not look like
        death): whether the engine thread still runs, this process's incarnation (a new one after Ray
        restarted the actor, so the router knows to recover and re-wire), how long the engine thread
        has been inside one turn of its loop (a stuck step shows here), the pid, and the peers lost."""
        return Ping(alive=self.worker.loop_error is None and self.worker.is_running(), incarnation=self.incarnation,
                    stalled_s=self.worker.stalled_s(), pid=os.getpid(), lost_peers=tuple(self.lost_peers()),
                    kv_tiers=kv_tier_usage(self.worker.engine),
                    kv_event_source=publisher.source() if (publisher := self.worker.kv_event_publisher) else None,
                    weight_version=self.worker.engine.weight_version)

    def lost_peers(self) -> list[str]:
        """Peers this worker lost to silence and that only a new handshake brings back (decode role)."""
        return []

    def stats(self) -> dict:
        return self.worker.stats()

    def load_lora(self, name: str, path: str) -> str:
        """Load a LoRA adapter while serving (LLMEngine.load_lora): its content digest."""
        return self.worker.call(self.worker.engine.load_lora, name, path, timeout_s=LORA_LOAD_TIMEOUT_S)

    def unload_lora(self, name: str) -> None:
        self.worker.call(self.worker.engine.unload_lora, name)

    def lora_adapters(self) -> dict[str, str]:
        """{adapter name: content digest} of the adapters requests may name here."""
        return self.worker.call(lambda: self.worker.engine.lora_adapters)

    def prepare_weights(self, model_path: str, weight_version: str) -> str:
        """Read and check a new checkpoint, held until ``commit_weights`` (engine/weight_update.py); its contents'
        digest (the router checks every worker read the same).
        WeightUpdateError (a ValueError) with the reason where it does not fit. On this call's thread, not the
        engine's: reading a large checkpoint must not look like a stuck step to the health check (the engine
        only reads its config for it)."""
        return self.worker.engine.prepare_weights(model_path, weight_version)

    def commit_weights(self) -> dict:
        """Serve the prepared weights from now on: the WeightUpdate as a dict. The router drained its requests first,
        but an abort it sent may still be on its way here (a threaded actor's calls are not ordered): the engine
        is given a moment to let such requests go before the commit, which refuses while any runs."""
        deadline = time.monotonic() + COMMIT_IDLE_WAIT_S
        while self.worker.call(self.worker.engine.has_unfinished) and time.monotonic() < deadline:
            time.sleep(0.01)
        return dataclasses.asdict(self.worker.call(self.worker.engine.commit_weights,
                                                   timeout_s=WEIGHTS_COMMIT_TIMEOUT_S))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, in every KV tier (``flush_when_idle``)."""
        return flush_when_idle(self.worker)

    def discard_weights(self) -> None:
        self.worker.call(self.worker.engine.discard_weights)

    def weight_version(self) -> str:
        return self.worker.engine.weight_version

    def release_memory(self, tags: tuple[str, ...], level: int) -> dict:
        """Sleep mode: give back the memory of ``tags`` (``sleep_when_idle``)."""
        return sleep_when_idle(self.worker, tags, level)

    def wake_up(self, tags: tuple[str, ...]) -> dict:
        return wake_worker(self.worker, tags)

    def announce_kv(self) -> int:
        """Publish every KV block this worker holds, by tier (after a restart: node/worker_loop.py)."""
        return self.worker.call(self.worker.announce_kv_blocks)

    def shutdown(self) -> None:
        self.worker.close()  # its engine's offload tiers too
        if self.pusher is not None:
            self.pusher.close()
