/* CPU kernels for the engine's hot path: paged attention, fused residual-add + RMSNorm, rotary
 * embedding, SiLU-and-mul. Plain C with OpenMP, built once per machine by kernels/cpu_build.py
 * (gcc -O3 -march=native -fopenmp) and called through ctypes with raw pointers, so the build needs
 * no torch headers (seconds, not minutes). Each function has a torch reference in kernels/reference.py
 * that tests compare it with.
 *
 * dtype codes: 0 = float32, 1 = bfloat16, and for the KV cache only 2 = float8_e4m3fn, 3 = float8_e5m2
 * (--kv-cache-dtype fp8). Math is float32 throughout; 16- and 8-bit inputs are widened on load and outputs
 * rounded to nearest even on store (what torch does), fp8 stores saturating at the format's largest finite
 * value (what vLLM's CUDA conversion does; torch's own cast makes NaN or inf there).
 *
 * OpenMP: linked against the libgomp torch already loaded (same soname), so torch's threads and ours
 * are one pool; every parallel region takes its thread count from the caller (torch.get_num_threads).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h> /* the attention score tiles (attend_item) */

/* Scores of NU queries over a 16-key block: scores[idx[u]][j] = the fma chain over d of qrow[u][d] * kt[d][j],
 * d in order (kt: the block's K as [d][16 keys]). NU is a constant at each call: NU registers of accumulators. */
static inline __attribute__((always_inline)) void score_tile16(const float *const *qrow, const float *kt, int head_dim,
                                                               float (*scores)[16], const int *idx, const int NU) {
    __m512 a[8];
    for (int u = 0; u < NU; u++) a[u] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const __m512 k = _mm512_loadu_ps(kt + 16 * d);
        for (int u = 0; u < NU; u++) a[u] = _mm512_fmadd_ps(_mm512_set1_ps(qrow[u][d]), k, a[u]);
    }
    for (int u = 0; u < NU; u++) _mm512_storeu_ps(scores[idx[u]], a[u]);
}

