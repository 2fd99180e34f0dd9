/* Paged attention on AMX tiles: the bf16 cache, block size 16, head_dim a multiple of 32. Included by
 * cpu_kernels.c after attend_item_bf16, whose helpers it uses (AttnItem, window_start, transpose16x16,
 * exp512_nonpos, fp8x32_to_bf16, store_row), and taken instead of it in every call where amx_usable().
 *
 * A work item is what attend_item_bf16's is (a request's chunk of query tokens, every head). The queries that
 * share a kv head -- token t, head g of its group: row r = t * group + g -- go in row groups of 16. For each
 * 16-key block, kv head and row group:
 *   S^T = K Q^T  on tiles: A = the block's 16 K rows read in place from the cache (32 dims a step), B = the
 *                group's queries as bf16 pairs [dim pair][16 rows] (staged once per item), C = 16 keys x 16
 *                rows in fp32.
 *   softmax      on S^T's rows: a key per vector, a query row per lane, so the masks, the block max, exp and
 *                every row's running max and sum are whole-vector operations (no horizontal reductions).
 *   O += P V     on tiles: A = P (S^T transposed: rows x 16 keys, bf16), B = V as bf16 pairs of consecutive
 *                keys [8][16 dims] (attend_item_bf16's layout), C = rows x 16 dims a tile; then every row's
 *                accumulator becomes fma(acc, alpha, that row of the tile).
 * Batch invariance (issue 24): a row's values come from that row alone, by operations that do not depend on
 * the item's size, the row's place in a tile or the thread. tdpbf16ps computes each output element from its
 * own A row and B column over a fixed k; the softmax is lane-wise; a block's probabilities are summed over
 * its 16 keys in order (a masked key adds +0, which changes no sum: sums of probabilities are never -0). So a
 * query's output has the same bits in a prefill chunk, a decode step or a verification step. They are not
 * attend_item_bf16's bits (other summation orders), so a process takes one of the two paths for every call:
 * amx_usable() is fixed per process. PDCLUSTER_ATTN_AMX=0 takes the avx512_bf16 path (tests compare them).
 */
#ifndef PD_ATTENTION_AMX_H
#define PD_ATTENTION_AMX_H
#include "amx.h"
#ifdef PD_HAVE_AMX
#include <limits.h>

/* Tiles: 0 S^T (16 keys x 16 rows fp32), 1 K (16 keys x 32 dims), 2 Q^T (16 dim pairs x 16 rows), 3 and 6 two
 * 16-dim strips of P V (rows x 16 fp32), 4 P (rows x 16 keys), 5 and 7 V (8 key pairs x 16 dims). rows is the
 * row count of P and the P V strips: an item's queries per kv head, at most 16 (a decode step of a model with
 * groups of 3 computes 3 rows, not 16). Tile state is per thread: each thread configures it before its first
 * item (again when rows changes) and releases it after its last. */
static void attn_amx_configure(int rows) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const uint8_t tile_rows[8] = {16, 16, 16, (uint8_t)rows, (uint8_t)rows, 8, (uint8_t)rows, 8};
    const uint16_t tile_colsb[8] = {64, 64, 64, 64, 32, 64, 64, 64};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = tile_rows[t];
        cfg.colsb[t] = tile_colsb[t];
    }
    amx_load_tilecfg(&cfg);
}

/* exp(x) for x <= 0 on 16 lanes, 0 below -87 (exp_nonpos's underflow select): a rescale by a factor that
 * small is a rescale to zero, as in the scalar code. */
static inline __m512 exp512_nonpos_or_zero(__m512 x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), exp512_nonpos(x));
}

/* The stack an item takes (bytes), for pd_paged_attention's limit: accumulators, Q^T, V pairs, fp8 staging. */
static inline int64_t attn_amx_stack_bytes(int q_chunk, int num_q_heads, int num_kv_heads, int head_dim) {
    const int64_t rows = (int64_t)q_chunk * (num_q_heads / num_kv_heads) + 15; /* per kv head, padded */
    return (int64_t)num_kv_heads * rows * head_dim * (4 + 2) + (int64_t)num_kv_heads * 8 * head_dim * 4 +
           (int64_t)2 * 16 * num_kv_heads * head_dim * 2;
}

/* The sum of a block's 16 rounded weights, in one fixed tree that both softmax forms compute: p_i + p_(i+8), then
 * 4 apart, 2 apart, 1 apart. As vectors (a key each, a row per lane) ... */
static inline __m512 sum16_columns(const __m512 p[16]) {
    __m512 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_add_ps(p[i], p[i + 8]);
    for (int i = 0; i < 4; i++) a[i] = _mm512_add_ps(a[i], a[i + 4]);
    for (int i = 0; i < 2; i++) a[i] = _mm512_add_ps(a[i], a[i + 2]);
    return _mm512_add_ps(a[0], a[1]);
}

