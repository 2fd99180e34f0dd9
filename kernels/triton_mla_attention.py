"""Triton kernel: multi-head latent attention (MLA: DeepSeek-V2 / V3) over the one-plane latent cache, absorbed.

What it computes is :func:`pdcluster.kernels.reference.latent_attention`: every query head attends to one cached
vector a token, [c, k_r] (LATENT + ROPE wide: 512 + 64 for the published models; engine/models/deepseek.py), its
query being [W_k^T q_nope, q_rope] of the same width, and the values are the latents c, the vector's first
LATENT dims, so the output is LATENT wide a head. The general paged kernel (triton_paged_attention.py) holds heads
of up to 256 dims and would also carry the 64 rotary dims through the value product; this one:

- scores a key tile in two dots, the latent part and the rotary part, each a power of two wide (512 and 64: no
  padding to 1,024 for 576);
- loads each key tile once: the latent tile [LATENT, BLOCK_N], loaded transposed for the scores, is the value
  tile (its transpose) for the output product;
- puts query heads in the rows of a tile: all of them share the one cached vector (MQA), so a key tile is read
  once for HEADS_BLOCK heads of one token, or, with fewer heads than that (small test models), for BLOCK_Q
  tokens of all of them.

Work split: one program per (query tile, head block, partition group); the grid's first axis numbers query
tiles as the paged kernel does (request r's tiles start at ``query_start_loc[r] // BLOCK_Q + r``; no host sync).
The context is cut into fixed partitions of PARTITION positions, each reduced from a fresh softmax state and
merged in order by the paged kernel's ``_merge``; a launch with too few programs to fill the GPU (a decode step
of a few requests) writes partition states to scratch and merges them in a second kernel (flash-decoding), the
others merge in the program. Tile shapes are constants of the model (rows: TILE_ROWS; keys: KV_TILE_TOKENS),
never of the batch, so a row's bits are the same in a prefill chunk, a verification row or a decode step, alone
or batched, split or not (deterministic mode; STYLE.md "Deterministic kernels"). Numerics as the paged kernel:
dots on fp32 operands (IEEE for fp32, TF32 for 16-bit inputs, exact for them), native 16-bit dots in the fast mode
on a GPU.

No sliding window and no soft-capping: no MLA model has them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdcluster.kernels.triton_paged_attention import (INTERPRETED, SPLIT_BELOW_PROGRAMS, _merge,
                                                      _merge_partitions_kernel, _query_tile, _softmax_step)

# Rows (query tokens x heads) a tile, in every batch: tl.dot's minimum, and one token's 16 heads for the published
# models (16 heads in DeepSeek-V2-Lite, 128 in V3: 1 or 8 head blocks a token).
TILE_ROWS = 16
# Key positions a tile. 16 with fp32 operands (the latent tile is 512 x 16 fp32 registers / shared memory on its
# way into the dot), 32 with native 16-bit ones (the fast mode on a GPU). Constants: the context's split into tiles
# fixes the order of a row's softmax reduction.
KV_TILE_TOKENS = 16
NATIVE_KV_TILE_TOKENS = 32
# Context positions a partition (a multiple of both key tiles): where a row's softmax states are merged.
PARTITION = 128
# Heads a program of the merge kernel folds (any: the merge is elementwise per row; a power of two).
MERGE_HEADS = 4


def heads_block_for(num_heads: int) -> int:
    """Query heads a tile: TILE_ROWS of them where there are as many, else all (a power of two)."""
    return min(TILE_ROWS, triton.next_power_of_2(num_heads))


@triton.jit
def _latent_partition_state(q_lat, q_rope, q_pos, row_valid, kv_lo, kv_hi, table_row_ptr, cache_ptr, block_size,
                            qk_scale_log2, lat_dims, lat_valid, rope_dims, rope_valid, stride_cache_block,
                            stride_cache_slot, stride_cache_dim, stride_table_entry,
                            LATENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            LATENT_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """Online softmax over context positions [kv_lo, kv_hi) from a fresh state: (m, l, acc)."""
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: -inf - -inf would be NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for kv_start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = kv_start + cols
        k_valid = k_pos < kv_hi
        block_ids = tl.load(table_row_ptr + (k_pos // block_size) * stride_table_entry, mask=k_valid, other=0)
        slots = block_ids.to(tl.int64) * stride_cache_block + (k_pos % block_size) * stride_cache_slot
        # The latent tile, transposed for q @ k: also the value tile (its transpose) below.
        c_t = tl.load(cache_ptr + slots[None, :] + lat_dims[:, None] * stride_cache_dim,
                      mask=lat_valid[:, None] & k_valid[None, :], other=0.0)
        r_t = tl.load(cache_ptr + slots[None, :] + (LATENT + rope_dims[:, None]) * stride_cache_dim,
                      mask=rope_valid[:, None] & k_valid[None, :], other=0.0)
        if NATIVE_DOT:
            scores = tl.dot(q_lat, c_t) + tl.dot(q_rope, r_t)
        else:
            c_t = c_t.to(tl.float32)
            scores = (tl.dot(q_lat, c_t, input_precision=DOT_PRECISION)
                      + tl.dot(q_rope, r_t.to(tl.float32), input_precision=DOT_PRECISION))
        scores = scores * qk_scale_log2
        causal = (k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        scores = tl.where(causal, scores, float("-inf"))

        # The values are the latents: the latent tile's transpose, [BLOCK_N, LATENT_PAD].
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, scores, tl.trans(c_t), DOT_PRECISION, NATIVE_DOT)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_reqs"])
def _mla_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, LATENT]
    query_ptr,  # [num_tokens, num_heads, LATENT + ROPE]
    cache_ptr,  # the layer's plane: [num_blocks, block_size, 1, LATENT + ROPE]
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_m_ptr,  # SPLIT: [num_tokens, num_heads, max_parts] fp32 partition states (else unused)
    part_l_ptr,
    part_acc_ptr,  # SPLIT: [num_tokens, num_heads, max_parts, LATENT_PAD] fp32
    qk_scale_log2,  # softmax scale * log2(e): the softmax runs on exp2
    num_reqs,
    block_size,
    num_heads,
    max_parts,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_dim,
    stride_table_req,
    stride_table_entry,
    LATENT: tl.constexpr,  # the latent's width: the values' and the output's
    ROPE: tl.constexpr,  # the shared rotary key part's width
    LATENT_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,  # query heads a tile (a power of two)
    BLOCK_Q: tl.constexpr,  # query tokens a tile
    BLOCK_M: tl.constexpr,  # rows a tile = BLOCK_Q * HEADS_BLOCK
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # write partition states to scratch (program_id(2) picks partitions) vs merge here
    NATIVE_DOT: tl.constexpr,
):
    q_tile_idx = tl.program_id(0)
    head_block = tl.program_id(1)

    req, q_start, q_len, tile_in_req = _query_tile(query_start_loc_ptr, q_tile_idx, num_reqs, BLOCK_Q)
    if tile_in_req * BLOCK_Q >= q_len:
        return  # a gap left by the "+ r" tile numbering, or past the last request
    first_q_pos = tl.load(seq_lens_ptr + req) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_in_req = tile_in_req * BLOCK_Q + rows // HEADS_BLOCK
    head = head_block * HEADS_BLOCK + rows % HEADS_BLOCK
    row_valid = (q_in_req < q_len) & (head < num_heads)
    q_token = (q_start + q_in_req).to(tl.int64)
    q_pos = first_q_pos + q_in_req

    lat_dims = tl.arange(0, LATENT_PAD)
    lat_valid = lat_dims < LATENT
    rope_dims = tl.arange(0, ROPE_PAD)
    rope_valid = rope_dims < ROPE
    q_row = q_token[:, None] * stride_q_token + head[:, None] * stride_q_head
    q_lat = tl.load(query_ptr + q_row + lat_dims[None, :] * stride_q_dim,
                    mask=row_valid[:, None] & lat_valid[None, :], other=0.0)
    q_rope = tl.load(query_ptr + q_row + (LATENT + rope_dims[None, :]) * stride_q_dim,
                     mask=row_valid[:, None] & rope_valid[None, :], other=0.0)
    if not NATIVE_DOT:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    # Keys up to the tile's latest valid token: later positions are masked for every row anyway, and cache slots
    # past the context may hold garbage (even NaN), so they are never loaded.
    last_q_in_tile = tl.minimum(tile_in_req * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = first_q_pos + last_q_in_tile + 1
    num_parts = tl.cdiv(kv_end, PARTITION_SIZE)
    table_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_table_req
    # Unsplit, the grid has one program on axis 2: this program walks every partition and merges them here.
    state_row = q_token * num_heads + head
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], dtype=tl.float32)
    for part in range(tl.program_id(2), num_parts, tl.num_programs(2)):
        kv_lo = part * PARTITION_SIZE
        m_p, l_p, acc_p = _latent_partition_state(
            q_lat, q_rope, q_pos, row_valid, kv_lo, tl.minimum(kv_lo + PARTITION_SIZE, kv_end), table_row_ptr,
            cache_ptr, block_size, qk_scale_log2, lat_dims, lat_valid, rope_dims, rope_valid, stride_cache_block,
            stride_cache_slot, stride_cache_dim, stride_table_entry, LATENT, BLOCK_M, BLOCK_N, LATENT_PAD,
            DOT_PRECISION, NATIVE_DOT)
        if SPLIT:
            at = state_row * max_parts + part
            tl.store(part_m_ptr + at, m_p, mask=row_valid)
            tl.store(part_l_ptr + at, l_p, mask=row_valid)
            tl.store(part_acc_ptr + at[:, None] * LATENT_PAD + lat_dims[None, :], acc_p, mask=row_valid[:, None])
        else:
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_p, l_p, acc_p)
    if not SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows: never stored, but keep them NaN-free
        out = acc / l_safe[:, None]
        out_offsets = q_token[:, None] * stride_out_token + head[:, None] * stride_out_head \
            + lat_dims[None, :] * stride_out_dim
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & lat_valid[None, :])


def mla_attention_triton(query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                         query_start_loc: Tensor, scale: float, latent_dim: int,
                         batch_invariant: bool = True) -> Tensor:
    """Absorbed MLA (module doc; shapes as :func:`pdcluster.kernels.reference.latent_attention`): ``layer_cache``
    is the layer's one-plane cache [1, num_blocks, block_size, 1, latent_dim + rope] (or a view with K and V
    planes over it: only plane 0 is read), ``query`` [num_tokens, num_heads, latent_dim + rope] (any strides).
    Returns [num_tokens, num_heads, latent_dim]. ``batch_invariant``: fp32 operands into the dots (the fixed
    tiles are used either way); otherwise native 16-bit dots and wider key tiles on a GPU."""
    native = not batch_invariant and query.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    return launch(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, latent_dim,
                  NATIVE_KV_TILE_TOKENS if native else KV_TILE_TOKENS, native_dot=native)


def launch(query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
           scale: float, latent_dim: int, block_n: int = KV_TILE_TOKENS, split: bool | None = None,
           native_dot: bool = False, heads_block: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None) -> Tensor:
    """Run the kernel (checked arguments). ``split``: merge the partitions in a second kernel (None: when the
    launch has too few programs). ``heads_block``: tests pass other row tiles to show the invariance checks
    catch a batch-dependent one."""
    num_tokens, num_heads, width = query.shape
    _, _, block_size, num_kv_heads, cache_width = layer_cache.shape
    if num_kv_heads != 1 or cache_width != width:
        raise ValueError(f"latent attention takes one cached vector a token of the query's width {width}; "
                         f"the cache has {num_kv_heads} heads of {cache_width}")
    rope_dim = width - latent_dim
    if latent_dim <= 0 or rope_dim <= 0:
        raise ValueError(f"latent_dim {latent_dim} must split the width {width} into latent and rotary parts")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {num_reqs} requests")
    if PARTITION % block_n:
        raise ValueError(f"partition {PARTITION} is not a multiple of the key tile {block_n}")
    out = torch.empty(num_tokens, num_heads, latent_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    plane = layer_cache[0]  # [num_blocks, block_size, 1, width]
    heads_block = heads_block or heads_block_for(num_heads)
    block_q = max(1, TILE_ROWS // heads_block)
    num_head_blocks = -(-num_heads // heads_block)
    num_q_tiles = num_tokens // block_q + num_reqs  # the "+ num_reqs": each request's partial last tile
    latent_pad = max(16, triton.next_power_of_2(latent_dim))
    rope_pad = max(16, triton.next_power_of_2(rope_dim))
    # The longest context this call can have, from shapes alone (no host sync): the block table's width.
    max_parts = -(-block_tables.shape[1] * block_size // PARTITION)
    programs = num_q_tiles * num_head_blocks
    if split is None:
        split = programs < SPLIT_BELOW_PROGRAMS and max_parts > 1
    num_splits = min(max_parts, -(-SPLIT_BELOW_PROGRAMS // programs)) if split else 1
    if split:
        part_m = torch.empty(num_tokens, num_heads, max_parts, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, max_parts, latent_pad, dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # never touched
    _mla_attention_kernel[(num_q_tiles, num_head_blocks, num_splits)](
        out, query, plane, block_tables, seq_lens, query_start_loc, part_m, part_l, part_acc,
        scale / math.log(2.0), num_reqs, block_size, num_heads, max_parts,
        *query.stride(), *out.stride(), plane.stride(0), plane.stride(1), plane.stride(3), *block_tables.stride(),
        LATENT=latent_dim, ROPE=rope_dim, LATENT_PAD=latent_pad, ROPE_PAD=rope_pad, HEADS_BLOCK=heads_block,
        BLOCK_Q=block_q, BLOCK_M=block_q * heads_block, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", PARTITION_SIZE=PARTITION, SPLIT=split,
        NATIVE_DOT=native_dot, num_warps=num_warps or 8, **({"num_stages": num_stages} if num_stages else {}),
    )
    if split:
        # The paged kernel's merge, MERGE_HEADS heads a program (all of V3's 128 x 512 in one would not fit).
        _merge_partitions_kernel[(num_tokens, -(-num_heads // MERGE_HEADS))](
            out, seq_lens, query_start_loc, part_m, part_l, part_acc, out, num_reqs, num_heads, latent_dim, max_parts,
            *out.stride(), HEADS_PAD=MERGE_HEADS, HEAD_DIM_PAD=latent_pad, PARTITION_SIZE=PARTITION,
        )
    return out
