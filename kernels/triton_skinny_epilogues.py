"""Triton kernels: what follows a decode step's few-row matmul, run in the kernel that adds its split-K partial sums.

The weight-streaming matmul (kernels/triton_skinny_gemm.py) leaves float32 partial sums [splits, M, N] when it cuts
K among programs, and a second kernel adds them. In a Llama block each of three matmuls is followed by a small
kernel that reads the matmul's whole output row anyway:

- the attention's output projection and the MLP's down projection by the residual add and the next RMSNorm
  (:class:`RmsNormEpilogue`: kernels/triton_rms_norm.py's kernel);
- the qkv projection by the rotary embedding of q and k and the write of K and V into the paged cache
  (:class:`RotaryKvEpilogue`: kernels/triton_rotary_kv.py's kernel).

Each of those works on one token's row, as the sum does, so one kernel does both: a program a row adds the row's
partials in split order, rounds them to the activations' dtype (what the matmul would have stored), and runs the
follower's own code on that row (``rms_norm_row``, ``rotate_values`` and ``write_token_kv``, shared with the
kernels above). A batch-1 step of a 22-layer model launches 66 kernels fewer (44 norms and 22 rotary writes;
bench/results/gpu_check_h200.json had 258 a step, ~2 us each for these). Where the matmul runs unsplit it writes
its sums as one "split" for the epilogue to read (float32: a few KB more for up to 128 rows).

Numerics: the rotary epilogue is elementwise, the same values rounded the same way as the matmul then the rotary
kernel: bit for bit. The norm epilogue's sum of squares is the norm kernel's code on a row of the same values, but a
GPU's reduction order follows the compiled layout, which the two kernels may not share: its rsqrt may differ in
float32's last bit (the interpreter sums alike: equal there), which moves a 16-bit output by at most one unit in
the last place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdcluster.kernels.triton_pdl import wait_then_release
from pdcluster.kernels.triton_rms_norm import _MAX_HIDDEN, rms_norm_row
from pdcluster.kernels.triton_rotary import _cos_sin, rotate_values
from pdcluster.kernels.triton_rotary_kv import write_token_kv


@dataclass(frozen=True)
class RmsNormEpilogue:
    """``residual += matmul output`` (in place, in the residual's dtype), and the output is RMSNorm of that sum
    times ``weight`` (kernels/triton_rms_norm.py with a residual)."""

    weight: torch.Tensor  # [N]
    eps: float
    residual: torch.Tensor  # [M, N], unit stride along N

    def check(self, m: int, n: int, dtype: torch.dtype) -> None:
        if self.weight.shape != (n,) or self.residual.shape != (m, n):
            raise ValueError(f"norm weight {tuple(self.weight.shape)} / residual {tuple(self.residual.shape)} do not "
                             f"fit a [{m}, {n}] matmul output")
        if self.weight.dtype != dtype or self.residual.dtype != dtype or self.residual.stride(1) != 1:
            raise ValueError(f"the norm epilogue takes a {dtype} weight and a packed-row {dtype} residual")
        if n > _MAX_HIDDEN:
            raise ValueError(f"hidden size {n} is over the norm kernel's limit {_MAX_HIDDEN}")

    def launch(self, out: torch.Tensor, partials: torch.Tensor, pdl: dict) -> None:
        split, m, n = partials.shape
        block = triton.next_power_of_2(n)
        _sum_rms_norm_kernel[(m,)](
            out, partials, self.residual, self.weight, m, n, self.eps, out.stride(0), self.residual.stride(0),
            SPLIT=split, BLOCK=block, num_warps=min(max(block // 256, 1), 16), **pdl,
        )


@dataclass(frozen=True)
class RotaryKvEpilogue:
    """The output is the qkv projection's [M, (num_q_heads + 2 num_kv_heads) * head_dim] with q's and k's heads
    rotated by each token's position, and the rotated K and V written into the token's cache slot
    (kernels/triton_rotary_kv.py's arguments)."""

    num_q_heads: int
    num_kv_heads: int
    positions: torch.Tensor  # int64 [M]
    cos_sin: torch.Tensor  # float32 [max_positions, head_dim]: cos of each frequency, then sin
    layer_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # int64 [M]; negative = padding, not written

    @property
    def head_dim(self) -> int:
        return self.cos_sin.shape[1]

    def check(self, m: int, n: int, dtype: torch.dtype) -> None:
        d = self.head_dim
        if d % 2 or n != (self.num_q_heads + 2 * self.num_kv_heads) * d:
            raise ValueError(f"a [{m}, {n}] qkv output is not {self.num_q_heads} + 2 x {self.num_kv_heads} heads of "
                             f"an even head_dim {d}")
        if self.layer_cache.shape[0] != 2 or tuple(self.layer_cache.shape[3:]) != (self.num_kv_heads, d):
            raise ValueError(f"layer_cache {tuple(self.layer_cache.shape)} does not fit {self.num_kv_heads} heads "
                             f"of {d}")
        if self.positions.shape != (m,) or self.slot_mapping.shape != (m,):
            raise ValueError(f"positions {tuple(self.positions.shape)} / slot_mapping "
                             f"{tuple(self.slot_mapping.shape)} do not fit {m} tokens")

    def launch(self, out: torch.Tensor, partials: torch.Tensor, pdl: dict) -> None:
        split, m, n = partials.shape
        half = self.head_dim // 2
        cache = self.layer_cache
        _sum_rotary_kv_kernel[(m,)](
            out, partials, self.positions, self.cos_sin, cache, self.slot_mapping, m, n, self.num_q_heads,
            self.num_kv_heads, half, cache.shape[2], out.stride(0), *self.cos_sin.stride(), *cache.stride(),
            SPLIT=split, Q_HEADS_PAD=triton.next_power_of_2(self.num_q_heads),
            KV_HEADS_PAD=triton.next_power_of_2(self.num_kv_heads), HALF_PAD=triton.next_power_of_2(half), **pdl,
        )


Epilogue = RmsNormEpilogue | RotaryKvEpilogue


@triton.jit
def _sum_rms_norm_kernel(out_ptr, part_ptr, residual_ptr, norm_w_ptr, M, N, eps, stride_om, stride_rm,
                         SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Row ``program_id``: its SPLIT partial sums added in split order and rounded to out's dtype, then the residual
    add and the RMSNorm (rms_norm_row)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    weight = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_then_release(USE_PDL)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    rms_norm_row(out_ptr + row * stride_om, total.to(dtype).to(tl.float32), residual_ptr + row * stride_rm, weight,
                 cols, mask, N, eps, True, dtype)


@triton.jit
def _summed_heads(part_ptr, row, M, N, first_head, num_heads, half, dims, dim_mask, SPLIT: tl.constexpr,
                  HEADS_PAD: tl.constexpr, dtype: tl.constexpr):
    """Heads ``first_head`` .. + num_heads of row ``row``: both halves [HEADS_PAD, HALF_PAD] summed over the splits in
    order and rounded to ``dtype`` (returned in float32), with their columns and mask."""
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < num_heads)[:, None] & dim_mask[None, :]
    cols = (first_head + heads)[:, None] * (2 * half) + dims[None, :]
    x1 = tl.zeros(mask.shape, dtype=tl.float32)
    x2 = tl.zeros(mask.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        at = part_ptr + (s * M + row) * N + cols
        x1 += tl.load(at, mask=mask, other=0.0)
        x2 += tl.load(at + half, mask=mask, other=0.0)
    return x1.to(dtype).to(tl.float32), x2.to(dtype).to(tl.float32), heads, cols, mask


@triton.jit
def _sum_rotary_kv_kernel(out_ptr, part_ptr, positions_ptr, cos_sin_ptr, cache_ptr, slot_mapping_ptr, M, N,
                          num_q_heads, num_kv_heads, half, block_size, stride_om, stride_cos_sin_pos,
                          stride_cos_sin_dim, stride_cache_kv, stride_cache_block, stride_cache_slot,
                          stride_cache_head, stride_cache_dim, SPLIT: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                          KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Token ``program_id``: its qkv row from the partial sums; q and k rotated, all three stored into out's row
    (as the matmul and the rotary kernel leave it), and K and V into the token's cache slot."""
    wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    out_row = out_ptr + row * stride_om
    cos, sin, dims, dim_mask = _cos_sin(positions_ptr, row, cos_sin_ptr, half, stride_cos_sin_pos,
                                        stride_cos_sin_dim, HALF_PAD)
    x1, x2, _, cols, mask = _summed_heads(part_ptr, row, M, N, 0, num_q_heads, half, dims, dim_mask, SPLIT,
                                          Q_HEADS_PAD, dtype)
    q1, q2 = rotate_values(x1, x2, cos, sin, dtype)
    tl.store(out_row + cols, q1, mask=mask)
    tl.store(out_row + cols + half, q2, mask=mask)
    x1, x2, heads, cols, mask = _summed_heads(part_ptr, row, M, N, num_q_heads, num_kv_heads, half, dims, dim_mask,
                                              SPLIT, KV_HEADS_PAD, dtype)
    k1, k2 = rotate_values(x1, x2, cos, sin, dtype)
    tl.store(out_row + cols, k1, mask=mask)
    tl.store(out_row + cols + half, k2, mask=mask)
    v1, v2, _, cols, _ = _summed_heads(part_ptr, row, M, N, num_q_heads + num_kv_heads, num_kv_heads, half, dims,
                                       dim_mask, SPLIT, KV_HEADS_PAD, dtype)
    v1, v2 = v1.to(dtype), v2.to(dtype)
    tl.store(out_row + cols, v1, mask=mask)
    tl.store(out_row + cols + half, v2, mask=mask)
    write_token_kv(cache_ptr, tl.load(slot_mapping_ptr + row), k1, k2, v1, v2, heads, dims, mask, half, block_size,
                   stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, stride_cache_dim)
