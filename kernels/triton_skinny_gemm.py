"""Triton kernels: a decode step's matmul of a few rows, ``out = a @ weight.T``, as a stream of the weight.

    a:      [M, K] (1 <= M <= MAX_ROWS; unit stride along K), or with ``silu_and_mul`` [M, 2K]: the fused
            gate/up projection's output, a = silu(gate) * up (the MLP's down projection)
    weight: [N, K] (F.linear's layout, unit stride along K), a's dtype
    out:    [M, N] in a's dtype (unit stride along N), every element accumulated in float32

Why (bench/results/gpu_check_h200.json, the 1.1B Llama's batch-1 decode step profiled on an H200): a one-row
matmul reads its weight once and does little else, so it should run at the copy bandwidth. cuBLAS tiles N in
64 columns there: the 2,048 x 2,048 output projection gets 32 tiles for 132 SMs, the 2,560-row qkv 40, and
those matmuls ran at ~1.6 TB/s of the H200's 4 TB/s; the 5,632-deep down projection took a split-K kernel
plus a reduction kernel (2.2 TB/s). The batch-1 step spent 0.74 ms in the layers' matmuls against 0.52 ms of
weight bytes at the copy bandwidth.

Both kernels give each program BLOCK_N weight rows (contiguous along K: coalesced loads) over its share of K:
``split`` programs per column band when the bands alone would leave SMs idle, each writing float32 partial
sums that ``_sum_splits_kernel`` adds in split order (fixed: a step's bits never depend on timing).
- The elementwise kernel (``_skinny_gemm_kernel``, 1 to FMA_MAX_ROWS rows): no tensor cores; the products
  accumulate in a [rows, BLOCK_N, BLOCK_K] float32 tile reduced over K once at the end, so a loaded weight
  element costs a convert and ``rows`` FMAs. The weight tile lands in registers. With ``silu_and_mul`` the
  activation is computed as it is loaded, so the MLP needs no SiLU-and-mul kernel.
- The dot kernel (``_skinny_dot_kernel``, 1 to MAX_ROWS rows): ``tl.dot`` of the weight tile with the rows
  padded to a power of two (16 to 128: the tensor-core tile's N side, the weight rows its M side), which lets
  Triton's software pipeline bring the weight through shared memory ``num_stages`` tiles ahead. Its
  ``silu_and_mul`` runs the SiLU-and-mul kernel first (a pipelined operand is loaded, not computed). Up to 128
  rows because cuBLAS did no better at batch 128: the H200 profile's 2,048-wide projections ran at 1.3-1.5 TB/s
  there, with 48- and 56-wide tiles.
Which (if either) beats cuBLAS for a shape and row count is measured on the GPU at hand, inside CUDA graphs
(engine/skinny_linear.py), never assumed.

Numerics: float32 sums of exact products of the 16-bit inputs, in another order than cuBLAS's: the result
differs from F.linear's by float32 rounding before the final cast. The fused activation is rounded as
kernels/triton_silu_and_mul.py rounds it (silu to a's dtype, then the product), so the fused matmul reads
exactly the values the unfused one would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdcluster.kernels import launch_pdl
from pdcluster.kernels.triton_pdl import wait_then_release
from pdcluster.kernels.triton_silu_and_mul import silu_and_mul_triton, silu_and_mul_values

# The interpreter multiplies 16-bit dot operands as raw bit patterns (kernels/triton_paged_attention.py): the dot
# kernel widens them to float32 there; products of 16-bit values are exact in float32 either way.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 128  # rows a launch takes (the dot kernel's widest tile); more go to cuBLAS
FMA_MAX_ROWS = 4  # the elementwise kernel's limit: its accumulator grows with the rows
MIN_DOT_ROWS = 16  # the dot kernel's rows are padded to a power of two, at least tl.dot's smallest tile side
# Shared memory a dot tiling may count on, at num_stages weight and operand tiles: the sm_90 builds took 3 to 7 such
# tiles' worth (the pipeline's num_stages - 1, the dot's operand staging, the transposed store), and every tiling
# this admits builds within the H100's and H200's 227 KiB a block (tests/test_skinny_gemm.py).
DOT_SHARED_BYTES = 180 * 1024
# float32 accumulator elements a program holds (rows x BLOCK_N x BLOCK_K): with 4 warps, 64 registers a thread.
ACC_ELEMENTS = 8192


@dataclass(frozen=True)
class SkinnyTiles:
    """One launch configuration. The elementwise kernel (``dot`` False): ``block_k`` is for one row; a launch of
    ``rows`` rows walks K in ``block_k // rows_pad`` steps so the accumulator stays ACC_ELEMENTS
    (:func:`block_k_for`). The dot kernel: tiles of BLOCK_N weight rows x BLOCK_K, the rows padded
    (:func:`dot_rows_for`), for as many rows as its pipeline's tiles fit DOT_SHARED_BYTES."""

    block_n: int
    block_k: int
    split: int  # programs per column band (K cut in this many even runs)
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False
    min_rows: int = 1  # a tiling for wide launches only (not timed below this many rows)

    def takes(self, rows: int, gated: bool = False) -> bool:
        """Whether a launch of ``rows`` rows may use this tiling (``gated``: the dot kernel's gate/up epilogue, two
        weight tiles a step)."""
        if rows < self.min_rows:
            return False
        if not self.dot:
            return not gated and 1 <= rows <= FMA_MAX_ROWS
        weight_rows = self.block_n * (2 if gated else 1)
        stage_bytes = (weight_rows + dot_rows_for(rows)) * self.block_k * 2  # 16-bit weight and operand tiles
        return 1 <= rows <= MAX_ROWS and self.num_stages * stage_bytes <= DOT_SHARED_BYTES