/* rows[j] (16 floats each) becomes column j: rows[c][j] = the old rows[j][c]. Shuffles only. */
static inline void transpose16x16(__m512 rows[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c], 128-bit lane k: column 4k + c of rows 4i .. 4i + 3 */
        u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        rows[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
        rows[4 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
        rows[8 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        rows[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
}
#endif

#define MAX_HEAD_DIM 576 /* MLA: a latent of 512 and a rotated part of 64 (engine/models/deepseek.py) */
#define MAX_BLOCK_SIZE 128
#define MAX_QUERIES 144 /* queries (token x head) of one work item */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp8 -> float32 for every byte of both formats (codes 2 and 3), built when the library loads: a load is then
 * one table lookup per element. */
static float fp8_table[2][256];

static float fp8_decode(uint8_t b, int code) {
    const int mbits = code == 2 ? 3 : 2, bias = code == 2 ? 7 : 15, emax = code == 2 ? 15 : 31;
    const int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1);
    float v;
    if (code == 2 && e == emax && m == (1 << mbits) - 1) v = NAN; /* e4m3fn: no infinities, one NaN */
    else if (code == 3 && e == emax) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexpf((float)m, 1 - bias - mbits); /* subnormal */
    else v = ldexpf((float)((1 << mbits) + m), e - bias - mbits);
    return (b & 0x80) ? -v : v;
}

__attribute__((constructor)) static void fp8_build_tables(void) {
    for (int b = 0; b < 256; b++) {
        fp8_table[0][b] = fp8_decode((uint8_t)b, 2);
        fp8_table[1][b] = fp8_decode((uint8_t)b, 3);
    }
}

/* float32 -> fp8 (code 2 or 3), round to nearest even, saturating: |f| at or past the largest finite value
 * (448, 57344) becomes it. Equals torch's f.clamp(-max, max).to(float8_*) on every finite float. */
static inline uint8_t f32_to_fp8(float f, int code) {
    const int mbits = code == 2 ? 3 : 2, bias = code == 2 ? 7 : 15;
    const float max_finite = code == 2 ? 448.0f : 57344.0f;
    const uint8_t max_code = code == 2 ? 0x7e : 0x7b;
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    if (f != f) return (uint8_t)(sign | 0x7f); /* NaN stays NaN (0x7f is NaN in both formats) */
    const float a = fabsf(f);
    if (a >= max_finite) return (uint8_t)(sign | max_code);
    int e = (int)((u >> 23) & 0xff) - 127; /* a < max_finite: a normal float32 or zero / a float32 subnormal */
    if (e < 1 - bias) { /* fp8 subnormal: multiples of 2^(1 - bias - mbits), the count rounded to even */
        return (uint8_t)(sign | (uint8_t)rintf(ldexpf(a, bias - 1 + mbits)));
    }
    int n = (int)rintf(ldexpf(a, mbits - e)); /* in [2^mbits, 2^(mbits + 1)] */
    if (n == 2 << mbits) {
        n = 1 << mbits;
        e++;
    }
    return (uint8_t)(sign | ((e + bias) << mbits) | (n - (1 << mbits)));
}

static inline void load_row(const void *src, int dtype, int64_t offset, float *dst, int n) {
    if (dtype == 1) {
        const uint16_t *s = (const uint16_t *)src + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else if (dtype >= 2) {
        const uint8_t *s = (const uint8_t *)src + offset;
        const float *table = fp8_table[dtype - 2];
        for (int i = 0; i < n; i++) dst[i] = table[s[i]];
    } else {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *dst, int dtype, int64_t offset, const float *src, int n) {
    if (dtype == 1) {
        uint16_t *d = (uint16_t *)dst + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else if (dtype >= 2) {
        uint8_t *d = (uint8_t *)dst + offset;
        for (int i = 0; i < n; i++) d[i] = f32_to_fp8(src[i], dtype);
    } else {
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
    }
}

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into an integer power
 * and a degree-6 polynomial on [-0.5, 0.5]; relative error ~2e-7, vectorisable, no libm call. */
static inline float exp_nonpos(float x) {
    /* Branch-free (a select, not a return) so loops calling it auto-vectorise on every ISA; the
     * clamp keeps the exponent bits valid on the lanes that then select 0. Rounding by adding and
     * subtracting 1.5 * 2^23 is nearbyintf in the default mode for |t| < 2^22 (here t >= -126). */
    const int under = x < -87.0f;
    const float xc = under ? -87.0f : x;
    const float t = xc * 1.4426950408889634f;
    const float n = (t + 12582912.0f) - 12582912.0f;
    const float f = (t - n) * 0.6931471805599453f; /* f in [-ln2/2, ln2/2] */
    const float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.16666667f + f * (0.041666668f + f * (0.008333334f + f * 0.0013888889f)))));
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    const float r = p * scale; /* computed on every lane: a select of two values, not a branch */
    return under ? 0.0f : r;
}

/* ---- paged attention ------------------------------------------------------------------------
 * Causal attention of each request's new query tokens over its paged context (K/V of the new
 * tokens already written). Query i of request r (q_len new tokens, context seq_len) sits at
 * position p = seq_len - q_len + i and sees keys 0 ..= p, or with a sliding window (window > 0)
 * keys p - window + 1 ..= p (Mistral's, Gemma's local layers), or with chunked attention (chunk > 0, Llama 4's
 * local layers) keys from p's chunk's start (p / chunk * chunk) on. Blocks wholly before a query's window
 * are skipped for it and the rest walked in the same order, so its bits stay those of its own window
 * in any item (batch invariance). With softcap > 0 (Gemma 2) each scaled score s becomes
 * softcap * tanh(s / softcap) before the softmax; with sinks (gpt-oss) each head's sink logit joins the
 * softmax in the epilogue (store_item_output); the avx512_bf16 path leaves both to the generic one. One work item is (request, chunk
 * of query tokens) with every head: a cache row holds all kv heads of a token, so an item reads
 * whole rows (sequential memory) and widens each K/V block once for all its queries. Online softmax
 * (flash style) block by block.
 */
typedef struct {
    int32_t req, q_begin, q_end;
} AttnItem;

/* The first key position a query at ``pos`` sees: 0, or with a sliding window its window's start, or with
 * chunked attention (chunk > 0: Llama 4's local layers) its chunk's start, whichever is later. */
static inline int window_start(int pos, int window, int chunk) {
    int start = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    if (chunk > 0 && pos / chunk * chunk > start) start = pos / chunk * chunk;
    return start;
}

/* The epilogue of an item: divides each query row's accumulator (row qi = t * num_q_heads + h of
 * acc, head_dim floats each) by its softmax sum l[qi] and stores it as that query's output row.
 * With attention sinks (gpt-oss; NULL: none) head h's sink logit sinks[h] joins the softmax here,
 * once, as one more key with a zero value: the sum becomes l * exp(m - m') + exp(sink - m') under
 * the larger max m' = max(m, sink), and the accumulator (kept under m) is rescaled by exp(m - m'). */
static inline void store_item_output(const AttnItem item, const int head_dim, int dtype,
                                     const int32_t *query_start_loc, int num_q_heads, float *acc, const float *m,
                                     const float *l, const float *sinks, void *out, int64_t out_tok_stride,
                                     int64_t out_head_stride) {
    const int nq_tok = item.q_end - item.q_begin;
    for (int t = 0; t < nq_tok; t++) {
        const int64_t tok = query_start_loc[item.req] + item.q_begin + t;
        for (int h = 0; h < num_q_heads; h++) {
            const int qi = t * num_q_heads + h;
            float *row = acc + (int64_t)qi * head_dim;
            float inv = 1.0f / l[qi];
            if (sinks) {
                const float top = m[qi] > sinks[h] ? m[qi] : sinks[h];
                const float rescale = exp_nonpos(m[qi] - top);
                inv = rescale / (l[qi] * rescale + exp_nonpos(sinks[h] - top));
            }
            for (int d = 0; d < head_dim; d++) row[d] *= inv;
            store_row(out, dtype, tok * out_tok_stride + h * out_head_stride, row, head_dim);
        }
    }
}

static inline void attend_item(const AttnItem item, const int head_dim, int dtype, int kv_dtype, const void *query,
                               int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache,
                               const void *v_cache, int64_t cache_blk_stride, int64_t cache_tok_stride,
                               int64_t cache_head_stride, const int32_t *block_tables, int64_t bt_stride,
                               const int32_t *seq_lens, const int32_t *query_start_loc, int num_q_heads,
                               int num_kv_heads, const int block_size, float scale, int window, int chunk,
                               float softcap,
                               const float *sinks, void *out, int out_dtype,
                               int64_t out_tok_stride, int64_t out_head_stride) {
    const int group = num_q_heads / num_kv_heads;
    const int r = item.req;
    const int q_len = query_start_loc[r + 1] - query_start_loc[r];
    const int first_pos = seq_lens[r] - q_len; /* position of query 0 */
    const int nq_tok = item.q_end - item.q_begin;
    const int nq = nq_tok * num_q_heads; /* query (token t, head h) is row t * num_q_heads + h */
    float qf[nq][head_dim], acc[nq][head_dim];
    float m[nq], l[nq];
    float kf[num_kv_heads][block_size][head_dim];
    float vf[num_kv_heads][block_size][head_dim];
    /* Scores always come from K transposed ([head][d][key]), one fma chain over d per (query, key):
     * a query's score is then the same in a prefill chunk, a verification row and a decode step
     * (batch invariance, issue 24). Choosing the per-key dot product for short items, as this did,
     * summed over d in another order (omp simd lanes) and changed the bits with the chunk. */
    const int transposed = 1;
    float kt[num_kv_heads][head_dim][block_size];
    float scores[nq][block_size];
    float zero_q[head_dim];
    for (int d = 0; d < head_dim; d++) zero_q[d] = 0.0f;
    float s[block_size];
    for (int t = 0; t < nq_tok; t++) {
        const int64_t tok = query_start_loc[r] + item.q_begin + t;
        for (int h = 0; h < num_q_heads; h++) {
            const int qi = t * num_q_heads + h;
            load_row(query, dtype, tok * q_tok_stride + h * q_head_stride, qf[qi], head_dim);
            for (int d = 0; d < head_dim; d++) {
                qf[qi][d] *= scale;
                acc[qi][d] = 0.0f;
            }
            m[qi] = -FLT_MAX;
            l[qi] = 0.0f;
        }
    }
    const int last_pos = first_pos + item.q_end - 1;
    const int num_blocks = last_pos / block_size + 1;
    const int32_t *table = block_tables + (int64_t)r * bt_stride;
    /* The first key any query of the item sees: blocks before it hold nothing for the item. */
    const int first_key = window_start(first_pos + item.q_begin, window, chunk);
    for (int b = first_key / block_size; b < num_blocks; b++) {
        const int64_t base = (int64_t)table[b] * cache_blk_stride;
        const int block_start = b * block_size;
        int n_valid = last_pos + 1 - block_start;
        if (n_valid > block_size) n_valid = block_size;
#ifdef __AVX512F__
        /* float32, 16-key blocks: K goes from the cache straight into kt, 16 x 16 at a time (the same values
         * as the widened copy and the scalar transpose below: data movement only). */
        const int direct_kt = transposed && kv_dtype == 0 && block_size == 16 && head_dim % 16 == 0;
#else
        const int direct_kt = 0;
#endif
        for (int j = 0; j < n_valid; j++)
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t off = base + j * cache_tok_stride + h * cache_head_stride;
                if (!direct_kt) load_row(k_cache, kv_dtype, off, kf[h][j], head_dim);
                load_row(v_cache, kv_dtype, off, vf[h][j], head_dim);
            }
#ifdef __AVX512F__
        if (direct_kt)
            for (int h = 0; h < num_kv_heads; h++)
                for (int d0 = 0; d0 < head_dim; d0 += 16) {
                    __m512 rows[16];
                    for (int j = 0; j < 16; j++)
                        rows[j] = j < n_valid ? _mm512_loadu_ps((const float *)k_cache + base + j * cache_tok_stride +
                                                                h * cache_head_stride + d0)
                                              : _mm512_setzero_ps();
                    transpose16x16(rows);
                    for (int c = 0; c < 16; c++) _mm512_storeu_ps(kt[h][d0 + c], rows[c]);
                }
#endif
        if (transposed && !direct_kt) {
            /* K as [head][d][key]: a query's scores for the whole block are FMAs over d without
             * reductions; 8 queries at a time keep 8 independent accumulator chains in flight. */
            for (int h = 0; h < num_kv_heads; h++)
                for (int j = 0; j < block_size; j++)
                    for (int d = 0; d < head_dim; d++) kt[h][d][j] = j < n_valid ? kf[h][j][d] : 0.0f;
        }
        if (transposed) {
            for (int h = 0; h < num_kv_heads; h++) {
                int idx[MAX_QUERIES + 8], cnt = 0;
                for (int t = 0; t < nq_tok; t++)
                    if (first_pos + item.q_begin + t >= block_start)
                        for (int g = 0; g < group; g++) idx[cnt++] = t * num_q_heads + h * group + g;
                for (int c = 0; c < cnt; c += 8) {
                    const float *qrow[8];
                    for (int u = 0; u < 8; u++) qrow[u] = c + u < cnt ? qf[idx[c + u]] : zero_q;
#ifdef __AVX512F__
                    if (block_size == 16) {
                        /* The same fma chain per (query, key), its accumulators held in registers (the generic
                         * loop below keeps them in memory: a store per fma); as many as there are queries. */
                        switch (cnt - c < 8 ? cnt - c : 8) {
#define PD_SCORES(NU) case NU: score_tile16(qrow, &kt[h][0][0], head_dim, (float(*)[16])scores, idx + c, NU); break;
                            PD_SCORES(1) PD_SCORES(2) PD_SCORES(3) PD_SCORES(4)
                            PD_SCORES(5) PD_SCORES(6) PD_SCORES(7) PD_SCORES(8)
#undef PD_SCORES
                        }
                        continue;
                    }
#endif
                    float acc8[8][block_size];
                    for (int u = 0; u < 8; u++)
                        for (int j = 0; j < block_size; j++) acc8[u][j] = 0.0f;
                    if (cnt - c >= 8) {
                        for (int d = 0; d < head_dim; d++) {
                            const float *k = kt[h][d];
                            for (int u = 0; u < 8; u++) {
                                const float qd = qrow[u][d];
#pragma omp simd
                                for (int j = 0; j < block_size; j++) acc8[u][j] = fmaf(qd, k[j], acc8[u][j]);
                            }
                        }
                    } else { /* the same chain per (query, key), only for the queries there are */
                        const int nu = cnt - c;
                        for (int d = 0; d < head_dim; d++) {
                            const float *k = kt[h][d];
                            for (int u = 0; u < nu; u++) {
                                const float qd = qrow[u][d];
#pragma omp simd
                                for (int j = 0; j < block_size; j++) acc8[u][j] = fmaf(qd, k[j], acc8[u][j]);
                            }
                        }
                    }
                    for (int u = 0; u < 8 && c + u < cnt; u++)
                        for (int j = 0; j < block_size; j++) scores[idx[c + u]][j] = acc8[u][j];
                }
            }
        }
        for (int t = 0; t < nq_tok; t++) {
            const int pos = first_pos + item.q_begin + t;
            int nk = pos + 1 - block_start; /* keys of this block it sees: j0 ..< nk */
            if (nk <= 0) continue;
            if (nk > n_valid) nk = n_valid;
            const int j0 = window_start(pos, window, chunk) > block_start ? window_start(pos, window, chunk) - block_start
                                                                          : 0;
            if (j0 >= nk) continue; /* the block ends before this query's window */
            for (int h = 0; h < num_q_heads; h++) {
                const int qi = t * num_q_heads + h;
                const int kvh = h / group;
                const float *q = qf[qi];
                float block_max = -FLT_MAX;
                if (transposed && softcap > 0.0f) { /* apart: the common uncapped loop stays as it was */
                    for (int j = j0; j < nk; j++) {
                        s[j] = softcap * tanhf(scores[qi][j] / softcap);
                        block_max = s[j] > block_max ? s[j] : block_max;
                    }
                } else if (transposed) {
                    for (int j = j0; j < nk; j++) {
                        s[j] = scores[qi][j];
                        block_max = s[j] > block_max ? s[j] : block_max;
                    }
                } else {
                    for (int j = j0; j < nk; j++) {
                        const float *k = kf[kvh][j];
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < head_dim; d++) dot += q[d] * k[d];
                        s[j] = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;
                        block_max = s[j] > block_max ? s[j] : block_max;
                    }
                }
                const float m_new = block_max > m[qi] ? block_max : m[qi];
                const float alpha = exp_nonpos(m[qi] - m_new);
                float sum;
                if (transposed && (block_size & (block_size - 1)) == 0) {
                    /* All the block's lanes at once (the keys this query does not see: 0), summed as a fixed
                     * pairwise tree: vector work, where a sum in key order is a chain of dependent scalar adds
                     * (the scores' lanes were already computed for every key, transposed). */
                    float e[block_size];
#pragma omp simd
                    for (int j = 0; j < block_size; j++) {
                        const float x = exp_nonpos(s[j < j0 || j >= nk ? j0 : j] - m_new);
                        e[j] = j < j0 || j >= nk ? 0.0f : x;
                    }
#pragma omp simd
                    for (int j = 0; j < block_size; j++) s[j] = e[j];
                    for (int w = block_size / 2; w > 0; w /= 2)
#pragma omp simd
                        for (int j = 0; j < w; j++) e[j] += e[j + w];
                    sum = e[0];
                } else {
                    sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int j = j0; j < nk; j++) {
                        s[j] = exp_nonpos(s[j] - m_new);
                        sum += s[j];
                    }
                }
                l[qi] = l[qi] * alpha + sum;
                m[qi] = m_new;
                float *a = acc[qi];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) a[d] *= alpha;
                for (int j = j0; j < nk; j++) {
                    const float p = s[j];
                    const float *v = vf[kvh][j];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
                }
            }
        }
    }
    store_item_output(item, head_dim, out_dtype, query_start_loc, num_q_heads, (float *)acc, m, l, sinks, out,
                      out_tok_stride,
                      out_head_stride);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PD_HAVE_BF16_FAST_PATH 1

