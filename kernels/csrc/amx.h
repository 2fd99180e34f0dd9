/* AMX tile support shared by the kernels that use tiles (gemm_bi.c's linear, cpu_kernels.c's paged attention).
 * PD_HAVE_AMX is defined where the compiler targets AMX-BF16 (gcc -march=native on a CPU that has it); whether
 * the running process may use the tiles is amx_usable()'s answer. Headers here are part of each including
 * source's build key (kernels/cpu_build.py), so editing one rebuilds the library. */
#ifndef PD_AMX_H
#define PD_AMX_H
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PD_HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux gives a process the AMX tile state only when it asks for it (arch_prctl, once per process; every
 * thread's later request is a no-op). A refusal (an old kernel, a VM without XTILEDATA) leaves AMX off.
 * PDCLUSTER_CPU_AMX=0 turns it off too (benchmarks compare the paths with it). */
static int amx_usable(void) {
    static int state = -1; /* a benign race: every thread computes the same answer */
    if (state < 0) {
        const char *off = getenv("PDCLUSTER_CPU_AMX");
        state = !(off && off[0] == '0') && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

/* ldtilecfg's 64-byte operand: palette 1, then each tile's bytes per row (colsb) and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_tilecfg;

/* ldtilecfg through an asm whose operand is the whole struct: gcc 12 sees _tile_loadconfig's builtin read too
 * little of it and dropped the stores of rows and colsb before it (a tile configuration of zeros: #GP). */
static inline void amx_load_tilecfg(const amx_tilecfg *cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(*cfg)); }
#endif
#endif
