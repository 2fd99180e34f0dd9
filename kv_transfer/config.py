"""Configuration of a worker's KV-transfer side (control plane + data plane), and the model
fingerprint both sides compare in the handshake."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.kv_transfer.protocol import KVLayout
from pdcluster.kv_transfer.transports import TransportConfig


@dataclass
class TransferConfig:
    transport: str = "tcp"
    secret: str | None = None  # cluster secret: HMAC proofs on the control and data planes; None on both sides = none
    host: str = "127.0.0.1"  # control-plane and data-plane listeners bind here
    port: int = 0  # prefill control-plane port; 0 = any free port
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 2.5  # a silent peer is dead after this: its blocks are reclaimed
    transfer_timeout_s: float = 30.0  # deadline of one request's transfer

    def transport_config(self) -> TransportConfig:
        return TransportConfig(timeout_s=self.transfer_timeout_s, host=self.host, secret=self.secret)


def model_fingerprint(model_dir: str | Path, kv_fingerprint: str = "") -> str:
    """Hash of the model's config and weight file names/sizes, and of what else decides its KV (CausalLM.
    kv_fingerprint: its LoRA adapters' names and contents, longrope's table): two workers serving different models
    (or different conversions, different adapters under one name, or one longrope model at max_model_lens either
    side of its original context) must not exchange KV."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    if kv_fingerprint:
        h.update(f"kv:{kv_fingerprint}".encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:24]


def kv_layout(kv_spec, state_shape=None, num_state_blocks: int = 0, tensor_parallel_size: int = 1) -> KVLayout:
    """``state_shape``: a hybrid model's MambaStateShape (None for attention-only models). ``kv_spec``: one rank's
    cache where the model is split ``tensor_parallel_size`` ways."""
    state = {}
    if state_shape is not None:
        state = dict(num_state_blocks=num_state_blocks, state_num_layers=state_shape.num_mamba_layers,
                     state_conv_dim=state_shape.conv_dim, state_conv_width=state_shape.conv_width,
                     state_num_heads=state_shape.num_heads, state_head_dim=state_shape.head_dim,
                     state_size=state_shape.state_size)
    return KVLayout(**state,
        num_layers=kv_spec.num_layers,
        num_draft_layers=kv_spec.num_draft_layers,
        block_size=kv_spec.block_size,
        num_kv_heads=kv_spec.num_kv_heads,
        head_dim=kv_spec.head_dim,
        dtype=str(kv_spec.dtype).removeprefix("torch."),
        num_planes=kv_spec.num_planes,
        tensor_parallel_size=tensor_parallel_size,
    )


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)