/* exp(x) for x <= 0, 16 lanes: the same range reduction and polynomial as exp_nonpos. */
static inline __m512 exp512_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
    __m512 p = _mm512_set1_ps(0.0013888889f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.008333334f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.041666668f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.16666667f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* Lane j of the result = sum of the 16 lanes of v[j]: 16 dot products finished with 45 shuffles and
 * adds instead of 16 separate horizontal reductions. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 32 fp8 values (code 2: e4m3fn, 3: e5m2) as the 32 bfloat16 values they are, exactly: a normal's exponent and
 * mantissa move up into bf16's fields, rebiased (e4m3: << 4, + 120 << 7; e5m2: << 5, + 112 << 7); the few
 * subnormals (exponent field 0) come from a table. NaN and inf are never stored (writes saturate). */
static inline void fp8x32_to_bf16(const uint8_t *src, uint16_t *dst, int code) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    const __m512i em = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
    __m512i normal, sub;
    __mmask32 is_sub;
    if (code == 2) {
        normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(0x3C00));
        /* m * 2^-9 for m = 0..7 */
        sub = _mm512_permutexvar_epi16(em, _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                            0, 0, 0, 0, 0, 0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0,
                                                            0x3B80, 0x3B00, 0));
        is_sub = _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8));
    } else {
        normal = _mm512_add_epi16(_mm512_slli_epi16(em, 5), _mm512_set1_epi16(0x3800));
        /* m * 2^-16 for m = 0..3 */
        sub = _mm512_permutexvar_epi16(em, _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0x3840, 0x3800, 0x3780, 0));
        is_sub = _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(4));
    }
    _mm512_storeu_si512(dst, _mm512_or_si512(_mm512_mask_blend_epi16(is_sub, normal, sub), sign));
}

/* A block's first n_valid rows of K and V (every kv head: row_elems values) widened from fp8 to bf16 into kst and
 * vst (row_elems apart), so the rest of a kernel reads them as a bf16 cache's. */
static inline void widen_fp8_block(const uint8_t *k8, const uint8_t *v8, int64_t tok_stride, int n_valid,
                                   int row_elems, uint16_t *kst, uint16_t *vst, int code) {
    for (int j = 0; j < n_valid; j++)
        for (int e = 0; e < row_elems; e += 32) {
            fp8x32_to_bf16(k8 + j * tok_stride + e, kst + (int64_t)j * row_elems + e, code);
            fp8x32_to_bf16(v8 + j * tok_stride + e, vst + (int64_t)j * row_elems + e, code);
        }
}

