"""The decode worker as a Ray actor (node/actor.py): the router hands it requests (``submit``), it
streams their events back."""

from __future__ import annotations

from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.actor import WorkerActor


class DecodeActor(WorkerActor):
    def make_worker(self, worker_id, engine_config, transfer):
        from pdcluster.decode_node.worker import DecodeWorker

        return DecodeWorker(worker_id, engine_config, transfer)

    def connect_prefill(self, address: str) -> str:
        return self.worker.connect_prefill(address)

    def disconnect_prefill(self, prefill_id: str) -> bool:
        return self.worker.disconnect_prefill(prefill_id)

    def lost_peers(self) -> list[str]:
        return self.worker.lost_prefills()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prefill_id: str | None) -> None:
        self.worker.submit(request_id, prompt_token_ids, params, prefill_id)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)
