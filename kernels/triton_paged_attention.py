"""Triton kernel: varlen causal attention of each request's new query tokens over its paged KV context.

Same semantics as :func:`pdcluster.kernels.reference.paged_attention` (read it for the cache layout and
the position rule: query token ``i`` of a request with ``q_len`` new tokens sits at position
``seq_lens[r] - q_len + i`` and sees context positions ``0 ..= that position``). One kernel serves
prefill chunks, decode (q_len 1) and speculative verification (q_len 1 + k).

Work split: one program per (query tile, KV head). A query tile is up to BLOCK_Q consecutive new
tokens of ONE request times the GROUP query heads that share this KV head (GQA), flattened into
BLOCK_M = BLOCK_Q * GROUP_PAD rows: each K/V tile loaded from the cache is reused by every row.
Each program walks its request's context in tiles of BLOCK_N token positions with an online softmax
(flash-attention style), stopping at the last position its tile's latest token can see.

The context is cut into fixed partitions of PARTITION positions (a constant, like the key tile). Each
partition is reduced from a fresh softmax state, and the partitions' states are merged in order by one
formula (``_merge``). Where that merge runs is the only thing a launch chooses: inside the program that
walked the partitions (prefill chunks, big batches), or, when a step has too few query tiles to fill
the GPU (a decode step of a few requests), by a second kernel after one program per (query tile, KV
head, partition group) wrote each partition's state to scratch (flash-decoding). Both run the same
per-partition loop and the same merge, so a row gets the same bits either way.

The fast mode (``batch_invariant=False``) splits a decode step of a few requests differently: each row's
key tiles are cut into fast_decode_segments() even runs whatever the context's length, one program each,
and one program per (token, head) merges all of them with one load (``_merge_segments_kernel``). Such a
step is latency-bound: the partition split walks PARTITION / BLOCK_N tiles one after another in each
program and merges partitions one by one, while here each program walks ceil(tiles / SEGMENTS).

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
query_start_loc for its request, and programs that land in a gap exit at once. A uniform step (every request
with the same number of query tokens, at most BLOCK_Q: a decode step, a short verification step; the engine
knows it as AttentionMetadata.uniform_q_len) needs neither: program r is request r, whose tokens start at
r * q_len. At batch 128 that spares each program the search's ~7 dependent loads before its first key, and
the GPU a third of its programs; the tiles, and so the bits, are the same.

Numerics: the dots run on fp32 operands (``ieee`` for fp32 inputs; ``tf32`` for 16-bit inputs, which
is exact for bf16/fp16 operands since tf32 keeps 10 mantissa bits). Why not native bf16 dots: the
Triton interpreter (3.9) multiplies bf16 operands as their raw uint16 bit patterns, so a native bf16
dot could never be checked on our CPU machines; this way the path the tests run is the GPU path. The
cost is up to 2x tensor-core throughput in compute-bound prefill; decode is memory-bound either way.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from torch import Tensor
import triton.language as tl

from pdcluster.kernels import launch_pdl
from pdcluster.kernels.triton_pdl import wait_then_release

# Key positions per inner-loop step. >= 16 because tl.dot needs every dim >= 16 on GPU. A constant: the
# context's split into tiles fixes the order of a query's softmax reduction (module doc).
KV_TILE_TOKENS = 32
# Rows (query tokens x heads of a GQA group) per tile, in every batch (module doc). 16: tl.dot's minimum,
# and the decode tile, so a decode step costs what it did before tiles were fixed.
TILE_ROWS = 16
# Context positions per partition (module doc): a multiple of every key tile. A constant: it fixes where
# a row's softmax states are merged.
PARTITION = 128
# The fast mode (deterministic off): wider key tiles, 64- or 128-row query tiles for prefill chunks and
# native 16-bit dots; a row's bits may then depend on its batch.
FAST_KV_TILE_TOKENS = 64
FAST_PREFILL_ROWS = 64  # with FAST_PREFILL_KV_TILE, 4 warps, 3 stages: bench/results/attention_sweep_h100.json
FAST_PREFILL_KV_TILE = 128
FAST_PARTITION = 256  # the fast mode's partition split (any size will do there: nothing needs fixed bits)
# The fast mode's decode split (module doc; flash-decoding as vLLM's unified Triton attention does it):
# by segments (False: the partition split) and their key tile. Segments a row (fast_decode_segments):
# enough for about FAST_DECODE_TARGET_PROGRAMS programs, a power of two within [MIN, MAX]. Timed inside
# CUDA graphs on an H100 (bench/results/attention_sweep_h100.json, decode_few; 32 query / 4 KV heads of
# 64, bf16), against the 16 segments every such step had before:
# 1 x 4,096 context 12.0 -> 8.4 us (32), 1 x 512 5.8 -> 5.6 us (32), 32 x 512 18.4 -> 15.5 us (8),
# 8 x 2,048 13.7 us either way (16).
FAST_DECODE_BY_SEGMENTS = True
FAST_DECODE_TARGET_PROGRAMS = 1024
FAST_DECODE_MIN_SEGMENTS, FAST_DECODE_MAX_SEGMENTS = 8, 32
FAST_DECODE_KV_TILE = 32
# Software-pipeline stages of the fast mode's unsplit decode (many requests, each walking its whole context). Its
# key tiles' addresses come from a block-table load, and Triton's pipeliner splits the stages between the two: K/V
# tiles in flight = (stages - 1) // 2 (the sm_90 build: tests/test_attention_uniform.py). 3 kept one in flight,
# and batch 128 x 512 took ~31 us a layer on an H100 and on an H200 alike (latency, not bandwidth: 2.1 TB/s on the
# H200's 4.8); 5 keeps two, at 37 KiB of shared memory a program.
FAST_DECODE_STAGES = 5
# Split a launch's context across programs when it has fewer (query tile, KV head) programs than this
# (about two waves of an H100's 132 SMs).
SPLIT_BELOW_PROGRAMS = 256


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


@triton.jit
def _query_tile(query_start_loc_ptr, q_tile_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """Query tile ``q_tile_idx``'s request (module doc: the "+ r" numbering), that request's first query token and
    query length, and the tile's index within the request; a tile with ``tile_in_req * BLOCK_Q >= q_len`` is a gap
    (or past the last request): its program has nothing to do."""
    req = _find_request(query_start_loc_ptr, q_tile_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    return req, q_start, q_len, q_tile_idx - (q_start // BLOCK_Q + req)


@triton.jit
def _token_position(query_start_loc_ptr, seq_lens_ptr, token, num_reqs):
    """The context position of query token ``token`` (its request found by binary search: the largest r with
    query_start_loc[r] <= token), or -1 for a row past the last request's tokens (batch padding)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1  # <= num_reqs - 1: lo stays within [0, num_reqs]
    q_end = tl.load(query_start_loc_ptr + req + 1)
    return tl.where(token < q_end, tl.load(seq_lens_ptr + req) - (q_end - token), -1)


