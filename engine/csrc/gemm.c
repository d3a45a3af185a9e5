/* Skinny GEMM for decode-sized batches, float32: out[M, N] = x[M, K] @ W^T (+ bias), W given as
 * nn.Linear's [N, K].
 *
 * The weight is repacked once at load time into panels of NR = 3 vectors of output columns:
 * panel p holds W[p*NR : p*NR+NR, :] transposed, k-major ([K][NR], zero-padded past N), so the
 * inner loop reads it as one contiguous stream. The microkernel is an MR x NR register tile:
 * per k it loads the panel's 3 vectors, broadcasts MR values of x and issues 3 * MR fused
 * multiply-adds, i.e. it reads each weight once per MR rows of x. Threads split the panels
 * (contiguous ranges, so each core streams its own part of the weights); every row tile of x
 * reuses the panel while it is in L1/L2. This is the BLIS/oneDNN recipe specialised to M <= a
 * few dozen rows, where a general GEMM's blocking for large M wastes the machine
 * (docs/performance.md, section 3.2).
 *
 * Vector width follows the compiler's target (-march=native): with AVX-512 a vector is 16
 * floats and the tile 8 x 48 (24 accumulators of the 32 vector registers); with AVX2 8 floats
 * and 4 x 24 (12 of 16 registers); elsewhere GCC lowers the vector types to what exists.
 *
 * Weights come from memory in every decode step (the model is far larger than the caches), so
 * while the row tiles of panel p compute, they prefetch panel p + 1: each of the T full row
 * tiles fetches 1 / T of it, spread over its k loop, so memory traffic overlaps the arithmetic
 * instead of stalling the first tile of every panel. One row (batch-1 decode) is a stream that
 * the hardware prefetcher already follows.
 */
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__)
typedef float vecf __attribute__((vector_size(64)));
#define VL 16 /* floats per vector */
#define MR 8  /* rows of x per register tile */
static inline vecf vfma(vecf a, vecf b, vecf c) { return _mm512_fmadd_ps(a, b, c); }
#else
typedef f32x8 vecf;
#define VL 8
#define MR 4
static inline vecf vfma(vecf a, vecf b, vecf c) { return fma8(a, b, c); }
#endif
#define NR (3 * VL) /* output columns per panel */
#define CACHE_LINE 64

static inline vecf vload(const float *source) {
    vecf value;
    memcpy(&value, source, sizeof value);
    return value;
}

static inline vecf vbroadcast(float value) { return (vecf){0} + value; }

/* Most rows for which this build measured faster than oneDNN's prepacked linear with weights
 * streamed from memory (docs/performance.md, section 3.2): the 8 x 48 AVX-512 tile up to 128 rows
 * (oneDNN wins again only for prompt-sized inputs), the 4 x 24 AVX2 tile up to 32 (equal there). */
int64_t gemm_max_rows(void) { return MR == 8 ? 128 : 32; }

/* Rows of x per full register tile (MR): a batch runs as M / MR full tiles, then the rest as
 * tiles of 4 (AVX-512), 2 and 1 rows, each one more pass over the weights (the simulator's
 * cost model prices those remainder rows: docs/simulator.md). */
int64_t gemm_tile_rows(void) { return MR; }

/* Number of floats of the packed weight for N x K: ceil(N / NR) panels of K x NR. */
int64_t packed_weight_numel(int64_t n, int64_t k) { return (n + NR - 1) / NR * k * NR; }

void pack_weight_f32(const float *weight, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; ++p) {
        float *panel = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t c = 0; c < NR; ++c) {
                const int64_t col = p * NR + c;
                panel[kk * NR + c] = col < n ? weight[col * k + kk] : 0.0f;
            }
    }
}

/* Stores one row's 3 accumulators (+ bias) into dst's first `cols` columns. */
static inline void store_row(const vecf *acc, const float *bias, float *dst, int64_t cols) {
    float values[NR];
    memcpy(values, acc, sizeof values);
    if (bias != NULL)
        for (int64_t c = 0; c < cols; ++c) values[c] += bias[c];
    memcpy(dst, values, sizeof(float) * cols);
}

/* ROWS x NR tile over the whole K; `prefetch` (or NULL) advances by `prefetch_step` bytes per k,
 * each step fetched whole (one prefetch per cache line). The accumulators are a fully unrolled
 * array, which GCC keeps in registers. */
