"""What rank 0 sends the other ranks (pickled over each worker's pipe): how to load their slice, where their KV cache
is, and then one message per forward. Tensors travel on the host; a worker moves them to its device."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from pdcluster.engine.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to load its slice (the model directory rank 0 resolved, the engine's resolved
    settings), and how to reach rank 0's rendezvous."""

    rank: int
    world_size: int
    port: int  # GPU ranks: rank 0's TCP store (the NCCL rendezvous)
    shm_path: str  # CPU ranks: the all-reduce segment (shm_allreduce.py)
    model_dir: str
    dtype_name: str
    max_positions: int
    max_model_len: int
    device: str
    deterministic: bool
    num_threads: int


@dataclass(frozen=True)
class AllocateCache:
    kv_spec: KVCacheSpec  # rank 0's, sized by its slice of the KV heads (every rank's is the same)


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object  # engine/attention.py AttentionMetadata


@dataclass(frozen=True)
class Stop:
    pass


def on_host(value):
    """``value`` with every tensor in it (a dataclass's fields, one level) as a compact host copy: a view of a
    persistent step buffer would otherwise pickle the whole buffer."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if is_dataclass(value) and not isinstance(value, type):
        changed = {f.name: on_host(v) for f in fields(value) if isinstance(v := getattr(value, f.name), torch.Tensor)}
        return replace(value, **changed) if changed else value
    return value


def on_device(value, device: torch.device):
    """The inverse of ``on_host`` on a worker: the tensors moved to its device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if is_dataclass(value) and not isinstance(value, type):
        changed = {f.name: v.to(device) for f in fields(value) if isinstance(v := getattr(value, f.name), torch.Tensor)}
        return replace(value, **changed) if changed else value
    return value
