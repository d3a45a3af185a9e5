/* Skinny GEMM for decode-sized batches, float32: out[M, N] = x[M, K] @ W^T (+ bias), W given as
 * nn.Linear's [N, K].
 *
 * The weight is repacked once at load time into panels of NR = 24 output columns: panel p holds
 * W[p*24 : p*24+24, :] transposed, k-major ([K][24], zero-padded past N), so the inner loop reads
 * it as one contiguous stream. A 4 x 24 register tile (12 accumulators of 8 floats) is the
 * microkernel: per k it loads 3 vectors of the panel, broadcasts 4 values of x and issues 12
 * fused multiply-adds, i.e. it reads each weight once per 4 rows of x from L1/L2. Threads split
 * the panels; every row tile of x reuses the panel while it is hot. This is the BLIS/oneDNN
 * recipe specialised to M <= a few dozen rows, where a general GEMM's blocking for large M wastes
 * the machine (docs/performance.md, section 9).
 */
#include <stdlib.h>

#include "common.h"

#define NR 24 /* output columns per panel: 3 vectors of 8 */
#define MR 4  /* rows of x per register tile */
#define KC 256 /* k per block: a 256 x 24 slice of a panel is 24 KB, inside a 32 KB L1 */

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

static inline f32x8 broadcast8(float value) {
    return (f32x8){value, value, value, value, value, value, value, value};
}

/* Adds a row's accumulators to dst (or sets dst when `first`); bias is given on the last K block. */
static inline void store_row(const f32x8 *acc, int first, const float *bias, float *dst, int64_t cols) {
    float values[NR];
    store8(values, acc[0]);
    store8(values + 8, acc[1]);
    store8(values + 16, acc[2]);
    if (!first)
        for (int64_t c = 0; c < cols; ++c) values[c] += dst[c];
    if (bias != NULL)
        for (int64_t c = 0; c < cols; ++c) values[c] += bias[c];
    memcpy(dst, values, sizeof(float) * cols);
}

/* MR x NR tile: the 12 accumulators are named variables so that they stay in registers. */
static void tile4(const float *x, int64_t x_stride, const float *panel, int64_t k, int first,
                  const float *bias, float *out, int64_t out_stride, int64_t cols) {
    const f32x8 zero = {0};
    f32x8 c00 = zero, c01 = zero, c02 = zero, c10 = zero, c11 = zero, c12 = zero;
    f32x8 c20 = zero, c21 = zero, c22 = zero, c30 = zero, c31 = zero, c32 = zero;
    const float *x0 = x, *x1 = x + x_stride, *x2 = x + 2 * x_stride, *x3 = x + 3 * x_stride;
    for (int64_t kk = 0; kk < k; ++kk) {
        const float *b = panel + kk * NR;
        const f32x8 b0 = load8(b), b1 = load8(b + 8), b2 = load8(b + 16);
        f32x8 a = broadcast8(x0[kk]);
        c00 = fma8(a, b0, c00); c01 = fma8(a, b1, c01); c02 = fma8(a, b2, c02);
        a = broadcast8(x1[kk]);
        c10 = fma8(a, b0, c10); c11 = fma8(a, b1, c11); c12 = fma8(a, b2, c12);
        a = broadcast8(x2[kk]);
        c20 = fma8(a, b0, c20); c21 = fma8(a, b1, c21); c22 = fma8(a, b2, c22);
        a = broadcast8(x3[kk]);
        c30 = fma8(a, b0, c30); c31 = fma8(a, b1, c31); c32 = fma8(a, b2, c32);
    }
    const f32x8 rows[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
    for (int64_t r = 0; r < MR; ++r) store_row(rows[r], first, bias, out + r * out_stride, cols);
}

/* One row x NR (the remainder rows of x, and batch-1 decode). */
static void tile1(const float *x, const float *panel, int64_t k, int first, const float *bias, float *out,
                  int64_t cols) {
    const f32x8 zero = {0};
    f32x8 c0 = zero, c1 = zero, c2 = zero, d0 = zero, d1 = zero, d2 = zero;
    int64_t kk = 0;
    for (; kk + 2 <= k; kk += 2) { /* two k per trip: two independent chains per vector */
        const float *b = panel + kk * NR;
        const f32x8 a = broadcast8(x[kk]), e = broadcast8(x[kk + 1]);
        c0 = fma8(a, load8(b), c0); c1 = fma8(a, load8(b + 8), c1); c2 = fma8(a, load8(b + 16), c2);
        d0 = fma8(e, load8(b + NR), d0); d1 = fma8(e, load8(b + NR + 8), d1); d2 = fma8(e, load8(b + NR + 16), d2);
    }
    for (; kk < k; ++kk) {
        const float *b = panel + kk * NR;
        const f32x8 a = broadcast8(x[kk]);
        c0 = fma8(a, load8(b), c0); c1 = fma8(a, load8(b + 8), c1); c2 = fma8(a, load8(b + 16), c2);
    }
    const f32x8 row[3] = {c0 + d0, c1 + d1, c2 + d2};
    store_row(row, first, bias, out, cols);
}

void gemm_packed_f32(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *packed,
                     const float *bias, int64_t n, float *out) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const float *panel = packed + p * k * NR;
        const int64_t col = p * NR, cols = n - col < NR ? n - col : NR;
        /* K blocks of KC: the panel's slice (KC x 24 floats) stays in L1 while every row tile uses it. */
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            const int first = k0 == 0;
            const float *slice = panel + k0 * NR;
            const float *panel_bias = bias != NULL && k0 + kc == k ? bias + col : NULL;
            int64_t row = 0;
            for (; row + MR <= m; row += MR)
                tile4(x + row * x_stride + k0, x_stride, slice, kc, first, panel_bias, out + row * n + col, n, cols);
            for (; row < m; ++row)
                tile1(x + row * x_stride + k0, slice, kc, first, panel_bias, out + row * n + col, cols);
        }
    }
}
