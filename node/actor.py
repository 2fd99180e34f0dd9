"""A worker as a Ray actor: Ray places it (its own device, a placement-group bundle) and restarts
it; the router calls its methods, and a decode worker's events go back over zmq (event_pusher.py).
Configs cross Ray as the typed dataclasses (EngineConfig, TransferConfig), not as dicts."""

from __future__ import annotations

import dataclasses
import os
import uuid

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.event_pusher import EventPusher


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
        self.worker = self.make_worker(worker_id, engine_config, transfer)
        self.pusher = EventPusher(event_address) if event_address else None
        if self.pusher is not None:
            self.worker.on_event = self.pusher
        self.incarnation = uuid.uuid4().hex[:12]

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
                    stalled_s=self.worker.stalled_s(), pid=os.getpid(), lost_peers=tuple(self.lost_peers()))

    def lost_peers(self) -> list[str]:
        """Peers this worker lost to silence and that only a new handshake brings back (decode role)."""
        return []

    def stats(self) -> dict:
        return self.worker.stats()

    def shutdown(self) -> None:
        self.worker.close()
        if self.pusher is not None:
            self.pusher.close()
