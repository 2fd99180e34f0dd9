"""The prefill worker as a Ray actor. Ray places it (its own device, a placement-group bundle) and
restarts it; requests come in as actor calls, events go out over zmq (engine/event_pusher.py)."""

from __future__ import annotations

import os
import uuid

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.event_pusher import EventPusher
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig


class PrefillActor:
    def __init__(self, worker_id: str, engine_config: dict, transfer_config: dict, event_address: str,
                 env: dict | None = None):
        os.environ.update(env or {})
        if transfer_config and transfer_config.get("host") == "auto":
            import ray

            transfer_config = {**transfer_config, "host": ray.util.get_node_ip_address()}
        from pdcluster.prefill_node.worker import PrefillWorker

        config = EngineConfig(**engine_config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.worker = PrefillWorker(worker_id, config, TransferConfig(**transfer_config))
        self.pusher = EventPusher(event_address)
        self.incarnation = uuid.uuid4().hex[:12]
        self.worker.on_event = self.pusher

    def address(self) -> str:
        return self.worker.address

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> tuple[bool, str, float]:
        """Health check that does not wait for the engine thread (a long step must not look like
        death): whether the engine thread still runs, this process's incarnation (a new one after Ray
        restarted the actor, so the router knows to recover and re-wire), and how long the engine
        thread has been inside one turn of its loop (a stuck step shows here)."""
        return self.worker.loop_error is None and self.worker.is_running(), self.incarnation, self.worker.stalled_s()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: dict, decode_id: str,
               dst_block_ids: list[int]) -> None:
        self.worker.submit(request_id, prompt_token_ids, SamplingParams(**params), decode_id, dst_block_ids)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def stats(self) -> dict:
        return self.worker.stats()

    def shutdown(self) -> None:
        self.worker.close()
        self.pusher.close()
