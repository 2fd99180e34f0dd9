"""Triton kernel: RMSNorm, optionally fused with the residual add before it.

Same semantics as :func:`pdcluster.kernels.reference.rms_norm` (HF LlamaRMSNorm):

    x:        [num_tokens, hidden]   (any leading dims; rows are the last dim)
    weight:   [hidden]
    residual: [num_tokens, hidden] or None; if given, residual <- residual + x (in place, rounded to
              residual's dtype) and the normalised row is that sum
    out:      [num_tokens, hidden] in the dtype of ``weight * row`` (torch type promotion)

Rows of x and residual may be strided (unit stride along hidden is all the kernel needs); any other
layout is copied first, and a copied residual is written back.

One program per token row: the whole row is loaded once into BLOCK (hidden rounded up to a power of
two, masked) lanes, the residual sum is stored, and the sum of squares, the scale and the weight
multiply run on that in-register row, so the row is read and written once.

Numerics follow the reference step by step: the residual add in fp32 rounded to the residual's dtype,
the mean of squares and rsqrt in fp32, the normalised row rounded to the row's dtype (the reference's
``.to(dtype)``), then the weight multiply in fp32 rounded to the output dtype.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
import triton.language as tl

from pdcluster.kernels import launch_pdl
from pdcluster.kernels.triton_pdl import wait_then_release

# A row longer than this does not fit one program's registers comfortably; Llama-family hidden sizes
# (<= 16384) are well under it.
_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,  # unused unless HAS_RESIDUAL
    weight_ptr,
    hidden,
    eps,
    stride_out_token,
    stride_x_token,
    stride_residual_token,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
):
    token_idx = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_then_release(USE_PDL)

    row = tl.load(x_ptr + token_idx * stride_x_token + cols, mask=mask, other=0.0).to(tl.float32)
    rms_norm_row(out_ptr + token_idx * stride_out_token, row, residual_ptr + token_idx * stride_residual_token,
                 weight, cols, mask, hidden, eps, HAS_RESIDUAL, x_ptr.dtype.element_ty)


@triton.jit
def rms_norm_row(out_row_ptr, row, residual_row_ptr, weight, cols, mask, hidden, eps, HAS_RESIDUAL: tl.constexpr,
                 row_dtype: tl.constexpr):
    """One row's residual add and RMSNorm (the module doc's numerics): ``row`` float32 [BLOCK] holding values of
    ``row_dtype`` (masked lanes 0) at columns ``cols`` (``mask``: those under ``hidden``), ``weight`` float32
    [BLOCK]; stores the sum at ``residual_row_ptr`` (HAS_RESIDUAL) and the normalised row at ``out_row_ptr``.
    Shared with the skinny matmul's norm epilogue (kernels/triton_skinny_epilogues.py), so both round the same math
    the same way."""
    if HAS_RESIDUAL:
        residual_dtype = residual_row_ptr.dtype.element_ty
        summed = tl.load(residual_row_ptr + cols, mask=mask, other=0.0).to(tl.float32) + row
        summed = summed.to(residual_dtype)  # the reference adds in place, in the residual's dtype
        tl.store(residual_row_ptr + cols, summed, mask=mask)
        row = summed.to(tl.float32)
        normed_dtype = residual_dtype
    else:
        normed_dtype = row_dtype

    # Masked lanes are 0 and add nothing; the mean divides by the true hidden size.
    mean_square = tl.sum(row * row, axis=0) / hidden
    normed = (row * tl.rsqrt(mean_square + eps)).to(normed_dtype).to(tl.float32)
    out = normed * weight
    tl.store(out_row_ptr + cols, out.to(out_row_ptr.dtype.element_ty), mask=mask)


def _row_view(t: Tensor, hidden: int) -> Tensor | None:
    """``t`` as a [num_rows, hidden] view with unit stride along hidden (rows may be strided), or None
    when its layout has no such view."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, hidden)
    except RuntimeError:
        return None


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm of each row (of ``residual + x`` when ``residual`` is given; see module doc)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is over the kernel's limit {_MAX_HIDDEN}")
    row_dtype = x.dtype if residual is None else residual.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, row_dtype), device=x.device)
    num_tokens = x.numel() // hidden if hidden else 0
    if num_tokens == 0:
        return out

    x_rows = _row_view(x, hidden)
    if x_rows is None:
        x_rows = x.contiguous().view(-1, hidden)
    residual_rows = None
    write_back = False
    if residual is not None:
        residual_rows = _row_view(residual, hidden)
        if residual_rows is None:  # no in-place row view: work on a copy, copy it back below
            residual_rows = residual.contiguous().view(-1, hidden)
            write_back = True
    out_rows = out.view(-1, hidden)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        out_rows,
        x_rows,
        x_rows if residual_rows is None else residual_rows,
        weight.contiguous(),
        hidden,
        eps,
        out_rows.stride(0),
        x_rows.stride(0),
        0 if residual_rows is None else residual_rows.stride(0),
        HAS_RESIDUAL=residual_rows is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
        **launch_pdl.options(x),
    )
    if write_back:
        residual.copy_(residual_rows.view(residual.shape))
    return out