/* The rows of the block at element offset ``base`` as bf16, returned in *kb and *vb with their stride: the cache's
 * own (a bf16 cache), or their first n_valid rows widened into kst and vst (an fp8 cache, kv_dtype >= 2). */
static inline int64_t block_rows_bf16(const void *k_cache, const void *v_cache, int64_t base,
                                      int64_t cache_tok_stride, int n_valid, int row_elems, int kv_dtype,
                                      uint16_t *kst, uint16_t *vst, const uint16_t **kb, const uint16_t **vb) {
    if (kv_dtype < 2) {
        *kb = (const uint16_t *)k_cache + base;
        *vb = (const uint16_t *)v_cache + base;
        return cache_tok_stride;
    }
    widen_fp8_block((const uint8_t *)k_cache + base, (const uint8_t *)v_cache + base, cache_tok_stride, n_valid,
                    row_elems, kst, vst, kv_dtype);
    *kb = kst;
    *vb = vst;
    return row_elems;
}

/* Row j of both planes of the block at element offset ``next``, asked for a 64-byte line at a time (LOCALITY:
 * __builtin_prefetch's, a constant). */
#define PD_PREFETCH_BLOCK_ROW(fp8, k_cache, v_cache, next, j, cache_tok_stride, row_elems, LOCALITY)               \
    do {                                                                                                       \
        if (fp8)                                                                                               \
            for (int e_ = 0; e_ < (row_elems); e_ += 64) { /* 64 fp8 = one line */                             \
                __builtin_prefetch((const uint8_t *)(k_cache) + (next) + (j) * (cache_tok_stride) + e_, 0, LOCALITY); \
                __builtin_prefetch((const uint8_t *)(v_cache) + (next) + (j) * (cache_tok_stride) + e_, 0, LOCALITY); \
            }                                                                                                  \
        else                                                                                                   \
            for (int e_ = 0; e_ < (row_elems); e_ += 32) { /* 32 bf16 = one line */                            \
                __builtin_prefetch((const uint16_t *)(k_cache) + (next) + (j) * (cache_tok_stride) + e_, 0, LOCALITY); \
                __builtin_prefetch((const uint16_t *)(v_cache) + (next) + (j) * (cache_tok_stride) + e_, 0, LOCALITY); \
            }                                                                                                  \
    } while (0)

/* V rows j - 1 and j (j odd) of every kv head as bf16 pairs of consecutive keys: lane d of pair j / 2 holds
 * (v[j-1][d], v[j][d]), so one dpbf16 (or tdpbf16ps, whose B layout this is) adds two keys' weighted rows. Row j
 * past the block's end (n_valid) is zero: unused slots may hold anything, NaN included. vp: [kv head][head_pairs][HD]
 * (head_pairs: 8, a block's pairs, or more where several blocks' pairs sit one after another). */
