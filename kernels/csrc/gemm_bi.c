/* Batch-invariant linear: y[m, n] = sum_k x[m, k] * w[n, k], each output element computed by the same
 * sequence of floating-point operations whatever the number of rows M, the tile or the thread it lands
 * in (issue 24, deterministic serving). Built into the kernel library by kernels/cpu_build.py (gcc -O3
 * -march=native -fopenmp), called through kernels/cpu_gemm.py.
 *
 * The invariant (call it BI): one fp32 accumulator per output element, starting at +0, updated in
 * increasing k with one fixed operation per step, then rounded once on store. No split-K, no K blocking
 * that depends on M or on the thread count, no partial sums combined in a tree. Tiles (rows x columns
 * of accumulators) and threads only choose WHICH elements are computed together, never how.
 *   float32:  acc = fma(x[k], w[k], acc) for k = 0 .. K-1. The same on every ISA path here (AVX-512,
 *             AVX2, scalar fmaf), so fp32 results are bitwise equal across these paths and machines.
 *   bfloat16, avx512_bf16: acc = vdpbf16ps(acc, (x[2p], x[2p+1]), (w[2p], w[2p+1])) for p = 0 .. K/2-1
 *             (the instruction adds a pair of products; an odd K ends with the pair (x[K-1], 0)).
 *   bfloat16, AVX2 / scalar: acc = fma(x[2p], w[2p], acc); acc = fma(x[2p+1], w[2p+1], acc) (odd K: the
 *             missing x is +0, its weight +0). AVX2 and scalar agree bitwise; vdpbf16ps does not (it
 *             rounds differently), so a machine's bf16 results depend on its best path, never on M.
 *   bfloat16, AMX (amx_bf16, Sapphire Rapids and later): acc = tdpbf16ps(acc, x[32 j .. 32 j + 31], w[...]) for
 *             j = 0 .. ceil(K / 32) - 1, the rows of x and of w zero padded to a multiple of 32 (a padded pair
 *             adds +0). One instruction sums 16 pairs inside the tile unit, so AMX does not agree bitwise
 *             with vdpbf16ps (it is the more accurate of the two: bench/results/gemm_bi_amx_s71.json), and
 *             it is used for every M, one row too: a decode step and a prefill give a row the same bits.
 * Output: float32, or bfloat16 rounded to nearest even from the accumulator (what torch does; NaN ->
 * 0x7fc0).
 *
 * Packed weight (kernels/cpu_gemm.py pack_bi, once at load): strips of 16 output columns, zero padded
 * to a whole strip and (bf16) to an even K:
 *   float32  [S][K][16]         S = ceil(N / 16)
 *   bfloat16 [S][K/2][16][2]    K rounded up to even: one 64-byte line per (strip, k pair), the
 *                               vdpbf16ps operand as is.
 * A tile is MR rows x NV strips of accumulators; OpenMP threads take contiguous ranges of strips.
 *
 * isa: 0 = best available, 1 = scalar C, 2 = AVX2+FMA, 3 = AVX-512 (fp32: avx512f; bf16: avx512_bf16), 4 = AMX
 * (bf16 only; where the compiler targets amx_bf16 and Linux grants the process the tile state).
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STRIP 16
/* Most rows per cache block; no effect on the arithmetic. Each group of strips (a tile's columns) is read from
 * memory once per block and then served from L2 to the block's rows, so a larger block reads the weights fewer
 * times: 512 against 96 made a 200-token prefill's GEMMs 12% faster on an AVX-512 Xeon with a 2 MiB L2, whose
 * weights come from DRAM (fp32 SmolLM2, one thread; bench/results/vs_vllm_fp32_avx512_s49.json). */
#define MC 512
#define MAX_MR 6
#define MAX_NV 8

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#endif
#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_AVX512BF16 1
#endif

typedef struct {
    const void *x;   /* [M, K] rows ldx apart (elements) */
    int64_t ldx;
    const void *w;   /* packed */
    int64_t strip;   /* elements per packed strip */
    int64_t n, k;
    void *y;         /* [M, N] rows ldy apart */
    int64_t ldy;
    int out_fp32;
    const float *xf; /* AVX2 / scalar bf16: x widened to fp32, rows kx apart (K rounded up to even, pad 0) */
    int64_t kx;
    const float *bias; /* [N] fp32 added to each accumulator once, after its k loop, before rounding; NULL: none */
} gemm_args;

typedef void (*tile_fn)(const gemm_args *a, int64_t m0, int64_t s0);

/* A tile kernel: MR rows x NV strips of accumulators from row m0, strip s0. Always inlined, so each
 * TILE1 instance below gets MR and NV as constants and its loops unrolled. */
#define TILE_KERNEL(name) \
    static inline __attribute__((always_inline)) void name(const gemm_args *a, int64_t m0, int64_t s0, const int MR, \
                                                           const int NV)
/* Loop heads, unrolled: over a tile's rows r < MR, its strips v < NV, and both (every accumulator). The
 * stores after the k loop stay rolled (unrolled, the inlined store would be copied MR x NV times). */
