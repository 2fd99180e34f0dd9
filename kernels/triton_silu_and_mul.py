"""Triton kernel: SiLU-and-multiply of the fused gate/up projection output.

Same semantics as :func:`pdcluster.kernels.reference.silu_and_mul`:

    x:   [num_tokens, 2 * d]: gate = x[:, :d], up = x[:, d:] (rows may be strided; unit stride along d)
    out: [num_tokens, d] = silu(gate) * up, in x's dtype

One program per (token row, chunk of BLOCK columns) (a power of two, masked tail), so any intermediate
size fits and a decode step of a few rows still spreads over the SMs (one program a row walked a 5,632-wide
row alone: 3.2 us a layer for a single row on an H200, bench/results/gpu_check_h200.json). Math is in fp32; like the reference (``F.silu(gate) * up`` in the tensor
dtype), silu(gate) is rounded to x's dtype before the multiply, and the product is rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels import launch_pdl
from pdcluster.kernels.triton_pdl import wait_then_release

# Columns per chunk: wide loads on a GPU, small enough to stay in registers.
_MAX_BLOCK = 1024


@triton.jit
def silu_and_mul_values(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32, rounded as the reference rounds it: silu(gate) to ``dtype`` before the multiply,
    the product once more (the caller stores it, or as kernels/triton_skinny_gemm.py does, reads it as a matmul's
    operand: both then see the same values)."""
    gate = gate.to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,
    x_ptr,
    d,
    stride_x_token,
    stride_out_token,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
):
    wait_then_release(USE_PDL)
    token_idx = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + token_idx * stride_x_token
    out_row_ptr = out_ptr + token_idx * stride_out_token
    dtype = out_ptr.dtype.element_ty
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < d
    gate = tl.load(x_row_ptr + offsets, mask=mask, other=0.0)
    up = tl.load(x_row_ptr + d + offsets, mask=mask, other=0.0)
    tl.store(out_row_ptr + offsets, silu_and_mul_values(gate, up, dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    """``silu(x[:, :d]) * x[:, d:]`` (see module doc)."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"last dim {x.shape[-1]} is odd")
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    num_tokens = out.numel() // d if d else 0
    if num_tokens == 0:
        return out
    x_rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, 2 * d)
    if x_rows.stride(-1) != 1:
        x_rows = x_rows.contiguous()
    out_rows = out.view(-1, d)
    block = min(triton.next_power_of_2(d), _MAX_BLOCK)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        out_rows,
        x_rows,
        d,
        x_rows.stride(0),
        out_rows.stride(0),
        BLOCK=block,
        **launch_pdl.options(x),
    )
    return out
