"""Ranks 1 .. n-1 of a tensor-parallel engine, each in its own process: join the group, load this rank's slice, make
this rank's KV cache, then run one forward per message from rank 0 until it says stop (or its pipe closes: rank 0 is
gone). Rank 0 computes the logits; the point is this rank's share of each all-reduce, and its part of the KV written
into its cache. The last forward's hidden states are kept only for an MTP draft's next forward (engine/tensor_parallel/
draft.py), a hybrid's Mamba state lives here as its heads' share (its pool, KeepStates, MoveStates), and LoRA adapters
as this rank's slices of them (engine/tensor_parallel/shard_lora.py; AddLora, RemoveLora while serving)."""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from dataclasses import replace
from multiprocessing.reduction import recv_handle

import torch

from pdcluster.engine.tensor_parallel.messages import (AddLora, AllocateCache, CommitWeights, DraftForward, Forward,
                                                       KeepStates, MoveStates, ReadWeights, RemoveLora, Stop,
                                                       WorkerSpec, decode, encode_status, on_device)


def worker_main(conn, spec: WorkerSpec) -> None:
    """The process's entry (multiprocessing, spawned). Reports ("loaded" | "ready" | "error", detail) on ``conn``."""
    logging.basicConfig(level=os.environ.get("PDCLUSTER_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s tp{spec.rank} %(name)s %(levelname)s %(message)s")
    try:
        _serve(conn, spec)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # rank 0 went away: nothing left to serve
    except BaseException:  # noqa: BLE001 - told to rank 0, whatever it was
        try:
            story = traceback.format_exc(limit=8)
            conn.send_bytes(encode_status("error", f"tensor-parallel rank {spec.rank}: {story}"))
        except OSError:
            pass
        raise SystemExit(1) from None


def _parent_alive(parent_pid: int):
    """A check for a CPU rank waiting in an all-reduce: rank 0 (its parent) gone means no forward will end."""
    def check() -> None:
        if os.getppid() != parent_pid:
            raise EOFError("rank 0 is gone")
    return check


def _serve(conn, spec: WorkerSpec) -> None:
    from pdcluster.engine.kv_cache import allocate_kv_cache
    from pdcluster.engine.memory import keep_freed_memory
    from pdcluster.engine.models.architectures import load_model
    from pdcluster.engine.tensor_parallel.group import TPGroup
    from pdcluster.engine.tensor_parallel.shared_cache import map_shared_cache

    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    group = TPGroup.join(spec.rank, spec.world_size, device, shm_path=spec.shm_path, port=spec.port)
    if group.shm is not None:
        group.shm.check_peers = _parent_alive(os.getppid())
    with torch.inference_mode():
        model = load_model(spec.model_dir, getattr(torch, spec.dtype_name), spec.max_positions, device,
                           deterministic=spec.deterministic, max_model_len=spec.max_model_len,
                           group=group, **_split(spec))
    if spec.lora_modules or spec.enable_lora:
        _install_lora(model, spec)
    draft = _RankDraft(model, spec) if spec.draft else None
    model.lm_head = None  # rank 0 alone computes logits (a tied head is the embedding, still held)
    if spec.pipeline:  # a later stage: rank 0 embeds and computes the logits
        model.embed_tokens = model.lm_head_proj = None
    conn.send_bytes(encode_status("loaded"))
    message = decode(conn.recv_bytes())
    if isinstance(message, Stop):
        return
    if not isinstance(message, AllocateCache):
        raise RuntimeError(f"expected the KV cache's spec, got {type(message).__name__}")
    if message.shared:  # rank 0's KV transport moves this cache too: compute in the segment rank 0 made
        kv_cache = map_shared_cache(recv_handle(conn), message.kv_spec)
    elif spec.pipeline:  # rank 0's spec, with this stage's layers
        kv_cache = allocate_kv_cache(replace(message.kv_spec, num_layers=len(model.layers)), device)
    else:
        kv_cache = allocate_kv_cache(message.kv_spec, device)
    conn.send_bytes(encode_status("ready"))
    states = _RankStates(model, device)
    last_hidden = None  # the last target forward's (an MTP draft's first forward reads rows of it)
    read_weights = None  # a new checkpoint's slice, read and not yet copied in (ReadWeights, CommitWeights)
    while True:
        message = decode(conn.recv_bytes())
        if isinstance(message, Stop):
            return
        if isinstance(message, (ReadWeights, CommitWeights)):
            read_weights = _weights_message(conn, spec, model, group, message, read_weights)
            continue
        if isinstance(message, KeepStates):
            states.pool.select(message.slots_np, message.position_index_np)
            continue
        if isinstance(message, MoveStates):
            states.move(message, kv_cache)
            if message.pack:  # rank 0 sends the blocks once every rank has packed (TensorParallelDriver.pack_states)
                group.all_reduce_(torch.zeros(1, device=device))
            continue
        if isinstance(message, AddLora):
            _add_lora(model, message)
            continue
        if isinstance(message, RemoveLora):
            from pdcluster.engine.lora import remove

            remove(model, message.slot)
            continue
        if isinstance(message, DraftForward):
            if draft is None:
                raise RuntimeError("an MTP forward reached a rank that loaded no MTP layers")
            with torch.inference_mode():
                draft.forward(message, kv_cache, last_hidden)
            continue
        if not isinstance(message, Forward):
            raise RuntimeError(f"unexpected message {type(message).__name__}")
        meta = on_device(message.meta, device)
        if meta.mamba is not None:
            meta = replace(meta, mamba=replace(meta.mamba, pool=states.pool_of(message.mamba_pool_size)))
        lora_rows = contextlib.nullcontext()
        if message.lora_rows is not None:
            if model.lora is None:
                raise RuntimeError("a forward with LoRA rows reached a rank that holds no adapters")
            lora_rows = model.lora.step(*message.lora_rows, device)
        if message.image_rows is not None:
            rows, embeds = message.image_rows
            model.image_rows = (rows.to(device), embeds.to(device))
        if message.prompt_rows is not None:
            rows, embeds = message.prompt_rows
            model.prompt_rows = (rows.to(device), embeds.to(device))
        try:
            with torch.inference_mode(), lora_rows:
                last_hidden = model.forward(message.input_ids.to(device), message.positions.to(device), kv_cache, meta)
        finally:
            model.image_rows = model.prompt_rows = None


def _split(spec: WorkerSpec) -> dict:
    """load_model's keyword for this rank's part: its slice of every layer, or its stage of the layers."""
    if spec.pipeline:
        from pdcluster.engine.models.architectures import arch_from_dir
        from pdcluster.engine.pipeline_parallel import stage_of

        return {"stage": stage_of(spec.rank, spec.world_size, arch_from_dir(spec.model_dir).num_layers)}
    from pdcluster.engine.tensor_parallel.layers import Shard

    return {"shard": Shard(spec.rank, spec.world_size)}


def _weights_message(conn, spec: WorkerSpec, model, group, message, read_weights):
    """A weight update's step on this rank (engine/weight_update.py): read this rank's slice of the new checkpoint
    (its contents checked against rank 0's digest) or copy it in; answers rank 0. A failure is told as "refused" and
    the rank serves on with the weights it has. Returns the slice now held (None after a copy or a discard)."""
    from pdcluster.engine.models.architectures import load_model
    from pdcluster.engine.tensor_parallel.layers import Shard
    from pdcluster.engine.weight_update import checkpoint_digest, copy_weights

    try:
        if isinstance(message, ReadWeights):
            read_weights = None  # the one held before goes first
            digest = checkpoint_digest(message.model_dir)
            if digest != message.digest:
                raise ValueError(f"{message.model_dir} holds other contents here ({digest}) than rank 0 read "
                                 f"({message.digest})")
            with torch.inference_mode():
                read_weights = load_model(message.model_dir, getattr(torch, spec.dtype_name), spec.max_positions,
                                          torch.device(spec.device), deterministic=spec.deterministic,
                                          max_model_len=spec.max_model_len, shard=Shard(spec.rank, spec.world_size),
                                          group=group)
            read_weights.lm_head = None  # as the served slice: rank 0 alone computes logits
            conn.send_bytes(encode_status("weights_read"))
            return read_weights
        if message.discard:
            return None
        if read_weights is None:
            raise ValueError("no weights were read to copy")
        copy_weights(model, read_weights)
        conn.send_bytes(encode_status("weights_copied"))
        return None
    except Exception as e:  # noqa: BLE001 - told to rank 0; this rank goes on serving its weights
        conn.send_bytes(encode_status("refused", f"tensor-parallel rank {spec.rank}: {type(e).__name__}: {e}"))
        return None


def _install_lora(model, spec: WorkerSpec) -> None:
    """The start-up adapters, this rank's slices of them, refused unless they hold what rank 0 read."""
    from pdcluster.engine.lora import install, load_adapter

    adapters = [load_adapter(name, path, spec.max_lora_rank) for name, path in spec.lora_modules.items()]
    read = {a.name: a.digest for a in adapters}
    if read != spec.lora_digests:
        raise RuntimeError(f"LoRA adapters changed on disk while the ranks read them: rank 0 read {spec.lora_digests}, "
                           f"this rank {read}")
    install(model, adapters, runtime=spec.enable_lora)


def _add_lora(model, message: AddLora) -> None:
    """An adapter loaded while serving, in the slot rank 0 put it in (the slots index every rank's updates alike)."""
    from pdcluster.engine.lora import add
    from pdcluster.engine.lora.adapter import parse_adapter

    adapter = parse_adapter(message.name, message.path, message.config_bytes, message.weights_bytes, message.max_rank)
    if model.lora is None or model.lora.free_slot() != message.slot:
        raise RuntimeError(f"LoRA adapter {message.name!r}: rank 0 holds it in slot {message.slot}, this rank's free "
                           f"slot is {None if model.lora is None else model.lora.free_slot()}")
    add(model, adapter)


class _RankDraft:
    """This rank's slice of the MTP draft (the checkpoint's own MTP layers, or a draft head) and the hidden states of
    its last MTP forward."""

    def __init__(self, model, spec: WorkerSpec) -> None:
        from pdcluster.engine.models.mtp import resolve_mtp_weights
        from pdcluster.engine.tensor_parallel.draft import draft_head, load_own_mtp_weights, own_mtp_head

        self.device = model.device
        if spec.draft == "own":
            self.head = own_mtp_head(model, load_own_mtp_weights(spec.model_dir, model.unsplit_arch))
        else:  # a draft head, resolved as rank 0 resolved it (LLMEngine); rank 0 alone turns it into tokens
            weights, _ = resolve_mtp_weights(spec.mtp_checkpoint, spec.mtp_cache_dir, spec.model_name,
                                             model.unsplit_arch, spec.seed)
            self.head = draft_head(model, weights, spec.draft_vocab_size, spec.eagle3_buffer_tokens)
        self.first_layer = model.arch.num_layers  # the draft layers sit right after the target's
        self.last_g: torch.Tensor | None = None

    def forward(self, message: DraftForward, kv_cache: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        source = target_hidden if message.from_target else self.last_g
        if source is None:
            raise RuntimeError("an MTP forward came before the forward its hidden states are from")
        rows = torch.from_numpy(message.rows_np).to(self.device)
        fuse = getattr(self.head, "target_hidden", None) if message.from_target else None  # EAGLE-3: aux states
        hidden = source[rows] if fuse is None else fuse(source, rows)
        self.last_g = self.head.forward(hidden, torch.from_numpy(message.next_token_ids_np).to(self.device),
                                        torch.from_numpy(message.positions_np).to(self.device),
                                        self.head.draft_cache(kv_cache, self.first_layer),
                                        on_device(message.meta, self.device))


class _RankStates:
    """A hybrid rank's Mamba state pool: its heads' conv and SSM states of every slot, made at the first forward
    with Mamba rows, as large as rank 0's (the same slots index the same requests on every rank)."""

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device
        self.pool = None

    def pool_of(self, size: tuple[int, int] | None):
        from pdcluster.engine.mamba_state import MambaStatePool

        if size is None:
            raise RuntimeError("a forward's Mamba rows came without rank 0's state pool size")
        if self.pool is None:
            self.pool = MambaStatePool(self.model.arch.mamba_state_shape(), size[0], size[1], self.device)
        elif (self.pool.num_slots, self.pool.max_positions_per_step) != tuple(size):
            raise RuntimeError(f"rank 0's Mamba state pool changed size: {size}, this rank's is "
                               f"{(self.pool.num_slots, self.pool.max_positions_per_step)}")
        return self.pool

    def move(self, message: MoveStates, kv_cache: torch.Tensor) -> None:
        """Packs (or unpacks) each slot's state of this rank's heads into (from) its own cache's state blocks."""
        from pdcluster.engine.mamba_state_blocks import pack_state, unpack_state

        pool = self.pool_of(message.pool_size)
        with torch.inference_mode():
            for slot, block_ids in zip(message.slots_np.tolist(), message.block_ids_np.tolist()):
                if message.pack:
                    pack_state(pool, slot, kv_cache, block_ids)
                else:
                    unpack_state(kv_cache, block_ids, pool, slot)
