"""Triton kernel for a Mamba2 layer's prefill conv: the causal depthwise conv over one request's tokens,
continuing from its conv state.

Same signature and semantics as :func:`pdcluster.kernels.mamba_reference.causal_conv1d`: the row
``padded = [conv_state (width inputs), x^T]`` is convolved per channel with the ``width + 1`` taps,
bias and SiLU optional; out [T, conv_dim] float32 and the new state (the last ``width`` inputs of
``padded``) [conv_dim, width] float32, a new tensor (the given state is only read).

One launch, grid (token blocks, channel blocks): each program computes its [BLOCK_T, BLOCK_C] outputs,
reading tap k of token t from x[t + k - width] or, before the row, from the state column t + k; the
programs of the first token block also write their channels of the new state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _causal_conv1d_kernel(
    out_ptr, new_state_ptr, x_ptr, state_ptr, weight_ptr, bias_ptr,
    num_tokens, conv_dim,
    stride_x_t, stride_x_c,
    stride_state_c, stride_state_w,
    stride_weight_c, stride_weight_k,
    WIDTH: tl.constexpr,  # conv_kernel - 1
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,  # WIDTH rounded up to a power of two
):
    pid_t = tl.program_id(0)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < conv_dim
    tmask = t < num_tokens

    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH + 1):
        src = t + (k - WIDTH)  # the input tap k reads: x[src], or the state column t + k before the row
        in_x = (src >= 0) & tmask
        in_state = (src < 0) & tmask
        v = tl.load(x_ptr + src[:, None] * stride_x_t + c[None, :] * stride_x_c,
                    mask=in_x[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        v += tl.load(state_ptr + c[None, :] * stride_state_c + (t + k)[:, None] * stride_state_w,
                     mask=in_state[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + c * stride_weight_c + k * stride_weight_k, mask=cmask, other=0.0).to(tl.float32)
        acc += v * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t[:, None] * conv_dim + c[None, :], acc, mask=tmask[:, None] & cmask[None, :])

    if pid_t == 0:
        # New state column j = padded[num_tokens + j]: x[num_tokens + j - WIDTH], or the old state column
        # num_tokens + j when the row is shorter than the state.
        j = tl.arange(0, BLOCK_W)
        j_src = num_tokens + j - WIDTH
        jmask = j < WIDTH
        s = tl.load(x_ptr + j_src[None, :] * stride_x_t + c[:, None] * stride_x_c,
                    mask=cmask[:, None] & (jmask & (j_src >= 0))[None, :], other=0.0).to(tl.float32)
        s += tl.load(state_ptr + c[:, None] * stride_state_c + (num_tokens + j)[None, :] * stride_state_w,
                     mask=cmask[:, None] & (jmask & (j_src < 0))[None, :], other=0.0).to(tl.float32)
        tl.store(new_state_ptr + c[:, None] * WIDTH + j[None, :], s, mask=cmask[:, None] & jmask[None, :])


def causal_conv1d_triton(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None, activation: bool = True
) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv over one request's tokens from ``conv_state``: (out [T, conv_dim] float32,
    the new conv state [conv_dim, width] float32)."""
    num_tokens, conv_dim = x.shape
    width = conv_state.shape[-1]
    if conv_state.shape[0] != conv_dim:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} does not fit conv_dim {conv_dim}")
    if weight.shape != (conv_dim, width + 1):
        raise ValueError(f"conv weight {tuple(weight.shape)} does not fit conv_dim {conv_dim}, kernel {width + 1}")
    out = torch.empty(num_tokens, conv_dim, dtype=torch.float32, device=x.device)
    new_state = torch.empty(conv_dim, width, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        new_state.copy_(conv_state)
        return out, new_state
    block_c = min(triton.next_power_of_2(conv_dim), 128)
    block_t = min(triton.next_power_of_2(num_tokens), 32)
    _causal_conv1d_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(conv_dim, block_c))](
        out, new_state, x, conv_state, weight, bias if bias is not None else weight,
        num_tokens, conv_dim,
        *x.stride(), *conv_state.stride(), *weight.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation,
        BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(max(width, 1)),
    )
    return out, new_state
