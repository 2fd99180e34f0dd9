"""The prefill worker as a Ray actor (node/actor.py). It takes no requests from the router: decode
workers ask it for KV over the control plane; the router only needs its address, its health and its
KV events (what its prefix cache and tiers hold, for ``kv_aware`` placement)."""

from __future__ import annotations

from pdcluster.node.actor import WorkerActor


class PrefillActor(WorkerActor):
    def make_worker(self, worker_id, engine_config, transfer):
        from pdcluster.prefill_node.worker import PrefillWorker

        return PrefillWorker(worker_id, engine_config, transfer)

    def address(self) -> str:
        return self.worker.address
