"""The ops the engine calls: Triton kernels on CUDA tensors, the C kernels on CPU tensors
(kernels/csrc/cpu_kernels.c, built once per machine), torch reference otherwise.

Signatures, tensor shapes and semantics are those of the same-named functions in
:mod:`pdcluster.kernels.reference`, written down there once; the functions here only pick the
implementation. Triton is imported lazily, only when a CUDA tensor arrives, so this module imports
(and the CPU engine runs) without triton installed; the C kernels are built on first use and, without
a compiler, the reference runs instead.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from pdcluster.kernels import cpu_ops, reference


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (checked once; find_spec does not import it)."""
    return importlib.util.find_spec("triton") is not None


# The Triton paged-attention tiles hold heads of up to 256 dims (accumulators in registers, K and V tiles in shared
# memory). Wider heads take the torch reference on CUDA, whose host reads keep such models out of CUDA graphs
# (engine/model_runner.py); MLA's 576-wide latents have a kernel of their own (latent_attention).
TRITON_MAX_HEAD_DIM = 256


def triton_attention_takes(head_dim: int) -> bool:
    return head_dim <= TRITON_MAX_HEAD_DIM


def _use_triton(*tensors: Tensor) -> bool:
    """Triton only when every tensor is on a CUDA device: the compiled kernels address device memory,
    and on CPU the reference is the engine's path (the interpreter is for tests only)."""
    return all(t.is_cuda for t in tensors) and triton_available()


