"""What rank 0 and the other ranks say over each rank's pipe, as msgpack (no pickle on any path we decode:
tests/test_no_pickle.py): rank 0 sends where the KV cache is, then one message per forward (and, for a hybrid under
speculation, which per-position Mamba states its verification rows keep), then stop; a rank answers "loaded", "ready"
or "error". Tensors travel as (dtype, shape, bytes) host copies; a rank moves them to its device. A hybrid's Mamba rows
travel without rank 0's state pool: each rank runs them on its own pool (its heads' states), of the size rank 0's has
(``Forward.mamba_pool_size``). LoRA adapters loaded while serving travel as their files' bytes (``AddLora``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import msgpack
import numpy as np
import torch

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.kv_cache import KVCacheSpec
from pdcluster.engine.mamba_state import MambaMetadata


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
    # MTP speculation (TensorParallelDriver.start's ``draft``): "own" (the checkpoint's own MTP layers) or "head"
    # (our MTP head, resolved from mtp_checkpoint as rank 0 resolves it); the rank loads its slice of it. "": none.
    draft: str = ""
    mtp_checkpoint: str = ""
    mtp_cache_dir: str = ""
    model_name: str = ""
    seed: int = 0
    draft_vocab_size: int = 0  # our MTP head's and an EAGLE draft's (unused on a rank: rank 0 drafts)
    eagle3_buffer_tokens: int = 0  # an EAGLE-3 draft's aux hidden state buffer
    # LoRA (engine/lora/): the start-up adapters {name: directory} and the contents rank 0 read of each {name: digest};
    # adapters come and go while serving with enable_lora (AddLora / RemoveLora).
    lora_modules: dict[str, str] = field(default_factory=dict)
    lora_digests: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 0
    enable_lora: bool = False
    # Pipeline parallelism (engine/pipeline_parallel.py): the rank is a stage of the model's layers, not a slice of
    # every layer; world_size counts the stages.
    pipeline: bool = False


@dataclass(frozen=True)
class AllocateCache:
    kv_spec: KVCacheSpec  # rank 0's, sized by its slice of the KV heads (every rank's is the same)
    # The cache is a shared-memory segment rank 0 made, whose descriptor follows on the pipe (shared_cache.py).
    shared: bool = False


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata  # decoded: a hybrid's ``meta.mamba.pool`` is None (the rank puts its own there)
    # A hybrid's Mamba state pool on rank 0 as (num_slots, max_positions_per_step): what each rank's pool must be.
    mamba_pool_size: tuple[int, int] | None = None
    # The step's LoRA rows (LoraSet.step's arguments): each row's adapter slot (-1: none) and the rows' token offsets;
    # None when no row has an adapter.
    lora_rows: tuple[np.ndarray, np.ndarray] | None = None
    # The step's image placeholder rows and their embeddings (CausalLM.image_rows: rank 0 encodes the images, every
    # rank's whole embedding table then takes them); None when no row is an image's.
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # The step's prompt rows given as embeddings and theirs (CausalLM.prompt_rows: engine/prompt_embeds.py).
    prompt_rows: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class DraftForward:
    """One forward of the MTP draft (engine/tensor_parallel/draft.py): its input hidden states are rows ``rows_np`` of
    the rank's own last target forward (``from_target``; an EAGLE-3 draft fuses its aux states of those rows) or of
    its last MTP forward."""

    from_target: bool
    rows_np: np.ndarray  # int64
    next_token_ids_np: np.ndarray  # int64, one per row
    positions_np: np.ndarray  # int64, one per row
    meta: AttentionMetadata


@dataclass(frozen=True)
class MoveStates:
    """A split hybrid on a KV transport (engine/mamba_state_blocks.py): each rank packs its heads' Mamba state of slot
    ``slots_np[i]`` into the state blocks ``block_ids_np[i]`` of its own cache (``pack``, a prefill worker's finished
    prompts; rank 0 then waits for every rank in one all-reduce before the blocks are sent), or unpacks a transferred
    state from them into the slot (a decode worker's request starting)."""

    pack: bool
    slots_np: np.ndarray  # int64 [n]
    block_ids_np: np.ndarray  # int64 [n, num_state_blocks]
    pool_size: tuple[int, int]  # rank 0's pool (Forward.mamba_pool_size)


@dataclass(frozen=True)
class KeepStates:
    """A hybrid's verification rows keep the Mamba state after input position ``position_index_np[i]`` in slot
    ``slots_np[i]`` (MambaStatePool.select), on every rank as on rank 0, between the same two forwards."""

    slots_np: np.ndarray
    position_index_np: np.ndarray


@dataclass(frozen=True)
class AddLora:
    """An adapter loaded while serving (engine/lora/runtime.py): its files' bytes as rank 0 read them, so every rank
    parses the same contents; a rank holds its slice of it in ``slot`` (rank 0's)."""

    slot: int
    name: str
    path: str
    config_bytes: bytes
    weights_bytes: bytes
    max_rank: int


@dataclass(frozen=True)
class RemoveLora:
    slot: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class ReadWeights:
    """Read this rank's slice of the checkpoint in ``model_dir`` and hold it (engine/weight_update.py); its contents
    must have rank 0's ``digest``. Answered "weights_read" or "refused" (with the reason: the rank serves on)."""

    model_dir: str
    digest: str


@dataclass(frozen=True)
class CommitWeights:
    """Copy the slice read into the served tensors (answered "weights_copied" or "refused"); ``discard``: drop it."""

    discard: bool = False


# ---- rank 0 -> the others -------------------------------------------------------------------------------------

Message = (AllocateCache | Forward | DraftForward | MoveStates | KeepStates | AddLora | RemoveLora | ReadWeights
           | CommitWeights | Stop)


def encode(message: Message) -> bytes:
    if isinstance(message, Forward):
        body = {"kind": "forward", "input_ids": _tensor(message.input_ids), "positions": _tensor(message.positions),
                "meta": _meta(message.meta)}
        if message.lora_rows is not None:
            body["lora_rows"] = [_array(a) for a in message.lora_rows]
        for name in ("image_rows", "prompt_rows"):
            if getattr(message, name) is not None:
                body[name] = [_tensor(t) for t in getattr(message, name)]
    elif isinstance(message, AddLora):
        body = {"kind": "add_lora", "slot": int(message.slot), "name": message.name, "path": message.path,
                "config": message.config_bytes, "weights": message.weights_bytes, "max_rank": int(message.max_rank)}
    elif isinstance(message, RemoveLora):
        body = {"kind": "remove_lora", "slot": int(message.slot)}
    elif isinstance(message, DraftForward):
        body = {"kind": "draft_forward", "from_target": bool(message.from_target), "rows": _array(message.rows_np),
                "next_token_ids": _array(message.next_token_ids_np), "positions": _array(message.positions_np),
                "meta": _meta(message.meta)}
    elif isinstance(message, MoveStates):
        body = {"kind": "move_states", "pack": bool(message.pack), "slots": _array(message.slots_np),
                "block_ids": _array(message.block_ids_np), "pool_size": list(message.pool_size)}
    elif isinstance(message, KeepStates):
        body = {"kind": "keep_states", "slots": _array(message.slots_np),
                "positions": _array(message.position_index_np)}
    elif isinstance(message, AllocateCache):
        spec = message.kv_spec
        sizes = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "dtype"}
        body = {"kind": "allocate", "kv_spec": sizes, "dtype": _dtype_name(spec.dtype), "shared": message.shared}
    elif isinstance(message, ReadWeights):
        body = {"kind": "read_weights", "model_dir": message.model_dir, "digest": message.digest}
    elif isinstance(message, CommitWeights):
        body = {"kind": "commit_weights", "discard": bool(message.discard)}
    elif isinstance(message, Stop):
        body = {"kind": "stop"}
    else:
        raise TypeError(f"not a rank message: {type(message).__name__}")
    return msgpack.packb(body, use_bin_type=True)


