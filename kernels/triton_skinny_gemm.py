"""Triton kernel: a decode step's matmul of one to four rows, ``out = a @ weight.T``, as a weight stream.

    a:      [M, K] (1 <= M <= MAX_ROWS; unit stride along K), or with ``silu_and_mul`` [M, 2K]: the fused
            gate/up projection's output, a = silu(gate) * up computed as it is loaded (the MLP's down
            projection then needs no SiLU-and-mul kernel of its own)
    weight: [N, K] (F.linear's layout, unit stride along K), a's dtype
    out:    [M, N] in a's dtype (unit stride along N), every element accumulated in float32

Why (bench/results/gpu_check_h200.json, the 1.1B Llama's batch-1 decode step profiled on an H200): a one-row
matmul reads its weight once and does nothing else, so it should run at the copy bandwidth. cuBLAS tiles N in
64 columns there: the 2,048 x 2,048 output projection gets 32 tiles for 132 SMs, the 2,560-row qkv 40, and
those matmuls ran at ~1.6 TB/s of the H200's 4 TB/s; the 5,632-deep down projection took a split-K kernel
plus a reduction kernel (2.2 TB/s). The batch-1 step spent 0.74 ms in the layers' matmuls against 0.52 ms of
weight bytes at the copy bandwidth.

Here one program streams BLOCK_N weight rows (contiguous along K: coalesced loads) over its share of K:
``SPLIT`` programs per column band when the bands alone would leave SMs idle, each writing float32 partial
sums that ``_sum_splits_kernel`` adds in split order (fixed, so a step's bits do not depend on timing). No
tensor cores: the products accumulate elementwise in a [rows, BLOCK_N, BLOCK_K] float32 tile reduced over K
once at the end, so each loaded weight element costs a convert and ``rows`` FMAs. Whether this beats cuBLAS
for a given shape and row count is measured on the GPU at hand, inside CUDA graphs (engine/skinny_linear.py),
never assumed.

Numerics: float32 products of the 16-bit inputs (exact) summed in float32 in a different order than cuBLAS's:
the result differs from F.linear's by float32 rounding before the final cast. With ``silu_and_mul`` the
activation is rounded as kernels/triton_silu_and_mul.py rounds it (silu to a's dtype, then the product), so
the fused matmul reads exactly the values the unfused one would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # rows a launch takes; more go to cuBLAS (tensor cores pay off there)
# float32 accumulator elements a program holds (rows x BLOCK_N x BLOCK_K): with 4 warps, 64 registers a thread.
ACC_ELEMENTS = 8192


@dataclass(frozen=True)
class SkinnyTiles:
    """One launch configuration. ``block_k`` is for one row; a launch of ``rows`` rows walks K in
    ``block_k // rows_pad`` steps so the accumulator stays ACC_ELEMENTS (see :func:`block_k_for`)."""

    block_n: int
    block_k: int
    split: int  # programs per column band (K cut in this many even runs)
    num_warps: int = 4
    num_stages: int = 3


# What engine/skinny_linear.py times against cuBLAS, per shape and row count.
CANDIDATE_TILES = (
    SkinnyTiles(16, 512, 1), SkinnyTiles(16, 512, 2), SkinnyTiles(16, 512, 4),
    SkinnyTiles(8, 1024, 1), SkinnyTiles(8, 1024, 2),
    SkinnyTiles(32, 256, 1), SkinnyTiles(32, 256, 2),
)


def rows_pad_for(rows: int) -> int:
    return triton.next_power_of_2(rows)


def block_k_for(tiles: SkinnyTiles, rows: int) -> int:
    """The K step for ``rows`` rows: the accumulator (rows_pad x BLOCK_N x BLOCK_K) at most ACC_ELEMENTS."""
    return max(16, min(tiles.block_k, ACC_ELEMENTS // (rows_pad_for(rows) * tiles.block_n)))


@triton.jit(do_not_specialize=["k_per_split"])
def _skinny_gemm_kernel(
    out_ptr,  # [M, N] (SPLIT == 1) or float32 [SPLIT, M, N] partial sums
    a_ptr,
    w_ptr,
    M,
    N,
    K,
    k_per_split,  # K positions a split walks: a multiple of BLOCK_K
    stride_am,
    stride_wn,
    stride_om,
    ROWS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,  # K is split: write float32 partial sums (out_ptr: [splits, M, N])
    SILU_AND_MUL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, ROWS_PAD)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_valid = rows < M
    col_valid = cols < N
    dtype = a_ptr.dtype.element_ty
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([ROWS_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + ks
        k_valid = k < k_hi
        w = tl.load(w_rows + k[None, :], mask=col_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        a_mask = row_valid[:, None] & k_valid[None, :]
        if SILU_AND_MUL:  # a = silu(gate) * up, rounded as the SiLU-and-mul kernel rounds it
            gate = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(a_rows + K + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
            silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            a = (silu * up).to(dtype).to(tl.float32)
        else:
            a = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
        acc += a[:, None, :] * w[None, :, :]
    total = tl.sum(acc, axis=2)  # [ROWS_PAD, BLOCK_N]
    mask = row_valid[:, None] & col_valid[None, :]
    if PARTIAL:
        at = (pid_k * M + rows.to(tl.int64))[:, None] * N + cols[None, :]
        tl.store(out_ptr + at, total, mask=mask)
    else:
        at = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, M, N, stride_om, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = the SPLIT partial sums of (m, n), added in split order."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + cols, mask=valid, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=valid)


def check_operands(a: torch.Tensor, weight: torch.Tensor, silu_and_mul: bool) -> int:
    """K of the product, after checking the shapes and strides the kernel takes (raises ValueError)."""
    if a.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"skinny_gemm takes 2-d a and weight, got {tuple(a.shape)} and {tuple(weight.shape)}")
    if not 1 <= a.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1 to {MAX_ROWS} rows, got {a.shape[0]}")
    k = weight.shape[1]
    if a.shape[1] != (2 * k if silu_and_mul else k):
        raise ValueError(f"a {tuple(a.shape)} does not fit weight {tuple(weight.shape)}"
                         + (" (silu_and_mul: a is [M, 2K])" if silu_and_mul else ""))
    if a.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_gemm needs unit stride along K in a and weight")
    if a.dtype != weight.dtype:
        raise ValueError(f"a is {a.dtype}, weight {weight.dtype}")
    return k


def skinny_gemm(a: torch.Tensor, weight: torch.Tensor, tiles: SkinnyTiles, silu_and_mul: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ weight.T`` (``silu_and_mul``: ``silu(a[:, :K]) * a[:, K:]`` first) for 1 to MAX_ROWS rows."""
    k = check_operands(a, weight, silu_and_mul)
    m, n = a.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != a.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a packed-row [{m}, {n}] {a.dtype} tensor")
    block_k = block_k_for(tiles, m)
    # Each split walks whole K steps (its share rounded up to one); the last may walk fewer or none.
    split = max(1, min(tiles.split, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    _skinny_gemm_kernel[(triton.cdiv(n, tiles.block_n), split)](
        target, a, weight, m, n, k, k_per_split, a.stride(0), weight.stride(0), out.stride(0),
        ROWS_PAD=rows_pad_for(m), BLOCK_N=tiles.block_n, BLOCK_K=block_k, PARTIAL=split > 1, SILU_AND_MUL=silu_and_mul,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(triton.cdiv(n, block), m)](out, target, m, n, out.stride(0), SPLIT=split, BLOCK=block)
    return out
