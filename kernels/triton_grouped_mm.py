"""Triton kernel: grouped linear for a fused MoE on CUDA (issue 26), the GPU twin of kernels/cpu_grouped_mm.py.

    rows:   [M, K], sorted by expert: expert e owns rows offs[e]:offs[e + 1]
    weight: [E, N, K] (each expert's [out, in] weight, as F.linear takes it; any strides)
    offs:   int [E + 1], non-decreasing, on the rows' device; offs[0] = 0, offs[E] = M
    out:    [M, N] = rows[r] @ weight[e].T for each row r of expert e, in rows' dtype (or float32)

Work is cut into tiles of BLOCK_M rows of one expert times BLOCK_N output columns. The tile table (which
expert, which first row) is built on the device from ``offs`` with a few torch ops, no host sync (CUDA graphs
capture it), sized by the bound ``ceil(M / BLOCK_M) + min(E, M)`` on the number of tiles (each expert with rows
adds at most one partial tile); unused entries have expert -1 and their programs do nothing. An expert with no
rows has no tile, so its weight is never read: decoding one token reads only its routed experts' weights.

Batch invariance: block sizes are constants (not chosen by M), every output element is accumulated over K in
the same BLOCK_K steps in fp32, so a row's result does not depend on how many rows its expert got. fp32 inputs
use IEEE dot products (no TF32), so fp32 results match torch up to summation order. bf16 and fp16 operands
are loaded as they are and widened to fp32 in registers, then multiplied as TF32: both fit TF32's 10-bit
mantissa exactly, so the products are those of a bf16 tensor-core dot (at TF32's rate), and the interpreter,
whose bf16 ``tl.dot`` is wrong (triton 3.9), runs the same code as the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64  # fixed: a row's arithmetic must not depend on the batch


@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    tile_expert_ptr,  # int32 [num_tiles]: the tile's expert, -1 for an unused entry
    tile_row_ptr,  # int32 [num_tiles]: the tile's first row
    offs_ptr,  # int32 [E + 1]
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    valid = expert >= 0
    expert = tl.maximum(expert, 0).to(tl.int64)
    row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.where(valid, tl.load(offs_ptr + expert + 1), row_start)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(valid, K, 0)  # an unused entry loops zero times: nothing read
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        # bf16 / fp16 upcast: exact in TF32's 10-bit mantissa, so this is a bf16 tensor-core product (module doc).
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def tile_table(offs: torch.Tensor, num_rows: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert int32 [T], first row int32 [T]) of each tile, T = ceil(num_rows / block_m) + min(E, num_rows),
    entries past the last tile with expert -1. Device ops only (no host sync)."""
    num_experts = offs.shape[0] - 1
    offs = offs.to(torch.int64)
    tiles = (offs[1:] - offs[:-1] + block_m - 1) // block_m  # [E]
    tiles_end = tiles.cumsum(0)
    t = torch.arange(triton.cdiv(num_rows, block_m) + min(num_experts, num_rows), device=offs.device)
    expert = torch.searchsorted(tiles_end, t, right=True)  # the expert whose tiles hold t (E: none)
    e = expert.clamp(max=num_experts - 1)
    first_row = offs[e] + (t - (tiles_end[e] - tiles[e])) * block_m
    valid = expert < num_experts
    return (torch.where(valid, expert, -1).to(torch.int32), torch.where(valid, first_row, 0).to(torch.int32))


def grouped_mm_triton(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[M, N] = each row of ``rows`` [M, K] times its expert's ``weight[e]`` [N, K] transposed (module doc)."""
    num_rows, k = rows.shape
    num_experts, n, k_w = weight.shape
    if k_w != k or offs.shape != (num_experts + 1,):
        raise ValueError(f"grouped_mm_triton: rows {tuple(rows.shape)}, weight {tuple(weight.shape)} and offs "
                         f"{tuple(offs.shape)} do not fit together")
    out = torch.empty(num_rows, n, dtype=out_dtype or rows.dtype, device=rows.device)
    if num_rows == 0:
        return out
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    tile_expert, tile_row = tile_table(offs, num_rows)
    grid = (tile_expert.shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_mm_kernel[grid](
        rows, weight, out, tile_expert, tile_row, offs.to(torch.int32), n, k,
        rows.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
    )
    return out
