"""Triton kernel: rotary position embedding (HF rotate_half convention), in place.

Same semantics as :func:`pdcluster.kernels.reference.rotary`:

    x:         [num_tokens, num_heads, head_dim], any strides (typically the q or k slice of the fused
               qkv projection output, so the token stride is larger than num_heads * head_dim)
    positions: int64 (or int32) [num_tokens]
    cos_sin:   float32 [max_positions, head_dim]: cos of each of the head_dim / 2 frequencies, then sin

For each head, with ``x1 = x[:half]``, ``x2 = x[half:]`` and ``cos``, ``sin`` of the token's position:
``x1 <- x1 * cos - x2 * sin``, ``x2 <- x2 * cos + x1 * sin``.

One program per token rotates all of that token's heads: a [HEADS_PAD, HALF_PAD] tile for each half
(powers of two, masked), so the token's cos/sin row is loaded once and shared by every head. The math
is in fp32; the result is rounded once to x's dtype, like the reference's ``copy_``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    positions_ptr,
    cos_sin_ptr,
    num_heads,
    half,  # head_dim // 2
    stride_x_token,
    stride_x_head,
    stride_x_dim,
    stride_cos_sin_pos,
    stride_cos_sin_dim,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token_idx = tl.program_id(0).to(tl.int64)
    cos, sin, dims, dim_mask = _cos_sin(positions_ptr, token_idx, cos_sin_ptr, half, stride_cos_sin_pos,
                                        stride_cos_sin_dim, HALF_PAD)
    _rotate_heads(x_ptr + token_idx * stride_x_token, num_heads, half, stride_x_head, stride_x_dim, cos, sin,
                  dims, dim_mask, HEADS_PAD)


@triton.jit
def _cos_sin(positions_ptr, token_idx, cos_sin_ptr, half, stride_pos, stride_dim, HALF_PAD: tl.constexpr):
    """The token's cos and sin rows (fp32, [HALF_PAD]), with the half's dims and their mask."""
    pos = tl.load(positions_ptr + token_idx).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < half
    row_ptr = cos_sin_ptr + pos * stride_pos
    cos = tl.load(row_ptr + dims * stride_dim, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(row_ptr + (dims + half) * stride_dim, mask=dim_mask, other=0.0).to(tl.float32)
    return cos, sin, dims, dim_mask


@triton.jit
def _rotate_heads(row_ptr, num_heads, half, stride_head, stride_dim, cos, sin, dims, dim_mask,
                  HEADS_PAD: tl.constexpr):
    """Rotate one token's heads in place (``row_ptr``: the token's first head); returns the two rotated
    halves, [HEADS_PAD, HALF_PAD] in the row's dtype (what was stored). Shared with the fused rotary +
    KV write kernel (kernels/triton_rotary_kv.py), so both round the same math the same way."""
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < num_heads)[:, None] & dim_mask[None, :]
    first_ptrs = row_ptr + heads[:, None] * stride_head + dims[None, :] * stride_dim
    second_ptrs = first_ptrs + half * stride_dim
    x1 = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second_ptrs, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = rotate_values(x1, x2, cos, sin, row_ptr.dtype.element_ty)
    tl.store(first_ptrs, out1, mask=mask)
    tl.store(second_ptrs, out2, mask=mask)
    return out1, out2


@triton.jit
def rotate_values(x1, x2, cos, sin, dtype: tl.constexpr):
    """The rotation of heads' two halves (float32 [HEADS_PAD, HALF_PAD]) by a token's cos and sin rows, rounded to
    ``dtype``; shared by every kernel that rotates (here, kernels/triton_rotary_kv.py and the skinny matmul's rotary
    epilogue, kernels/triton_skinny_epilogues.py)."""
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    return out1.to(dtype), out2.to(dtype)


def rotary_triton(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place (any strides)
    positions: torch.Tensor,  # int64 [num_tokens]
    cos_sin: torch.Tensor,  # float32 [max_positions, head_dim]: cos of each frequency, then sin
) -> None:
    """Rotate ``x`` in place by each token's position (see module doc)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [num_tokens, num_heads, head_dim], got {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim {head_dim} is odd")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} do not fit {num_tokens} tokens")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} does not fit head_dim {head_dim}")
    if num_tokens == 0 or num_heads == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        x,
        positions,
        cos_sin,
        num_heads,
        half,
        *x.stride(),
        *cos_sin.stride(),
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HALF_PAD=triton.next_power_of_2(half),
    )
