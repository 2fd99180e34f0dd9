"""Triton kernel: varlen causal attention of each request's new query tokens over its paged KV context.

Same semantics as :func:`pdcluster.kernels.reference.paged_attention` (read it for the cache layout and
the position rule: query token ``i`` of a request with ``q_len`` new tokens sits at position
``seq_lens[r] - q_len + i`` and sees context positions ``0 ..= that position``). One kernel serves
prefill chunks, decode (q_len 1) and speculative verification (q_len 1 + k).

Work split: one program per (query tile, KV head). A query tile is up to BLOCK_Q consecutive new
tokens of ONE request times the GROUP query heads that share this KV head (GQA), flattened into
BLOCK_M = BLOCK_Q * GROUP_PAD rows: each K/V tile loaded from the cache is reused by every row.
Each program walks its request's context in tiles of BLOCK_N token positions with an online softmax
(flash-attention style), stopping at the last position its tile's latest token can see. There is no
split of the context across programs (no flash-decoding): one program reduces a row's whole context.

Batch invariance (issue 24; STYLE.md "Deterministic kernels"): a query's result is bit for bit the same
in a prefill chunk, a verification row and a decode step, alone or in any batch. Its reduction order
is fixed: key tiles of BLOCK_N positions from position 0 up, each merged by the same online-softmax
update. The tile shapes are constants of the model (TILE_ROWS rows, GROUP_PAD from the head counts),
never chosen from the batch: the dots' instruction and the row reductions' layout follow the tile
shape on a GPU. (Until issue 24 a batch of prefill chunks got 64-row tiles and a decode batch 16-row
ones; every batch now gets the decode tile, so prefill reads each K/V tile more often, mostly from L2.)
Tiles past a row's own position, which a prefill chunk's earlier tokens walk through for their later
neighbours, are exact no-ops for that row: every score is -inf, so p = 0 and alpha = exp2(0) = 1.
``num_reqs`` is not specialised, so a request alone (Triton would compile num_reqs == 1 as a constant)
runs the same compiled kernel as a batch.

Programs find their request without a host sync: request r owns query tiles starting at index
``query_start_loc[r] // BLOCK_Q + r`` (the "+ r" leaves room for every request's partial last
tile), so the grid ``num_tokens // BLOCK_Q + num_reqs`` always suffices, a program binary-searches
query_start_loc for its request, and programs that land in a gap exit at once.

Numerics: the dots run on fp32 operands (``ieee`` for fp32 inputs; ``tf32`` for 16-bit inputs, which
is exact for bf16/fp16 operands since tf32 keeps 10 mantissa bits). Why not native bf16 dots: the
Triton interpreter (3.9) multiplies bf16 operands as their raw uint16 bit patterns, so a native bf16
dot could never be checked on our CPU machines; this way the path the tests run is the GPU path. The
cost is up to 2x tensor-core throughput in compute-bound prefill; decode is memory-bound either way.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor
import triton.language as tl

# Key positions per inner-loop step. >= 16 because tl.dot needs every dim >= 16 on GPU. A constant: the
# context's split into tiles fixes the order of a query's softmax reduction (module doc).
KV_TILE_TOKENS = 32
# Rows (query tokens x heads of a GQA group) per tile, in every batch (module doc). 16: tl.dot's minimum,
# and the decode tile, so a decode step costs what it did before tiles were fixed.
TILE_ROWS = 16


@triton.jit
def _find_request(query_start_loc_ptr, q_tile_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= q_tile_idx (binary search)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale_log2,  # softmax scale * log2(e): the softmax runs on exp2
    num_reqs,
    block_size,
    head_dim,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_cache_dim,
    stride_table_req,
    stride_table_entry,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two (tl.arange needs one)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile = BLOCK_Q * GROUP_PAD
    BLOCK_N: tl.constexpr,  # key positions per inner step
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    req = _find_request(query_start_loc_ptr, q_tile_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tile_in_req = q_tile_idx - (q_start // BLOCK_Q + req)
    if tile_in_req * BLOCK_Q >= q_len:
        return  # a gap left by the "+ r" tile numbering, or past the last request
    context_len = tl.load(seq_lens_ptr + req)
    first_q_pos = context_len - q_len  # position of the request's first new token

    # Row -> (query token of this request, query head of this KV head's group).
    rows = tl.arange(0, BLOCK_M)
    q_in_req = tile_in_req * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (q_in_req < q_len) & (head_in_group < GROUP)
    q_token = (q_start + q_in_req).to(tl.int64)
    q_head = kv_head * GROUP + head_in_group
    q_pos = first_q_pos + q_in_req

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < head_dim
    q_offsets = (
        q_token[:, None] * stride_q_token + q_head[:, None] * stride_q_head + dims[None, :] * stride_q_dim
    )
    row_dim_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_dim_mask, other=0.0).to(tl.float32)

    # Finite start for the running max: padding rows see no key at all, and -inf - -inf would be NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys up to the tile's latest valid token: later positions are masked for every row anyway, and
    # cache slots past context_len may hold garbage (even NaN), so they are never loaded.
    last_q_in_tile = tl.minimum(tile_in_req * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = first_q_pos + last_q_in_tile + 1
    table_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_table_req
    cols = tl.arange(0, BLOCK_N)
    for kv_start in range(0, kv_end, BLOCK_N):
        k_pos = kv_start + cols
        k_valid = k_pos < kv_end
        block_ids = tl.load(table_row_ptr + (k_pos // block_size) * stride_table_entry, mask=k_valid, other=0)
        slot_offsets = (
            block_ids.to(tl.int64) * stride_cache_block
            + (k_pos % block_size) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        # K is loaded transposed, [HEAD_DIM_PAD, BLOCK_N], ready for q @ k.
        k_t = tl.load(
            cache_ptr + slot_offsets[None, :] + dims[:, None] * stride_cache_dim,
            mask=dim_valid[:, None] & k_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            cache_ptr + stride_cache_kv + slot_offsets[:, None] + dims[None, :] * stride_cache_dim,
            mask=k_valid[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(tl.float32)

        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_M, BLOCK_N]
        causal = (k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        scores = tl.where(causal, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows: never stored, but keep them NaN-free
    out = acc / l_safe[:, None]
    out_offsets = (
        q_token[:, None] * stride_out_token
        + q_head[:, None] * stride_out_head
        + dims[None, :] * stride_out_dim
    )
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_dim_mask)


def block_q_for(group_pad: int) -> int:
    """Query tokens per tile: a function of the model's head grouping only, never of the batch."""
    return max(1, TILE_ROWS // group_pad)


def paged_attention_triton(
    query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float
) -> Tensor:
    """Causal attention of each request's new query tokens over its paged context (see module doc;
    arguments and shapes as in :func:`pdcluster.kernels.reference.paged_attention`).

    The K/V of the new tokens must already be written into the cache. Rows of the output past
    ``query_start_loc[-1]`` (batch padding) are left unwritten, as in the reference.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = layer_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {num_reqs} requests")
    out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out

    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    return launch(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, out,
                  block_q_for(group_pad), KV_TILE_TOKENS)


def launch(query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
           scale: float, out: Tensor, block_q: int, block_n: int) -> Tensor:
    """Run the kernel with the given tiles (checked arguments; :func:`paged_attention_triton` passes the
    fixed ones, tests pass batch-dependent ones to show the invariance tests catch them)."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # The "+ num_reqs" covers each request's partial last tile (see the module doc).
    num_q_tiles = num_tokens // block_q + num_reqs
    _paged_attention_kernel[(num_q_tiles, num_kv_heads)](
        out,
        query,
        layer_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale / math.log(2.0),
        num_reqs,
        block_size,
        head_dim,
        *query.stride(),
        *out.stride(),
        *layer_cache.stride(),
        *block_tables.stride(),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad,
        BLOCK_N=block_n,
        HEAD_DIM_PAD=max(triton.next_power_of_2(head_dim), 16),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