static inline void v_pairs(const uint16_t *vb, int64_t tok_stride, int j, int n_valid, int num_kv_heads,
                           int64_t head_stride, int HD, int head_pairs, uint32_t *vp) {
    for (int h = 0; h < num_kv_heads; h++) {
        const uint16_t *v0 = vb + (j - 1) * tok_stride + h * head_stride;
        const uint16_t *v1 = v0 + tok_stride;
        uint32_t *dst = vp + ((int64_t)h * head_pairs + j / 2) * HD;
        for (int c = 0; c < HD; c += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + c)));
            const __m512i hi = j < n_valid ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + c)))
                                           : _mm512_setzero_si512();
            _mm512_store_si512(dst + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* The bf16 / block size 16 / head_dim multiple of 32 path of attend_item: scores with the
 * avx512_bf16 dot-product instruction straight from the cache (no widening of K), 16 keys per
 * reduce16, softmax on whole vectors, V widened once per block and shared by every query. Unpermuted
 * lanes of reduce16 are in key order: lane j of v[j]'s sum is key j. The online softmax is updated once
 * per key group of two blocks (32 keys; groups start at even block indices, fixed by position, so a query
 * sees the same groups in every call): one max, one exp for the rescale and one rescale of the accumulator
 * per 32 keys, where the horizontal max and sum and the scalar exp were most of a prefill's time. */
static inline void attend_item_bf16(const AttnItem item, const int HD, int kv_dtype, const uint16_t *query,
                                    int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache_raw,
                                    const void *v_cache_raw,
                                    int64_t cache_blk_stride, int64_t cache_tok_stride, int64_t cache_head_stride,
                                    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                    const int32_t *query_start_loc, int num_q_heads, int num_kv_heads, float scale,
                                    int window, int chunk, void *out, int out_dtype, int64_t out_tok_stride,
                                    int64_t out_head_stride) {
    enum { BS = 16, GB = 2 /* blocks a softmax update */, GP = GB * BS / 2 /* V pairs a group */ };
    const int group = num_q_heads / num_kv_heads;
    const int r = item.req;
    const int q_len = query_start_loc[r + 1] - query_start_loc[r];
    const int first_pos = seq_lens[r] - q_len;
    const int nq_tok = item.q_end - item.q_begin;
    const int nq = nq_tok * num_q_heads;
    const int nc = HD / 16; /* 16-float chunks of a head */
    float acc[nq][HD] __attribute__((aligned(64)));
    float m[nq], l[nq];
    uint32_t vp[num_kv_heads][GP][HD] __attribute__((aligned(64)));
    uint16_t kc[GB][BS][num_kv_heads * HD + 32] __attribute__((aligned(64)));
    /* Several query tokens share each block (prefill): re-laying K once per block pays for itself. */
    const int pair_scores = nq_tok >= 4;
    uint32_t kp[GB][pair_scores ? num_kv_heads : 1][HD / 2][BS] __attribute__((aligned(64)));
    /* An fp8 cache: each block's rows widened to bf16 here first (fp8x32_to_bf16), the rest reads them as a bf16
     * cache's; rows are then row_elems apart. */
    const int fp8 = kv_dtype >= 2;
    const int row_elems_all = num_kv_heads * HD;
    uint16_t kst[GB][fp8 ? BS : 1][fp8 ? row_elems_all : 1] __attribute__((aligned(64)));
    uint16_t vst[GB][fp8 ? BS : 1][fp8 ? row_elems_all : 1] __attribute__((aligned(64)));
    for (int qi = 0; qi < nq; qi++) {
        for (int d = 0; d < HD; d++) acc[qi][d] = 0.0f;
        m[qi] = -FLT_MAX;
        l[qi] = 0.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    const int last_pos = first_pos + item.q_end - 1;
    const int num_blocks = last_pos / BS + 1;
    const int32_t *table = block_tables + (int64_t)r * bt_stride;
    /* Blocks before this one hold no key any query of the item sees (window starts grow with the position); the
     * first group may begin one block earlier, which then takes no part. */
    const int first_block = window_start(first_pos + item.q_begin, window, chunk) / BS;
    for (int b = first_block - first_block % GB; b < num_blocks; b += GB) {
        int present[GB], n_valid[GB];
        for (int i = 0; i < GB; i++) {
            const int bi = b + i;
            present[i] = bi >= first_block && bi < num_blocks;
            n_valid[i] = last_pos + 1 - bi * BS < BS ? last_pos + 1 - bi * BS : BS;
            if (!present[i]) continue;
            const int64_t base = (int64_t)table[bi] * cache_blk_stride;
            /* Decode is bound by fetching blocks from memory: while this block's rows are laid out,
             * ask for the same row of the next block's K and V (each row: every kv head), so the next
             * block streams in while this one is computed. Spread out, not one burst: a burst of
             * prefetches fills the miss buffers and stalls the core. This block's K rows are copied to
             * L1 in memory order first (kc): reading them straight from the cache in the per-query
             * loops, head by head, defeated the hardware prefetcher (cold cache: 1.05 -> 0.79 ms a
             * layer at batch 32 x 264 tokens). */
            /* Only a jump needs it: the hardware prefetcher already follows physically adjacent blocks
             * (measured: prefetching those too is slower). */
            const int64_t next = bi + 1 < num_blocks && table[bi + 1] != table[bi] + 1
                                     ? (int64_t)table[bi + 1] * cache_blk_stride : -1;
            const int row_elems = num_kv_heads * (int)cache_head_stride;
            const uint16_t *kb, *vb;
            const int64_t tok_stride = block_rows_bf16(k_cache_raw, v_cache_raw, base, cache_tok_stride, n_valid[i],
                                                       row_elems, kv_dtype, &kst[i][0][0], &vst[i][0][0], &kb, &vb);
            for (int j = 0; j < BS; j++) {
                if (next >= 0)
                    PD_PREFETCH_BLOCK_ROW(fp8, k_cache_raw, v_cache_raw, next, j, cache_tok_stride, row_elems, 3);
                if (!pair_scores && j < n_valid[i]) /* this block's K rows, swept in memory order into L1 */
                    for (int e = 0; e < row_elems; e += 32)
                        _mm512_store_si512(&kc[i][j][e], _mm512_loadu_si512(kb + j * tok_stride + e));
                /* V pairs (a pair wholly past the block's end is never read here) */
                if ((j & 1) && j - 1 < n_valid[i])
                    v_pairs(vb, tok_stride, j, n_valid[i], num_kv_heads, cache_head_stride, HD, GP,
                            &vp[0][i * BS / 2][0]);
            }
            if (pair_scores) /* K as [head][dim pair][key]: bf16 pairs, so one dpbf16 covers 16 keys */
                for (int h = 0; h < num_kv_heads; h++)
                    for (int j = 0; j < BS; j++) {
                        const uint32_t *k = (const uint32_t *)(kb + j * tok_stride + h * cache_head_stride);
                        for (int d2 = 0; d2 < HD / 2; d2++) kp[i][h][d2][j] = j < n_valid[i] ? k[d2] : 0u;
                    }
        }
        for (int t = 0; t < nq_tok; t++) {
            const int pos = first_pos + item.q_begin + t;
            const int ws = window_start(pos, window, chunk);
            /* Per block of the group: the keys this query sees (nk: up to, j0: from), as a lane mask. */
            __mmask16 valid[GB];
            int nk[GB];
            for (int i = 0; i < GB; i++) {
                const int block_start = (b + i) * BS;
                nk[i] = pos + 1 - block_start < n_valid[i] ? pos + 1 - block_start : n_valid[i];
                const int j0 = ws > block_start ? ws - block_start : 0;
                valid[i] = present[i] && nk[i] > j0 ? (__mmask16)(((1u << nk[i]) - 1u) & ~((1u << j0) - 1u)) : 0;
            }
            if (!(valid[0] | valid[1])) continue; /* the group is past this query or before its window */
            const int64_t tok = query_start_loc[r] + item.q_begin + t;
            for (int h = 0; h < num_q_heads; h++) {
                const int qi = t * num_q_heads + h;
                const int kvh = h / group;
                const uint16_t *q = query + tok * q_tok_stride + h * q_head_stride;
                __m512 sc[GB];
                float group_max = -FLT_MAX;
                for (int i = 0; i < GB; i++) {
                    if (!valid[i]) continue;
                    __m512 raw;
                    if (pair_scores) {
                        /* Lane j accumulates q . k_j directly, in exactly the order of the other branch
                         * (batch invariance, issue 24: a query's score must not depend on whether its item
                         * has 1 or 4+ tokens): chain l (l = 0..15) takes dim pairs 16c + l for c = 0, 1, ...
                         * (lane l of the other branch's dpbf16 over 32-element chunks), and the 16 chains
                         * are added in reduce16's tree: ((Q0 + Q1) + (Q2 + Q3)), Qk = (a[4k] + a[4k+2]) +
                         * (a[4k+1] + a[4k+3]). */
                        const uint32_t *q32 = (const uint32_t *)q;
                        __m512 a[16];
                        for (int l2 = 0; l2 < 16; l2++) a[l2] = _mm512_setzero_ps();
                        for (int d2 = 0; d2 < HD / 2; d2 += 16) /* HD % 32 == 0, so HD / 2 % 16 == 0 */
                            for (int l2 = 0; l2 < 16; l2++)
                                a[l2] = _mm512_dpbf16_ps(a[l2], (__m512bh)_mm512_set1_epi32((int)q32[d2 + l2]),
                                                         (__m512bh)_mm512_load_si512(kp[i][kvh][d2 + l2]));
                        __m512 qk[4];
                        for (int k4 = 0; k4 < 4; k4++)
                            qk[k4] = _mm512_add_ps(_mm512_add_ps(a[4 * k4], a[4 * k4 + 2]),
                                                   _mm512_add_ps(a[4 * k4 + 1], a[4 * k4 + 3]));
                        raw = _mm512_add_ps(_mm512_add_ps(qk[0], qk[1]), _mm512_add_ps(qk[2], qk[3]));
                    } else {
                        __m512 dots[BS];
                        for (int j = 0; j < BS; j++) {
                            dots[j] = _mm512_setzero_ps();
                            if (j < nk[i]) {
                                const uint16_t *k = &kc[i][j][kvh * cache_head_stride];
                                for (int c = 0; c < HD; c += 32)
                                    dots[j] = _mm512_dpbf16_ps(dots[j], (__m512bh)_mm512_loadu_si512(q + c),
                                                               (__m512bh)_mm512_loadu_si512(k + c));
                            }
                        }
                        raw = reduce16(dots);
                    }
                    sc[i] = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), valid[i], _mm512_mul_ps(raw, vscale));
                    const float block_max = _mm512_mask_reduce_max_ps(valid[i], sc[i]); /* exact in any order */
                    group_max = block_max > group_max ? block_max : group_max;
                }
                const float m_new = group_max > m[qi] ? group_max : m[qi];
                const float alpha = exp_nonpos(m[qi] - m_new);
                /* P in bf16 for the PV product (as flash attention does on GPUs); the normaliser sums
                 * the same rounded weights, so the output stays a convex combination of V rows. A group's
                 * sum: its first block's, then its second's added (a block this query does not see adds
                 * nothing, in every call alike). */
                uint32_t pairs[GB][BS / 2] __attribute__((aligned(32)));
                float sum = 0.0f;
                for (int i = 0; i < GB; i++) {
                    if (!valid[i]) continue;
                    const __m512 p = _mm512_maskz_mov_ps(valid[i],
                                                         exp512_nonpos(_mm512_sub_ps(sc[i], _mm512_set1_ps(m_new))));
                    const __m256bh p_bf16 = _mm512_cvtneps_pbh(p);
                    sum += _mm512_reduce_add_ps(
                        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)p_bf16), 16)));
                    _mm256_store_si256((__m256i *)pairs[i], (__m256i)p_bf16);
                }
                l[qi] = l[qi] * alpha + sum;
                m[qi] = m_new;
                const __m512 valpha = _mm512_set1_ps(alpha);
                __m512 a[HD / 16]; /* the query's output row in registers for the whole group */
                for (int c = 0; c < nc; c++) a[c] = _mm512_mul_ps(_mm512_load_ps(&acc[qi][16 * c]), valpha);
                for (int i = 0; i < GB; i++) {
                    if (!valid[i]) continue;
                    for (int j2 = 0; j2 < (nk[i] + 1) / 2; j2++) {
                        const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pairs[i][j2]);
                        for (int c = 0; c < nc; c++)
                            a[c] = _mm512_dpbf16_ps(a[c], pb,
                                                    (__m512bh)_mm512_load_si512(&vp[kvh][i * BS / 2 + j2][16 * c]));
                    }
                }
                for (int c = 0; c < nc; c++) _mm512_store_ps(&acc[qi][16 * c], a[c]);
            }
        }
    }
    store_item_output(item, HD, out_dtype, query_start_loc, num_q_heads, (float *)acc, m, l, NULL, out, out_tok_stride,
                      out_head_stride);
}