#define DEFINE_TILE(NAME, ROWS)                                                                             \
    static void NAME(const float *x, int64_t x_stride, const float *panel, int64_t k,            \
                           const float *bias, float *out, int64_t out_stride, int64_t cols,            \
                           const char *prefetch, int64_t prefetch_step) {                              \
        vecf c[ROWS][3];                                                                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) c[r][0] = c[r][1] = c[r][2] = (vecf){0}; \
        for (int64_t kk = 0; kk < k; ++kk) {                                                            \
            if (prefetch != NULL) {                                                                     \
                for (int64_t offset = 0; offset < prefetch_step; offset += CACHE_LINE)                  \
                    __builtin_prefetch(prefetch + offset, 0, 3);                                        \
                prefetch += prefetch_step;                                                              \
            }                                                                                           \
            const float *b = panel + kk * NR;                                                           \
            const vecf b0 = vload(b), b1 = vload(b + VL), b2 = vload(b + 2 * VL);                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {                                    \
                const vecf a = vbroadcast(x[r * x_stride + kk]);                                        \
                c[r][0] = vfma(a, b0, c[r][0]);                                                         \
                c[r][1] = vfma(a, b1, c[r][1]);                                                         \
                c[r][2] = vfma(a, b2, c[r][2]);                                                         \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)                                          \
            store_row(c[r], bias, out + r * out_stride, cols);                                          \
    }
DEFINE_TILE(tile_mr, MR)
#if MR == 8
DEFINE_TILE(tile4, 4)
#endif
DEFINE_TILE(tile2, 2)

/* One row x NR (the last odd row of x, and batch-1 decode): two k per trip, so each vector has
 * two independent FMA chains. */
static void tile1(const float *x, const float *panel, int64_t k, const float *bias, float *out, int64_t cols) {
    vecf c0 = {0}, c1 = {0}, c2 = {0}, d0 = {0}, d1 = {0}, d2 = {0};
    int64_t kk = 0;
    for (; kk + 2 <= k; kk += 2) {
        const float *b = panel + kk * NR;
        const vecf a = vbroadcast(x[kk]), e = vbroadcast(x[kk + 1]);
        c0 = vfma(a, vload(b), c0), c1 = vfma(a, vload(b + VL), c1), c2 = vfma(a, vload(b + 2 * VL), c2);
        d0 = vfma(e, vload(b + NR), d0), d1 = vfma(e, vload(b + NR + VL), d1), d2 = vfma(e, vload(b + NR + 2 * VL), d2);
    }
    for (; kk < k; ++kk) {
        const float *b = panel + kk * NR;
        const vecf a = vbroadcast(x[kk]);
        c0 = vfma(a, vload(b), c0), c1 = vfma(a, vload(b + VL), c1), c2 = vfma(a, vload(b + 2 * VL), c2);
    }
    const vecf row[3] = {c0 + d0, c1 + d1, c2 + d2};
    store_row(row, bias, out, cols);
}

void gemm_packed_f32(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *packed,
                     const float *bias, int64_t n, float *out) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t full_tiles = m / MR;
    /* Bytes of the next panel each full tile prefetches per k: the panel is k * NR floats. */
    const int64_t prefetch_step = full_tiles > 0 ? (int64_t)(NR * sizeof(float)) / full_tiles : 0;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const float *panel = packed + p * k * NR;
        const int64_t col = p * NR, cols = n - col < NR ? n - col : NR;
        const float *panel_bias = bias != NULL ? bias + col : NULL;
        const char *next = p + 1 < panels ? (const char *)(panel + k * NR) : NULL;
        int64_t row = 0;
        for (int64_t t = 0; t < full_tiles; ++t, row += MR) {
            const char *prefetch = next != NULL ? next + t * k * prefetch_step : NULL;
            tile_mr(x + row * x_stride, x_stride, panel, k, panel_bias, out + row * n + col, n, cols, prefetch, prefetch_step);
        }
#if MR == 8
        if (row + 4 <= m) {
            tile4(x + row * x_stride, x_stride, panel, k, panel_bias, out + row * n + col, n, cols, NULL, 0);
            row += 4;
        }
#endif
        if (row + 2 <= m) {
            tile2(x + row * x_stride, x_stride, panel, k, panel_bias, out + row * n + col, n, cols, NULL, 0);
            row += 2;
        }
        if (row < m) tile1(x + row * x_stride, panel, k, panel_bias, out + row * n + col, cols);
    }
}