#define FOR_EACH_ROW _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)
#define FOR_EACH_STRIP _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++)
#define FOR_EACH_ACC FOR_EACH_ROW FOR_EACH_STRIP

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Stores n_valid (<= count) fp32 accumulators at column col of row r. */
static inline void store_scalar(const gemm_args *a, int64_t r, int64_t col, const float *acc, int n_valid) {
    float biased[STRIP];
    if (a->bias != NULL) {
        for (int i = 0; i < n_valid; i++) biased[i] = acc[i] + a->bias[col + i];
        acc = biased;
    }
    if (a->out_fp32) {
        memcpy((float *)a->y + r * a->ldy + col, acc, (size_t)n_valid * 4);
    } else {
        uint16_t *y = (uint16_t *)a->y + r * a->ldy + col;
        for (int i = 0; i < n_valid; i++) y[i] = f32_to_bf16(acc[i]);
    }
}

static inline int valid_cols(const gemm_args *a, int64_t s) {
    int64_t v = a->n - s * STRIP;
    return v >= STRIP ? STRIP : (int)v;
}

/* ---------------------------------------------------------------- scalar (any CPU) */

static void scalar_tile(const gemm_args *a, int64_t m0, int64_t s0, int mr, int nv, int bf16) {
    for (int r = 0; r < mr; r++) {
        for (int v = 0; v < nv; v++) {
            float acc[STRIP] = {0};
            if (bf16) {
                const uint16_t *w = (const uint16_t *)a->w + (s0 + v) * a->strip;
                const float *x = a->xf + (m0 + r) * a->kx;
                for (int64_t p = 0; p < a->kx / 2; p++)
                    for (int c = 0; c < STRIP; c++) {
                        acc[c] = fmaf(x[2 * p], bf16_to_f32(w[(p * STRIP + c) * 2]), acc[c]);
                        acc[c] = fmaf(x[2 * p + 1], bf16_to_f32(w[(p * STRIP + c) * 2 + 1]), acc[c]);
                    }
            } else {
                const float *w = (const float *)a->w + (s0 + v) * a->strip;
                const float *x = (const float *)a->x + (m0 + r) * a->ldx;
                for (int64_t k = 0; k < a->k; k++)
                    for (int c = 0; c < STRIP; c++) acc[c] = fmaf(x[k], w[k * STRIP + c], acc[c]);
            }
            store_scalar(a, m0 + r, (s0 + v) * STRIP, acc, valid_cols(a, s0 + v));
        }
    }
}

/* ---------------------------------------------------------------- AVX2 + FMA */
#ifdef HAVE_AVX2
static inline void avx2_store(const gemm_args *a, int64_t r, int64_t s, __m256 lo, __m256 hi) {
    const int64_t col = s * STRIP;
    const int nvalid = valid_cols(a, s);
    if (a->bias != NULL && nvalid == STRIP) { /* a partial strip's bias: store_scalar's */
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(a->bias + col));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(a->bias + col + 8));
    }
    if (a->out_fp32 && nvalid == STRIP) {
        float *y = (float *)a->y + r * a->ldy + col;
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
        return;
    }
    if (!a->out_fp32 && nvalid == STRIP) {
        const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), qnan = _mm256_set1_epi32(0x7fc0);
        __m128i half[2];
        for (int h = 0; h < 2; h++) {
            const __m256 v = h ? hi : lo;
            __m256i u = _mm256_castps_si256(v);
            u = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
            u = _mm256_srli_epi32(u, 16);
            u = _mm256_blendv_epi8(u, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
            half[h] = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
        }
        uint16_t *y = (uint16_t *)a->y + r * a->ldy + col;
        _mm_storeu_si128((__m128i *)y, half[0]);
        _mm_storeu_si128((__m128i *)(y + 8), half[1]);
        return;
    }
    float buf[STRIP];
    _mm256_storeu_ps(buf, lo);
    _mm256_storeu_ps(buf + 8, hi);
    store_scalar(a, r, col, buf, nvalid);
}

/* The accumulators out to memory once, by constant indices (unrolled), then stored from there by a rolled
 * loop. Indexing acc[r][v] with the rolled loop's variables instead made GCC keep the array in memory and
 * write every accumulator back on every k step (12 stores per 12 FMAs: the fp32 tile ran at 40% of its
 * speed, bench/results/gemm_bi_avx2_s43.json). Only register allocation changes: the arithmetic is the same. */
#define AVX2_FLUSH(acc)                                                                                  \
    do {                                                                                                 \
        float out_[MAX_MR][MAX_NV][STRIP] __attribute__((aligned(32)));                                  \
        FOR_EACH_ACC {                                                                                   \
            _mm256_store_ps(out_[r][v], (acc)[r][v][0]);                                                 \
            _mm256_store_ps(out_[r][v] + 8, (acc)[r][v][1]);                                             \
        }                                                                                                \
        for (int r = 0; r < MR; r++)                                                                     \
            for (int v = 0; v < NV; v++)                                                                 \
                avx2_store(a, m0 + r, s0 + v, _mm256_load_ps(out_[r][v]), _mm256_load_ps(out_[r][v] + 8)); \
    } while (0)

