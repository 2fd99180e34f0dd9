"""The control-plane identity a worker presents in the handshake, built the same way by both roles."""

from __future__ import annotations

from pdcluster.engine.loaded_model import DTYPES, LoadedModel
from pdcluster.kernels import numerics
from pdcluster.kv_transfer.config import TransferConfig, kv_layout, model_fingerprint
from pdcluster.kv_transfer.control_plane import EndpointConfig


def endpoint_config(worker_id: str, model: LoadedModel, transfer: TransferConfig, transport) -> EndpointConfig:
    """``model``: the worker's LoadedModel (its KV layout and model); ``transport``: its KV transport."""
    return EndpointConfig(
        worker_id=worker_id,
        layout=kv_layout(model.kv_spec, model.state_shape, model.num_state_blocks, model.config.tensor_parallel_size),
        model_fingerprint=model_fingerprint(model.model_dir, model.model.kv_fingerprint),
        transport=transfer.transport,
        transport_descriptor=transport.local_descriptor(),
        secret=transfer.secret,
        heartbeat_interval_s=transfer.heartbeat_interval_s,
        peer_timeout_s=transfer.peer_timeout_s,
        numerics=numerics.describe(model.config.device, DTYPES[model.dtype_name]),
    )