# What engine/skinny_linear.py times against cuBLAS, per shape and row count. The elementwise kernel holds
# its weight tile in registers (as many bytes in flight as the registers allow); the dot kernel lets Triton's
# software pipeline stream the weight through shared memory num_stages tiles ahead (tensor cores, rows padded).
# Few on purpose: each is a compile or two per row padding at a process's first start (Triton caches them on
# disk after). Between them a 2,048-wide matrix gets 128 to 512 programs for an H100's / H200's 132 SMs.
CANDIDATE_TILES = (
    SkinnyTiles(16, 512, 1), SkinnyTiles(16, 512, 2), SkinnyTiles(8, 1024, 2),
    SkinnyTiles(64, 128, 1, 4, 4, dot=True), SkinnyTiles(32, 256, 1, 4, 4, dot=True),
    SkinnyTiles(16, 256, 2, 4, 5, dot=True), SkinnyTiles(64, 64, 4, 4, 6, dot=True),
    # From 32 rows: 128 weight rows a program (a 128-row tensor-core tile over 8 warps), K split in two; 3 stages, so
    # that its gated form (two weight tiles a step) takes 128 rows too.
    SkinnyTiles(128, 64, 2, 8, 3, dot=True, min_rows=32),
)


def rows_pad_for(rows: int) -> int:
    return triton.next_power_of_2(rows)


