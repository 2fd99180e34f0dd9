"""The engine's connector for vLLM's external prefill/decode protocol (wire/external_kv.py): one object on both
sides, as vLLM's kv_both.

Prefill side: a request that asks ``do_remote_decode`` and ends normally (length or stop) keeps its blocks
(``request_finished`` returns True) while the export server holds its full prompt blocks for one pull, and its
answer carries ``kv_transfer_params`` naming them; ``poll`` hands back the holds that ended (pulled, released or
expired) as ``finished_sending``, so the scheduler frees the blocks then. Nothing runs inside steps
(no step hooks): async scheduling and CUDA graphs are as without it.

Decode side: a request with ``do_remote_prefill`` gets a ``PullSource`` (``external_source``), which the offload
gate loads from before the request's first step."""

from __future__ import annotations

from typing import Callable

import torch
import zmq

from pdcluster.kv_transfer.external.export_server import KVExportServer
from pdcluster.kv_transfer.external.pull import PullSource, PullStats
from pdcluster.wire.external_kv import ExternalKVConfig, remote_prefill, wants_remote_decode
from pdcluster.wire.kv_connector import KVConnector, KVConnectorOutput
from pdcluster.wire.sglang_bootstrap import bootstrap_remote, is_bootstrap_pull, room_key

ENDED_NORMALLY = ("length", "stop")


class ExternalKVConnector(KVConnector):
    fetches_external = True

    def __init__(self, config: ExternalKVConfig, engine_id: str, port: int, layout: str, block_size: int,
                 block_shape: tuple[int, ...], dtype: torch.dtype, read_blocks: Callable[[list[int]], memoryview],
                 hash_prompt_blocks: Callable[[object, int], list[int]]) -> None:
        """``hash_prompt_blocks(request, n)``: the chained hashes of the request's first n prompt blocks (as its
        engine's prefix cache names them); ``read_blocks``: KVExportServer's; ``port``: this worker's (0: any)."""
        self.config, self.engine_id, self.layout, self.block_size = config, engine_id, layout, block_size
        self.block_shape, self.dtype, self._hash_prompt_blocks = tuple(block_shape), dtype, hash_prompt_blocks
        self.block_nbytes = torch.Size(self.block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.server = (KVExportServer(config.host, port, layout, self.block_nbytes, read_blocks)
                       if config.produces else None)
        self._ctx = zmq.Context()
        self.pull_stats = PullStats()

    # ---- prefill side (engine thread) -------------------------------------------------------------------
    def request_finished(self, request) -> bool:
        params = request.sampling_params.kv_transfer_params
        if self.server is None or not wants_remote_decode(params) or request.status.value not in ENDED_NORMALLY:
            return False
        num_blocks = min(len(request.prompt_token_ids) // self.block_size, len(request.block_ids))
        block_ids = list(request.block_ids[:num_blocks])
        # SGLang's router: pulled by its room (wire/sglang_bootstrap.py); held even without a full block, so that
        # the decode side, which asks without knowing, learns it at once instead of waiting out its pull.
        room = params.get("bootstrap_room")
        token = ""
        if num_blocks or room is not None:
            token = self.server.hold(request.request_id, block_ids, self._hash_prompt_blocks(request, num_blocks),
                                     self.config.hold_timeout_s, None if room is None else room_key(room))
        request.kv_transfer_out = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id, "remote_block_ids": block_ids,
            "remote_host": self.config.public_host, "remote_port": self.server.port, "remote_token": token,
            "tp_size": 1,
        }
        return bool(num_blocks)

    def poll(self) -> KVConnectorOutput:
        if self.server is None:
            return KVConnectorOutput()
        ended = self.server.take_ended()
        return KVConnectorOutput(finished_sending=set(ended)) if ended else KVConnectorOutput()

    # ---- decode side ----------------------------------------------------------------------------------------
    def external_source(self, request) -> PullSource | None:
        if not self.config.consumes:
            return None
        params = request.sampling_params.kv_transfer_params
        # SGLang's router's decode leg (its bootstrap fields, translated and checked by the API) or vLLM's.
        remote = bootstrap_remote(params) if is_bootstrap_pull(params) else remote_prefill(params)
        if remote is None or not remote.num_blocks:
            return None
        return PullSource(remote, self.layout, self.block_shape, self.dtype, self.block_nbytes,
                          self.config.fetch_timeout_s, self._ctx, self.pull_stats)

    def stats(self) -> dict:
        out = {"pulls": self.pull_stats.__dict__.copy()}
        if self.server is not None:
            out["export"] = {**self.server.counters, "num_held": self.server.num_held, "port": self.server.port}
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._ctx.term()
