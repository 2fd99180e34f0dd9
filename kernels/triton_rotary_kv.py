"""Triton kernel: rotary embedding of a token's query and key heads and the write of its K and V into the
paged cache, in one launch (the CUDA decode step's rotary and KV-write kernels, fused: one kernel a layer
fewer, and K is not read back from memory to be written).

Same result as :func:`pdcluster.kernels.triton_rotary.rotary_triton` on q and k (in place, the same
rotation, ``_rotate_heads``) followed by :func:`pdcluster.kernels.triton_write_kv.write_kv_triton` of the
rotated k and of v: bit for bit, since both round the rotated values to the activations' dtype first. A
negative slot (batch padding) rotates but writes nothing, as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels import launch_pdl
from pdcluster.kernels.triton_pdl import wait_then_release
from pdcluster.kernels.triton_rotary import _cos_sin, _rotate_heads
from pdcluster.kernels.triton_write_kv import to_cache_dtype


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_q_heads,
    num_kv_heads,
    half,  # head_dim // 2
    block_size,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_cos_sin_pos,
    stride_cos_sin_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_cache_dim,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
):
    wait_then_release(USE_PDL)
    token_idx = tl.program_id(0).to(tl.int64)
    cos, sin, dims, dim_mask = _cos_sin(positions_ptr, token_idx, cos_sin_ptr, half, stride_cos_sin_pos,
                                        stride_cos_sin_dim, HALF_PAD)
    _rotate_heads(q_ptr + token_idx * stride_q_token, num_q_heads, half, stride_q_head, stride_q_dim, cos, sin,
                  dims, dim_mask, Q_HEADS_PAD)
    k1, k2 = _rotate_heads(k_ptr + token_idx * stride_k_token, num_kv_heads, half, stride_k_head, stride_k_dim,
                           cos, sin, dims, dim_mask, KV_HEADS_PAD)

    heads = tl.arange(0, KV_HEADS_PAD)
    mask = (heads < num_kv_heads)[:, None] & dim_mask[None, :]
    v_first = v_ptr + token_idx * stride_v_token + heads[:, None] * stride_v_head + dims[None, :] * stride_v_dim
    v1 = tl.load(v_first, mask=mask)
    v2 = tl.load(v_first + half * stride_v_dim, mask=mask)
    write_token_kv(cache_ptr, tl.load(slot_mapping_ptr + token_idx), k1, k2, v1, v2, heads, dims, mask, half,
                   block_size, stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
                   stride_cache_dim)


@triton.jit
def write_token_kv(cache_ptr, slot, k1, k2, v1, v2, heads, dims, mask, half, block_size, stride_cache_kv,
                   stride_cache_block, stride_cache_slot, stride_cache_head, stride_cache_dim):
    """A token's K and V heads (two halves each, [KV_HEADS_PAD, HALF_PAD]) into its ``slot`` of the layer cache;
    a negative slot (batch padding) writes nothing. Shared with the skinny matmul's rotary epilogue
    (kernels/triton_skinny_epilogues.py)."""
    slot = slot.to(tl.int64)  # int64: slot * stride overflows int32 on caches of a few GiB
    if slot >= 0:
        first = (cache_ptr + (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
                 + heads[:, None] * stride_cache_head + dims[None, :] * stride_cache_dim)
        second = first + half * stride_cache_dim
        cache_dtype = cache_ptr.dtype.element_ty
        # Index 0 of the layer cache is K, index 1 is V.
        tl.store(first, to_cache_dtype(k1, cache_dtype), mask=mask)
        tl.store(second, to_cache_dtype(k2, cache_dtype), mask=mask)
        tl.store(first + stride_cache_kv, to_cache_dtype(v1, cache_dtype), mask=mask)
        tl.store(second + stride_cache_kv, to_cache_dtype(v2, cache_dtype), mask=mask)


def rotary_write_kv_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], rotated in place (any strides)
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # int64 [num_tokens]
    cos_sin: torch.Tensor,  # float32 [max_positions, head_dim]: cos of each frequency, then sin
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = padding, not written
) -> None:
    """Rotate ``query`` and ``key`` in place by each token's position and write the rotated K and V into
    the cache (see module doc)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd")
    if layer_cache.shape[0] != 2 or tuple(layer_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(f"layer_cache {tuple(layer_cache.shape)} does not fit key {tuple(key.shape)}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} / slot_mapping {tuple(slot_mapping.shape)} do not fit "
                         f"{num_tokens} tokens")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} does not fit head_dim {head_dim}")
    if num_tokens == 0:
        return
    _rotary_write_kv_kernel[(num_tokens,)](
        query, key, value, positions, cos_sin, layer_cache, slot_mapping,
        num_q_heads, num_kv_heads, head_dim // 2, layer_cache.shape[2],
        *query.stride(), *key.stride(), *value.stride(), *cos_sin.stride(), *layer_cache.stride(),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        **launch_pdl.options(query),
    )