#include "attention_amx.h"
#endif

/* 1 where this process computes bf16 attention on AMX tiles (attention_amx.h), else 0. */
int pd_attention_amx(void) {
#ifdef PD_HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

int pd_paged_attention(int dtype, int kv_dtype, const void *query, int64_t q_tok_stride, int64_t q_head_stride,
                       const void *k_cache, const void *v_cache, int64_t cache_blk_stride,
                       int64_t cache_tok_stride, int64_t cache_head_stride, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                       int num_reqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                       float scale, int window, int chunk, float softcap, const float *sinks, void *out, int out_dtype,
                       int64_t out_tok_stride,
                       int64_t out_head_stride,
                       int num_threads) {
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads) return -2;
    /* Working set of one item lives on the thread's stack: keep it well under a worker's stack. */
    const int q_chunk = num_q_heads >= MAX_QUERIES ? 1 : MAX_QUERIES / num_q_heads;
    const int64_t stack_bytes = 4 * ((int64_t)2 * q_chunk * num_q_heads * head_dim +
                                     (int64_t)2 * num_kv_heads * block_size * head_dim);
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE || stack_bytes > (1 << 20)) return -1;
    int64_t num_items = 0;
    for (int r = 0; r < num_reqs; r++) {
        int q_len = query_start_loc[r + 1] - query_start_loc[r];
        num_items += (q_len + q_chunk - 1) / q_chunk;
    }
    if (num_items == 0) return 0;
    AttnItem *items = (AttnItem *)malloc((size_t)num_items * sizeof(AttnItem));
    if (!items) return -3;
    int64_t n = 0;
    for (int r = 0; r < num_reqs; r++) {
        int q_len = query_start_loc[r + 1] - query_start_loc[r];
        for (int c = 0; c < q_len; c += q_chunk) {
            items[n].req = r;
            items[n].q_begin = c;
            items[n].q_end = c + q_chunk < q_len ? c + q_chunk : q_len;
            n++;
        }
    }

    /* The vector path reads q and K rows as whole 32-element bf16 vectors. */
    /* An fp8 cache takes it too (its blocks widened to bf16 on the way in), where its staging fits the stack. */
    const int fast_kv = kv_dtype == 1 || (kv_dtype >= 2 && num_kv_heads * head_dim * 16 * 2 * 2 <= (256 << 10));
    /* attend_item_bf16's stack: accumulators, a key group's V pairs, K rows (copied and as pairs), fp8 staging.
     * Half of the 8 MiB a thread's stack usually is (a model with 32 kv heads of 128 and an fp8 cache: 1.4 MiB). */
    const int64_t row_elems = (int64_t)num_kv_heads * head_dim;
    const int64_t bf16_stack_bytes = (int64_t)q_chunk * num_q_heads * head_dim * 4 + row_elems * 16 * 4 +
                                     2 * 16 * (row_elems + 32) * 2 + 2 * row_elems / 2 * 16 * 4 +
                                     (kv_dtype >= 2 ? 2 * 2 * 16 * row_elems * 2 : 0);
    const int fast_bf16 = dtype == 1 && fast_kv && block_size == 16 && head_dim % 32 == 0 &&
                          cache_head_stride == head_dim && cache_tok_stride == (int64_t)num_kv_heads * head_dim &&
                          softcap <= 0.0f && sinks == NULL && bf16_stack_bytes <= (4 << 20) &&
                          getenv("PDCLUSTER_ATTN_GENERIC") == NULL;
    (void)fast_bf16;
    int amx = 0;
    (void)amx;
#ifdef PD_HAVE_AMX
    {
        const char *env = getenv("PDCLUSTER_ATTN_AMX");
        /* Decided by the model's shape and the process alone, never by this call's batch: the same query must
         * take the same path in every step (batch invariance). */
        amx = fast_bf16 && !(env && env[0] == '0') && amx_usable() &&
              attn_amx_stack_bytes(q_chunk, num_q_heads, num_kv_heads, head_dim) <= (1 << 20);
    }
#endif
#pragma omp parallel num_threads(num_threads)
    {
    int tile_rows = 0; /* the AMX tile configuration this thread holds (0: none) */
    (void)tile_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; it++) {
#define PD_ATTEND(HD, BS)                                                                                   \
    attend_item(items[it], HD, dtype, kv_dtype, query, q_tok_stride, q_head_stride, k_cache, v_cache,             \
                cache_blk_stride, cache_tok_stride, cache_head_stride, block_tables, bt_stride, seq_lens,            \
                query_start_loc,                                                                                  \
                num_q_heads, num_kv_heads, BS, scale, window, chunk, softcap, sinks, out, out_dtype,   \
                out_tok_stride, out_head_stride)
#ifdef PD_HAVE_BF16_FAST_PATH
#define PD_ATTEND_BF16(HD)                                                                                       \
    attend_item_bf16(items[it], HD, kv_dtype, (const uint16_t *)query, q_tok_stride, q_head_stride, k_cache, v_cache, \
                     cache_blk_stride, cache_tok_stride, cache_head_stride, block_tables, \
                     bt_stride, seq_lens, query_start_loc, num_q_heads, num_kv_heads, scale, window, chunk,          \
                     out, out_dtype, out_tok_stride, out_head_stride)
#ifdef PD_HAVE_AMX
#define PD_ATTEND_AMX(HD)                                                                                       \
    attend_item_amx(items[it], HD, kv_dtype, (const uint16_t *)query, q_tok_stride, q_head_stride, k_cache, v_cache, \
                    cache_blk_stride, cache_tok_stride, cache_head_stride, block_tables, bt_stride, seq_lens,      \
                    query_start_loc, num_q_heads, num_kv_heads, scale, window, chunk, out, out_dtype,           \
                    out_tok_stride, out_head_stride, &tile_rows)
        if (amx && head_dim == 64) PD_ATTEND_AMX(64);
        else if (amx && head_dim == 128) PD_ATTEND_AMX(128);
        else if (amx) PD_ATTEND_AMX(head_dim);
        else
#undef PD_ATTEND_AMX
#endif
        if (fast_bf16 && head_dim == 64) PD_ATTEND_BF16(64);
        else if (fast_bf16 && head_dim == 128) PD_ATTEND_BF16(128);
        else if (fast_bf16) PD_ATTEND_BF16(head_dim);
        else
#undef PD_ATTEND_BF16
#endif
        /* Constant head dims and block sizes get fully unrolled inner loops (the common sizes). */
        if (head_dim == 64 && block_size == 16) PD_ATTEND(64, 16);
        else if (head_dim == 128 && block_size == 16) PD_ATTEND(128, 16);
        else PD_ATTEND(head_dim, block_size);
#undef PD_ATTEND
    }
#ifdef PD_HAVE_AMX
    if (tile_rows) _tile_release();
#endif
    }
    free(items);
    return 0;
}

/* ---- fused residual add + RMSNorm ---------------------------------------------------------------
 * With a residual: residual = residual + x (rounded to the dtype, as an unfused add would be), then
 * out = weight * dtype(residual * rsqrt(mean(residual^2) + eps)) -- HF's LlamaRMSNorm op order.
 * Without (residual == NULL): out = norm(x). x and out may alias.
 */