def _rows(encoded, what: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A forward's (row ids, embeddings) pair as encode wrote it, or None."""
    if encoded is None:
        return None
    rows, embeds = (_untensor(t) for t in encoded)
    if rows.dim() != 1 or embeds.dim() != 2 or rows.shape[0] != embeds.shape[0]:
        raise ValueError(f"{what} rows {list(rows.shape)} and embeddings {list(embeds.shape)} do not pair")
    return rows, embeds


def decode(payload: bytes) -> Message:
    """ValueError for anything not encode's."""
    try:
        body = msgpack.unpackb(payload, raw=False)
        kind = body["kind"]
        if kind == "forward":
            meta, pool_size = _unmeta(body["meta"])
            lora_rows = body.get("lora_rows")
            if lora_rows is not None:
                adapter_of_row, query_start_loc = (_unarray(a) for a in lora_rows)
                lora_rows = (adapter_of_row, query_start_loc)
            return Forward(_untensor(body["input_ids"]), _untensor(body["positions"]), meta, pool_size, lora_rows,
                           _rows(body.get("image_rows"), "image"), _rows(body.get("prompt_rows"), "prompt"))
        if kind == "add_lora":
            config, weights = body["config"], body["weights"]
            if not isinstance(config, bytes) or not isinstance(weights, bytes):
                raise TypeError("an adapter's files travel as bytes")
            return AddLora(int(body["slot"]), str(body["name"]), str(body["path"]), config, weights,
                           int(body["max_rank"]))
        if kind == "remove_lora":
            return RemoveLora(int(body["slot"]))
        if kind == "draft_forward":
            meta, _ = _unmeta(body["meta"])
            return DraftForward(bool(body["from_target"]), _unarray(body["rows"]), _unarray(body["next_token_ids"]),
                                _unarray(body["positions"]), meta)
        if kind == "move_states":
            slots, positions = body["pool_size"]
            return MoveStates(bool(body["pack"]), _unarray(body["slots"]), _unarray(body["block_ids"]),
                              (int(slots), int(positions)))
        if kind == "keep_states":
            return KeepStates(_unarray(body["slots"]), _unarray(body["positions"]))
        if kind == "allocate":
            return AllocateCache(KVCacheSpec(**body["kv_spec"], dtype=_dtype(body["dtype"])), bool(body["shared"]))
        if kind == "read_weights":
            return ReadWeights(str(body["model_dir"]), str(body["digest"]))
        if kind == "commit_weights":
            return CommitWeights(bool(body["discard"]))
        if kind == "stop":
            return Stop()
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed rank message: {e}") from None
    raise ValueError(f"unknown rank message kind {kind!r}")


# ---- the others -> rank 0 -------------------------------------------------------------------------------------

STATUSES = ("loaded", "ready", "error", "weights_read", "weights_copied", "refused")


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


def _array(a: np.ndarray) -> dict:
    return _tensor(torch.from_numpy(np.ascontiguousarray(a)))


def _unarray(v: dict) -> np.ndarray:
    return _untensor(v).numpy()


# A hybrid step's Mamba rows: the host arrays each rank's layers plan the step from (MambaStepPlan.build). The plan
# and the device copy of the slots are CUDA graphs' (off with tensor parallelism): a rank builds its own plan.
_MAMBA_ROWS = ("query_start_loc_np", "state_slots_np", "has_initial_state_np", "keep_positions_np")


def _meta(meta: AttentionMetadata) -> dict:
    out = {}
    for f in fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = {"tensor": _tensor(value)}
        elif isinstance(value, np.ndarray):
            out[f.name] = {"array": _array(value)}
        elif value is None or isinstance(value, (bool, int, float)):
            out[f.name] = {"value": value}
        elif isinstance(value, MambaMetadata):
            pool = value.pool
            out[f.name] = {"mamba": {name: _array(getattr(value, name)) for name in _MAMBA_ROWS},
                           "pool_size": [pool.num_slots, pool.max_positions_per_step]}
        else:
            raise TypeError(f"AttentionMetadata.{f.name} ({type(value).__name__}) does not travel to other ranks")
    return out


def _unmeta(body: dict) -> tuple[AttentionMetadata, tuple[int, int] | None]:
    values, pool_size = {}, None
    for name, v in body.items():
        if "tensor" in v:
            values[name] = _untensor(v["tensor"])
        elif "array" in v:
            values[name] = _unarray(v["array"])
        elif "mamba" in v:
            rows = v["mamba"]
            values[name] = MambaMetadata(None, **{key: _unarray(rows[key]) for key in _MAMBA_ROWS})
            slots, positions = v["pool_size"]
            pool_size = (int(slots), int(positions))
        else:
            values[name] = v["value"]
    return AttentionMetadata(**values), pool_size


def on_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``meta`` with its tensors on a rank's device."""
    if device.type == "cpu":
        return meta
    return replace(meta, **{f.name: v.to(device) for f in fields(meta)
                            if isinstance(v := getattr(meta, f.name), torch.Tensor)})
