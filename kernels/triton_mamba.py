"""Triton kernels for a Mamba2 layer's decode step: the one-token causal conv update and the one-token
SSM state update, both reading and writing the request's state in the slot-indexed pool in place (no
gather/scatter copies of the state).

Same signatures and semantics as the same-named functions in :mod:`pdcluster.kernels.mamba_reference`
(shapes written down there). Everything is computed in float32; states are float32.

Slots within one call must be distinct: each program owns one (request, channel/head block) and
updates that slot's state in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _softplus(v):
    # log(1 + exp(v)) with log1p's accuracy for small exp(v) (Goldberg's trick: log(u) * e / (u - 1)
    # cancels the rounding of u = 1 + e), and v itself above torch's threshold of 20.
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    rounded = u == 1.0  # e under half an ulp of 1: log1p(e) = e
    log1p = tl.where(rounded, e, tl.log(u) * (e / tl.where(rounded, 1.0, u - 1.0)))
    return tl.where(v > 20.0, v, log1p)


@triton.jit
def head_block(h, p_block, head_dim, state_size, heads_per_group, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's share of head h's [head_dim, state_size] state (here and in triton_mamba_scan.py): the
    head's B/C group g, rows p (block p_block of head_dim), columns n, and their masks."""
    p = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    return h // heads_per_group, p, n, p < head_dim, n < state_size


@triton.jit
def _conv1d_update_kernel(
    out_ptr, x_ptr, state_ptr, slots_ptr, weight_ptr, bias_ptr,
    conv_dim,
    stride_out_b, stride_x_b,
    stride_state_s, stride_state_c, stride_state_w,
    stride_weight_c, stride_weight_k,
    WIDTH: tl.constexpr,  # conv_kernel - 1
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,  # conv_kernel rounded up to a power of two
):
    b = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = channels < conv_dim
    k = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state_row = state_ptr + slot * stride_state_s + channels[:, None] * stride_state_c

    # The window [state (WIDTH inputs), x]: column k < WIDTH from the state, column WIDTH is x.
    x = tl.load(x_ptr + b * stride_x_b + channels, mask=cmask, other=0.0).to(tl.float32)
    window = tl.load(state_row + k[None, :] * stride_state_w, mask=cmask[:, None] & (k[None, :] < WIDTH), other=0.0)
    window = tl.where(k[None, :] == WIDTH, x[:, None], window)
    weight = tl.load(weight_ptr + channels[:, None] * stride_weight_c + k[None, :] * stride_weight_k,
                     mask=cmask[:, None] & (k[None, :] <= WIDTH), other=0.0).to(tl.float32)
    out = tl.sum(window * weight, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + channels, mask=cmask, other=0.0).to(tl.float32)
    if SILU:
        out = out * tl.sigmoid(out)
    tl.store(out_ptr + b * stride_out_b + channels, out, mask=cmask)

    # The new state is the window shifted by one: column k <- column k + 1 (x lands in WIDTH - 1).
    shifted = tl.load(state_row + (k[None, :] + 1) * stride_state_w,
                      mask=cmask[:, None] & (k[None, :] + 1 < WIDTH), other=0.0)
    shifted = tl.where(k[None, :] == WIDTH - 1, x[:, None], shifted)
    tl.store(state_row + k[None, :] * stride_state_w, shifted, mask=cmask[:, None] & (k[None, :] < WIDTH))


def causal_conv1d_update_triton(
    x: Tensor, conv_state: Tensor, state_slots: Tensor, weight: Tensor, bias: Tensor | None, activation: bool = True
) -> Tensor:
    """One conv step per request, its state at ``conv_state[state_slots[b]]`` shifted in place."""
    batch, conv_dim = x.shape
    width = conv_state.shape[-1]
    if conv_state.dtype != torch.float32 or conv_state.shape[1] != conv_dim:
        raise ValueError(f"conv_state must be float32 [slots, {conv_dim}, width]; got {conv_state.dtype} "
                         f"{tuple(conv_state.shape)}")
    if weight.shape != (conv_dim, width + 1):
        raise ValueError(f"conv weight {tuple(weight.shape)} does not fit conv_dim {conv_dim}, kernel {width + 1}")
    out = torch.empty(batch, conv_dim, dtype=torch.float32, device=x.device)
    if batch == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_c = min(triton.next_power_of_2(conv_dim), 256)
    _conv1d_update_kernel[(batch, triton.cdiv(conv_dim, block_c))](
        out, x, conv_state, state_slots, weight, bias if bias is not None else weight,
        conv_dim,
        out.stride(0), x.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation,
        BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(width + 1),
    )
    return out


@triton.jit
def _selective_state_update_kernel(
    out_ptr, state_ptr, slots_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr,
    dt_min, head_dim, state_size, heads_per_group,
    stride_out_b, stride_out_h,
    stride_state_s, stride_state_h, stride_state_p, stride_state_n,
    stride_x_b, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_h,
    stride_B_b, stride_B_g, stride_B_n,
    stride_C_b, stride_C_g, stride_C_n,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g, p, n, pmask, nmask = head_block(h, tl.program_id(2), head_dim, state_size, heads_per_group, BLOCK_P, BLOCK_N)
    slot = tl.load(slots_ptr + b).to(tl.int64)

    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = tl.maximum(_softplus(dt), dt_min)
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))

    state_ptrs = (state_ptr + slot * stride_state_s + h * stride_state_h
                  + p[:, None] * stride_state_p + n[None, :] * stride_state_n)
    smask = pmask[:, None] & nmask[None, :]
    state = tl.load(state_ptrs, mask=smask, other=0.0)
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + p * stride_x_p, mask=pmask, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + n * stride_B_n, mask=nmask, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + n * stride_C_n, mask=nmask, other=0.0).to(tl.float32)

    state = state * decay + (dt * x)[:, None] * Bv[None, :]
    tl.store(state_ptrs, state, mask=smask)
    y = tl.sum(state * Cv[None, :], axis=1) + tl.load(D_ptr + h).to(tl.float32) * x
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + p, y, mask=pmask)


def selective_state_update_triton(
    ssm_state: Tensor, state_slots: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    dt_bias: Tensor, dt_min: float,
) -> Tensor:
    """One SSM step per request, its state at ``ssm_state[state_slots[b]]`` updated in place."""
    batch, num_heads, head_dim = x.shape
    n_groups, state_size = B.shape[1], B.shape[2]
    if ssm_state.dtype != torch.float32 or tuple(ssm_state.shape[1:]) != (num_heads, head_dim, state_size):
        raise ValueError(f"ssm_state must be float32 [slots, {num_heads}, {head_dim}, {state_size}]; got "
                         f"{ssm_state.dtype} {tuple(ssm_state.shape)}")
    if num_heads % n_groups:
        raise ValueError(f"num_heads {num_heads} is not a multiple of n_groups {n_groups}")
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=x.device)
    if batch == 0:
        return out
    block_n = triton.next_power_of_2(state_size)
    block_p = min(triton.next_power_of_2(head_dim), 16 if block_n >= 128 else 32)
    _selective_state_update_kernel[(batch, num_heads, triton.cdiv(head_dim, block_p))](
        out, ssm_state, state_slots, x, dt, A, B, C, D, dt_bias,
        float(dt_min), head_dim, state_size, num_heads // n_groups,
        out.stride(0), out.stride(1),
        *ssm_state.stride(),
        *x.stride(),
        *dt.stride(),
        *B.stride(),
        *C.stride(),
        BLOCK_P=block_p, BLOCK_N=block_n,
    )
    return out