/* fp32: MR rows x NV strips, 2 ymm per strip. */
TILE_KERNEL(avx2_f32_tile) {
    __m256 acc[MAX_MR][MAX_NV][2];
    FOR_EACH_ACC acc[r][v][0] = acc[r][v][1] = _mm256_setzero_ps();
    const float *x = (const float *)a->x + m0 * a->ldx;
    const float *w = (const float *)a->w + s0 * a->strip;
    const int64_t ldx = a->ldx, strip = a->strip;
    for (int64_t k = 0; k < a->k; k++) {
        if (NV == 1) {
            /* A tall tile (the big one): each row's broadcast is used at once, so its 12 accumulators, the
             * strip's 2 weight vectors and 1 broadcast fit the 16 ymm registers (all rows' broadcasts
             * first would need 18, and GCC spills accumulators). */
            const __m256 w0 = _mm256_loadu_ps(w + k * STRIP);
            const __m256 w1 = _mm256_loadu_ps(w + k * STRIP + 8);
            FOR_EACH_ROW {
                const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
                acc[r][0][0] = _mm256_fmadd_ps(xb, w0, acc[r][0][0]);
                acc[r][0][1] = _mm256_fmadd_ps(xb, w1, acc[r][0][1]);
            }
            continue;
        }
        __m256 xb[MAX_MR];
        FOR_EACH_ROW xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
        FOR_EACH_STRIP {
            const __m256 w0 = _mm256_loadu_ps(w + v * strip + k * STRIP);
            const __m256 w1 = _mm256_loadu_ps(w + v * strip + k * STRIP + 8);
            FOR_EACH_ROW {
                acc[r][v][0] = _mm256_fmadd_ps(xb[r], w0, acc[r][v][0]);
                acc[r][v][1] = _mm256_fmadd_ps(xb[r], w1, acc[r][v][1]);
            }
        }
    }
    AVX2_FLUSH(acc);
}

/* bf16 (x widened in a->xf): a ymm of 8 (even, odd) pairs gives even = pair << 16, odd = pair & hi. */
TILE_KERNEL(avx2_bf16_tile) {
    __m256 acc[MAX_MR][MAX_NV][2];
    FOR_EACH_ACC acc[r][v][0] = acc[r][v][1] = _mm256_setzero_ps();
    const float *x = a->xf + m0 * a->kx;
    const uint16_t *w = (const uint16_t *)a->w + s0 * a->strip;
    const int64_t kx = a->kx, strip = a->strip;
    const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t p = 0; p < kx / 2; p++) {
        FOR_EACH_STRIP {
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(w + v * strip + p * 2 * STRIP));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(w + v * strip + p * 2 * STRIP + 16));
            const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(q0, 16));
            const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(q0, hi_mask));
            const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(q1, 16));
            const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(q1, hi_mask));
            FOR_EACH_ROW {
                const __m256 xe = _mm256_broadcast_ss(x + r * kx + 2 * p);
                const __m256 xo = _mm256_broadcast_ss(x + r * kx + 2 * p + 1);
                acc[r][v][0] = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, acc[r][v][0]));
                acc[r][v][1] = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, acc[r][v][1]));
            }
        }
    }
    AVX2_FLUSH(acc);
}
#endif

/* ---------------------------------------------------------------- AVX-512 */
#ifdef HAVE_AVX512
static inline void avx512_store(const gemm_args *a, int64_t r, int64_t s, __m512 v) {
    const int64_t col = s * STRIP;
    const int nvalid = valid_cols(a, s);
    const __mmask16 mask = nvalid >= STRIP ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    if (a->bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a->bias + col));
    if (a->out_fp32) {
        _mm512_mask_storeu_ps((float *)a->y + r * a->ldy + col, mask, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    u = _mm512_srli_epi32(u, 16);
    u = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16((uint16_t *)a->y + r * a->ldy + col, mask, _mm512_cvtepi32_epi16(u));
}

TILE_KERNEL(avx512_f32_tile) {
    __m512 acc[MAX_MR][MAX_NV];
    FOR_EACH_ACC acc[r][v] = _mm512_setzero_ps();
    const float *x = (const float *)a->x + m0 * a->ldx;
    const float *w = (const float *)a->w + s0 * a->strip;
    const int64_t ldx = a->ldx, strip = a->strip;
    for (int64_t k = 0; k < a->k; k++) {
        __m512 xb[MAX_MR];
        FOR_EACH_ROW xb[r] = _mm512_set1_ps(x[r * ldx + k]);
        FOR_EACH_STRIP {
            const __m512 wv = _mm512_loadu_ps(w + v * strip + k * STRIP);
            FOR_EACH_ROW acc[r][v] = _mm512_fmadd_ps(xb[r], wv, acc[r][v]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) avx512_store(a, m0 + r, s0 + v, acc[r][v]);
}
#endif

#ifdef HAVE_AVX512BF16
/* One k pair for a tile: xp(r) gives row r's pair as 32 bits. */
#define BF16_STEP(XP)                                                                        \
    do {                                                                                     \
        __m512bh xb[MAX_MR];                                                                 \
        FOR_EACH_ROW xb[r] = (__m512bh)_mm512_set1_epi32((int)(XP));                         \
        FOR_EACH_STRIP {                                                                     \
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + v * strip + p * 2 * STRIP); \
            FOR_EACH_ROW acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb[r], wv);                 \
        }                                                                                    \
    } while (0)

static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

TILE_KERNEL(avx512bf16_tile) {
    __m512 acc[MAX_MR][MAX_NV];
    FOR_EACH_ACC acc[r][v] = _mm512_setzero_ps();
    const uint16_t *x = (const uint16_t *)a->x + m0 * a->ldx;
    const uint16_t *w = (const uint16_t *)a->w + s0 * a->strip;
    const int64_t ldx = a->ldx, strip = a->strip, pairs = a->k / 2;
    int64_t p = 0;
    for (; p < pairs; p++) BF16_STEP(load_pair(x + r * ldx + 2 * p));
    if (a->k & 1) BF16_STEP(x[r * ldx + 2 * p]); /* odd K: the last pair is (x[K-1], +0) */
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) avx512_store(a, m0 + r, s0 + v, acc[r][v]);
}
#endif


