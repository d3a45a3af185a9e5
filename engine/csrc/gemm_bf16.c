/* Skinny GEMM for decode-sized batches in bfloat16: out[M, N] (float32) = x[M, K] (float32) @ W^T
 * (+ bias), with W held in bfloat16, on CPUs with AVX512-BF16's dot-product instruction.
 *
 * The same kernel as gemm.c (panels of NR = 48 output columns, an 8 x 48 register tile, the
 * next panel prefetched while the row tiles compute), with two changes:
 *   - the panel stores W in bfloat16 pairs: for each pair of k, its 48 columns as (W[c][k],
 *     W[c][k+1]) in one 32-bit lane ([K / 2][NR][2], zero-padded past N and past an odd K), so a
 *     decode step streams half the bytes of the float32 panels;
 *   - x is rounded to bfloat16 pairs once per call (round to nearest even, as torch's .to(bfloat16)),
 *     and each k pair is one VDPBF16PS per vector: 16 lanes x 2 products summed into float32
 *     accumulators, twice the multiply-adds per instruction of float32 FMA.
 * Products of two bfloat16 are exact in float32; what differs from the float32 kernel is the
 * rounding of x and W to bfloat16 (8 mantissa bits) and the order of the sums (docs/decisions.md,
 * decision 19 measures the logits).
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere
 * gemm_bf16_supported() returns 0 and the engine keeps the float32 kernel.
 */
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define VL 16      /* float32 lanes per vector */
#define MR 8       /* rows of x per register tile */
#define NR (3 * VL) /* output columns per panel */
#define CACHE_LINE 64

int64_t gemm_bf16_supported(void) { return 1; }

/* Same crossover as the float32 AVX-512 tile: oneDNN takes prompt-sized inputs above it. */
int64_t gemm_bf16_max_rows(void) { return 128; }

/* Number of bfloat16 values of the packed weight for N x K: ceil(N / NR) panels of ceil(K / 2) x NR pairs. */
int64_t packed_weight_numel_bf16(int64_t n, int64_t k) { return (n + NR - 1) / NR * ((k + 1) / 2) * NR * 2; }

/* float32 -> bfloat16 bits, round to nearest even (NaN kept quiet), as torch rounds. */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

void pack_weight_bf16(const float *weight, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t panels = (n + NR - 1) / NR, pairs = (k + 1) / 2;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; ++p) {
        uint16_t *panel = packed + p * pairs * NR * 2;
        for (int64_t kp = 0; kp < pairs; ++kp)
            for (int64_t c = 0; c < NR; ++c)
                for (int64_t half = 0; half < 2; ++half) {
                    const int64_t col = p * NR + c, kk = 2 * kp + half;
                    panel[(kp * NR + c) * 2 + half] = col < n && kk < k ? to_bf16(weight[col * k + kk]) : 0;
                }
    }
}

static inline void store_row(const __m512 *acc, const float *bias, float *dst, int64_t cols) {
    float values[NR];
    memcpy(values, acc, sizeof values);
    if (bias != NULL)
        for (int64_t c = 0; c < cols; ++c) values[c] += bias[c];
    memcpy(dst, values, sizeof(float) * cols);
}

/* ROWS x NR tile over all k pairs; x is the bfloat16 copy as 32-bit pairs, `pairs` per row. */
#define DEFINE_TILE(NAME, ROWS)                                                                            \
    static void NAME(const uint32_t *x, int64_t pairs, const uint32_t *panel, const float *bias, float *out,  \
                     int64_t out_stride, int64_t cols, const char *prefetch, int64_t prefetch_step) {          \
        __m512 c[ROWS][3];                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) c[r][0] = c[r][1] = c[r][2] = _mm512_setzero_ps(); \
        for (int64_t kp = 0; kp < pairs; ++kp) {                                                            \
            if (prefetch != NULL) {                                                                         \
                for (int64_t offset = 0; offset < prefetch_step; offset += CACHE_LINE)                      \
                    __builtin_prefetch(prefetch + offset, 0, 3);                                            \
                prefetch += prefetch_step;                                                                  \
            }                                                                                               \
            const uint32_t *b = panel + kp * NR;                                                            \
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + VL), \
                           b2 = (__m512bh)_mm512_loadu_si512(b + 2 * VL);                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {                                        \
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + kp]);                     \
                c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);                                                 \
                c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);                                                 \
                c[r][2] = _mm512_dpbf16_ps(c[r][2], a, b2);                                                 \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) store_row(c[r], bias, out + r * out_stride, cols); \
    }
DEFINE_TILE(tile_mr, MR)
DEFINE_TILE(tile4, 4)
DEFINE_TILE(tile2, 2)
DEFINE_TILE(tile1, 1)

/* The linear_fn of decoder_layer.c (weight: pack_weight_bf16's panels). */
void gemm_packed_bf16(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *weight, const float *bias,
                      int64_t n, float *out) {
    const uint16_t *packed = weight;
    const int64_t panels = (n + NR - 1) / NR, pairs = (k + 1) / 2, full_tiles = m / MR;
    /* x in bfloat16 pairs, zero-padded to an even k: read by every panel, so rounded once here. */
    uint16_t *xb = malloc(sizeof(uint16_t) * 2 * pairs * (m > 0 ? m : 1));
    if (xb == NULL) {
        fprintf(stderr, "gemm_packed_bf16: out of memory for the %lld x %lld bfloat16 copy of x\n", (long long)m, (long long)k);
        abort();
    }
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t kk = 0; kk < k; ++kk) xb[r * 2 * pairs + kk] = to_bf16(x[r * x_stride + kk]);
        if (k % 2) xb[r * 2 * pairs + k] = 0;
    }
    const uint32_t *xp = (const uint32_t *)xb;
    const int64_t panel_bytes = pairs * NR * 4;
    const int64_t prefetch_step = full_tiles > 0 ? (int64_t)(NR * 4) / full_tiles : 0;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const uint32_t *panel = (const uint32_t *)(packed + p * pairs * NR * 2);
        const int64_t col = p * NR, cols = n - col < NR ? n - col : NR;
        const float *panel_bias = bias != NULL ? bias + col : NULL;
        const char *next = p + 1 < panels ? (const char *)panel + panel_bytes : NULL;
        int64_t row = 0;
        for (int64_t t = 0; t < full_tiles; ++t, row += MR) {
            const char *prefetch = next != NULL ? next + t * pairs * prefetch_step : NULL;
            tile_mr(xp + row * pairs, pairs, panel, panel_bias, out + row * n + col, n, cols, prefetch, prefetch_step);
        }
        if (row + 4 <= m) tile4(xp + row * pairs, pairs, panel, panel_bias, out + row * n + col, n, cols, NULL, 0), row += 4;
        if (row + 2 <= m) tile2(xp + row * pairs, pairs, panel, panel_bias, out + row * n + col, n, cols, NULL, 0), row += 2;
        if (row < m) tile1(xp + row * pairs, pairs, panel, panel_bias, out + row * n + col, n, cols, NULL, 0);
    }
    free(xb);
}
#else
int64_t gemm_bf16_supported(void) { return 0; }
#endif
