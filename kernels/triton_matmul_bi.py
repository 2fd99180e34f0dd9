"""Triton kernel: batch-invariant ``y = x @ weight.T`` on CUDA (issue 24), the GPU twin of kernels/cpu_gemm.py.

    x:      [..., K] in bfloat16, float16 or float32 (rows may be strided; unit stride along K)
    weight: [N, K] in x's dtype (F.linear's layout; any strides)
    out:    [..., N] in x's dtype; every element accumulated in float32

Batch invariance (STYLE.md "Deterministic kernels"): each row's result is bit for bit a function of that
row alone, whatever the number of rows M in the call. The tile sizes, warps and pipeline depth come from
(N, K, dtype) only (:func:`tiles_for`), never from M: no autotuning keyed on M, no split-K. Every output
element is accumulated over K in the same BLOCK_K steps, in increasing k, by the same ``tl.dot`` on a tile
of the same shape; M only decides how many row tiles there are and where in its tile a row sits, and a
dot's element ``(r, c)`` reads only row r of x. ``M`` is not specialised (``do_not_specialize``), so a
one-row call (Triton would otherwise compile M == 1 as a constant) runs the very kernel a batch runs.

Why BLOCK_M is fixed too (64, even for a one-row decode step): the dot's instruction (Hopper's wgmma or
the older mma) and its layout follow the tile shape, and a different instruction may sum a tile's k's in
another order. A decode step wastes tensor-core work on padding rows but is bound by reading the weight.
BLOCK_N is the widest of 128/64/32 that still gives about 132 column tiles (an H100's SM count) when there
is one row tile: a decode step then keeps the GPU's SMs busy without splitting K, and wide matrices (the
MLP's gate/up, the LM head) get wide tiles for prefill. Untuned: bench/gpu_check.py's ``deterministic``
section measures the cost against cuBLAS (the fast mode).

Numerics: 16-bit operands go into ``tl.dot`` as they are (tensor cores, fp32 accumulation); float32 uses
IEEE dots (no TF32), like torch's default. Under the interpreter (TRITON_INTERPRET=1) 16-bit operands are
widened to float32 first, because the interpreter's bf16 ``tl.dot`` multiplies raw bit patterns (triton
3.9): the products of bf16/fp16 values are exact in fp32 either way, so only the hardware's summation
inside one dot can differ from what the CPU checks. That is the one difference between the code the tests
interpret and the code a GPU runs (tests/test_triton_deterministic.py compiles the GPU variant for sm_80
and sm_90, and its ``gpu`` tests run it). The bits are the same on every worker with the same GPU model
and Triton version; another GPU generation may pick another dot instruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_M = 64  # rows per tile, whatever M (module doc)
TARGET_COLUMN_TILES = 132  # an H100's SM count: column tiles wanted in a one-row-tile (decode) step
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MatmulTiles:
    """One launch configuration; a function of (N, K, dtype) only (see :func:`tiles_for`)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles walked together per column band (L2 reuse of the weight in prefill)


def tiles_for(n: int, k: int, dtype: torch.dtype) -> MatmulTiles:
    """The configuration for an [N, K] weight: never a function of the number of rows."""
    block_n = 32
    for wide in (128, 64):
        if n >= wide * TARGET_COLUMN_TILES:
            block_n = wide
            break
    wide_k = 32 if dtype == torch.float32 else 64  # fp32 tiles take twice the shared memory a stage
    block_k = min(wide_k, max(16, triton.next_power_of_2(k)))  # tl.dot needs every dim >= 16
    return MatmulTiles(BLOCK_M, block_n, block_k, num_warps=4, num_stages=2 if dtype == torch.float32 else 3)


@triton.jit(do_not_specialize=["M"])
def _matmul_bi_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WIDEN: tl.constexpr,  # 16-bit operands to fp32 before the dot (the interpreter only; module doc)
    DOT_PRECISION: tl.constexpr,
):
    # Program -> (row tile, column tile), GROUP_M row tiles at a time per column band. Only the order in
    # which tiles run changes with M, never what a tile computes.
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    m_tile = first_m + (pid % tiles_per_group) % group_rows
    n_tile = (pid % tiles_per_group) // group_rows

    rows = m_tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K  # the tail step: zeros past K add nothing
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if WIDEN:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# TRITON_INTERPRET=1 when triton decorated the kernel: it runs on the interpreter (numpy), not compiled.
_INTERPRETED = isinstance(_matmul_bi_kernel, InterpretedFunction)


def matmul_bi(x: torch.Tensor, weight: torch.Tensor, tiles: MatmulTiles | None = None) -> torch.Tensor:
    """``F.linear(x, weight)``, batch-invariant (module doc). ``tiles`` overrides the configuration (tests
    show that a choice keyed on M breaks invariance; the engine never passes it)."""
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"matmul_bi takes bf16/fp16/fp32 x and a weight of its dtype, got {x.dtype} and "
                         f"{weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} ([out, in])")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    if k == 0:
        return out.zero_().reshape(*x.shape[:-1], n)
    t = tiles or tiles_for(n, k, x.dtype)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _matmul_bi_kernel[grid](
        rows, weight, out, m, n, k,
        rows.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        WIDEN=x.dtype != torch.float32 and _INTERPRETED,
        # fp32: no TF32. 16-bit: moot on a GPU (tensor cores take them as they are); widened, tf32 is exact.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out.reshape(*x.shape[:-1], n)