/* ---------------------------------------------------------------- AMX (bfloat16) */
#include "amx.h"
#if defined(HAVE_AVX512BF16) && defined(PD_HAVE_AMX)
#define HAVE_AMX 1
#define AMX_K 32     /* bf16 elements of k per tile step: a tile row is 64 bytes */
#define AMX_ROWS 16  /* rows per A tile; a block is 16 or 32 rows x 1 or 2 strips */

/* Palette 1, eight tiles: 0-3 the fp32 accumulators of a block of up to 32 x 32 (rows x 64 bytes), 4-5 two A
 * tiles (rows x 32 k), 6-7 two B tiles (16 k pairs x one strip: the packed layout's 64-byte lines as is).
 * rows (1 .. 16) is how many rows each A tile holds: fewer for the last rows of a call (a decode step's one
 * row costs one row's work, not sixteen). A row's arithmetic is the same in a tile of any height: tdpbf16ps
 * computes each row of its output from that row of A alone. Tile state is per thread: every thread that
 * runs tiles loads this first and releases it after. */
static void amx_configure(int rows) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t < 6 ? (uint8_t)rows : AMX_ROWS;
        cfg.colsb[t] = 64;
    }
    amx_load_tilecfg(&cfg);
}

/* One block: 16 x (1 + R2) rows of A from x (rows ldx elements apart, zero beyond k up to a multiple of
 * AMX_K) times 1 + S2 strips from w (strip_elems apart). Whole k steps read w directly; the last partial one
 * reads each strip's zero-padded copy in tail (AMX_K / 2 pairs x STRIP x 2, one per strip). Every element
 * gets the same tdpbf16ps sequence over k = 0, 32, 64, ... whichever tile holds it.
 * B tiles are loaded with tileloaddt1 (a hint to keep them out of L1): a block's rows of A (32 x 576 bf16 is
 * 36 KiB) then stay in L1 across a row group's strips while the weights come from L2 (a 2,048-row GEMM 1.33x
 * faster). Each k step also prefetches pf_lines cache lines from pf into L2: weights that later blocks read. A
 * prefetch never faults, but pf stays inside the weights (amx_rows). */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, int64_t ldx, const uint16_t *w,
                                                            int64_t strip_elems, int64_t k_steps,
                                                            const uint16_t *tail, float *out, const int R2,
                                                            const int S2, const char *pf, int64_t pf_lines) {
    const int64_t lda = ldx * 2;
    _tile_zero(0);
    if (S2) _tile_zero(1);
    if (R2) _tile_zero(2);
    if (R2 && S2) _tile_zero(3);
    for (int64_t i = 0; i < k_steps; i++) {
        const int64_t k = i * AMX_K;
        _tile_loadd(4, x + k, lda);
        if (R2) _tile_loadd(5, x + AMX_ROWS * ldx + k, lda);
        _tile_stream_loadd(6, w + k * STRIP, 64);
        if (S2) _tile_stream_loadd(7, w + strip_elems + k * STRIP, 64);
        for (int64_t j = 0; j < pf_lines; j++) _mm_prefetch(pf + (i * pf_lines + j) * 64, _MM_HINT_T1);
        _tile_dpbf16ps(0, 4, 6);
        if (S2) _tile_dpbf16ps(1, 4, 7);
        if (R2) _tile_dpbf16ps(2, 5, 6);
        if (R2 && S2) _tile_dpbf16ps(3, 5, 7);
    }
    if (tail != NULL) {
        const int64_t k = k_steps * AMX_K;
        _tile_loadd(4, x + k, lda);
        if (R2) _tile_loadd(5, x + AMX_ROWS * ldx + k, lda);
        _tile_loadd(6, tail, 64);
        if (S2) _tile_loadd(7, tail + AMX_K * STRIP, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (S2) _tile_dpbf16ps(1, 4, 7);
        if (R2) _tile_dpbf16ps(2, 5, 6);
        if (R2 && S2) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 2 * STRIP * 4);
    if (S2) _tile_stored(1, out + STRIP, 2 * STRIP * 4);
    if (R2) _tile_stored(2, out + AMX_ROWS * 2 * STRIP, 2 * STRIP * 4);
    if (R2 && S2) _tile_stored(3, out + AMX_ROWS * 2 * STRIP + STRIP, 2 * STRIP * 4);
}

/* One output row of a block: 16 or 32 columns from strip s. Two strips to bfloat16 take one vcvtne2ps2bf16
 * (round to nearest even, as avx512_store) and one store: with avx512_store's per-strip rounding the stores
 * took a third of a 2,048 x 960 x 576 GEMM. That instruction treats denormal inputs as zero, which cannot
 * change a result here: tdpbf16ps flushes denormal results to zero, so no accumulator is one. NaN is 0x7fc0
 * as on the other paths. */
static inline void amx_store_row(const gemm_args *a, int64_t r, int64_t s, int two_strips, const float *acc) {
    if (a->out_fp32 || !two_strips) {
        for (int v = 0; v <= two_strips; v++) avx512_store(a, r, s + v, _mm512_load_ps(acc + v * STRIP));
        return;
    }
    const int64_t valid = a->n - s * STRIP;
    __m512 lo = _mm512_load_ps(acc), hi = _mm512_load_ps(acc + STRIP);
    if (a->bias != NULL) { /* two strips: the first is whole */
        const int64_t rest = valid - STRIP;
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(a->bias + s * STRIP));
        hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(rest >= STRIP ? (__mmask16)0xffff : (__mmask16)((1u << rest) - 1),
                                                     a->bias + s * STRIP + STRIP));
    }
    const __mmask32 nan = (__mmask32)_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) |
                          ((__mmask32)_mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q) << 16);
    const __m512i bf = _mm512_mask_blend_epi16(nan, (__m512i)_mm512_cvtne2ps_pbh(hi, lo), _mm512_set1_epi16(0x7fc0));
    const __mmask32 cols = valid >= 2 * STRIP ? (__mmask32)0xffffffffu : (__mmask32)((1u << valid) - 1);
    _mm512_mask_storeu_epi16((uint16_t *)a->y + r * a->ldy + s * STRIP, cols, bf);
}