def dot_rows_for(rows: int) -> int:
    """The dot kernel's padded rows (the N side of its tensor-core tile: 16 to 128)."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(rows))


def block_k_for(tiles: SkinnyTiles, rows: int) -> int:
    """The K step for ``rows`` rows: the accumulator (rows_pad x BLOCK_N x BLOCK_K) at most ACC_ELEMENTS."""
    return max(16, min(tiles.block_k, ACC_ELEMENTS // (rows_pad_for(rows) * tiles.block_n)))


@triton.jit
def _store(out_ptr, total, rows, cols, pid_k, M, N, stride_om, PARTIAL: tl.constexpr):
    """Both kernels' epilogue: ``total`` (float32) at output rows ``rows`` and columns ``cols``, two index tensors
    broadcasting to its shape (either orientation); PARTIAL: as split ``pid_k``'s partial sums ([splits, M, N]
    float32), else cast into out [M, N]."""
    rows = rows.to(tl.int64)
    mask = (rows < M) & (cols < N)
    if PARTIAL:
        tl.store(out_ptr + (pid_k * M + rows) * N + cols, total, mask=mask)
    else:
        tl.store(out_ptr + rows * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fma_step(acc, w, a_rows, k, k_valid, row_valid, K, dtype: tl.constexpr, SILU_AND_MUL: tl.constexpr):
    """acc += a[:, k] (x) w: one K step of the elementwise kernel, ``w`` its weight tile already loaded."""
    a_mask = row_valid[:, None] & k_valid[None, :]
    if SILU_AND_MUL:  # a = silu(gate) * up, rounded as the SiLU-and-mul kernel rounds it
        gate = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0)
        up = tl.load(a_rows + K + k[None, :], mask=a_mask, other=0.0)
        a = silu_and_mul_values(gate, up, dtype).to(tl.float32)
    else:
        a = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
    return acc + a[:, None, :] * w[None, :, :]


@triton.jit(do_not_specialize=["steps_per_split"])
def _skinny_gemm_kernel(
    out_ptr,  # [M, N] (not PARTIAL) or float32 [splits, M, N] partial sums
    a_ptr,
    w_ptr,
    M,
    N,
    K,
    steps_per_split,  # BLOCK_K steps a split walks (its K positions: a multiple of BLOCK_K the compiler can see)
    stride_am,
    stride_wn,
    stride_om,
    ROWS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,  # K is split: write float32 partial sums (out_ptr: [splits, M, N])
    SILU_AND_MUL: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
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
    k_lo = pid_k * steps_per_split * BLOCK_K
    # The first K step's weight tile is loaded before the wait (a weight: launch_pdl.py), so with PDL it comes
    # in while the previous kernel finishes; the step itself is peeled off the loop (the same sums in the same
    # order, with or without PDL).
    k = k_lo + ks
    k_valid = k < K  # the splits tile K; only the last runs past it
    w = tl.load(w_rows + k[None, :], mask=col_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
    wait_then_release(USE_PDL)
    acc = _fma_step(tl.zeros([ROWS_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32), w, a_rows, k, k_valid, row_valid, K,
                    dtype, SILU_AND_MUL)
    for k0 in range(k_lo + BLOCK_K, k_lo + steps_per_split * BLOCK_K, BLOCK_K):
        k = k0 + ks
        k_valid = k < K
        w = tl.load(w_rows + k[None, :], mask=col_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        acc = _fma_step(acc, w, a_rows, k, k_valid, row_valid, K, dtype, SILU_AND_MUL)
    _store(out_ptr, tl.sum(acc, axis=2), rows[:, None], cols[None, :], pid_k, M, N, stride_om, PARTIAL)


@triton.jit
def _dot(acc, w, a_t, NATIVE_DOT: tl.constexpr):
    """acc += w @ a_t (the dot kernel's step, its operands loaded)."""
    if NATIVE_DOT:
        return tl.dot(w, a_t, acc)
    return tl.dot(w.to(tl.float32), a_t.to(tl.float32), acc, input_precision="ieee")


@triton.jit(do_not_specialize=["steps_per_split"])
def _skinny_dot_kernel(
    out_ptr,  # [M, N] (not PARTIAL) or float32 [splits, M, N] partial sums
    a_ptr,
    w_ptr,
    M,
    N,
    K,
    steps_per_split,  # BLOCK_K steps a split walks (its K positions: a multiple of BLOCK_K the compiler can see)
    stride_am,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    NATIVE_DOT: tl.constexpr,  # 16-bit operands into the dot as they are (a GPU); else float32 (the interpreter)
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
    ROWS: tl.constexpr = 16,  # M padded (dot_rows_for)
    GATED: tl.constexpr = False,  # the weight is [2N, K], gate rows then up rows: out = silu(gate) * up (module doc)
):
    """out^T [BLOCK_N, ROWS] = weight tile @ a^T tile, the rows past M masked to zero."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_valid = rows < M
    col_valid = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn  # GATED: the up rows of the same columns
    a_cols = a_ptr + rows.to(tl.int64)[None, :] * stride_am
    # The loop's bounds and the loads' offsets are multiples of BLOCK_K the compiler can see (a bound clipped
    # to K with tl.minimum, or a split length passed as is, kept it from vectorising and pipelining the loads).
    k_lo = pid_k * steps_per_split * BLOCK_K
    # As in the elementwise kernel: the first step's weight tiles before the wait, the step peeled off the loop.
    k = k_lo + ks
    k_valid = k < K  # the splits tile K; only the last runs past it
    w_mask = col_valid[:, None] & k_valid[None, :]
    w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
    if GATED:
        w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
    wait_then_release(USE_PDL)
    a_t = tl.load(a_cols + k[:, None], mask=k_valid[:, None] & row_valid[None, :], other=0.0)
    acc = _dot(tl.zeros([BLOCK_N, ROWS], dtype=tl.float32), w, a_t, NATIVE_DOT)
    acc_up = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    if GATED:
        acc_up = _dot(acc_up, w_up, a_t, NATIVE_DOT)
    for k0 in range(k_lo + BLOCK_K, k_lo + steps_per_split * BLOCK_K, BLOCK_K):
        k = k0 + ks
        k_valid = k < K
        w_mask = col_valid[:, None] & k_valid[None, :]
        a_t = tl.load(a_cols + k[:, None], mask=k_valid[:, None] & row_valid[None, :], other=0.0)
        acc = _dot(acc, tl.load(w_rows + k[None, :], mask=w_mask, other=0.0), a_t, NATIVE_DOT)
        if GATED:
            acc_up = _dot(acc_up, tl.load(up_rows + k[None, :], mask=w_mask, other=0.0), a_t, NATIVE_DOT)
    if GATED:
        _store_gated(out_ptr, acc, acc_up, rows[None, :], cols[:, None], pid_k, M, N, stride_om, PARTIAL)
    else:
        _store(out_ptr, acc, rows[None, :], cols[:, None], pid_k, M, N, stride_om, PARTIAL)  # acc is out^T


@triton.jit
def _store_gated(out_ptr, gate, up, rows, cols, pid_k, M, N, stride_om, PARTIAL: tl.constexpr):
    """The gated dot kernel's epilogue: PARTIAL, both sums as split ``pid_k``'s partials ([splits, M, 2N] float32,
    gate columns then up columns); else silu(gate) * up into out [M, N], each rounded to out's dtype first as the
    gate/up projection's output is before the SiLU-and-mul kernel reads it."""
    rows = rows.to(tl.int64)
    mask = (rows < M) & (cols < N)
    if PARTIAL:
        at = out_ptr + (pid_k * M + rows) * (2 * N) + cols
        tl.store(at, gate, mask=mask)
        tl.store(at + N, up, mask=mask)
    else:
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + rows * stride_om + cols, silu_and_mul_values(gate.to(dtype), up.to(dtype), dtype), mask=mask)


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, M, N, stride_om, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr = False, GATED: tl.constexpr = False):
    """out[m, n] = the SPLIT partial sums of (m, n), added in split order (GATED: silu(gate) * up of the gate and up
    sums, the partials [splits, M, 2N]; each sum rounded to out's dtype first, as _store_gated does)."""
    wait_then_release(USE_PDL)
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < N
    width = 2 * N if GATED else N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        at = part_ptr + (s * M + row).to(tl.int64) * width + cols
        total += tl.load(at, mask=valid, other=0.0)
        if GATED:
            up += tl.load(at + N, mask=valid, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        out = silu_and_mul_values(total.to(dtype), up.to(dtype), dtype)
    else:
        out = total.to(dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, out, mask=valid)


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
                out: torch.Tensor | None = None, gated: bool = False, epilogue=None) -> torch.Tensor:
    """``a @ weight.T`` (``silu_and_mul``: ``silu(a[:, :K]) * a[:, K:]`` first) for the rows ``tiles`` takes (the
    dot kernel runs the activation as the SiLU-and-mul kernel first: its operand is streamed, not computed).
    ``gated`` (dot tilings): ``weight`` is the fused gate/up projection [2N, K] and the result is
    ``silu(gate) * up`` [M, N], computed in the matmul's epilogue: the bits of the plain matmul followed by the
    SiLU-and-mul kernel, without the [M, 2N] round trip or that kernel. ``epilogue``
    (kernels/triton_skinny_epilogues.py: an RmsNormEpilogue or RotaryKvEpilogue, not with ``gated``): what follows the
    matmul, run by the kernel that adds the partial sums (the matmul writes them even unsplit); the result is the
    epilogue's."""
    k = check_operands(a, weight, silu_and_mul)
    m, n = a.shape[0], weight.shape[0]
    if gated and (silu_and_mul or n % 2 or not tiles.dot):
        raise ValueError("gated takes a dot tiling and an even-rowed gate/up weight, without silu_and_mul")
    if not tiles.takes(m, gated):
        raise ValueError(f"{tiles} does not take {m} rows (the elementwise kernel takes at most {FMA_MAX_ROWS}, the dot "
                         f"kernel's pipeline must fit {DOT_SHARED_BYTES} bytes of shared memory)")
    if gated and epilogue is not None:
        raise ValueError("gated takes no epilogue")
    if gated:
        n //= 2  # the output's columns: each program computes its gate and its up columns
    if epilogue is not None:
        epilogue.check(m, n, a.dtype)
    if silu_and_mul and tiles.dot:
        a, silu_and_mul = silu_and_mul_triton(a), False
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != a.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a packed-row [{m}, {n}] {a.dtype} tensor")
    block_k = tiles.block_k if tiles.dot else block_k_for(tiles, m)
    # Each split walks whole K steps (its share rounded up to one); the last may run past K (masked).
    num_steps = triton.cdiv(k, block_k)
    steps_per_split = triton.cdiv(num_steps, max(1, min(tiles.split, num_steps)))
    split = triton.cdiv(num_steps, steps_per_split)
    partial = split > 1 or epilogue is not None
    target = torch.empty(split, m, 2 * n if gated else n, dtype=torch.float32, device=a.device) if partial else out
    grid = (triton.cdiv(n, tiles.block_n), split)
    pdl = launch_pdl.options(a)
    if tiles.dot:
        _skinny_dot_kernel[grid](
            target, a, weight, m, n, k, steps_per_split, a.stride(0), weight.stride(0), out.stride(0),
            BLOCK_N=tiles.block_n, BLOCK_K=block_k, PARTIAL=partial, NATIVE_DOT=a.dtype != torch.float32
            and not INTERPRETED, ROWS=dot_rows_for(m), GATED=gated, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, **pdl,
        )
    else:
        _skinny_gemm_kernel[grid](
            target, a, weight, m, n, k, steps_per_split, a.stride(0), weight.stride(0), out.stride(0),
            ROWS_PAD=rows_pad_for(m), BLOCK_N=tiles.block_n, BLOCK_K=block_k, PARTIAL=partial,
            SILU_AND_MUL=silu_and_mul, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl,
        )
    if epilogue is not None:
        epilogue.launch(out, target, pdl)
    elif split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(triton.cdiv(n, block), m)](out, target, m, n, out.stride(0), SPLIT=split, BLOCK=block,
                                                        GATED=gated, **pdl)
    return out
