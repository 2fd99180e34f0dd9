"""What rank 0 and the other ranks say over each rank's pipe, as msgpack (no pickle on any path we decode:
tests/test_no_pickle.py): rank 0 sends where the KV cache is, then one message per forward, then stop; a rank answers
"loaded", "ready" or "error". Tensors travel as (dtype, shape, bytes) host copies; a rank moves them to its device."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import msgpack
import numpy as np
import torch

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to load its slice (the model directory rank 0 resolved, the engine's resolved
    settings), and how to reach rank 0's rendezvous. Handed to the spawned process as its argument."""

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
    # The cache is a shared-memory segment rank 0 made, whose descriptor follows on the pipe (shared_cache.py).
    shared: bool = False


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass(frozen=True)
class Stop:
    pass


# ---- rank 0 -> the others -------------------------------------------------------------------------------------

def encode(message: AllocateCache | Forward | Stop) -> bytes:
    if isinstance(message, Forward):
        body = {"kind": "forward", "input_ids": _tensor(message.input_ids), "positions": _tensor(message.positions),
                "meta": _meta(message.meta)}
    elif isinstance(message, AllocateCache):
        spec = message.kv_spec
        sizes = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "dtype"}
        body = {"kind": "allocate", "kv_spec": sizes, "dtype": _dtype_name(spec.dtype), "shared": message.shared}
    elif isinstance(message, Stop):
        body = {"kind": "stop"}
    else:
        raise TypeError(f"not a rank message: {type(message).__name__}")
    return msgpack.packb(body, use_bin_type=True)


def decode(payload: bytes) -> AllocateCache | Forward | Stop:
    """ValueError for anything not encode's."""
    try:
        body = msgpack.unpackb(payload, raw=False)
        kind = body["kind"]
        if kind == "forward":
            return Forward(_untensor(body["input_ids"]), _untensor(body["positions"]), _unmeta(body["meta"]))
        if kind == "allocate":
            return AllocateCache(KVCacheSpec(**body["kv_spec"], dtype=_dtype(body["dtype"])), bool(body["shared"]))
        if kind == "stop":
            return Stop()
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed rank message: {e}") from None
    raise ValueError(f"unknown rank message kind {kind!r}")


# ---- the others -> rank 0 -------------------------------------------------------------------------------------

STATUSES = ("loaded", "ready", "error")


def encode_status(status: str, detail: str = "") -> bytes:
    return msgpack.packb({"status": status, "detail": detail}, use_bin_type=True)


def decode_status(payload: bytes) -> tuple[str, str]:
    try:
        body = msgpack.unpackb(payload, raw=False)
        status, detail = body["status"], str(body.get("detail", ""))
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed rank status: {e}") from None
    if status not in STATUSES:
        raise ValueError(f"unknown rank status {status!r}")
    return status, detail


# ---- values ---------------------------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _tensor(t: torch.Tensor) -> dict:
    """A compact host copy (a view of a persistent step buffer is sent as its own elements only)."""
    t = t.detach().to("cpu").contiguous()
    return {"dtype": _dtype_name(t.dtype), "shape": list(t.shape),
            "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}


def _untensor(v: dict) -> torch.Tensor:
    dtype, shape, data = _dtype(v["dtype"]), [int(n) for n in v["shape"]], v["data"]
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _meta(meta: AttentionMetadata) -> dict:
    out = {}
    for f in fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = {"tensor": _tensor(value)}
        elif isinstance(value, np.ndarray):
            out[f.name] = {"array": _tensor(torch.from_numpy(np.ascontiguousarray(value)))}
        elif value is None or isinstance(value, (bool, int, float)):
            out[f.name] = {"value": value}
        else:  # a hybrid's Mamba plan: hybrids do not split (shard.check_shardable)
            raise TypeError(f"AttentionMetadata.{f.name} ({type(value).__name__}) does not travel to other ranks")
    return out


def _unmeta(body: dict) -> AttentionMetadata:
    values = {}
    for name, v in body.items():
        if "tensor" in v:
            values[name] = _untensor(v["tensor"])
        elif "array" in v:
            values[name] = _untensor(v["array"]).numpy()
        else:
            values[name] = v["value"]
    return AttentionMetadata(**values)


def on_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``meta`` with its tensors on a rank's device."""
    if device.type == "cpu":
        return meta
    return replace(meta, **{f.name: v.to(device) for f in fields(meta)
                            if isinstance(v := getattr(meta, f.name), torch.Tensor)})