/* Strips per panel: a panel's weights stay in L2 while every row group passes over them, and a row group's
 * outputs are written as one stretch per row (strip pair after strip pair down all rows wrote 64 bytes per row
 * and page: 2,048 x 3,072 x 576 took 50% longer than oneDNN). Two sizes, by whether the call's rows of A fit in
 * L2 beside the weights:
 * - they do (a prefill chunk of up to ~900 rows of 576): 256 KiB panels, and the later row groups of each prefetch
 *   the next one (amx_rows), which leaves room in a 2 MiB L2 for both panels and A (1 MiB panels, whose next
 *   one evicted A, made a 200-row prefill's GEMMs 1.15x slower);
 * - they do not: A streams from memory once per panel, so 1 MiB panels (a quarter of the passes over A) and no
 *   prefetch (the next panel would evict the current one); weights are a small part of such a call's traffic.
 * Even, so pairs never straddle two panels. No effect on the arithmetic. */
#define AMX_SMALL_PANEL_BYTES (256 << 10)
#define AMX_LARGE_PANEL_BYTES (1 << 20)
#define AMX_A_IN_L2_BYTES (1 << 20)
#define AMX_PF_MAX 8 /* most lines prefetched per k step */

static int amx_prefetches(const gemm_args *a, int64_t m) {
    return m * ((a->k + AMX_K - 1) / AMX_K * AMX_K) * 2 <= AMX_A_IN_L2_BYTES;
}

static int64_t amx_panel_strips(const gemm_args *a, int64_t m, int64_t strips) {
    const int64_t bytes = amx_prefetches(a, m) ? AMX_SMALL_PANEL_BYTES : AMX_LARGE_PANEL_BYTES;
    int64_t most = bytes / (a->strip * 2) / 2 * 2;
    if (most < 2) most = 2;
    const int64_t panels = (strips + most - 1) / most; /* of equal size: no narrow last panel */
    return ((strips + panels - 1) / panels + 1) / 2 * 2;
}

/* Rows [0, m) of src (rows ld apart, readable up to a multiple of AMX_K columns), strips [s_begin, s_end), panel
 * by panel: the whole 16-row tiles two at a time, then the last m % 16 rows in tiles that high (within the panel,
 * so its weights come from memory once, not once more for the last rows). tail: room for a panel's strips' last
 * partial k step (AMX_K / 2 pairs x STRIP x 2 each), zero padded to a whole one.
 * A panel's first row group reads its weights from memory; where A fits in L2 (amx_prefetches) the later ones,
 * reading them from L2, prefetch the next panel's into L2, spread evenly over their k steps, so that memory and the tiles work at once (a 200-row
 * prefill's GEMMs 1.2-1.35x faster on a Xeon that streams 13 GB/s to one core). A call of one row group (a
 * decode step) prefetches nothing: the hardware prefetchers serve it better than software ones did (M = 1:
 * 1.15x slower with the next strip pair prefetched). */
