"""A worker's connector for vLLM's external prefill/decode protocol (--kv-transfer-config), made on its loaded
model: the KV layout key both instances compare, how the export server reads a block's KV, how a prompt's blocks
are hashed (as the engine's prefix cache hashes them)."""

from __future__ import annotations

import hashlib

import torch

from pdcluster.engine.block_manager import block_hash_root, block_keys, chained_block_hashes
from pdcluster.engine.kv_offload.block_columns import BlockColumns
from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.kv_transfer.config import model_fingerprint
from pdcluster.kv_transfer.connector.external import ExternalKVConnector
from pdcluster.wire.external_kv import parse_config


def external_layout(loaded: LoadedModel, block_shape: tuple[int, ...]) -> str:
    """Equal on two instances only where a block's bytes mean the same: the model (config, weights, adapters,
    RoPE table: model_fingerprint), the KV dtype, the column shape (layers, block size, heads) and the split."""
    key = (f"{model_fingerprint(loaded.model_dir, loaded.model.kv_fingerprint)}|{loaded.dtype_name}|"
           f"{tuple(block_shape)}|{loaded.kv_cache.dtype}|tp:{loaded.config.tensor_parallel_size}")
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def make_external_connector(loaded: LoadedModel, engine_id: str, worker_index: int = 0) -> ExternalKVConnector | None:
    """None where the config has no kv_transfer_config. ``worker_index``: kv_port + index is this worker's port."""
    config = parse_config(loaded.config.kv_transfer_config)
    if config is None:
        return None
    assert not loaded.is_hybrid, "LoadedModel.load refuses a hybrid with kv_transfer_config"
    columns = BlockColumns(loaded.rank_kv_caches or (loaded.kv_cache,))
    block_size = loaded.config.block_size

    def read_blocks(block_ids: list[int]) -> memoryview:
        # One gather per cache for all the blocks (a Python loop a block would take the GIL from the engine thread
        # each time); its host bytes go to zmq without another copy.
        data = columns.read_many(block_ids).cpu().contiguous()
        return memoryview(data.view(torch.uint8).numpy()).cast("B")

    def hash_prompt_blocks(request, num_blocks: int) -> list[int]:
        params = request.sampling_params
        return chained_block_hashes(request.prompt_token_ids[:num_blocks * block_size], block_size,
                                    block_hash_root(params), block_keys(params, block_size))

    port = config.port + worker_index if config.port else 0
    return ExternalKVConnector(config, engine_id, port, external_layout(loaded, columns.block_shape), block_size,
                               columns.block_shape, columns.dtype, read_blocks, hash_prompt_blocks)
