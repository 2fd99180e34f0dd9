/* Multi-LoRA update in one call (engine/lora/layers.py): for every adapter row r of a step and every slice s
 * of the projection's output (q, k, v of a fused qkv; gate, up; or the one slice of o and down),
 *     xa = x[r, :] @ a[e].T                         (a[e]: the slices' A matrices stacked, [rank, k])
 *     y[r, ycol_s : ycol_s + width_s] += xa[col_s : col_s + rank_s] @ b_s[e].T     (scale folded into b_s)
 * where e is r's adapter and adapter e's rows are row_ids[offs[e] .. offs[e+1]) (the step's rows sorted by
 * adapter, punica's SGMV shape). Built into the kernel library by kernels/cpu_build.py, called through
 * kernels/cpu_lora.py. Each slice's own B (not one block-diagonal B over the fused output) keeps the zeros
 * between slices out of the arithmetic and out of the bytes read: a third of a decode step's LoRA cost.
 *
 * One call instead of gather, two grouped GEMMs and a scatter-add (four library calls and three temporaries a
 * projection): on a decode step that is what LoRA costs, its arithmetic being a few percent of the base
 * matmul's. Both products are gemm_bi.c's batch-invariant GEMM (invariant BI there) and the add is one rounding
 * per element, so a row's result is bit for bit the same whatever the other rows, their adapters, how the rows
 * are cut into chunks or the thread count. An adapter with no rows is not read.
 *
 *   x [*, k] rows ldx apart, y [*, n] rows ldy apart, both dtype (0 float32, 1 bfloat16);
 *   a_packed: num_adapters x [rank, k] in gemm_bi.c's strip layout, one after the other; slices: num_slices x
 *   (xa column, rank, y column, width); b_packed[s]: num_adapters x [width_s, rank_s] packed the same way.
 *   The low-rank product is rounded to dtype (as a torch chain of two linears would), each slice's product
 *   is added to y in fp32 and rounded once.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STRIP 16
#define CHUNK_ROWS 256 /* rows gathered at a time: bounds the temporaries; no effect on the arithmetic */

int pd_gemm_bi(int dtype, const void *x, int64_t ldx, int64_t m, const void *w_packed, int64_t n, int64_t k,
               void *y, int64_t ldy, int out_fp32, int isa, int num_threads) __attribute__((weak));

static inline uint16_t to_bf16(float f) { /* round to nearest even, NaN -> 0x7fc0 (gemm_bi.c's store) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int64_t packed_elems(int dtype, int64_t n, int64_t k) { /* one [n, k] weight in the strip layout */
    return (n + STRIP - 1) / STRIP * STRIP * (dtype == 1 ? (k + 1) / 2 * 2 : k);
}

int pd_lora_bi(int dtype, const void *x, int64_t ldx, const int64_t *row_ids, const int64_t *offs,
               int64_t num_adapters, const void *a_packed, int64_t rank, int64_t k, int64_t num_slices,
               const int64_t *slices, const void *const *b_packed, void *y, int64_t ldy, int isa, int num_threads) {
    if (pd_gemm_bi == NULL) return -1;
    if ((dtype != 0 && dtype != 1) || num_adapters < 1 || rank < 1 || k < 1 || num_slices < 1 || offs[0] != 0)
        return -1;
    for (int64_t e = 0; e < num_adapters; e++)
        if (offs[e + 1] < offs[e]) return -1;
    int64_t widest = 0;
    for (int64_t s = 0; s < num_slices; s++) {
        const int64_t *sl = slices + 4 * s; /* xa column, rank, y column, width */
        if (sl[0] < 0 || sl[1] < 1 || sl[0] + sl[1] > rank || sl[2] < 0 || sl[3] < 1) return -1;
        if (sl[3] > widest) widest = sl[3];
    }
    const int64_t size = dtype == 1 ? 2 : 4;
    const int64_t a_elems = packed_elems(dtype, rank, k);
    char *xs = malloc((size_t)(CHUNK_ROWS * k * size));
    char *xa = malloc((size_t)(CHUNK_ROWS * rank * size));
    float *d = malloc((size_t)(CHUNK_ROWS * widest) * sizeof(float));
    int rc = xs != NULL && xa != NULL && d != NULL ? 0 : -1;
    for (int64_t e = 0; e < num_adapters && rc == 0; e++) {
        const char *ae = (const char *)a_packed + e * a_elems * size;
        for (int64_t c0 = offs[e]; c0 < offs[e + 1] && rc == 0; c0 += CHUNK_ROWS) {
            const int64_t m = offs[e + 1] - c0 < CHUNK_ROWS ? offs[e + 1] - c0 : CHUNK_ROWS;
            for (int64_t i = 0; i < m; i++)
                memcpy(xs + i * k * size, (const char *)x + row_ids[c0 + i] * ldx * size, (size_t)(k * size));
            /* out_fp32 is what a float32 GEMM stores (0 means a bfloat16 output there) */
            rc |= pd_gemm_bi(dtype, xs, k, m, ae, rank, k, xa, rank, dtype == 0, isa, num_threads);
            for (int64_t s = 0; s < num_slices && rc == 0; s++) {
                const int64_t *sl = slices + 4 * s;
                const char *be = (const char *)b_packed[s] + e * packed_elems(dtype, sl[3], sl[1]) * size;
                rc |= pd_gemm_bi(dtype, xa + sl[0] * size, rank, m, be, sl[3], sl[1], d, sl[3], 1, isa, num_threads);
                for (int64_t i = 0; i < m && rc == 0; i++) {
                    const float *di = d + i * sl[3];
                    if (dtype == 1) {
                        uint16_t *yi = (uint16_t *)y + row_ids[c0 + i] * ldy + sl[2];
                        for (int64_t j = 0; j < sl[3]; j++) yi[j] = to_bf16(from_bf16(yi[j]) + di[j]);
                    } else {
                        float *yi = (float *)y + row_ids[c0 + i] * ldy + sl[2];
                        for (int64_t j = 0; j < sl[3]; j++) yi[j] += di[j];
                    }
                }
            }
        }
    }
    free(xs);
    free(xa);
    free(d);
    return rc;
}