static void amx_rows(const gemm_args *a, const uint16_t *src, int64_t ld, int64_t m, int64_t s_begin,
                     int64_t s_end, uint16_t *tail) {
    const int64_t kx = (a->k + 1) / 2 * 2, k_steps = kx / AMX_K, tail_pairs = (kx % AMX_K) / 2;
    const int64_t panel = amx_panel_strips(a, m, s_end - s_begin);
    const int64_t whole = m / AMX_ROWS * AMX_ROWS;
    const int64_t groups = (whole + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS) + (m > whole);
    const char *w_bytes = (const char *)a->w;
    float out[2 * AMX_ROWS][2 * STRIP] __attribute__((aligned(64)));
    int tile_rows = 0;
    for (int64_t ps = s_begin; ps < s_end; ps += panel) {
        const int64_t pe = s_end - ps < panel ? s_end : ps + panel, pairs = (pe - ps + 1) / 2;
        if (tail_pairs)
            for (int64_t s = ps; s < pe; s++) {
                uint16_t *dst = tail + (s - ps) * AMX_K * STRIP;
                memset(dst, 0, AMX_K * STRIP * 2);
                memcpy(dst, (const uint16_t *)a->w + s * a->strip + k_steps * AMX_K * STRIP,
                       (size_t)tail_pairs * STRIP * 2 * 2);
            }
        /* The next panel: lines [0, next_lines) from next, next_per_step of them in each k step of groups 1..
         * (never past its end: the last few lines, fewer than k_steps, are left to the hardware) */
        const int64_t ne = s_end - pe < panel ? s_end : pe + panel;
        const char *next = w_bytes + pe * a->strip * 2;
        const int64_t next_lines = k_steps > 0 && amx_prefetches(a, m) ? (ne - pe) * a->strip * 2 / 64 : 0;
        const int64_t later_steps = (groups - 1) * pairs * k_steps;
        int64_t next_per_step = later_steps > 0 ? (next_lines + later_steps - 1) / later_steps : 0;
        if (next_per_step > AMX_PF_MAX) next_per_step = AMX_PF_MAX;
        int64_t next_done = 0;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r = g * 2 * AMX_ROWS < whole ? g * 2 * AMX_ROWS : whole;
            const int64_t rows = r < whole ? (whole - r < 2 * AMX_ROWS ? whole - r : 2 * AMX_ROWS) : m - whole;
            const int want = r < whole ? AMX_ROWS : (int)rows;
            if (want != tile_rows) amx_configure(tile_rows = want);
            const int two_rows = rows > AMX_ROWS;
            const uint16_t *x = src + r * ld;
            for (int64_t s = ps; s < pe; s += 2) {
                const int two_strips = s + 1 < pe;
                const uint16_t *w = (const uint16_t *)a->w + s * a->strip;
                const uint16_t *t = tail_pairs ? tail + (s - ps) * AMX_K * STRIP : NULL;
                int64_t pf_lines = 0;
                if (g > 0 && next_done < next_lines) {
                    pf_lines = next_per_step;
                    if (next_done + pf_lines * k_steps > next_lines) pf_lines = (next_lines - next_done) / k_steps;
                }
                const char *pf = next + next_done * 64;
                next_done += pf_lines * k_steps;
                if (two_rows && two_strips) amx_block(x, ld, w, a->strip, k_steps, t, &out[0][0], 1, 1, pf, pf_lines);
                else if (two_rows) amx_block(x, ld, w, a->strip, k_steps, t, &out[0][0], 1, 0, pf, pf_lines);
                else if (two_strips) amx_block(x, ld, w, a->strip, k_steps, t, &out[0][0], 0, 1, pf, pf_lines);
                else amx_block(x, ld, w, a->strip, k_steps, t, &out[0][0], 0, 0, pf, pf_lines);
                for (int64_t i = 0; i < rows; i++) amx_store_row(a, r + i, s, two_strips, out[i]);
            }
        }
    }
}

/* One thread's strips [s_begin, s_end) of every row. x is read in place when k is a whole number of tile steps,
 * else through a copy zero padded to one, so a tile never reads another row's values (which could be NaN) nor
 * past the caller's buffer. */
static int amx_run(const gemm_args *a, int64_t m, int64_t s_begin, int64_t s_end) {
    const int64_t kp = (a->k + AMX_K - 1) / AMX_K * AMX_K;
    uint16_t *tail = aligned_alloc(64, (size_t)(amx_panel_strips(a, m, s_end - s_begin) * AMX_K * STRIP * 2));
    uint16_t *pad = kp != a->k ? aligned_alloc(64, (size_t)(m * kp * 2 + 63) / 64 * 64) : NULL;
    if (tail == NULL || (kp != a->k && pad == NULL)) {
        free(tail);
        free(pad);
        return -1;
    }
    const uint16_t *src = (const uint16_t *)a->x;
    int64_t ld = a->ldx;
    if (pad != NULL) {
        for (int64_t r = 0; r < m; r++) {
            memcpy(pad + r * kp, src + r * a->ldx, (size_t)a->k * 2);
            memset(pad + r * kp + a->k, 0, (size_t)(kp - a->k) * 2);
        }
        src = pad;
        ld = kp;
    }
    amx_rows(a, src, ld, m, s_begin, s_end, tail);
    _tile_release();
    free(tail);
    free(pad);
    return 0;
}
#endif