@triton.jit
def _softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """One key tile's online-softmax update of the running state (m, l, acc) from its masked log2-scaled
    ``scores`` [rows, keys] and value tile ``v`` [keys, dims] (16-bit into the dot with NATIVE_DOT, else fp32)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if NATIVE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge(m, l, acc, m_p, l_p, acc_p):
    """Fold one partition's softmax state into the running one (rows x dims). A partition that saw no
    key (m_p = -1e30, l_p = 0, acc_p = 0) is an exact no-op; so is the first real one on the empty start."""
    m_new = tl.maximum(m, m_p)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_p - m_new)
    # Explicit fma: the compiler may not contract these differently in the two kernels that merge.
    return m_new, tl.fma(l_p, b, l * a), tl.fma(acc_p, b[:, None], acc * a[:, None])


@triton.jit
def _fold_sink(m, l, acc, sink):
    """Attention sinks (gpt-oss): fold each row's sink logit ``sink`` (log2-scaled, [rows]) into its final
    softmax state as one more key whose value is zero: the sum gains exp2(sink - m'), the accumulator is
    rescaled to the new max m' = max(m, sink). Applied once, where a row's state is final (every key seen)."""
    m_new = tl.maximum(m, sink)
    a = tl.exp2(m - m_new)
    return tl.fma(l, a, tl.exp2(sink - m_new)), acc * a[:, None]


@triton.jit
def _partition_state(q, q_pos, row_valid, kv_lo, kv_hi, win_lo, window, chunk, softcap, table_row_ptr, cache_ptr,
                     kv_head,
                     block_size, qk_scale_log2, dims, dim_valid, stride_cache_kv, stride_cache_block,
                     stride_cache_slot, stride_cache_head, stride_cache_dim, stride_table_entry,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax over context positions [kv_lo, kv_hi) from a fresh state: (m, l, acc). Rows see keys
    after q_pos - window (sliding window; ``window`` is huge without one) and from their chunk's start on (chunked
    attention; ``chunk`` is huge without it, so every chunk starts at 0); key tiles wholly before
    ``win_lo`` (the tile's first visible key) are skipped: for every row they would be exact no-ops."""
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: -inf - -inf would be NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    first_tile = kv_lo + tl.maximum(win_lo - kv_lo, 0) // BLOCK_N * BLOCK_N  # tiles stay where they were
    for kv_start in range(first_tile, kv_hi, BLOCK_N):
        k_pos = kv_start + cols
        k_valid = k_pos < kv_hi
        block_ids = tl.load(table_row_ptr + (k_pos // block_size) * stride_table_entry, mask=k_valid, other=0)
        slot_offsets = (
            block_ids.to(tl.int64) * stride_cache_block
            + (k_pos % block_size) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        # K is loaded transposed, [HEAD_DIM_PAD, BLOCK_N], ready for q @ k.
        # An fp8 cache (--kv-cache-dtype) is widened to the query's dtype as it loads: exact, and the dots then
        # run as they do over a 16-bit cache.
        k_t = tl.load(cache_ptr + slot_offsets[None, :] + dims[:, None] * stride_cache_dim,
                      mask=dim_valid[:, None] & k_valid[None, :], other=0.0).to(q.dtype)
        v = tl.load(cache_ptr + stride_cache_kv + slot_offsets[:, None] + dims[None, :] * stride_cache_dim,
                    mask=k_valid[:, None] & dim_valid[None, :], other=0.0).to(q.dtype)
        if NATIVE_DOT:
            scores = tl.dot(q, k_t) * qk_scale_log2
        else:
            scores = tl.dot(q, k_t.to(tl.float32), input_precision=DOT_PRECISION) * qk_scale_log2
        if SOFTCAP:  # Gemma 2: softcap * tanh(s / softcap) on the natural-log score, tanh(x) = 2 sigmoid(2x) - 1
            x = scores * (0.6931471805599453 / softcap)
            scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0) * 1.4426950408889634
        causal = ((k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
                  & (k_pos[None, :] >= q_pos[:, None] // chunk * chunk) & row_valid[:, None])
        scores = tl.where(causal, scores, float("-inf"))

        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION, NATIVE_DOT)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_m_ptr,  # SPLIT: [num_tokens, num_q_heads, max_parts] fp32 partition states (else unused)
    part_l_ptr,
    part_acc_ptr,  # SPLIT: [num_tokens, num_q_heads, max_parts, HEAD_DIM_PAD] fp32
    sinks_ptr,  # HAS_SINKS: fp32 [num_q_heads] attention-sink logits (natural-log scale)
    qk_scale_log2,  # softmax scale * log2(e): the softmax runs on exp2
    window,  # sliding window: a row sees positions after q_pos - window (NO_WINDOW: all)
    chunk,  # chunked attention: a row sees positions from q_pos // chunk * chunk on (NO_WINDOW: all)
    softcap,  # SOFTCAP: scores become softcap * tanh(score / softcap)
    num_reqs,
    block_size,
    head_dim,
    num_q_heads,
    max_parts,
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
    PARTITION_SIZE: tl.constexpr,  # context positions per partition (a multiple of BLOCK_N)
    SPLIT: tl.constexpr,  # write partition states to scratch (program_id(2) picks partitions) vs merge here
    NATIVE_DOT: tl.constexpr,  # 16-bit operands straight into tl.dot (fast mode on a GPU)
    NUM_SEGMENTS: tl.constexpr = 0,  # SPLIT by segments (fast_decode_segments; max_parts == it), not partitions
    SOFTCAP: tl.constexpr = False,  # Gemma 2's attention logit soft-capping
    HAS_SINKS: tl.constexpr = False,  # gpt-oss's attention sinks (folded in where a row's state is final)
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
    UNIFORM_Q: tl.constexpr = 0,  # every request has this many query tokens (<= BLOCK_Q): program r is request r
):
    wait_then_release(USE_PDL)
    q_tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    if UNIFORM_Q > 0:  # a uniform decode or verification step: no search, no gap programs (module doc)
        req = q_tile_idx
        q_start = req * UNIFORM_Q
        q_len = UNIFORM_Q
        tile_in_req = 0
    else:
        req, q_start, q_len, tile_in_req = _query_tile(query_start_loc_ptr, q_tile_idx, num_reqs, BLOCK_Q)
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
    q = tl.load(query_ptr + q_offsets, mask=row_dim_mask, other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    # Keys up to the tile's latest valid token: later positions are masked for every row anyway, and
    # cache slots past context_len may hold garbage (even NaN), so they are never loaded.
    last_q_in_tile = tl.minimum(tile_in_req * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = first_q_pos + last_q_in_tile + 1
    num_parts = tl.cdiv(kv_end, PARTITION_SIZE)
    # The first key any row of the tile sees (its first token's window or chunk start: later tokens' are later).
    first_pos_in_tile = first_q_pos + tile_in_req * BLOCK_Q
    win_lo = tl.maximum(tl.maximum(first_pos_in_tile - window + 1, 0), first_pos_in_tile // chunk * chunk)
    table_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_table_req
    if SPLIT:
        state_row = q_token * num_q_heads + q_head  # [BLOCK_M]
        if NUM_SEGMENTS > 0:
            # Segment program_id(2) of the row's key tiles, an even share of them: stored even when empty
            # (m = -1e30, l = 0, acc = 0: no weight in the merge), so the merge reads them all at once.
            part_len = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SEGMENTS) * BLOCK_N
            parts_end = tl.program_id(2) + 1
        else:
            part_len = PARTITION_SIZE
            parts_end = num_parts
        for part in range(tl.program_id(2), parts_end, tl.num_programs(2)):
            kv_lo = part * part_len
            m_p, l_p, acc_p = _partition_state(
                q, q_pos, row_valid, kv_lo, tl.minimum(kv_lo + part_len, kv_end), win_lo, window, chunk, softcap,
                table_row_ptr, cache_ptr, kv_head, block_size, qk_scale_log2, dims, dim_valid, stride_cache_kv,
                stride_cache_block, stride_cache_slot, stride_cache_head, stride_cache_dim, stride_table_entry,
                BLOCK_M, BLOCK_N, HEAD_DIM_PAD, DOT_PRECISION, NATIVE_DOT, SOFTCAP)
            at = state_row * max_parts + part  # max_parts == NUM_SEGMENTS with segments (launch)
            tl.store(part_m_ptr + at, m_p, mask=row_valid)
            tl.store(part_l_ptr + at, l_p, mask=row_valid)
            tl.store(part_acc_ptr + at[:, None] * HEAD_DIM_PAD + dims[None, :], acc_p, mask=row_valid[:, None])
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        # Partitions wholly before the window hold nothing for any row (an empty state merges as a no-op).
        for part in range(win_lo // PARTITION_SIZE, num_parts):
            kv_lo = part * PARTITION_SIZE
            m_p, l_p, acc_p = _partition_state(
                q, q_pos, row_valid, kv_lo, tl.minimum(kv_lo + PARTITION_SIZE, kv_end), win_lo, window, chunk,
                softcap,
                table_row_ptr, cache_ptr, kv_head, block_size, qk_scale_log2, dims, dim_valid, stride_cache_kv,
                stride_cache_block, stride_cache_slot, stride_cache_head, stride_cache_dim, stride_table_entry,
                BLOCK_M, BLOCK_N, HEAD_DIM_PAD, DOT_PRECISION, NATIVE_DOT, SOFTCAP)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_p, l_p, acc_p)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + q_head, mask=row_valid, other=0.0) * 1.4426950408889634
            l_i, acc = _fold_sink(m_i, l_i, acc, sink)
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows: never stored, but keep them NaN-free
        out = acc / l_safe[:, None]
        out_offsets = (
            q_token[:, None] * stride_out_token
            + q_head[:, None] * stride_out_head
            + dims[None, :] * stride_out_dim
        )
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_dim_mask)


@triton.jit(do_not_specialize=["num_reqs"])
def _merge_partitions_kernel(
    out_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    sinks_ptr,  # HAS_SINKS: fp32 [num_q_heads] (natural-log scale)
    num_reqs,
    num_q_heads,
    head_dim,
    max_parts,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
):
    """One program per query token and HEADS_PAD of its heads (program_id(1): which; the paged kernel's launch
    takes every head in one, the latent kernel's a few: kernels/triton_mla_attention.py): merge each head's
    partition states in order (``_merge``, the same fold the unsplit kernel runs) and write the output rows."""
    wait_then_release(USE_PDL)
    token = tl.program_id(0)
    q_pos = _token_position(query_start_loc_ptr, seq_lens_ptr, token, num_reqs)
    if q_pos < 0:
        return  # batch padding past the last request
    num_parts = tl.cdiv(q_pos + 1, PARTITION_SIZE)
    heads = tl.program_id(1) * HEADS_PAD + tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_valid = heads < num_q_heads
    state_row = token.to(tl.int64) * num_q_heads + heads
    m_i = tl.full([HEADS_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([HEADS_PAD], dtype=tl.float32)
    acc = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for part in range(0, num_parts):
        at = state_row * max_parts + part
        m_p = tl.load(part_m_ptr + at, mask=head_valid, other=-1.0e30)
        l_p = tl.load(part_l_ptr + at, mask=head_valid, other=0.0)
        acc_p = tl.load(part_acc_ptr + at[:, None] * HEAD_DIM_PAD + dims[None, :], mask=head_valid[:, None], other=0.0)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_p, l_p, acc_p)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0) * 1.4426950408889634
        l_i, acc = _fold_sink(m_i, l_i, acc, sink)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    offsets = token.to(tl.int64) * stride_out_token + heads[:, None] * stride_out_head + dims[None, :] * stride_out_dim
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & (dims[None, :] < head_dim))


@triton.jit(do_not_specialize=["num_reqs"])
def _merge_segments_kernel(
    out_ptr,
    query_start_loc_ptr,
    part_m_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    part_l_ptr,
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_DIM_PAD] fp32
    sinks_ptr,  # HAS_SINKS: fp32 [num_q_heads] (natural-log scale)
    num_reqs,
    num_q_heads,
    head_dim,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    NUM_SEGMENTS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # kernels/launch_pdl.py
):
    """One program per (query token, head): every segment's state in one load, merged at once (the fast
    mode's decode split; the sum's order is the compiler's, so its bits are not batch invariant)."""
    wait_then_release(USE_PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # batch padding past the last request: no state was written
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    at = (token.to(tl.int64) * num_q_heads + head) * NUM_SEGMENTS + segments
    m = tl.load(part_m_ptr + at)
    l = tl.load(part_l_ptr + at)
    acc = tl.load(part_acc_ptr + at[:, None] * HEAD_DIM_PAD + dims[None, :])
    top = tl.max(m, 0)
    if HAS_SINKS:  # the sink: one more value-less key in the sum (natural-log logit, to log2)
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # an empty segment (m = -1e30) weighs 0
    total = tl.sum(l * weight, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    offsets = token.to(tl.int64) * stride_out_token + head * stride_out_head + dims * stride_out_dim
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def block_q_for(group_pad: int, rows: int = TILE_ROWS) -> int:
    """Query tokens per tile: a function of the model's head grouping only, never of the batch."""
    return max(1, rows // group_pad)


def paged_attention_triton(
    query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float,
    batch_invariant: bool = True, window: int = 0, softcap: float = 0.0, sinks: Tensor | None = None, chunk: int = 0,
    uniform_q_len: int | None = None,
) -> Tensor:
    """Causal attention of each request's new query tokens over its paged context (see module doc;
    arguments and shapes as in :func:`pdcluster.kernels.reference.paged_attention`).

    ``window`` > 0: sliding-window attention (each row sees its last ``window`` positions). ``sinks``: float32
    [num_q_heads] attention-sink logits (gpt-oss), folded into each row's final softmax state. ``chunk`` > 0:
    chunked attention (each row sees its own chunk of ``chunk`` positions: Llama 4's local layers).
    ``batch_invariant`` (deterministic mode): the fixed tiles. Otherwise (the fast mode) prefill chunks
    get 128-row query tiles, keys come in tiles of 64 and 16-bit operands go to the dots as they are.
    The K/V of the new tokens must already be written into the cache. Rows of the output past
    ``query_start_loc[-1]`` (batch padding) are left unwritten, as in the reference. ``uniform_q_len``: every
    request has that many query tokens (query_start_loc is r * uniform_q_len): one program per request where a
    request fits one query tile (module doc).
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
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # packed, whatever the query's strides
    if num_tokens == 0 or num_reqs == 0:
        return out

    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)

    def uniform(block_q: int) -> int:
        fits = uniform_q_len is not None and 0 < uniform_q_len <= block_q and num_tokens == num_reqs * uniform_q_len
        return uniform_q_len if fits else 0

    if batch_invariant:
        return launch(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, out,
                      block_q_for(group_pad), KV_TILE_TOKENS, window=window, softcap=softcap, sinks=sinks,
                      chunk=chunk, uniform_q=uniform(block_q_for(group_pad)))
    # Fast mode: prefill-sized calls (more than a few query tokens a request) get the big row tile.
    prefill = num_tokens > 4 * num_reqs
    native = query.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    if prefill:
        return launch(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, out,
                      block_q_for(group_pad, FAST_PREFILL_ROWS), FAST_PREFILL_KV_TILE, native_dot=native, window=window,
                      softcap=softcap, sinks=sinks, chunk=chunk,
                      uniform_q=uniform(block_q_for(group_pad, FAST_PREFILL_ROWS)),
                      partition=fast_whole_context(block_tables, block_size), num_warps=4, num_stages=3)
    # Decode and verification: a few requests split their context in segments (flash-decoding), many
    # (enough programs to fill the GPU) walk it whole in one program each, as one partition: one key
    # loop the software pipeline runs through (with FAST_PARTITION's 4-tile partitions it filled and
    # drained its stages every 256 positions).
    block_q = block_q_for(group_pad)
    num_q_tiles = num_tokens // block_q + num_reqs
    if FAST_DECODE_BY_SEGMENTS and too_few_programs(num_q_tiles, num_kv_heads):
        return launch(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, out, block_q,
                      FAST_DECODE_KV_TILE, split=True, native_dot=native, window=window, softcap=softcap, sinks=sinks,
                      chunk=chunk, uniform_q=uniform(block_q),
                      segments=fast_decode_segments(num_q_tiles, num_kv_heads), num_warps=4, num_stages=3)
    return launch(query, layer_cache, block_tables, seq_lens, query_start_loc, scale, out, block_q,
                  FAST_KV_TILE_TOKENS, native_dot=native, window=window, softcap=softcap, sinks=sinks,
                  chunk=chunk, partition=fast_whole_context(block_tables, block_size), uniform_q=uniform(block_q),
                  num_warps=4, num_stages=FAST_DECODE_STAGES)


def too_few_programs(num_q_tiles: int, num_kv_heads: int) -> bool:
    """A launch of this many (query tile, KV head) programs leaves the GPU idle: split the context."""
    return num_q_tiles * num_kv_heads < SPLIT_BELOW_PROGRAMS


def fast_decode_segments(num_q_tiles: int, num_kv_heads: int) -> int:
    """Segments a row's context is cut into in the fast mode's split decode: about
    FAST_DECODE_TARGET_PROGRAMS programs in all, a power of two in [FAST_DECODE_MIN_SEGMENTS,
    FAST_DECODE_MAX_SEGMENTS]. From the launch's shape only (a CUDA graph's batch bucket fixes it)."""
    per_segment = max(1, num_q_tiles * num_kv_heads)
    want = max(1, FAST_DECODE_TARGET_PROGRAMS // per_segment)
    return min(FAST_DECODE_MAX_SEGMENTS, max(FAST_DECODE_MIN_SEGMENTS, 1 << (want.bit_length() - 1)))


def fast_whole_context(block_tables: Tensor, block_size: int) -> int:
    """The fast mode's partition for prefill and unsplit decode: the whole context (from the block
    table's width), so each program's key loop runs the context at once; short loops leave the software
    pipeline idle. A power of two (a multiple of both fast key tiles): the partition is a compile-time
    constant, and eager steps whose widths grow one block at a time compile ~log2(max_model_len)
    variants, not one per 128 positions (a bigger partition than the context costs nothing: the loop
    stops at the row's last key)."""
    width = block_tables.shape[1] * block_size
    return triton.next_power_of_2(max(FAST_PREFILL_KV_TILE, width))


# The interpreter multiplies 16-bit dot operands wrongly (module doc): it never runs the native dot.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# A window no context reaches: the kernel's "no sliding window" (q_pos - NO_WINDOW stays an int32).
NO_WINDOW = 1 << 30


def launch(query: Tensor, layer_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
           scale: float, out: Tensor, block_q: int, block_n: int, split: bool | None = None,
           native_dot: bool = False, partition: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, segments: int = 0, window: int = 0, softcap: float = 0.0,
           sinks: Tensor | None = None, chunk: int = 0, uniform_q: int = 0) -> Tensor:
    """Run the kernel with the given tiles (checked arguments; :func:`paged_attention_triton` passes the
    fixed ones, tests pass batch-dependent ones to show the invariance tests catch them). ``split``:
    merge the partitions in a second kernel (None: when the launch has too few programs, module doc).
    ``segments`` (with ``split``): split each row's key tiles in that many even runs instead of
    partitions (the fast mode's decode split, fast_decode_segments; a power of two). ``uniform_q``: every request
    has this many query tokens, at most ``block_q``: one program per request (module doc)."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    partition = PARTITION if partition is None else partition
    if partition % block_n:
        raise ValueError(f"partition {partition} is not a multiple of the key tile {block_n}")
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(triton.next_power_of_2(head_dim), 16)
    # The "+ num_reqs" covers each request's partial last tile (see the module doc).
    num_q_tiles = num_tokens // block_q + num_reqs
    if uniform_q and (uniform_q > block_q or num_tokens != num_reqs * uniform_q):
        raise ValueError(f"uniform_q={uniform_q}: {num_tokens} tokens for {num_reqs} requests, query tiles of {block_q}")
    # The longest context this call can have, from shapes alone (no host sync): the block table's width.
    max_parts = -(-block_tables.shape[1] * block_size // partition)
    if split is None:
        split = too_few_programs(num_q_tiles, num_kv_heads) and max_parts > 1
    num_splits = min(max_parts, -(-SPLIT_BELOW_PROGRAMS // (num_q_tiles * num_kv_heads))) if split else 1
    if segments:
        if not split or segments & (segments - 1):
            raise ValueError(f"segments={segments}: a power of two, with split")
        max_parts = num_splits = segments
    if split:
        part_m = torch.empty(num_tokens, num_q_heads, max_parts, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_q_heads, max_parts, head_dim_pad, dtype=torch.float32,
                               device=query.device)
    else:
        part_m = part_l = part_acc = out  # never touched
    if sinks is not None:
        if sinks.shape != (num_q_heads,):
            raise ValueError(f"sinks has shape {tuple(sinks.shape)} for {num_q_heads} query heads")
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    sinks_arg = out if sinks is None else sinks  # never read without HAS_SINKS
    pdl = launch_pdl.options(query)
    prefill_rows = block_q * group_pad >= 64
    # The split is decided from num_q_tiles whatever the grid (the same choice with and without uniform_q).
    _paged_attention_kernel[(num_reqs if uniform_q else num_q_tiles, num_kv_heads, num_splits)](
        out,
        query,
        layer_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        part_m,
        part_l,
        part_acc,
        sinks_arg,
        scale / math.log(2.0),
        window if window > 0 else NO_WINDOW,
        chunk if chunk > 0 else NO_WINDOW,
        float(softcap) if softcap > 0 else 1.0,
        num_reqs,
        block_size,
        head_dim,
        num_q_heads,
        max_parts,
        *query.stride(),
        *out.stride(),
        *layer_cache.stride(),
        *block_tables.stride(),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad,
        BLOCK_N=block_n,
        HEAD_DIM_PAD=head_dim_pad,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        PARTITION_SIZE=partition,
        SPLIT=split,
        NATIVE_DOT=native_dot,
        NUM_SEGMENTS=segments,
        SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        UNIFORM_Q=uniform_q,
        num_warps=num_warps or (8 if prefill_rows else 4),
        **({"num_stages": num_stages} if num_stages else {}),
        **pdl,
    )
    if segments:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            out, query_start_loc, part_m, part_l, part_acc, sinks_arg, num_reqs, num_q_heads, head_dim, *out.stride(),
            NUM_SEGMENTS=segments, HEAD_DIM_PAD=head_dim_pad, HAS_SINKS=sinks is not None, **pdl,
        )
    elif split:
        _merge_partitions_kernel[(num_tokens,)](
            out, seq_lens, query_start_loc, part_m, part_l, part_acc, sinks_arg, num_reqs, num_q_heads, head_dim,
            max_parts, *out.stride(), HEADS_PAD=triton.next_power_of_2(num_q_heads), HEAD_DIM_PAD=head_dim_pad,
            PARTITION_SIZE=partition, HAS_SINKS=sinks is not None, **pdl,
        )
    return out
