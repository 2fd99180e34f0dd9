/* Paged attention on AMX tiles: the bf16 cache, block size 16, head_dim a multiple of 32. Included by
 * cpu_kernels.c after attend_item_bf16, whose helpers it uses (AttnItem, window_start, transpose16x16,
 * exp512_nonpos, fp8x32_to_bf16, store_row), and taken instead of it in every call where amx_usable().
 *
 * A work item is what attend_item_bf16's is (a request's chunk of query tokens, every head). The queries that
 * share a kv head -- token t, head g of its group: row r = t * group + g -- go in row groups of 16. For each
 * key group (two 16-key blocks, AMX_KEYS), kv head and row group:
 *   S^T = K Q^T  on tiles, a block at a time: A = the block's 16 K rows read in place from the cache (32 dims a
 *                step), B = the group's queries as bf16 pairs [dim pair][16 rows] (staged once per item), C = 16
 *                keys x 16 rows in fp32.
 *   softmax      on S^T's rows: a key per vector, a query row per lane, so the masks, the group max, exp and
 *                every row's running max and sum are whole-vector operations (no horizontal reductions).
 *   O += P V     on tiles: A = P (S^T transposed: rows x 32 keys, bf16), B = V as bf16 pairs of consecutive
 *                keys [16][16 dims] (attend_item_bf16's layout, both blocks' pairs), C = rows x 16 dims a tile;
 *                then every row's accumulator becomes fma(acc, alpha, that row of the tile).
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

/* Keys per softmax update: two 16-token blocks, a group starting at an even block index. Groups are fixed by key
 * position, never by the call, so every query row sees the same groups in a prefill chunk and a decode step. One
 * update for 32 keys halves the accumulators' rescaling (tile store, load, fma, store per row) and fills the P V
 * product's depth (16 key pairs, a whole tile) where a 16-key block filled half of it. */
enum { AMX_GROUP_BLOCKS = 2, AMX_KEYS = 32 };

/* Tiles: 0 and 7 S^T of a group's two blocks (16 keys x 16 rows fp32 each), 1 and 5 K (16 keys x 32 dims) then V
 * (16 key pairs x 16 dims), 2 Q^T (16 dim pairs x 16 rows), 3 and 6 two 16-dim strips of P V (rows x 16 fp32), 4 P
 * (rows x 32 keys). rows is the row count of P and the P V strips: an item's queries per kv head, at most 16 (a
 * decode step of a model with groups of 3 computes 3 rows, not 16). Tile state is per thread: each thread
 * configures it before its first item (again when rows changes) and releases it after its last. */
static void attn_amx_configure(int rows) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const uint8_t tile_rows[8] = {16, 16, 16, (uint8_t)rows, (uint8_t)rows, 16, (uint8_t)rows, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = tile_rows[t];
        cfg.colsb[t] = 64;
    }
    amx_load_tilecfg(&cfg);
}

/* exp(x) for x <= 0 on 16 lanes, 0 below -87 (exp_nonpos's underflow select): a rescale by a factor that
 * small is a rescale to zero, as in the scalar code. */
static inline __m512 exp512_nonpos_or_zero(__m512 x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), exp512_nonpos(x));
}

/* exp(x) for x <= 0 on 16 lanes, for the softmax weights, which are rounded to bf16 next (a relative error of 2^-9):
 * 2^f for f = x log2(e) - n by a degree-4 fit (relative error 2.7e-6), times 2^n in one vscalefps (below about -87
 * it underflows to a denormal or 0). 9 operations where exp512_nonpos takes 15: the weights' exps are most of a
 * prefill's softmax. Both softmax forms call it, so both compute the same bits. */
static inline __m512 exp512_weights(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(0.00956051983f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0559171228f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240249817f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693121958f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999919f));
    return _mm512_scalef_ps(p, n);
}

