"""How much device memory the paged KV pool gets on a GPU: vLLM's ``--gpu-memory-utilization``.

The engine may use ``gpu_memory_utilization`` of the GPU's memory in all. What it needs besides the KV pool is
the weights (allocated when this runs), the peak of one step's activations (measured: a profile forward of a
full step, ``max_num_batched_tokens`` prompt tokens as requests of at most ``max_model_len`` each and the
logits of ``max_num_seqs`` rows, over a scratch
cache) and what the process holds outside torch's allocator (the CUDA context, cuBLAS workspaces). The pool
gets the rest:

    kv bytes = utilization x total - (weights and other tensors + activation peak + non-torch memory)

as vLLM v1 sizes it. Workers sharing a GPU (``serve --mode disagg`` on one GPU) each get their share of the
utilization from the launcher. On a CPU the pool keeps its fixed budget (``kv_cache_memory_gib``, 1 GiB
by default). Hybrid models (Mamba state in the pool) are not profiled: their activation reserve is a fixed
fraction of the GPU (``HYBRID_ACTIVATION_FRACTION``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdcluster.engine.kv_cache import KVCacheSpec, kv_planes

log = logging.getLogger(__name__)

GIB = 1 << 30
CPU_DEFAULT_GIB = 1.0  # kv_cache_memory_gib 0 (auto) on a CPU
HYBRID_ACTIVATION_FRACTION = 0.05


class KVBudgetError(ValueError):
    """The model and one step's activations leave no room for a KV pool under the utilization asked for."""


@dataclass(frozen=True)
class MemorySnapshot:
    """A GPU's memory as this process sees it, in bytes."""

    total: int
    free: int  # free on the device (every process)
    allocated: int  # live tensors of this process
    reserved: int  # held by this process's caching allocator (allocated or not)

    @property
    def non_torch(self) -> int:
        """What this process holds outside torch's allocator: the used memory torch does not account for (the
        CUDA context; other processes' memory counts here too when they share the GPU, which errs safe)."""
        return max(0, self.total - self.free - self.reserved)


def kv_pool_bytes(snapshot: MemorySnapshot, activation_peak: int, utilization: float) -> int:
    """The KV pool's bytes under ``utilization`` of the GPU; KVBudgetError naming the numbers when nothing is
    left."""
    requested = int(utilization * snapshot.total)
    needed = snapshot.allocated + activation_peak + snapshot.non_torch
    pool = requested - needed
    if pool <= 0:
        raise KVBudgetError(
            f"gpu_memory_utilization {utilization:g} gives {requested / GIB:.2f} GiB of the GPU's "
            f"{snapshot.total / GIB:.2f} GiB, but the weights and other tensors take {snapshot.allocated / GIB:.2f} GiB, "
            f"a step's activations {activation_peak / GIB:.2f} GiB and memory outside torch "
            f"{snapshot.non_torch / GIB:.2f} GiB: no room for the KV cache. Raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, or give --kv-cache-memory-gib")
    return pool


def snapshot(device: torch.device) -> MemorySnapshot:
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(total=total, free=free, allocated=torch.cuda.memory_allocated(device),
                          reserved=torch.cuda.memory_reserved(device))


def profile_activation_peak(model, num_tokens: int, num_logit_rows: int, block_size: int, device: torch.device,
                            measure=None, max_seq_len: int = 0) -> int:
    """Bytes a step of ``num_tokens`` prompt tokens and the logits of ``num_logit_rows`` rows add at their peak over
    what is allocated before it, over a scratch cache of just those tokens (freed after). The tokens are requests
    from position 0 of at most ``max_seq_len`` tokens each (0: one request), as vLLM's profile run splits its
    budget: a step's budget may be larger than the model's context (8,192 tokens on an H100, the context capped
    at 4,096), and a position past the rotary table would be read out of bounds. ``measure``: (reset, peak,
    allocated) callables (tests pass their own; default torch.cuda's peak statistics on ``device``)."""
    from pdcluster.engine.attention import AttentionMetadata

    if measure is None:
        measure = (lambda: torch.cuda.reset_peak_memory_stats(device), lambda: torch.cuda.max_memory_allocated(device),
                   lambda: torch.cuda.memory_allocated(device))
    reset, peak, allocated = measure
    a = model.arch
    seq_lens = profile_seq_lens(num_tokens, max_seq_len)
    blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = blocks_per_seq * len(seq_lens)
    spec = KVCacheSpec(a.num_layers, 0, num_blocks, block_size, a.num_kv_heads, a.head_dim, model.dtype,
                       num_planes=kv_planes(a))
    cache = torch.zeros(spec.shape, dtype=model.dtype, device=device)
    # Request i holds blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq): its slots start at its first block.
    positions = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
    first_slot = torch.cat([torch.full((n,), i * blocks_per_seq * block_size) for i, n in enumerate(seq_lens)])
    block_tables = torch.arange(num_blocks, dtype=torch.int32).view(len(seq_lens), blocks_per_seq)
    starts = torch.tensor([0, *seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=positions + first_slot.to(device), block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc=starts.to(device),
        uniform_q_len=None, scale=model.scale)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    before = allocated()
    reset()
    with torch.inference_mode():
        hidden = model.forward(input_ids, positions, cache, meta)
        model.compute_logits(hidden[-num_logit_rows:])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    used = max(0, peak() - before)
    del cache, hidden
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return used


def profile_seq_lens(num_tokens: int, max_seq_len: int) -> list[int]:
    """``num_tokens`` as requests of at most ``max_seq_len`` tokens (0: one request)."""
    if max_seq_len <= 0 or num_tokens <= max_seq_len:
        return [num_tokens]
    full, rest = divmod(num_tokens, max_seq_len)
    return [max_seq_len] * full + ([rest] if rest else [])


def cuda_kv_pool_bytes(model, config, hybrid: bool, device: torch.device, max_model_len: int) -> int:
    """The pool's bytes on this GPU for ``config`` (EngineConfig: gpu_memory_utilization, the step sizes); the
    profile step's requests are at most ``max_model_len`` tokens."""
    total = torch.cuda.mem_get_info(device)[1]
    if hybrid:
        peak = int(HYBRID_ACTIVATION_FRACTION * total)
    else:
        peak = profile_activation_peak(model, config.max_num_batched_tokens, min(config.max_num_seqs,
                                       config.max_num_batched_tokens), config.block_size, device,
                                       max_seq_len=max_model_len)
    snap = snapshot(device)
    pool = kv_pool_bytes(snap, peak, config.gpu_memory_utilization)
    log.info("KV cache: %.2f GiB (gpu_memory_utilization %g of %.2f GiB; weights %.2f GiB, activation peak "
             "%.2f GiB, outside torch %.2f GiB)", pool / GIB, config.gpu_memory_utilization, snap.total / GIB,
             snap.allocated / GIB, peak / GIB, snap.non_torch / GIB)
    return pool
