/* Batch-invariant grouped linear for a fused MoE (issue 26): the rows arrive sorted by expert, expert e
 * owning rows [offs[e], offs[e+1]), and y[r, :] = x[r, :] @ w[e].T for each row r of expert e. Built into the
 * kernel library by kernels/cpu_build.py, called through kernels/cpu_grouped_mm.py.
 *
 * Every (expert, range of output strips) is one call of pd_gemm_bi (gemm_bi.c) on that expert's rows and
 * packed weight. gemm_bi.c's invariant BI fixes each output element's arithmetic (one fp32 accumulator,
 * increasing k, one fixed operation per step) whatever the number of rows, the tile or the thread, so here a
 * row's result is bit for bit linear_bi(row, w[e]): it does not depend on how many rows its expert got this
 * step, on the other experts, or on how the work is cut into pieces. An expert with no rows is never read, so
 * decoding one token touches only its routed experts' weights.
 *
 * Packed weights: E experts one after the other, each in gemm_bi.c's strip layout (float32 [S][K][16],
 * bfloat16 [S][K/2][16][2] with K rounded up to even; S = ceil(N / 16)).
 *
 * Threads: the non-empty experts' strips are cut into pieces (enough for every thread to get a couple, none
 * under MIN_PIECE_STRIPS strips), OpenMP threads take pieces as they free up, and each piece runs pd_gemm_bi
 * on one thread. Small problems run on the calling thread alone.
 */
#include <stdint.h>
#include <stdlib.h>

#define STRIP 16
#define MIN_PIECE_STRIPS 4
#define MIN_PARALLEL_WORK ((int64_t)1 << 18) /* rows x n x k under which one thread is faster (gemm_bi.c's rule) */

/* gemm_bi.c, linked into the same library; weak so that a build that left gemm_bi.c out still loads (this
 * function then refuses to run). */
int pd_gemm_bi(int dtype, const void *x, int64_t ldx, int64_t m, const void *w_packed, int64_t n, int64_t k,
               void *y, int64_t ldy, int out_fp32, int isa, int num_threads) __attribute__((weak));
int pd_gemm_bi_isa(int dtype) __attribute__((weak));

typedef struct {
    int64_t expert, s_begin, s_end;
} piece;

/* dtype: 0 float32, 1 bfloat16 (x and the packed weights); y float32 when out_fp32, else x's dtype.
 * offs: num_experts + 1 non-decreasing row offsets into x and y. isa as pd_gemm_bi (0 = best).
 * Returns 0, or -1 for a bad argument, an ISA this build lacks or a missing gemm_bi.c. */
int pd_grouped_gemm_bi(int dtype, const void *x, int64_t ldx, const int64_t *offs, int64_t num_experts,
                       const void *w_packed, int64_t n, int64_t k, void *y, int64_t ldy, int out_fp32, int isa,
                       int num_threads) {
    if (pd_gemm_bi == NULL || pd_gemm_bi_isa == NULL) return -1;
    if ((dtype != 0 && dtype != 1) || num_experts < 1 || n < 1 || k < 1 || offs[0] < 0) return -1;
    const int best = pd_gemm_bi_isa(dtype);
    if (isa == 0) isa = best;
    if (isa < 1 || isa > best) return -1;
    const int64_t strips = (n + STRIP - 1) / STRIP;
    const int64_t strip_elems = (dtype == 1 ? (k + 1) / 2 * 2 : k) * STRIP;
    const int64_t x_size = dtype == 1 ? 2 : 4, y_size = out_fp32 ? 4 : x_size;
    int64_t busy = 0, rows = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (offs[e + 1] < offs[e]) return -1;
        if (offs[e + 1] > offs[e]) busy++;
    }
    rows = offs[num_experts] - offs[0];
    if (busy == 0) return 0;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (rows * n * k < MIN_PARALLEL_WORK) threads = 1;
    /* Pieces per busy expert: about two per thread over all experts, each at least MIN_PIECE_STRIPS wide. */
    int64_t per_expert = threads == 1 ? 1 : (2 * threads + busy - 1) / busy;
    const int64_t widest = (strips + MIN_PIECE_STRIPS - 1) / MIN_PIECE_STRIPS;
    if (per_expert > widest) per_expert = widest;
    piece *pieces = malloc(sizeof(piece) * (size_t)(busy * per_expert));
    if (pieces == NULL) return -1;
    int64_t count = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (offs[e + 1] == offs[e]) continue;
        for (int64_t i = 0; i < per_expert; i++)
            pieces[count++] = (piece){e, strips * i / per_expert, strips * (i + 1) / per_expert};
    }
    if (threads > count) threads = (int)count;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
    for (int64_t i = 0; i < count; i++) {
        const piece p = pieces[i];
        const int64_t r0 = offs[p.expert], m = offs[p.expert + 1] - r0;
        const int64_t c0 = p.s_begin * STRIP, c1 = p.s_end * STRIP < n ? p.s_end * STRIP : n;
        const char *xe = (const char *)x + r0 * ldx * x_size;
        const char *we = (const char *)w_packed + (p.expert * strips + p.s_begin) * strip_elems * x_size;
        char *ye = (char *)y + (r0 * ldy + c0) * y_size;
        failed |= pd_gemm_bi(dtype, xe, ldx, m, we, c1 - c0, k, ye, ldy, out_fp32, isa, 1) != 0;
    }
    free(pieces);
    return failed ? -1 : 0;
}
