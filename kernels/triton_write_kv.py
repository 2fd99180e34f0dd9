"""Triton kernel: write each new token's K and V into its slot of a layer's paged KV cache.

Same semantics as :func:`pdcluster.kernels.reference.write_kv`; the cache layout is documented there
(``layer_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``, slot = block_id * block_size +
offset_in_block).

One program per token copies that token's whole ``[num_kv_heads, head_dim]`` tile for K and for V:
a token's heads are contiguous in the cache, so one program writes one contiguous run.

One deliberate difference: a negative slot (the usual padding marker when a batch is padded, e.g. to a
CUDA-graph size) is skipped. The torch reference would raise on it; on a GPU it would be an
out-of-bounds write, so skipping is the only safe choice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_bits(x, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_FINITE: tl.constexpr):
    """The fp8 code (int32 in [0, 255]) of ``x`` in the format with MBITS mantissa bits and exponent bias BIAS: rounded
    to nearest even, saturating at MAX_FINITE (the C kernel's f32_to_fp8, torch's clamp-then-cast). Written out, not
    ``x.to(fp8)``: Triton's interpreter rounds fp8 wrongly (500 -> 256 in e5m2, carries into the exponent lost), and
    GPUs before sm_89 convert in software; this is the same bits everywhere."""
    x = x.to(tl.float32)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), MAX_FINITE)
    # The quantum a rounds to: 2^(e - MBITS) for a in [2^e, 2^(e + 1)), the subnormals' below the smallest normal.
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - BIAS)
    magic = ((e - MBITS + 23 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - MBITS + 23): its ulp is the quantum
    r = (a + magic) - magic  # the float32 add rounds a to a multiple of the quantum, ties to even; exact after
    normal = (r.to(tl.int32, bitcast=True) >> (23 - MBITS)) - ((127 - BIAS) << MBITS)
    # r is a whole number of subnormal quanta where it is below the smallest normal (elsewhere unused: kept in range)
    subnormal = (tl.minimum(r, 2.0 ** (1 - BIAS)) * (2.0 ** (BIAS - 1 + MBITS))).to(tl.int32)
    return tl.where(r >= 2.0 ** (1 - BIAS), normal, subnormal) | sign


@triton.jit
def to_cache_dtype(x, cache_dtype: tl.constexpr):
    """``x`` as the cache stores it (reference.to_cache_dtype): an fp8 cache (--kv-cache-dtype) takes it rounded to
    nearest even and saturating at the format's largest finite value instead of becoming NaN (_fp8_bits)."""
    if cache_dtype.is_fp8e4nv():
        return _fp8_bits(x, 3, 7, 448.0).to(tl.uint8).to(cache_dtype, bitcast=True)
    elif cache_dtype.is_fp8e5():
        return _fp8_bits(x, 2, 15, 57344.0).to(tl.uint8).to(cache_dtype, bitcast=True)
    else:
        return x.to(cache_dtype)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    block_size,
    num_kv_heads,
    head_dim,
    stride_key_token,
    stride_key_head,
    stride_key_dim,
    stride_value_token,
    stride_value_head,
    stride_value_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_cache_dim,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token_idx = tl.program_id(0).to(tl.int64)
    # int64: slot * stride overflows int32 on caches of a few GiB.
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size
    offset_in_block = slot % block_size

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]

    key_offsets = (
        token_idx * stride_key_token + heads[:, None] * stride_key_head + dims[None, :] * stride_key_dim
    )
    value_offsets = (
        token_idx * stride_value_token + heads[:, None] * stride_value_head + dims[None, :] * stride_value_dim
    )
    cache_offsets = (
        block_id * stride_cache_block
        + offset_in_block * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :] * stride_cache_dim
    )
    cache_dtype = cache_ptr.dtype.element_ty
    key = tl.load(key_ptr + key_offsets, mask=mask)
    value = tl.load(value_ptr + value_offsets, mask=mask)
    # Index 0 of the layer cache is K, index 1 is V.
    tl.store(cache_ptr + cache_offsets, to_cache_dtype(key, cache_dtype), mask=mask)
    tl.store(cache_ptr + stride_cache_kv + cache_offsets, to_cache_dtype(value, cache_dtype), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = padding, skipped
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if layer_cache.shape[0] != 2 or tuple(layer_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(f"layer_cache {tuple(layer_cache.shape)} does not fit key {tuple(key.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    block_size = layer_cache.shape[2]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        layer_cache,
        slot_mapping,
        block_size,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *layer_cache.stride(),
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
