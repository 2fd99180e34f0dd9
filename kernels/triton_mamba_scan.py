"""Triton kernels for a Mamba2 layer's prefill: the chunked SSD (state space duality) scan over one
request's tokens, continuing from its SSM state.

Same signature and semantics as :func:`pdcluster.kernels.mamba_reference.ssd_chunk_scan` (shapes and
the recurrence are written down in that module): initial state in, final state out, dt discretized as
``max(softplus(dt + dt_bias), dt_min)``, the D skip, heads reading group ``h // (H // n_groups)`` of
B and C, float32 everywhere.

The algorithm is that of mamba_ssm / vLLM (``_chunk_cumsum``, ``_chunk_state``, ``_state_passing``,
``_chunk_scan``) in three launches:

1. ``_dt_cumsum_kernel``, grid (chunks, heads): the discretized dt of every token and the cumulative
   log decay ``cs = cumsum(dt * A)`` from the start of its chunk, into [H, L] float32 buffers.
2. ``_chunk_state_passing_kernel``, grid (heads, head_dim blocks): one program walks its head's chunks
   in order, stores the state at each chunk's start into ``starts`` [chunks, H, P, N] and carries it:
   ``S <- exp(cs_last) S + sum_s exp(cs_last - cs_s) dt_s x_s (outer) B_s`` (mamba_ssm's chunk_state and
   state_passing fused: the sequential part is per head, parallel over heads and head_dim blocks).
3. ``_chunk_scan_kernel``, grid (chunks x row blocks, heads, head_dim blocks): every token's output,
   ``y_l = exp(cs_l) C_l S_start + sum_{s <= l in chunk} (C_l . B_s) exp(cs_l - cs_s) dt_s x_s + D x_l``
   (the within-chunk part is a masked matmul, quadratic in the chunk length, over column blocks).

Every matmul is a ``tl.dot`` with all dimensions padded to at least 16 (the GPU's minimum) and IEEE
float32 precision (not TF32: the states are carried across chunks, and the oracle is float32).
The within-chunk decay is ``exp(cs_l - cs_s)``, a difference of cumsums as in mamba_ssm, where the
reference sums segments directly; they agree within float32 rounding of ``|cs|`` (small unless dt * A is
large, when the decay is ~0 anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdcluster.kernels.triton_mamba import _softplus, head_block


@triton.jit
def _dt_cumsum_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, dt_out_ptr, cs_out_ptr,
    L, chunk_size, dt_min,
    stride_dt_t, stride_dt_h,
    BLOCK_CS: tl.constexpr,  # chunk_size rounded up to a power of two
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    l = tl.arange(0, BLOCK_CS)
    t = c * chunk_size + l
    valid = (l < chunk_size) & (t < L)
    raw = tl.load(dt_ptr + t * stride_dt_t + h * stride_dt_h, mask=valid, other=0.0).to(tl.float32)
    dt = tl.maximum(_softplus(raw + tl.load(dt_bias_ptr + h).to(tl.float32)), dt_min)
    dt = tl.where(valid, dt, 0.0)  # tokens past the chunk or the row neither decay nor add
    cs = tl.cumsum(dt * tl.load(A_ptr + h).to(tl.float32), axis=0)
    tl.store(dt_out_ptr + h * L + t, dt, mask=valid)
    tl.store(cs_out_ptr + h * L + t, cs, mask=valid)


@triton.jit
def _chunk_state_passing_kernel(
    x_ptr, B_ptr, dt_ptr, cs_ptr, init_ptr, starts_ptr, final_ptr,
    L, chunk_size, num_chunks, num_heads, head_dim, state_size, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_init_h, stride_init_p, stride_init_n,
    HAS_INIT: tl.constexpr,
    BLOCK_K: tl.constexpr,  # tokens per step within a chunk (>= 16)
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    h = tl.program_id(0)
    g, p, n, pmask, nmask = head_block(h, tl.program_id(1), head_dim, state_size, heads_per_group, BLOCK_P, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    smask = pmask[:, None] & nmask[None, :]
    # [P, N] offsets of this head's block within one [H, P, N] state (int64: starts can be large).
    state_offs = h.to(tl.int64) * head_dim * state_size + p[:, None] * state_size + n[None, :]

    if HAS_INIT:
        state = tl.load(init_ptr + h * stride_init_h + p[:, None] * stride_init_p + n[None, :] * stride_init_n,
                        mask=smask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)

    start_ptrs = starts_ptr + state_offs  # advanced by one [H, P, N] state per chunk (64-bit pointers)
    for c in range(num_chunks):
        tl.store(start_ptrs, state, mask=smask)
        start_ptrs += num_heads * head_dim * state_size
        t0 = c * chunk_size
        t_last = tl.minimum(t0 + chunk_size, L) - 1
        cs_last = tl.load(cs_ptr + h * L + t_last)  # log decay over the whole chunk
        chunk = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, chunk_size, BLOCK_K):
            k = k0 + kk
            t = t0 + k
            valid = (k < chunk_size) & (t < L)
            dt = tl.load(dt_ptr + h * L + t, mask=valid, other=0.0)
            cs = tl.load(cs_ptr + h * L + t, mask=valid, other=0.0)
            scale = tl.where(valid, dt * tl.exp(cs_last - cs), 0.0)  # dt_s, decayed to the chunk's end
            xk = tl.load(x_ptr + t[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
                         mask=valid[:, None] & pmask[None, :], other=0.0).to(tl.float32)
            Bk = tl.load(B_ptr + t[:, None] * stride_B_t + g * stride_B_g + n[None, :] * stride_B_n,
                         mask=valid[:, None] & nmask[None, :], other=0.0).to(tl.float32)
            chunk += tl.dot(tl.trans(xk * scale[:, None]), Bk, input_precision="ieee")
        state = state * tl.exp(cs_last) + chunk

    tl.store(final_ptr + state_offs, state, mask=smask)


@triton.jit
def _chunk_scan_kernel(
    y_ptr, x_ptr, B_ptr, C_ptr, D_ptr, dt_ptr, cs_ptr, starts_ptr,
    L, chunk_size, num_heads, head_dim, state_size, heads_per_group, row_blocks,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_y_t, stride_y_h,
    BLOCK_M: tl.constexpr,  # rows (tokens l) per program, >= 16; also the column (s) step
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    c = tl.program_id(0) // row_blocks
    mb = tl.program_id(0) % row_blocks
    h = tl.program_id(1)
    g, p, n, pmask, nmask = head_block(h, tl.program_id(2), head_dim, state_size, heads_per_group, BLOCK_P, BLOCK_N)
    t0 = c * chunk_size

    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    tm = t0 + m
    mvalid = (m < chunk_size) & (tm < L)
    cs_m = tl.load(cs_ptr + h * L + tm, mask=mvalid, other=0.0)
    Cm = tl.load(C_ptr + tm[:, None] * stride_C_t + g * stride_C_g + n[None, :] * stride_C_n,
                 mask=mvalid[:, None] & nmask[None, :], other=0.0).to(tl.float32)

    # The state at the chunk's start, decayed to each row: exp(cs_l) C_l S_start.
    start = tl.load(starts_ptr + (c.to(tl.int64) * num_heads + h) * head_dim * state_size
                    + p[:, None] * state_size + n[None, :],
                    mask=pmask[:, None] & nmask[None, :], other=0.0)
    acc = tl.dot(Cm, tl.trans(start), input_precision="ieee") * tl.exp(cs_m)[:, None]  # [M, P]

    # Within the chunk, columns s <= l: (C_l . B_s) exp(cs_l - cs_s) dt_s x_s.
    for k0 in range(0, (mb + 1) * BLOCK_M, BLOCK_M):
        k = k0 + tl.arange(0, BLOCK_M)
        tk = t0 + k
        kvalid = (k < chunk_size) & (tk < L)
        cs_k = tl.load(cs_ptr + h * L + tk, mask=kvalid, other=0.0)
        dt_k = tl.load(dt_ptr + h * L + tk, mask=kvalid, other=0.0)
        Bk = tl.load(B_ptr + tk[:, None] * stride_B_t + g * stride_B_g + n[None, :] * stride_B_n,
                     mask=kvalid[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        xk = tl.load(x_ptr + tk[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
                     mask=kvalid[:, None] & pmask[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(Cm, tl.trans(Bk), input_precision="ieee")  # [M, K]
        causal = (k[None, :] <= m[:, None]) & kvalid[None, :]
        decay = tl.exp(tl.minimum(cs_m[:, None] - cs_k[None, :], 0.0))  # min: no overflow above the diagonal
        scores = tl.where(causal, scores * decay * dt_k[None, :], 0.0)
        acc += tl.dot(scores, xk, input_precision="ieee")

    xm = tl.load(x_ptr + tm[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
                 mask=mvalid[:, None] & pmask[None, :], other=0.0).to(tl.float32)
    acc += tl.load(D_ptr + h).to(tl.float32) * xm
    tl.store(y_ptr + tm[:, None] * stride_y_t + h * stride_y_h + p[None, :], acc,
             mask=mvalid[:, None] & pmask[None, :])


def _block(n: int, cap: int) -> int:
    """A power of two covering ``n`` up to ``cap``, at least 16 (tl.dot's minimum on a GPU)."""
    return max(16, min(cap, triton.next_power_of_2(n)))


def ssd_chunk_scan_triton(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor, dt_min: float,
    chunk_size: int, initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The SSM over one request's L tokens in chunks of ``chunk_size`` from ``initial_state`` (zeros if
    None): (y [L, H, P] float32 with the D skip, the state after the last token [H, P, N] float32)."""
    L, H, P = x.shape
    n_groups, N = B.shape[1], B.shape[2]
    if H % n_groups:
        raise ValueError(f"num_heads {H} is not a multiple of n_groups {n_groups}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    if initial_state is not None and tuple(initial_state.shape) != (H, P, N):
        raise ValueError(f"initial_state must be [{H}, {P}, {N}]; got {tuple(initial_state.shape)}")
    device = x.device
    y = torch.empty(L, H, P, dtype=torch.float32, device=device)
    final = torch.empty(H, P, N, dtype=torch.float32, device=device)
    if L == 0:
        final.copy_(initial_state) if initial_state is not None else final.zero_()
        return y, final
    nc = triton.cdiv(L, chunk_size)
    dt_d = torch.empty(H, L, dtype=torch.float32, device=device)
    cs = torch.empty(H, L, dtype=torch.float32, device=device)
    starts = torch.empty(nc, H, P, N, dtype=torch.float32, device=device)

    _dt_cumsum_kernel[(nc, H)](
        dt, dt_bias, A, dt_d, cs, L, chunk_size, float(dt_min), *dt.stride(),
        BLOCK_CS=triton.next_power_of_2(chunk_size),
    )

    block_n = _block(N, 256)
    block_m = _block(chunk_size, 64)
    block_p_state = _block(P, 32)
    init = initial_state if initial_state is not None else final  # a placeholder pointer when absent
    _chunk_state_passing_kernel[(H, triton.cdiv(P, block_p_state))](
        x, B, dt_d, cs, init, starts, final,
        L, chunk_size, nc, H, P, N, H // n_groups,
        *x.stride(), *B.stride(), *init.stride(),
        HAS_INIT=initial_state is not None, BLOCK_K=block_m, BLOCK_P=block_p_state, BLOCK_N=block_n,
    )

    row_blocks = triton.cdiv(chunk_size, block_m)
    block_p = _block(P, 64)
    _chunk_scan_kernel[(nc * row_blocks, H, triton.cdiv(P, block_p))](
        y, x, B, C, D, dt_d, cs, starts,
        L, chunk_size, H, P, N, H // n_groups, row_blocks,
        *x.stride(), *B.stride(), *C.stride(), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_N=block_n,
    )
    return y, final


def bench_scan(device: str = "cuda", num_tokens: int = 2048, num_heads: int = 64, head_dim: int = 64,
               state_size: int = 128, n_groups: int = 8, chunk_size: int = 128, iters: int = 20) -> dict:
    """Time the Triton scan against the torch reference on ``device`` at a NemotronH-like size; returns
    {"triton_ms", "reference_ms", "speedup", "max_err_y", "max_err_state"} (median ms per call)."""
    import time

    from pdcluster.kernels import mamba_reference as reference

    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    args = (r(num_tokens, num_heads, head_dim), r(num_tokens, num_heads),
            -(torch.rand(num_heads, generator=gen) * 4 + 0.5).to(device),
            r(num_tokens, n_groups, state_size), r(num_tokens, n_groups, state_size), r(num_heads),
            r(num_heads) - 2.0, 0.001, chunk_size, r(num_heads, head_dim, state_size))
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def median_ms(fn) -> float:
        fn()  # compile / warm up
        sync()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    y_t, s_t = ssd_chunk_scan_triton(*args)
    y_r, s_r = reference.ssd_chunk_scan(*args)
    triton_ms = median_ms(lambda: ssd_chunk_scan_triton(*args))
    reference_ms = median_ms(lambda: reference.ssd_chunk_scan(*args))
    return {"triton_ms": triton_ms, "reference_ms": reference_ms, "speedup": reference_ms / triton_ms,
            "max_err_y": (y_t - y_r).abs().max().item(), "max_err_state": (s_t - s_r).abs().max().item()}