def write_kv(key: Tensor, value: Tensor, layer_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write each token's K and V into its slot of the paged cache (in place)."""
    if _use_triton(key, value, layer_cache, slot_mapping):
        from pdcluster.kernels.triton_write_kv import write_kv_triton

        write_kv_triton(key, value, layer_cache, slot_mapping)
    elif not cpu_ops.write_kv(key, value, layer_cache, slot_mapping):
        reference.write_kv(key, value, layer_cache, slot_mapping)


def paged_attention(
    query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float,
    batch_invariant: bool = True, window: int = 0, softcap: float = 0.0, sinks: Tensor | None = None,
    chunk: int = 0, uniform_q_len: int | None = None,
) -> Tensor:
    """Causal attention of each request's new query tokens over its paged context. ``batch_invariant``:
    a query's bits independent of its batch (the CPU kernel always; on CUDA the fixed tiles, else the
    fast ones). ``window`` > 0: sliding-window attention (each query sees its last ``window`` positions);
    ``softcap`` > 0: scores capped by softcap * tanh(s / softcap) (Gemma 2); ``sinks`` (float32 [num_q_heads]):
    gpt-oss's attention sinks, one value-less logit per head in each softmax; ``chunk`` > 0: chunked attention (each
    query sees the keys of its own chunk of ``chunk`` positions: Llama 4's local layers)."""
    if _use_triton(query, layer_cache, block_tables, seq_lens, query_start_loc) and triton_attention_takes(
            query.shape[-1]):
        from pdcluster.kernels.triton_paged_attention import paged_attention_triton

        # The kernel takes the query's strides: the model's q is a strided view of its qkv projection, and
        # packing it first was a copy kernel a layer (on the H100: 0.055 ms of a 5.2 ms batch-128 decode
        # step, 3.8 ms of the 16 x 2,048 prefill).
        return paged_attention_triton(query, layer_cache, block_tables, seq_lens, query_start_loc, scale,
                                      batch_invariant=batch_invariant, window=window, softcap=softcap, sinks=sinks,
                                      chunk=chunk, uniform_q_len=uniform_q_len)
    out = cpu_ops.paged_attention(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, window=window,
                                  softcap=softcap, sinks=sinks, chunk=chunk)
    if out is not None:
        return out
    return reference.paged_attention(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, window,
                                     softcap, sinks, chunk)


def latent_attention(query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                     query_start_loc: Tensor, scale: float, latent_dim: int, batch_invariant: bool = True) -> Tensor:
    """Absorbed MLA over the one-plane latent cache (reference.latent_attention): [num_tokens, num_heads,
    latent_dim]. CUDA: the latent kernel (kernels/triton_mla_attention.py: any width, capturable in CUDA graphs);
    CPU: the C paged kernel over the plane as K and V (a stride-0 view), keeping the latent dims."""
    if _use_triton(query, layer_cache, block_tables, seq_lens, query_start_loc):
        from pdcluster.kernels.triton_mla_attention import mla_attention_triton

        return mla_attention_triton(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, latent_dim,
                                    batch_invariant=batch_invariant)
    out = cpu_ops.paged_attention(query, reference.layer_planes(layer_cache), block_tables, seq_lens, query_start_loc,
                                  scale)
    if out is not None:
        return out[:, :, :latent_dim]
    return reference.latent_attention(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, latent_dim)


def paged_attention_uniform(
    query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, q_len: int, scale: float
) -> Tensor:
    """Attention for a uniform-decode batch (every request has ``q_len`` new tokens)."""
    if not query.is_cuda and cpu_ops.available():
        # The C kernel is one kernel for every batch shape: a uniform batch is evenly spaced starts.
        num_reqs = seq_lens.shape[0]
        query_start_loc = torch.arange(0, (num_reqs + 1) * q_len, q_len, dtype=torch.int32)
        out = cpu_ops.paged_attention(query, layer_cache, block_tables, seq_lens, query_start_loc, scale)
        if out is not None:
            return out
    query = query.contiguous()  # the torch and Triton paths take a packed query
    if _use_triton(query, layer_cache, block_tables, seq_lens) and triton_attention_takes(query.shape[-1]):
        from pdcluster.kernels.triton_paged_attention import paged_attention_triton

        # The varlen kernel already handles this case; a uniform batch is just evenly spaced starts
        # (built on the device: no host sync).
        num_reqs = seq_lens.shape[0]
        query_start_loc = torch.arange(
            0, (num_reqs + 1) * q_len, q_len, dtype=torch.int32, device=query.device
        )
        return paged_attention_triton(query, layer_cache, block_tables, seq_lens, query_start_loc, scale)
    return reference.paged_attention_uniform(query, layer_cache, block_tables, seq_lens, q_len, scale)


def gather_blocks(kv_cache: Tensor, block_ids: Tensor, out: Tensor | None = None) -> Tensor:
    """Copy the listed blocks (all layers, K and V) into one contiguous buffer, in list order."""
    tensors = (kv_cache, block_ids) if out is None else (kv_cache, block_ids, out)
    if _use_triton(*tensors):
        from pdcluster.kernels.triton_block_copy import gather_blocks_triton

        return gather_blocks_triton(kv_cache, block_ids, out)
    return reference.gather_blocks(kv_cache, block_ids, out)


def scatter_blocks(buffer: Tensor, kv_cache: Tensor, block_ids: Tensor) -> None:
    """Write buffer entry ``i`` into block ``block_ids[i]`` (inverse of :func:`gather_blocks`)."""
    if _use_triton(buffer, kv_cache, block_ids):
        from pdcluster.kernels.triton_block_copy import scatter_blocks_triton

        scatter_blocks_triton(buffer, kv_cache, block_ids)
    else:
        reference.scatter_blocks(buffer, kv_cache, block_ids)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm, optionally fused with the residual add before it (one pass over the row)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if _use_triton(*tensors):
        from pdcluster.kernels.triton_rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    out = cpu_ops.rms_norm(x, weight, eps, residual)
    if out is not None:
        return out
    return reference.rms_norm(x, weight, eps, residual)


def rotary(x: Tensor, positions: Tensor, cos_sin: Tensor) -> None:
    """Rotary embedding of ``x`` [num_tokens, num_heads, head_dim] in place (heads may be strided)."""
    if _use_triton(x, positions, cos_sin):
        from pdcluster.kernels.triton_rotary import rotary_triton

        rotary_triton(x, positions, cos_sin)
        return
    if not cpu_ops.rotary(x, positions, cos_sin):
        reference.rotary(x, positions, cos_sin)


def rotary_write_kv(query: Tensor, key: Tensor, value: Tensor, positions: Tensor, cos_sin: Tensor,
                    layer_cache: Tensor, slot_mapping: Tensor) -> bool:
    """Rotary on ``query`` and ``key`` in place and the rotated K and V into the cache, in one kernel
    where Triton runs (CUDA): True. False elsewhere, having done nothing (the caller runs ``rotary`` and
    ``write_kv``, the same result)."""
    if not _use_triton(query, key, value, positions, cos_sin, layer_cache, slot_mapping):
        return False
    from pdcluster.kernels.triton_rotary_kv import rotary_write_kv_triton

    rotary_write_kv_triton(query, key, value, positions, cos_sin, layer_cache, slot_mapping)
    return True


def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for the fused gate/up projection's output."""
    if _use_triton(x):
        from pdcluster.kernels.triton_silu_and_mul import silu_and_mul_triton

        return silu_and_mul_triton(x)
    out = cpu_ops.silu_and_mul(x)
    if out is not None:
        return out
    return reference.silu_and_mul(x)


def argmax_rows(x: Tensor) -> Tensor:
    """Greedy token of each row of logits [num_rows, vocab] (first index of the maximum)."""
    out = cpu_ops.argmax_rows(x)
    return out if out is not None else x.argmax(dim=-1)
