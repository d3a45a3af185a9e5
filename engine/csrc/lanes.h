/* LANES-wide float vectors for the C kernels (cascade_attention.c, paged_attention.c, quant_gemm.c):
 * the vector type, its fused multiply-add, and the shuffle-based lane reductions and transpose.
 * Kept in one place so that every kernel uses the same (tested) code. */
#ifndef SERVELAB_LANES_H
#define SERVELAB_LANES_H
#include "common.h"

/* The vector width follows the ISA the kernel is compiled for (-march=native): 16 lanes and 32
 * registers with AVX-512, 8 lanes and 16 registers with AVX2; each kernel sizes its register
 * tiles to fit either register file. */
#if defined(__AVX512F__)
#define LANES 16
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline vf vbroadcast(float v) { return (vf)_mm512_set1_ps(v); }
#else
#define LANES 8
typedef f32x8 vf;
typedef i32x8 vi;
static inline vf vfma(vf a, vf b, vf c) { return fma8(a, b, c); }
static inline vf vbroadcast(float v) { return (vf){v, v, v, v, v, v, v, v}; }
#endif

static inline vf vselect(vi mask, vf if_true, vf if_false) {
    return (vf)(((vi)if_true & mask) | ((vi)if_false & ~mask));
}

static inline vf load_vf(const float *source) {
    vf value;
    memcpy(&value, source, sizeof value);
    return value;
}

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* r[i][l] <- r[l][i] for a LANES x LANES block, in log2(LANES) stages: stage k swaps the
 * off-diagonal k x k sub-blocks of every 2k x 2k block (rows i and i + k, lanes taken from both
 * with one two-vector shuffle each). */
/* The log2(LANES) shuffle stages shared by the transpose and the lane sums below: stage k pairs
 * rows i and i + k; `low` takes k-lane runs alternately from both rows' even runs, `high` from
 * their odd runs (indices >= LANES name the second row's lanes). */
#define LIST(...) __VA_ARGS__
#if LANES == 16
#define FOR_EACH_STAGE(X)                                                                   \
    X(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),                            \
         (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))                      \
    X(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),                          \
         (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))                        \
    X(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),                          \
         (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))                        \
    X(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),                         \
         (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#define FOR_EACH_ROTATION(X, x)                                                   \
    X((8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7), x)                  \
    X((4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3), x)                  \
    X((2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1), x)                  \
    X((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0), x)
DEFINE_VECTOR_EXP(vexp, vf, vi, vselect) /* exp8's polynomial (common.h) on 16 lanes */
#else
#define FOR_EACH_STAGE(X)                                                 \
    X(4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))          \
    X(2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))          \
    X(1, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))
#define FOR_EACH_ROTATION(X, x)                      \
    X((4, 5, 6, 7, 0, 1, 2, 3), x)                   \
    X((2, 3, 4, 5, 6, 7, 0, 1), x)                   \
    X((1, 2, 3, 4, 5, 6, 7, 0), x)
#define vexp exp8
#endif

/* r[i][l] <- r[l][i] for a LANES x LANES block: stage k swaps the off-diagonal k x k sub-blocks of
 * every 2k x 2k block. */
#define TRANSPOSE_STAGE(k, low, high)                          \
    for (int i = 0; i < LANES; ++i) {                          \
        if (i & k) continue;                                   \
        const vf a = r[i], b = r[i + k];                       \
        r[i] = __builtin_shufflevector(a, b, LIST low);        \
        r[i + k] = __builtin_shufflevector(a, b, LIST high);   \
    }
static inline void transpose_tile(vf r[LANES]) { FOR_EACH_STAGE(TRANSPOSE_STAGE) }

/* Lane j of the result = the sum of r[j]'s lanes (LANES horizontal sums at the cost of LANES - 1
 * shuffle pairs): the transpose's stages, each adding its two halves instead of keeping both, so
 * after stage k the rows left hold partial sums of 2k rows' lanes side by side. Clobbers r. */
#define SUM_STAGE(k, low, high)                                                                 \
    for (int i = 0; i < k; ++i)                                                                 \
        r[i] = __builtin_shufflevector(r[i], r[i + k], LIST low) + __builtin_shufflevector(r[i], r[i + k], LIST high);
static inline vf lane_sums(vf r[LANES]) {
    FOR_EACH_STAGE(SUM_STAGE)
    return r[0];
}
/* max and sum of one vector's lanes: log2(LANES) rotations by half the width, then a quarter...,
 * each combined with the vector (dependent steps: log2(LANES), not LANES - 1) */
#define ROTATE_AND(op, x) FOR_EACH_ROTATION(ROTATE_STEP_##op, x)
#define ROTATE_STEP_MAX(rotation, x) x = vmax(x, __builtin_shufflevector(x, x, LIST rotation));
#define ROTATE_STEP_SUM(rotation, x) x += __builtin_shufflevector(x, x, LIST rotation);
static inline float lane_max(vf x) {
    ROTATE_AND(MAX, x)
    return x[0];
}

static inline float lane_sum(vf x) {
    ROTATE_AND(SUM, x)
    return x[0];
}
#undef ROTATE_AND
#undef ROTATE_STEP_MAX
#undef ROTATE_STEP_SUM
#undef FOR_EACH_ROTATION
#undef TRANSPOSE_STAGE
#undef SUM_STAGE
#undef FOR_EACH_STAGE
#undef LIST
#endif