/* ... and within one vector (a row's 16 keys). */
static inline float sum16_row(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

static inline __m512 round_to_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* The online softmax of one row group over one block, from its scores S^T (st[key][row], unscaled): updates each
 * row's running max and sum (m_rows, l_rows), writes the factor its accumulator is to be rescaled by (alpha_rows)
 * and its weights in bf16 (pb[row][key]); returns the rows that saw a key of the block. Two forms, the same
 * arithmetic on every (row, key) -- the same lane-wise operations, the same sum tree -- so the same bits:
 *   columns: a key per vector, a row per lane; for groups of many rows (prefill).
 *   rows:    S^T transposed first, a row per vector; for a few rows (decode: a kv head's group of query heads), where
 *            the columns form would do 16 lanes' work for each of 3 or 4. */
#define AMX_ROW_FORM_ROWS 8

static inline __mmask16 softmax_columns(const float st[16][16], int block_start, const int32_t *pos_rows,
                                        const int32_t *ws_rows, float scale, float *m_rows, float *l_rows,
                                        float *alpha_rows, uint16_t pb[16][16]) {
    const __m512 vscale = _mm512_set1_ps(scale), vlow = _mm512_set1_ps(-FLT_MAX);
    const __m512i pos_v = _mm512_load_si512(pos_rows), ws_v = _mm512_load_si512(ws_rows);
    __mmask16 key_mask[16], seen = 0;
    __m512 p[16], block_max = vlow;
    for (int j = 0; j < 16; j++) {
        const __m512i key = _mm512_set1_epi32(block_start + j);
        key_mask[j] = _mm512_cmple_epi32_mask(ws_v, key) & _mm512_cmple_epi32_mask(key, pos_v);
        seen |= key_mask[j];
        p[j] = _mm512_mask_mov_ps(vlow, key_mask[j], _mm512_mul_ps(_mm512_load_ps(st[j]), vscale));
        block_max = _mm512_max_ps(block_max, p[j]);
    }
    if (!seen) return 0;
    const __m512 m_old = _mm512_load_ps(m_rows), l_old = _mm512_load_ps(l_rows);
    const __m512 m_new = _mm512_max_ps(m_old, block_max);
    const __m512 alpha = exp512_nonpos_or_zero(_mm512_sub_ps(m_old, m_new));
    /* P in bf16 for the P V product; the sum adds the same rounded weights, so the output stays a convex
     * combination of V rows. */
    for (int j = 0; j < 16; j++)
        p[j] = round_to_bf16(_mm512_maskz_mov_ps(key_mask[j], exp512_nonpos(_mm512_sub_ps(p[j], m_new))));
    const __m512 sum = sum16_columns(p);
    /* Rows that saw no key of this block keep their state. */
    _mm512_store_ps(m_rows, _mm512_mask_mov_ps(m_old, seen, m_new));
    _mm512_store_ps(l_rows, _mm512_mask_mov_ps(l_old, seen, _mm512_fmadd_ps(l_old, alpha, sum)));
    _mm512_store_ps(alpha_rows, alpha);
    transpose16x16(p); /* p[row]: the row's 16 weights (exact bf16 values) */
    for (int r = 0; r < 16; r++) _mm256_store_si256((__m256i *)pb[r], (__m256i)_mm512_cvtneps_pbh(p[r]));
    return seen;
}

static inline __mmask16 softmax_rows(const float st[16][16], int num_rows, int block_start, const int32_t *pos_rows,
                                     const int32_t *ws_rows, float scale, float *m_rows, float *l_rows,
                                     float *alpha_rows, uint16_t pb[16][16]) {
    const __m512 vscale = _mm512_set1_ps(scale), vlow = _mm512_set1_ps(-FLT_MAX);
    __m512 x[16];
    for (int j = 0; j < 16; j++) x[j] = _mm512_load_ps(st[j]);
    transpose16x16(x); /* x[row]: the row's 16 scores */
    const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(block_start),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __mmask16 seen = 0;
    for (int r = 0; r < num_rows; r++) {
        const __mmask16 mask = _mm512_cmple_epi32_mask(_mm512_set1_epi32(ws_rows[r]), keys) &
                               _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(pos_rows[r]));
        if (!mask) continue;
        seen |= (__mmask16)(1u << r);
        const __m512 sc = _mm512_mask_mov_ps(vlow, mask, _mm512_mul_ps(x[r], vscale));
        const float block_max = _mm512_reduce_max_ps(sc); /* a max is exact in any order */
        const float m_old = m_rows[r];
        const float m_new = m_old > block_max ? m_old : block_max; /* _mm512_max_ps(m_old, block_max) */
        const float alpha = _mm512_cvtss_f32(exp512_nonpos_or_zero(_mm512_set1_ps(m_old - m_new)));
        const __m512 p = round_to_bf16(_mm512_maskz_mov_ps(mask, exp512_nonpos(_mm512_sub_ps(sc, _mm512_set1_ps(m_new)))));
        m_rows[r] = m_new;
        l_rows[r] = fmaf(l_rows[r], alpha, sum16_row(p)); /* one rounding, as _mm512_fmadd_ps */
        alpha_rows[r] = alpha;
        _mm256_store_si256((__m256i *)pb[r], (__m256i)_mm512_cvtneps_pbh(p));
    }
    return seen;
}

static inline void attend_item_amx(const AttnItem item, const int HD, int kv_dtype, const uint16_t *query,
                                   int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache_raw,
                                   const void *v_cache_raw, int64_t cache_blk_stride, int64_t cache_tok_stride,
                                   int64_t cache_head_stride, const int32_t *block_tables, int64_t bt_stride,
                                   const int32_t *seq_lens, const int32_t *query_start_loc, int num_q_heads,
                                   int num_kv_heads, float scale, int window, int chunk, void *out, int out_dtype,
                                   int64_t out_tok_stride, int64_t out_head_stride, int *tile_rows) {
    enum { BS = 16 };
    const int group = num_q_heads / num_kv_heads;
    const int r = item.req;
    const int q_len = query_start_loc[r + 1] - query_start_loc[r];
    const int first_pos = seq_lens[r] - q_len;
    const int64_t first_tok = query_start_loc[r] + item.q_begin;
    const int nq_tok = item.q_end - item.q_begin;
    const int rows = nq_tok * group; /* query rows per kv head */
    const int ngroups = (rows + 15) / 16;
    const int R = rows < 16 ? rows : 16;
    if (*tile_rows != R) {
        attn_amx_configure(R);
        *tile_rows = R;
    }
    const int np = HD / 2; /* dim pairs */
    float acc[num_kv_heads][ngroups * 16][HD] __attribute__((aligned(64)));
    float m_rows[num_kv_heads][ngroups][16] __attribute__((aligned(64)));
    float l_rows[num_kv_heads][ngroups][16] __attribute__((aligned(64)));
    uint32_t qt[num_kv_heads][ngroups][np][16] __attribute__((aligned(64)));
    int32_t pos_rows[ngroups * 16] __attribute__((aligned(64))), ws_rows[ngroups * 16] __attribute__((aligned(64)));
    uint32_t vp[num_kv_heads][BS / 2][HD] __attribute__((aligned(64)));
    const int fp8 = kv_dtype >= 2;
    const int row_elems = num_kv_heads * HD;
    uint16_t kst[fp8 ? BS : 1][fp8 ? row_elems : 1] __attribute__((aligned(64)));
    uint16_t vst[fp8 ? BS : 1][fp8 ? row_elems : 1] __attribute__((aligned(64)));

    memset(acc, 0, sizeof acc);
    for (int h = 0; h < num_kv_heads; h++)
        for (int g2 = 0; g2 < ngroups; g2++) {
            _mm512_store_ps(m_rows[h][g2], _mm512_set1_ps(-FLT_MAX));
            _mm512_store_ps(l_rows[h][g2], _mm512_setzero_ps());
        }
    /* Each row sees keys ws ..= pos; padding rows (pos -1) see none. */
    for (int row = 0; row < ngroups * 16; row++) {
        const int pos = first_pos + item.q_begin + row / group;
        pos_rows[row] = row < rows ? pos : -1;
        ws_rows[row] = row < rows ? window_start(pos, window, chunk) : 0;
    }
    /* Q^T: 16 rows' next 16 dim pairs as 16 vectors, transposed (32-bit lanes: a pair moves whole). */
    for (int h = 0; h < num_kv_heads; h++)
        for (int g2 = 0; g2 < ngroups; g2++)
            for (int p0 = 0; p0 < np; p0 += 16) {
                __m512 x[16];
                for (int rr = 0; rr < 16; rr++) {
                    const int row = g2 * 16 + rr;
                    const uint16_t *q = query + (first_tok + row / group) * q_tok_stride +
                                        (h * group + row % group) * q_head_stride;
                    x[rr] = row < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(q + 2 * p0)) : _mm512_setzero_ps();
                }
                transpose16x16(x);
                for (int i = 0; i < 16; i++) _mm512_store_ps((float *)qt[h][g2][p0 + i], x[i]);
            }

    const int last_pos = first_pos + item.q_end - 1;
    const int num_blocks = last_pos / BS + 1;
    const int32_t *table = block_tables + (int64_t)r * bt_stride;
    const int first_key = window_start(first_pos + item.q_begin, window, chunk);
    for (int b = first_key / BS; b < num_blocks; b++) {
        const int64_t base = (int64_t)table[b] * cache_blk_stride;
        /* The block after next is asked for (into L2) while this one is computed, adjacent or not: decode is bound
         * by fetching blocks, and one block ahead into L1 (attend_item_bf16's way) left too few lines in flight
         * (cold cache, 32 x 232 tokens over 30 layers, scattered blocks: 25.3 -> 23.2 ms; adjacent ones 22.1 ->
         * 21.6-22.7). */
        const int64_t next = b + 2 < num_blocks ? (int64_t)table[b + 2] * cache_blk_stride : -1;
        const int block_start = b * BS;
        int n_valid = last_pos + 1 - block_start;
        if (n_valid > BS) n_valid = BS;
        const uint16_t *kb, *vb;
        const int64_t tok_stride = block_rows_bf16(k_cache_raw, v_cache_raw, base, cache_tok_stride, n_valid,
                                                   row_elems, kv_dtype, &kst[0][0], &vst[0][0], &kb, &vb);
        for (int j = 0; j < BS; j++) {
            if (next >= 0) PD_PREFETCH_BLOCK_ROW(fp8, k_cache_raw, v_cache_raw, next, j, cache_tok_stride, row_elems, 2);
            /* V pairs; a pair wholly past the block's end is zero (P V reads all 8) */
            if ((j & 1) && j - 1 < n_valid) v_pairs(vb, tok_stride, j, n_valid, num_kv_heads, cache_head_stride, HD, &vp[0][0][0]);
            else if (j & 1)
                for (int h = 0; h < num_kv_heads; h++)
                    for (int c = 0; c < HD; c += 16) _mm512_store_si512(&vp[h][j / 2][c], _mm512_setzero_si512());
        }
        for (int h = 0; h < num_kv_heads; h++) {
            const uint16_t *kh = kb + h * cache_head_stride;
            for (int g2 = 0; g2 < ngroups; g2++) {
                /* K rows past n_valid are read too (the block is whole in memory); their scores are masked. */
                float st[16][16] __attribute__((aligned(64)));
                _tile_zero(0);
                for (int s = 0; s < HD / 32; s++) {
                    _tile_loadd(1, kh + 32 * s, tok_stride * 2);
                    _tile_loadd(2, qt[h][g2][16 * s], 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, st, 64);
                const int rows_here = rows - g2 * 16 < 16 ? rows - g2 * 16 : 16;
                float alpha_rows[16] __attribute__((aligned(64)));
                uint16_t pb[16][16] __attribute__((aligned(64)));
                const __mmask16 seen =
                    R <= AMX_ROW_FORM_ROWS
                        ? softmax_rows(st, rows_here, block_start, &pos_rows[g2 * 16], &ws_rows[g2 * 16], scale,
                                       m_rows[h][g2], l_rows[h][g2], alpha_rows, pb)
                        : softmax_columns(st, block_start, &pos_rows[g2 * 16], &ws_rows[g2 * 16], scale,
                                          m_rows[h][g2], l_rows[h][g2], alpha_rows, pb);
                if (!seen) continue; /* the block is outside every row's window: nothing changes */
                _tile_loadd(4, pb, 32);
                for (int c = 0; c < HD; c += 32) {
                    float o[2][16][16] __attribute__((aligned(64)));
                    _tile_zero(3);
                    _tile_zero(6);
                    _tile_loadd(5, &vp[h][0][c], HD * 4);
                    _tile_dpbf16ps(3, 4, 5);
                    _tile_loadd(7, &vp[h][0][c + 16], HD * 4);
                    _tile_dpbf16ps(6, 4, 7);
                    _tile_stored(3, o[0], 64);
                    _tile_stored(6, o[1], 64);
                    for (int rr = 0; rr < rows_here; rr++) {
                        if (!((seen >> rr) & 1)) continue;
                        float *a = acc[h][g2 * 16 + rr] + c;
                        const __m512 va = _mm512_set1_ps(alpha_rows[rr]);
                        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), va, _mm512_load_ps(o[0][rr])));
                        _mm512_store_ps(a + 16, _mm512_fmadd_ps(_mm512_load_ps(a + 16), va, _mm512_load_ps(o[1][rr])));
                    }
                }
            }
        }
    }
    for (int h = 0; h < num_kv_heads; h++)
        for (int row = 0; row < rows; row++) {
            float *a = acc[h][row];
            const __m512 inv = _mm512_set1_ps(1.0f / l_rows[h][row / 16][row % 16]);
            for (int d = 0; d < HD; d += 16) _mm512_store_ps(a + d, _mm512_mul_ps(_mm512_load_ps(a + d), inv));
            const int64_t tok = first_tok + row / group;
            store_row(out, out_dtype, tok * out_tok_stride + (h * group + row % group) * out_head_stride, a, HD);
        }
}
#endif
#endif