/* ---------------------------------------------------------------- tiles: one function per (MR, NV) */
#define TILE1(kern, MR, NV) \
    static void kern##_##MR##_##NV(const gemm_args *a, int64_t m0, int64_t s0) { kern##_tile(a, m0, s0, MR, NV); }
#define ROW4(kern, MR) TILE1(kern, MR, 1) TILE1(kern, MR, 2) TILE1(kern, MR, 3) TILE1(kern, MR, 4)
#define ROW8(kern, MR) ROW4(kern, MR) TILE1(kern, MR, 5) TILE1(kern, MR, 6) TILE1(kern, MR, 7) TILE1(kern, MR, 8)
#define T4(kern, MR) {NULL, kern##_##MR##_1, kern##_##MR##_2, kern##_##MR##_3, kern##_##MR##_4}
#define T8(kern, MR) \
    {NULL, kern##_##MR##_1, kern##_##MR##_2, kern##_##MR##_3, kern##_##MR##_4, kern##_##MR##_5, kern##_##MR##_6, \
     kern##_##MR##_7, kern##_##MR##_8}

/* How a path tiles: big_mr x big_nv tiles for M > 3; M <= 3 rows at once with small_nv[M] strips. */
typedef struct {
    tile_fn tab[MAX_MR + 1][MAX_NV + 1];
    int big_mr, big_nv, small_nv[4];
} tiling;

/* Both AVX-512 paths (32 zmm registers): 6 x 4 tiles, and up to 8 strips for M <= 3. */
#define AVX512_TILING(kern, name)                                                                          \
    ROW8(kern, 1) ROW8(kern, 2) ROW8(kern, 3) ROW4(kern, 4) ROW4(kern, 5) ROW4(kern, 6)                    \
    static const tiling name = {                                                                           \
        {{NULL}, T8(kern, 1), T8(kern, 2), T8(kern, 3), T4(kern, 4), T4(kern, 5), T4(kern, 6)}, 6, 4, {0, 8, 8, 8}};
#ifdef HAVE_AVX512BF16
AVX512_TILING(avx512bf16, TILING_AVX512BF16)
#endif
#ifdef HAVE_AVX512
AVX512_TILING(avx512_f32, TILING_AVX512_F32)
#endif
#ifdef HAVE_AVX2
/* 16 ymm registers: fp32 keeps <= 12 accumulators, bf16 <= 8 (4 more hold a strip's widened weights). */
TILE1(avx2_f32, 1, 1) TILE1(avx2_f32, 1, 2) TILE1(avx2_f32, 1, 3) TILE1(avx2_f32, 1, 4) TILE1(avx2_f32, 1, 5)
TILE1(avx2_f32, 1, 6) TILE1(avx2_f32, 2, 1) TILE1(avx2_f32, 2, 2) TILE1(avx2_f32, 2, 3) TILE1(avx2_f32, 3, 1)
TILE1(avx2_f32, 3, 2) TILE1(avx2_f32, 4, 1) TILE1(avx2_f32, 5, 1) TILE1(avx2_f32, 6, 1)
static const tiling TILING_AVX2_F32 = {
    {{NULL},
     {NULL, avx2_f32_1_1, avx2_f32_1_2, avx2_f32_1_3, avx2_f32_1_4, avx2_f32_1_5, avx2_f32_1_6},
     {NULL, avx2_f32_2_1, avx2_f32_2_2, avx2_f32_2_3},
     {NULL, avx2_f32_3_1, avx2_f32_3_2},
     {NULL, avx2_f32_4_1}, {NULL, avx2_f32_5_1}, {NULL, avx2_f32_6_1}}, 6, 1, {0, 6, 3, 2}};
TILE1(avx2_bf16, 1, 1) TILE1(avx2_bf16, 1, 2) TILE1(avx2_bf16, 1, 3) TILE1(avx2_bf16, 1, 4)
TILE1(avx2_bf16, 2, 1) TILE1(avx2_bf16, 2, 2) TILE1(avx2_bf16, 3, 1) TILE1(avx2_bf16, 4, 1)
static const tiling TILING_AVX2_BF16 = {
    {{NULL},
     {NULL, avx2_bf16_1_1, avx2_bf16_1_2, avx2_bf16_1_3, avx2_bf16_1_4},
     {NULL, avx2_bf16_2_1, avx2_bf16_2_2},
     {NULL, avx2_bf16_3_1},
     {NULL, avx2_bf16_4_1}}, 4, 1, {0, 4, 2, 1}};
#endif

/* Strips [s_begin, s_end) of every row. Which tile computes an element never changes its arithmetic. */
static void run_tiles(const gemm_args *a, const tiling *t, int64_t m, int64_t s_begin, int64_t s_end) {
    if (m <= 3) {
        const int nv_max = t->small_nv[m];
        for (int64_t s = s_begin; s < s_end; s += nv_max) {
            const int nv = s_end - s < nv_max ? (int)(s_end - s) : nv_max;
            t->tab[m][nv](a, 0, s);
        }
        return;
    }
    /* Row blocks of at most MC rows, of equal size in whole tiles: no short last block (600 rows: 300 + 300,
     * not 512 + 88), whose few rows would cost a whole pass over the weights. */
    const int64_t nblocks = (m + MC - 1) / MC;
    const int64_t block = ((m + nblocks - 1) / nblocks + t->big_mr - 1) / t->big_mr * t->big_mr;
    for (int64_t mb = 0; mb < m; mb += block) {
        const int64_t m_end = mb + block < m ? mb + block : m;
        for (int64_t s = s_begin; s < s_end; s += t->big_nv) {
            const int nv = s_end - s < t->big_nv ? (int)(s_end - s) : t->big_nv;
            for (int64_t r = mb; r < m_end; r += t->big_mr) {
                const int mr = m_end - r < t->big_mr ? (int)(m_end - r) : t->big_mr;
                t->tab[mr][nv](a, r, s);
            }
        }
    }
}

static void run_scalar(const gemm_args *a, int64_t m, int64_t s_begin, int64_t s_end, int bf16) {
    for (int64_t r = 0; r < m; r++) scalar_tile(a, r, s_begin, 1, (int)(s_end - s_begin), bf16);
}

int pd_gemm_bi_isa(int dtype) {
#ifdef HAVE_AMX
    if (dtype == 1 && amx_usable()) return 4;
#endif
#ifdef HAVE_AVX512BF16
    if (dtype == 1) return 3;
#endif
#ifdef HAVE_AVX512
    if (dtype == 0) return 3;
#endif
#ifdef HAVE_AVX2
    return 2;
#endif
    (void)dtype;
    return 1;
}

/* y = x @ w.T + bias. dtype: 0 float32, 1 bfloat16 (x and packed w). y is float32 when out_fp32, else x's dtype.
 * bias: fp32 [n] added to each accumulator before it is rounded (one more fixed operation per element:
 * batch-invariant still), or NULL. Returns 0, or -1 for a bad argument / an ISA this build lacks. */
int pd_gemm_bi_bias(int dtype, const void *x, int64_t ldx, int64_t m, const void *w_packed, int64_t n, int64_t k,
                    void *y, int64_t ldy, int out_fp32, int isa, int num_threads, const float *bias) {
    if ((dtype != 0 && dtype != 1) || m < 0 || n < 1 || k < 1) return -1;
    const int best = pd_gemm_bi_isa(dtype);
    if (isa == 0) isa = best;
    if (isa < 1 || isa > best) return -1;
    if (m == 0) return 0;
    const int64_t kx = (k + 1) / 2 * 2;
    gemm_args a = {x, ldx, w_packed, dtype == 1 ? kx * STRIP : k * STRIP, n, k, y, ldy, out_fp32, NULL, kx, bias};
    const tiling *t = NULL;
    float *xf = NULL;
    if (dtype == 1 && isa < 3) { /* AVX2 / scalar bf16 read x widened to fp32 (exact) */
        xf = aligned_alloc(64, (size_t)((m * kx * 4 + 63) / 64 * 64));
        if (xf == NULL) return -1;
        for (int64_t r = 0; r < m; r++) {
            const uint16_t *src = (const uint16_t *)x + r * ldx;
            for (int64_t i = 0; i < kx; i++) xf[r * kx + i] = i < k ? bf16_to_f32(src[i]) : 0.0f;
        }
        a.xf = xf;
    }
#ifdef HAVE_AVX512BF16
    if (isa == 3 && dtype == 1) t = &TILING_AVX512BF16;
#endif
#ifdef HAVE_AVX512
    if (isa == 3 && dtype == 0) t = &TILING_AVX512_F32;
#endif
#ifdef HAVE_AVX2
    if (isa == 2) t = dtype == 1 ? &TILING_AVX2_BF16 : &TILING_AVX2_F32;
#endif
    const int64_t strips = (n + STRIP - 1) / STRIP;
    /* Threads split the strips (N) only: each element's arithmetic is the same whoever computes it. */
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > strips) threads = (int)strips;
    if (m * n * k < (int64_t)1 << 18) threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t s_begin = strips * tid / nt, s_end = strips * (tid + 1) / nt;
        if (s_begin < s_end) {
#ifdef HAVE_AMX
            if (isa == 4) failed |= amx_run(&a, m, s_begin, s_end) != 0;
            else
#endif
            if (t != NULL) run_tiles(&a, t, m, s_begin, s_end);
            else run_scalar(&a, m, s_begin, s_end, dtype == 1);
        }
    }
    free(xf);
    return failed ? -1 : 0;
}

/* pd_gemm_bi_bias without a bias. */
int pd_gemm_bi(int dtype, const void *x, int64_t ldx, int64_t m, const void *w_packed, int64_t n, int64_t k,
               void *y, int64_t ldy, int out_fp32, int isa, int num_threads) {
    return pd_gemm_bi_bias(dtype, x, ldx, m, w_packed, n, k, y, ldy, out_fp32, isa, num_threads, NULL);
}