/* The stack an item takes (bytes), for pd_paged_attention's limit: accumulators, Q^T, V pairs, fp8 staging. */
static inline int64_t attn_amx_stack_bytes(int q_chunk, int num_q_heads, int num_kv_heads, int head_dim) {
    const int64_t rows = (int64_t)q_chunk * (num_q_heads / num_kv_heads) + 15; /* per kv head, padded */
    return (int64_t)num_kv_heads * rows * head_dim * (4 + 2) + (int64_t)num_kv_heads * (AMX_KEYS / 2) * head_dim * 4 +
           (int64_t)AMX_GROUP_BLOCKS * 2 * 16 * num_kv_heads * head_dim * 2;
}

/* The sum of 16 rounded weights, in one fixed tree that both softmax forms compute: p_i + p_(i+8), then 4 apart, 2
 * apart, 1 apart; a group's sum is its first block's plus its second's. As vectors (a key each, a row per lane) ... */
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

/* The online softmax of one row group over one key group, from its scores S^T (st[key][row], unscaled; the
 * columns form overwrites them with the masked scaled scores): updates each row's running max and sum (m_rows,
 * l_rows), writes the factor its accumulator is to be rescaled by (alpha_rows) and its weights in bf16
 * (pb[row][key]); returns the rows that saw a key of the group. Two forms, the same arithmetic on every (row, key)
 * -- the same lane-wise operations, the same sum tree -- so the same bits:
 *   columns: a key per vector, a row per lane; for groups of many rows (prefill).
 *   rows:    S^T transposed first, a row per vector; for a few rows (decode: a kv head's group of query heads), where
 *            the columns form would do 16 lanes' work for each of 3 or 4. */
#define AMX_ROW_FORM_ROWS 8

static inline __mmask16 softmax_columns(float st[AMX_KEYS][16], int group_start, int all_see_all,
                                        const int32_t *pos_rows, const int32_t *ws_rows, float scale, float *m_rows,
                                        float *l_rows, float *alpha_rows, uint16_t pb[16][AMX_KEYS]) {
    const __m512 vscale = _mm512_set1_ps(scale), vlow = _mm512_set1_ps(-FLT_MAX);
    const __m512i pos_v = _mm512_load_si512(pos_rows), ws_v = _mm512_load_si512(ws_rows);
    __mmask16 key_mask[AMX_KEYS], seen = 0;
    __m512 block_max = vlow;
    if (all_see_all) { /* every row sees every key of the group (most of a long prefill): no masks, the same values */
        for (int j = 0; j < AMX_KEYS; j++) {
            key_mask[j] = 0xFFFF;
            const __m512 sc = _mm512_mul_ps(_mm512_load_ps(st[j]), vscale);
            _mm512_store_ps(st[j], sc);
            block_max = _mm512_max_ps(block_max, sc);
        }
        seen = 0xFFFF;
    } else {
        for (int j = 0; j < AMX_KEYS; j++) {
            const __m512i key = _mm512_set1_epi32(group_start + j);
            key_mask[j] = _mm512_cmple_epi32_mask(ws_v, key) & _mm512_cmple_epi32_mask(key, pos_v);
            seen |= key_mask[j];
            const __m512 sc = _mm512_mask_mov_ps(vlow, key_mask[j], _mm512_mul_ps(_mm512_load_ps(st[j]), vscale));
            _mm512_store_ps(st[j], sc);
            block_max = _mm512_max_ps(block_max, sc);
        }
    }
    if (!seen) return 0;
    const __m512 m_old = _mm512_load_ps(m_rows), l_old = _mm512_load_ps(l_rows);
    const __m512 m_new = _mm512_max_ps(m_old, block_max);
    const __m512 alpha = exp512_nonpos_or_zero(_mm512_sub_ps(m_old, m_new));
    /* P in bf16 for the P V product; the sum adds the same rounded weights, so the output stays a convex
     * combination of V rows. A block (16 keys) at a time: 16 vectors in registers. */
    __m512 sums[AMX_GROUP_BLOCKS];
    for (int half = 0; half < AMX_GROUP_BLOCKS; half++) {
        __m512 p[16];
        for (int j = 0; j < 16; j++)
            p[j] = round_to_bf16(_mm512_maskz_mov_ps(key_mask[16 * half + j],
                                                     exp512_weights(_mm512_sub_ps(_mm512_load_ps(st[16 * half + j]),
                                                                                  m_new))));
        sums[half] = sum16_columns(p);
        transpose16x16(p); /* p[row]: the row's 16 weights of this block (exact bf16 values) */
        for (int r = 0; r < 16; r++)
            _mm256_store_si256((__m256i *)&pb[r][16 * half], (__m256i)_mm512_cvtneps_pbh(p[r]));
    }
    const __m512 sum = _mm512_add_ps(sums[0], sums[1]);
    /* Rows that saw no key of this group keep their state. */
    _mm512_store_ps(m_rows, _mm512_mask_mov_ps(m_old, seen, m_new));
    _mm512_store_ps(l_rows, _mm512_mask_mov_ps(l_old, seen, _mm512_fmadd_ps(l_old, alpha, sum)));
    _mm512_store_ps(alpha_rows, alpha);
    return seen;
}