#ifdef PD_HAVE_BF16_FAST_PATH
static inline __m512 bf16v_load(const uint16_t *p) { return bf16x16_to_f32(p); }
static inline void bf16v_store(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline __m512 bf16v_round(__m512 v) { /* through bf16 and back: what an unfused bf16 op stores */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* bf16 rows, hidden % 16 == 0: the same op order as the portable loop, 16 lanes at a time. */
static void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                          int64_t num_tokens, int hidden, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 8)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t off = t * hidden;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < hidden; i += 16) {
            __m512 v = bf16v_load(x + off + i);
            if (residual) {
                v = bf16v_round(_mm512_add_ps(v, bf16v_load(residual + off + i)));
                bf16v_store(residual + off + i, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / hidden + eps));
        const uint16_t *src = residual ? residual : x;
        for (int i = 0; i < hidden; i += 16) {
            const __m512 normed = bf16v_round(_mm512_mul_ps(bf16v_load(src + off + i), r));
            bf16v_store(out + off + i, _mm512_mul_ps(bf16v_load(weight + i), normed));
        }
    }
}

static void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t num_tokens, int d, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 4)
    for (int64_t t = 0; t < num_tokens; t++) {
        const uint16_t *gate = x + t * 2 * (int64_t)d, *up = gate + d;
        for (int i = 0; i < d; i += 16) {
            const __m512 g = bf16v_load(gate + i);
            /* silu(g) = g * sigmoid(g) with exp of -|g| only (no overflow) */
            const __m512 e = exp512_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            const __m512 one = _mm512_set1_ps(1.0f);
            const __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
            const __m512 num = _mm512_mask_blend_ps(pos, e, one);
            const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
            bf16v_store(out + t * (int64_t)d + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), bf16v_load(up + i)));
        }
    }
}
#endif

int pd_rms_norm(int dtype, const void *x, void *residual, const void *weight, void *out, int64_t num_tokens,
                int hidden, float eps, int num_threads) {
    if (hidden > 16384) return -1;
#ifdef PD_HAVE_BF16_FAST_PATH
    if (dtype == 1 && hidden % 16 == 0) {
        rms_norm_bf16((const uint16_t *)x, (uint16_t *)residual, (const uint16_t *)weight, (uint16_t *)out,
                      num_tokens, hidden, eps, num_threads);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 8)
    for (int64_t t = 0; t < num_tokens; t++) {
        float row[16384];
        float w[16384];
        const int64_t off = t * hidden;
        load_row(x, dtype, off, row, hidden);
        if (residual) {
            float res[16384];
            load_row(residual, dtype, off, res, hidden);
            for (int i = 0; i < hidden; i++) row[i] += res[i];
            store_row(residual, dtype, off, row, hidden);
            if (dtype == 1) load_row(residual, dtype, off, row, hidden); /* the rounded sum, as HF sees it */
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < hidden; i++) ss += row[i] * row[i];
        const float r = 1.0f / sqrtf(ss / hidden + eps);
        load_row(weight, dtype, 0, w, hidden);
        if (dtype == 1) {
            uint16_t *o = (uint16_t *)out + off;
#pragma omp simd
            for (int i = 0; i < hidden; i++) o[i] = f32_to_bf16(w[i] * bf16_to_f32(f32_to_bf16(row[i] * r)));
        } else {
            float *o = (float *)out + off;
#pragma omp simd
            for (int i = 0; i < hidden; i++) o[i] = w[i] * (row[i] * r);
        }
    }
    return 0;
}

/* ---- rotary embedding (HF rotate_half convention), in place -------------------------------------
 * x: [num_tokens, num_heads, head_dim] with the given strides; cos_sin: float32 [max_pos, head_dim]
 * holding cos in the first half and sin in the second (one frequency per pair). */
int pd_rotary(int dtype, void *x, int64_t tok_stride, int64_t head_stride, int64_t num_tokens, int num_heads,
              int head_dim, const int64_t *positions, const float *cos_sin, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 2) return -1;
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 16)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cs = cos_sin + positions[t] * head_dim;
        float row[MAX_HEAD_DIM], outr[MAX_HEAD_DIM];
        for (int h = 0; h < num_heads; h++) {
            const int64_t off = t * tok_stride + h * head_stride;
            load_row(x, dtype, off, row, head_dim);
            for (int i = 0; i < half; i++) {
                const float c = cs[i], s = cs[half + i];
                outr[i] = row[i] * c - row[half + i] * s;
                outr[half + i] = row[half + i] * c + row[i] * s;
            }
            store_row(x, dtype, off, outr, head_dim);
        }
    }
    return 0;
}

/* ---- SiLU and mul: out = silu(x[:, :d]) * x[:, d:] ---------------------------------------------- */
int pd_silu_and_mul(int dtype, const void *x, void *out, int64_t num_tokens, int d, int num_threads) {
    if (d > 65536) return -1;
#ifdef PD_HAVE_BF16_FAST_PATH
    if (dtype == 1 && d % 16 == 0) {
        silu_and_mul_bf16((const uint16_t *)x, (uint16_t *)out, num_tokens, d, num_threads);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 4)
    for (int64_t t = 0; t < num_tokens; t++) {
        float gate[4096], up[4096];
        for (int c = 0; c < d; c += 4096) {
            const int n = d - c < 4096 ? d - c : 4096;
            load_row(x, dtype, t * 2 * d + c, gate, n);
            load_row(x, dtype, t * 2 * d + d + c, up, n);
#pragma omp simd
            for (int i = 0; i < n; i++) {
                /* silu(g) = g * sigmoid(g), with exp of -|g| only (no overflow, vectorisable). */
                const float g = gate[i];
                const float e = exp_nonpos(-fabsf(g));
                const float num = g >= 0.0f ? 1.0f : e;
                gate[i] = g * (num / (1.0f + e)) * up[i];
            }
            store_row(out, dtype, t * d + c, gate, n);
        }
    }
    return 0;
}

/* ---- KV write: each token's K and V rows into its cache slot -----------------------------------
 * key/value: [num_tokens, num_kv_heads, head_dim] with token and head strides (views of the qkv
 * matmul's output); cache halves: [num_slots, num_kv_heads, head_dim] contiguous. Negative slots are
 * skipped (padding). The same dtype on both sides is copied (elem_bytes each); an fp8 cache (cache_dtype 2
 * or 3) takes each row converted from src_dtype. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PD_HAVE_FP8_STORE 1
/* f32_to_fp8 on 16 lanes, the same bits: the float32 add of 2^(e - mbits + 23) rounds |x| to the format's quantum
 * (ties to even), exact after subtracting it again; fp8 subnormals are whole counts of the smallest quantum. */
static inline __m128i f32x16_to_fp8(__m512 x, int code) {
    const int mbits = code == 2 ? 3 : 2, bias = code == 2 ? 7 : 15;
    const __m512 max_finite = _mm512_set1_ps(code == 2 ? 448.0f : 57344.0f);
    const __m512 min_normal = _mm512_set1_ps(ldexpf(1.0f, 1 - bias));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 24), _mm512_set1_epi32(0x80));
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), max_finite);
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 23), _mm512_set1_epi32(127));
    e = _mm512_max_epi32(e, _mm512_set1_epi32(1 - bias));
    const __m512 magic = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(23 + 127 - mbits)), 23));
    const __m512 r = _mm512_sub_ps(_mm512_add_ps(a, magic), magic);
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(r), 23 - mbits),
                                            _mm512_set1_epi32((127 - bias) << mbits));
    const __m512i sub = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_min_ps(r, min_normal),
                                                          _mm512_set1_ps(ldexpf(1.0f, bias - 1 + mbits))));
    __m512i bits = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(r, min_normal, _CMP_GE_OQ), sub, normal);
    bits = _mm512_mask_mov_epi32(bits, nan, _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(bits, sign));
}