static inline __mmask16 softmax_rows(float st[AMX_KEYS][16], int num_rows, int group_start, const int32_t *pos_rows,
                                     const int32_t *ws_rows, float scale, float *m_rows, float *l_rows,
                                     float *alpha_rows, uint16_t pb[16][AMX_KEYS]) {
    const __m512 vscale = _mm512_set1_ps(scale), vlow = _mm512_set1_ps(-FLT_MAX);
    float sr[16][AMX_KEYS] __attribute__((aligned(64))); /* S, a row's keys in order */
    for (int half = 0; half < AMX_GROUP_BLOCKS; half++) {
        __m512 x[16];
        for (int j = 0; j < 16; j++) x[j] = _mm512_load_ps(st[16 * half + j]);
        transpose16x16(x);
        for (int r = 0; r < num_rows; r++) _mm512_store_ps(&sr[r][16 * half], x[r]);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i keys[2] = {_mm512_add_epi32(_mm512_set1_epi32(group_start), lane),
                             _mm512_add_epi32(_mm512_set1_epi32(group_start + 16), lane)};
    __mmask16 seen = 0;
    for (int r = 0; r < num_rows; r++) {
        __mmask16 mask[2];
        for (int half = 0; half < 2; half++)
            mask[half] = _mm512_cmple_epi32_mask(_mm512_set1_epi32(ws_rows[r]), keys[half]) &
                         _mm512_cmple_epi32_mask(keys[half], _mm512_set1_epi32(pos_rows[r]));
        if (!(mask[0] | mask[1])) continue;
        seen |= (__mmask16)(1u << r);
        __m512 sc[2];
        float block_max = -FLT_MAX;
        for (int half = 0; half < 2; half++) {
            sc[half] = _mm512_mask_mov_ps(vlow, mask[half], _mm512_mul_ps(_mm512_load_ps(&sr[r][16 * half]), vscale));
            const float mx = _mm512_reduce_max_ps(sc[half]); /* a max is exact in any order */
            block_max = mx > block_max ? mx : block_max;
        }
        const float m_old = m_rows[r];
        const float m_new = m_old > block_max ? m_old : block_max; /* _mm512_max_ps(m_old, block_max) */
        const float alpha = _mm512_cvtss_f32(exp512_nonpos_or_zero(_mm512_set1_ps(m_old - m_new)));
        float sums[2];
        for (int half = 0; half < 2; half++) {
            const __m512 p = round_to_bf16(
                _mm512_maskz_mov_ps(mask[half], exp512_weights(_mm512_sub_ps(sc[half], _mm512_set1_ps(m_new)))));
            sums[half] = sum16_row(p);
            _mm256_store_si256((__m256i *)&pb[r][16 * half], (__m256i)_mm512_cvtneps_pbh(p));
        }
        m_rows[r] = m_new;
        l_rows[r] = fmaf(l_rows[r], alpha, sums[0] + sums[1]); /* one rounding, as _mm512_fmadd_ps */
        alpha_rows[r] = alpha;
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
    enum { BS = 16, NP = AMX_KEYS / 2 /* key pairs of a group */ };
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
    uint32_t vp[num_kv_heads][NP][HD] __attribute__((aligned(64)));
    const int fp8 = kv_dtype >= 2;
    const int row_elems = num_kv_heads * HD;
    uint16_t kst[AMX_GROUP_BLOCKS][fp8 ? BS : 1][fp8 ? row_elems : 1] __attribute__((aligned(64)));
    uint16_t vst[AMX_GROUP_BLOCKS][fp8 ? BS : 1][fp8 ? row_elems : 1] __attribute__((aligned(64)));

    memset(acc, 0, sizeof acc);
    for (int h = 0; h < num_kv_heads; h++)
        for (int g2 = 0; g2 < ngroups; g2++) {
            _mm512_store_ps(m_rows[h][g2], _mm512_set1_ps(-FLT_MAX));
            _mm512_store_ps(l_rows[h][g2], _mm512_setzero_ps());
        }
    /* Each row sees keys ws ..= pos; padding rows (pos -1) see none. Per row group, over its real rows: the
     * smallest pos and the largest ws (a key group between them is seen whole by every row). */
    int pos_min[ngroups], ws_max[ngroups];
    for (int row = 0; row < ngroups * 16; row++) {
        const int pos = first_pos + item.q_begin + row / group;
        pos_rows[row] = row < rows ? pos : -1;
        ws_rows[row] = row < rows ? window_start(pos, window, chunk) : 0;
        if (row % 16 == 0) {
            pos_min[row / 16] = INT_MAX;
            ws_max[row / 16] = 0;
        }
        if (row < rows) {
            if (pos < pos_min[row / 16]) pos_min[row / 16] = pos;
            if (ws_rows[row] > ws_max[row / 16]) ws_max[row / 16] = ws_rows[row];
        }
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
    /* Blocks before this one hold no key any row of the item sees (window starts grow with the position); the
     * first group may begin one block earlier, which then takes no part (zero scores, all masked; zero V). */
    const int first_block = window_start(first_pos + item.q_begin, window, chunk) / BS;
    for (int b = first_block - first_block % AMX_GROUP_BLOCKS; b < num_blocks; b += AMX_GROUP_BLOCKS) {
        const uint16_t *kb[AMX_GROUP_BLOCKS], *vb[AMX_GROUP_BLOCKS];
        int64_t tok_stride[AMX_GROUP_BLOCKS];
        int present[AMX_GROUP_BLOCKS];
        for (int i = 0; i < AMX_GROUP_BLOCKS; i++) {
            const int bi = b + i;
            present[i] = bi >= first_block && bi < num_blocks;
            int n_valid = last_pos + 1 - bi * BS;
            if (n_valid > BS) n_valid = BS;
            if (present[i])
                tok_stride[i] = block_rows_bf16(k_cache_raw, v_cache_raw, (int64_t)table[bi] * cache_blk_stride,
                                                cache_tok_stride, n_valid, row_elems, kv_dtype, &kst[i][0][0],
                                                &vst[i][0][0], &kb[i], &vb[i]);
            /* The next group's blocks are asked for (into L2) while this one is computed, adjacent or not: decode
             * is bound by fetching blocks, and one block ahead into L1 (attend_item_bf16's way) left too few lines
             * in flight (cold cache, 32 x 232 tokens over 30 layers, scattered blocks: 25.3 -> 23.2 ms; adjacent
             * ones 22.1 -> 21.6-22.7, with 16-key updates and the block after next). */
            const int nb = bi + AMX_GROUP_BLOCKS;
            const int64_t next = nb < num_blocks ? (int64_t)table[nb] * cache_blk_stride : -1;
            for (int j = 0; j < BS; j++) {
                if (next >= 0)
                    PD_PREFETCH_BLOCK_ROW(fp8, k_cache_raw, v_cache_raw, next, j, cache_tok_stride, row_elems, 2);
                /* V pairs; a pair wholly past the block's end, or of a block that takes no part, is zero (P V reads
                 * all of a group's pairs) */
                if (!(j & 1)) continue;
                if (present[i] && j - 1 < n_valid)
                    v_pairs(vb[i], tok_stride[i], j, n_valid, num_kv_heads, cache_head_stride, HD, NP,
                            &vp[0][BS / 2 * i][0]);
                else
                    for (int h = 0; h < num_kv_heads; h++)
                        for (int c = 0; c < HD; c += 16)
                            _mm512_store_si512(&vp[h][BS / 2 * i + j / 2][c], _mm512_setzero_si512());
            }
        }
        /* One unit per (kv head, row group). Each unit's scores are computed and stored before the previous
         * unit's softmax, so the tiles compute them while the vector units work (the unit after that reuses the
         * other buffer). K rows past a block's end are read too (the block is whole in memory); their scores are
         * masked. */
        const int num_units = num_kv_heads * ngroups;
        float st_buf[2][AMX_KEYS][16] __attribute__((aligned(64)));
#define PD_AMX_SCORES(unit)                                                                                      \
    do {                                                                                                        \
        const int h_ = (unit) / ngroups, g_ = (unit) % ngroups;                                                  \
        _tile_zero(0);                                                                                          \
        _tile_zero(7);                                                                                          \
        for (int s = 0; s < HD / 32; s++) {                                                                     \
            _tile_loadd(2, qt[h_][g_][16 * s], 64);                                                             \
            if (present[0]) {                                                                                   \
                _tile_loadd(1, kb[0] + h_ * cache_head_stride + 32 * s, tok_stride[0] * 2);                     \
                _tile_dpbf16ps(0, 1, 2);                                                                        \
            }                                                                                                   \
            if (present[1]) {                                                                                   \
                _tile_loadd(5, kb[1] + h_ * cache_head_stride + 32 * s, tok_stride[1] * 2);                     \
                _tile_dpbf16ps(7, 5, 2);                                                                        \
            }                                                                                                   \
        }                                                                                                       \
        _tile_stored(0, st_buf[(unit) & 1][0], 64);                                                             \
        _tile_stored(7, st_buf[(unit) & 1][16], 64);                                                            \
    } while (0)
        PD_AMX_SCORES(0);
        for (int unit = 0; unit < num_units; unit++) {
            {
                const int h = unit / ngroups, g2 = unit % ngroups;
                if (unit + 1 < num_units) PD_AMX_SCORES(unit + 1);
                float (*st)[16] = st_buf[unit & 1];
                const int rows_here = rows - g2 * 16 < 16 ? rows - g2 * 16 : 16;
                float alpha_rows[16] __attribute__((aligned(64)));
                uint16_t pb[16][AMX_KEYS] __attribute__((aligned(64)));
                const __mmask16 seen =
                    R <= AMX_ROW_FORM_ROWS
                        ? softmax_rows(st, rows_here, b * BS, &pos_rows[g2 * 16], &ws_rows[g2 * 16], scale,
                                       m_rows[h][g2], l_rows[h][g2], alpha_rows, pb)
                        : softmax_columns(st, b * BS, ws_max[g2] <= b * BS && b * BS + AMX_KEYS - 1 <= pos_min[g2],
                                          &pos_rows[g2 * 16], &ws_rows[g2 * 16], scale, m_rows[h][g2], l_rows[h][g2],
                                          alpha_rows, pb);
                if (!seen) continue; /* the group is outside every row's window: nothing changes */
                _tile_loadd(4, pb, 2 * AMX_KEYS);
                for (int c = 0; c < HD; c += 32) {
                    float o[2][16][16] __attribute__((aligned(64)));
                    _tile_zero(3);
                    _tile_zero(6);
                    _tile_loadd(1, &vp[h][0][c], HD * 4);
                    _tile_dpbf16ps(3, 4, 1);
                    _tile_loadd(5, &vp[h][0][c + 16], HD * 4);
                    _tile_dpbf16ps(6, 4, 5);
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
#undef PD_AMX_SCORES
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