/* One head row of head_dim (a multiple of 16) elements of src_dtype (0 or 1) into fp8 bytes. */
static inline void store_row_fp8x16(const void *src, int src_dtype, int64_t src_off, uint8_t *dst, int head_dim,
                                    int code) {
    for (int d = 0; d < head_dim; d += 16) {
        const __m512 x = src_dtype == 1
            ? _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + src_off + d))), 16))
            : _mm512_loadu_ps((const float *)src + src_off + d);
        _mm_storeu_si128((__m128i *)(dst + d), f32x16_to_fp8(x, code));
    }
}
#endif

/* The cache plane's strides in elements: a block, a slot in it, a head (a draft layer packed into a wider cache layer
   has blocks further apart than its own slots: engine/kv_cache.py packed_layer_views). */
int pd_write_kv(const void *key, const void *value, int64_t kv_tok_stride, int64_t kv_head_stride,
                void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int num_kv_heads,
                int head_dim, int elem_bytes, int src_dtype, int cache_dtype, int num_threads, int64_t block_size,
                int64_t cache_block_stride, int64_t cache_slot_stride, int64_t cache_head_stride) {
    if (head_dim > MAX_HEAD_DIM || block_size <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t src = t * kv_tok_stride + h * kv_head_stride;
            const int64_t dst = (slot / block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride
                                + (int64_t)h * cache_head_stride;
            if (src_dtype == cache_dtype) {
                memcpy((char *)k_cache + dst * elem_bytes, (const char *)key + src * elem_bytes,
                       (size_t)head_dim * elem_bytes);
                memcpy((char *)v_cache + dst * elem_bytes, (const char *)value + src * elem_bytes,
                       (size_t)head_dim * elem_bytes);
            } else {
#ifdef PD_HAVE_FP8_STORE
                if (cache_dtype >= 2 && head_dim % 16 == 0) {
                    store_row_fp8x16(key, src_dtype, src, (uint8_t *)k_cache + dst, head_dim, cache_dtype);
                    store_row_fp8x16(value, src_dtype, src, (uint8_t *)v_cache + dst, head_dim, cache_dtype);
                    continue;
                }
#endif
                float buf[MAX_HEAD_DIM];
                load_row(key, src_dtype, src, buf, head_dim);
                store_row(k_cache, cache_dtype, dst, buf, head_dim);
                load_row(value, src_dtype, src, buf, head_dim);
                store_row(v_cache, cache_dtype, dst, buf, head_dim);
            }
        }
    }
    return 0;
}

/* ---- greedy argmax over rows of logits (first index of the maximum, as torch.argmax) ------------ */
int pd_argmax_rows(int dtype, const void *x, int64_t row_stride, int64_t num_rows, int64_t n, int64_t *out,
                   int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++) {
        float best = -INFINITY;
        int64_t best_i = 0;
        float buf[1024];
        for (int64_t c = 0; c < n; c += 1024) {
            const int len = n - c < 1024 ? (int)(n - c) : 1024;
            load_row(x, dtype, r * row_stride + c, buf, len);
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int i = 0; i < len; i++) m = buf[i] > m ? buf[i] : m;
            if (m > best) { /* strictly greater: the first chunk holding the maximum wins */
                for (int i = 0; i < len; i++)
                    if (buf[i] == m) {
                        best_i = c + i;
                        break;
                    }
                best = m;
            }
        }
        out[r] = best_i;
    }
    return 0;
}

/* ---- y = x @ w.T for a few rows of float32 x (decode batches) ----------------------------------------
 * x [M, K] (row stride x_stride), w [N, K] contiguous (an nn.Linear weight), y [M, N] (row stride
 * y_stride). MKL's sgemm runs M = 2..8 as M separate matrix-vector passes over the weight (measured
 * here: the same GFLOP/s at M = 1 and 2), so a decode step of two requests read every weight twice;
 * this streams each weight row once for up to PD_SMALL_M rows. Every (m, n) dot product is summed the
 * same way whatever M is (8 lanes over k, lanes added pairwise, then the tail), so a request's
 * logits do not depend on the batch it shares. */
#define PD_SMALL_M 8

static inline float dot_tail(const float *a, const float *b, int64_t from, int64_t k) {
    float s = 0.0f;
    for (int64_t i = from; i < k; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);                     /* lanes i + (i + 4) */
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));  /* + (i + 2) */
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* Rows m0..m0+mb (mb <= 4) against weight rows n and n + 1. */
static inline void small_m_block(const float *x, int64_t x_stride, int mb, const float *w0, const float *w1,
                                 int64_t k, float *out0, float *out1, int64_t y_stride) {
    __m256 a0[4], a1[4];
    for (int m = 0; m < 4; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    const int64_t k8 = k & ~(int64_t)7;
    for (int64_t i = 0; i < k8; i += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + i);
        const __m256 v1 = w1 ? _mm256_loadu_ps(w1 + i) : v0;
        for (int m = 0; m < mb; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * x_stride + i);
            a0[m] = _mm256_fmadd_ps(xv, v0, a0[m]);
            a1[m] = _mm256_fmadd_ps(xv, v1, a1[m]);
        }
    }
    for (int m = 0; m < mb; m++) {
        out0[m * y_stride] = hsum8(a0[m]) + dot_tail(x + m * x_stride, w0, k8, k);
        if (w1) out1[m * y_stride] = hsum8(a1[m]) + dot_tail(x + m * x_stride, w1, k8, k);
    }
}
#else
static inline void small_m_block(const float *x, int64_t x_stride, int mb, const float *w0, const float *w1,
                                 int64_t k, float *out0, float *out1, int64_t y_stride) {
    for (int m = 0; m < mb; m++) {
        const float *xm = x + m * x_stride;
        float lanes0[8] = {0}, lanes1[8] = {0};
        const int64_t k8 = k & ~(int64_t)7;
        for (int64_t i = 0; i < k8; i += 8)
            for (int l = 0; l < 8; l++) {
                lanes0[l] += xm[i + l] * w0[i + l];
                if (w1) lanes1[l] += xm[i + l] * w1[i + l];
            }
        /* the AVX2 path's order: (l + l+4), then + (l+2), then + (l+1) */
        float s0 = ((lanes0[0] + lanes0[4]) + (lanes0[2] + lanes0[6])) + ((lanes0[1] + lanes0[5]) + (lanes0[3] + lanes0[7]));
        out0[m * y_stride] = s0 + dot_tail(xm, w0, k8, k);
        if (w1) {
            float s1 = ((lanes1[0] + lanes1[4]) + (lanes1[2] + lanes1[6])) + ((lanes1[1] + lanes1[5]) + (lanes1[3] + lanes1[7]));
            out1[m * y_stride] = s1 + dot_tail(xm, w1, k8, k);
        }
    }
}
#endif

int pd_linear_small_m(const float *x, int64_t x_stride, int64_t m_rows, const float *w, int64_t n, int64_t k,
                      float *y, int64_t y_stride, int num_threads) {
    if (m_rows < 1 || m_rows > PD_SMALL_M) return -1;
    const int64_t n_pairs = (n + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k > 65536)
    for (int64_t p = 0; p < n_pairs; p++) {
        const int64_t j = 2 * p;
        const float *w0 = w + j * k;
        const float *w1 = j + 1 < n ? w0 + k : NULL;
        for (int64_t m0 = 0; m0 < m_rows; m0 += 4) {
            const int mb = m_rows - m0 < 4 ? (int)(m_rows - m0) : 4;
            small_m_block(x + m0 * x_stride, x_stride, mb, w0, w1, k, y + m0 * y_stride + j,
                          y + m0 * y_stride + j + 1, y_stride);
        }
    }
    return 0;
}
