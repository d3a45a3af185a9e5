/* Integer GEMM over GGUF-quantized weights (Q4_1, Q8_0) with 8-bit activations, for CPUs with
 * AVX512-VNNI: out[M, N] = x[M, K] @ W^T (+ bias), float32 in and out, the products in int8.
 *
 * Why: `vpdpbusd` multiplies 64 pairs of (unsigned byte, signed byte) and adds each group of four
 * into an int32 lane, one instruction per cycle on a 512-bit unit: twice the multiply-adds of
 * bfloat16's `vdpbf16ps` (32 pairs) and four times float32's FMA (measured on a 2-core AMD EPYC
 * with AVX512-BF16: 3.4 G instructions/s of each, per core). Prompt steps and decode batches of
 * many rows are bound by arithmetic, so they run faster. This is llama.cpp's recipe for its CPU
 * matmuls: weights in their GGUF integers, activations quantized per block of 32 on the fly.
 *
 * Exact weights: a GGUF block of 32 weights is w = d * q (Q8_0, q in -128..127) or d * q + m (Q4_1,
 * q in 0..15); the kernel keeps q as bytes and d, m as float32, so it multiplies with the float32
 * checkpoint's weights exactly. The only rounding it adds is the activations': each row's block
 * of 32 becomes x ~ s * xq, xq = round(x / s) in -127..127, s = max |x| / 127 (llama.cpp's Q8_0
 * activations: 8 bits per block, against bfloat16's 8 bits per value). Its accuracy against
 * float32 is measured, not assumed (experiments/bench/bf16_accuracy.py, docs/decisions.md).
 *
 * One operand of `vpdpbusd` is unsigned. Q4_1: the weights' q (0..15) are, the activations signed:
 * sum_k x_k w_k = s d sum_k xq_k q_k + m sum_k x_k, with the block's exact float32 sum of x.
 * Q8_0: the activations are made unsigned, xu = xq + 128, so sum_k xu_k q_k = sum_k xq_k q_k +
 * 128 sum_k q_k; the panel stores -128 sum_k q_k per column and block as the int32 sums' start.
 * The integer sums are exact (|products| <= 255 * 128, 32 terms), then scaled in float32.
 *
 * Layout: panels of NC = 48 output columns (3 vectors of 16 int32 lanes). Per panel and block of
 * 32 k: the 48 columns' d, then m (float32; for Q8_0 the int32 start instead), then the quants as
 * [8 k-quads][48 columns][4] bytes, so one 64-byte load holds 16 columns x 4 consecutive k, the
 * shape `vpdpbusd` multiplies against a broadcast quad (x[k..k + 3]). 1,920 bytes per panel block.
 *
 * Loop order: threads split the panels (each streams its own part of the weights); per panel, a
 * register tile of 4 rows x 48 columns walks every block of k, its float32 sums in registers
 * (12 int32 and 12 float32 accumulators, 3 weight vectors, within the 32 AVX-512 registers), so
 * each panel is read from L1 / L2 once per tile.
 */
#include <immintrin.h>
#include <stdlib.h>

#include "common.h"
#include "gguf_blocks.h"

/* Built without AVX512-VNNI in the compiler's target (-march=native on a CPU without it), the file
 * holds only int8_gemm_supported(), which returns 0, and the engine keeps its other kernels. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
int64_t int8_gemm_supported(void) { return 1; }

#define QUADS 8      /* k-quads per block */
#define NC 48        /* output columns per panel */
#define NV 3         /* 16-lane vectors per panel row */
#define TILE 4       /* rows per register tile */
#define PANEL_BLOCK_BYTES (2 * NC * sizeof(float) + QUADS * NC * 4)

/* Most rows of a decode batch the engine gives this kernel: as the int16 kernel's (int_gemm.c);
 * prompt steps up to PREFILL_MAX_ROWS (engine/integer_gemm.py) take it with prefill_dtype=int8. */
int64_t int8_gemm_max_rows(void) { return 32; }

/* Bytes of the packed weight (0: unsupported type or K not a multiple of 32). */
int64_t int8_packed_bytes(int64_t type, int64_t n, int64_t k) {
    if (block_bytes(type) == 0 || k % QK != 0) return 0;
    return (n + NC - 1) / NC * (k / QK) * (int64_t)PANEL_BLOCK_BYTES;
}

/* raw: the GGUF tensor, n rows of k / 32 blocks; packed: int8_packed_bytes(type, n, k) bytes.
 * Columns past n (the last panel's padding) get d = m = q = 0: their weights are 0. */
void int8_pack(const uint8_t *raw, int64_t type, int64_t n, int64_t k, uint8_t *packed) {
    const int64_t bytes = block_bytes(type), blocks = k / QK, panels = (n + NC - 1) / NC;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *dst = packed + (p * blocks + b) * PANEL_BLOCK_BYTES;
            float *d = (float *)dst, *m = d + NC;
            int32_t *start = (int32_t *)m;
            uint8_t *q = (uint8_t *)(m + NC);
            for (int64_t c = 0; c < NC; ++c) {
                const int64_t row = p * NC + c;
                uint8_t values[QK] = {0};
                d[c] = m[c] = 0.0f;
                if (row < n) {
                    const uint8_t *block = raw + (row * blocks + b) * bytes;
                    d[c] = half_to_float(block);
                    if (type == GGML_Q4_1) {
                        m[c] = half_to_float(block + 2);
                        for (int j = 0; j < QK / 2; ++j) values[j] = block[4 + j] & 15, values[j + QK / 2] = block[4 + j] >> 4;
                    } else {
                        int32_t total = 0;
                        for (int j = 0; j < QK; ++j) values[j] = block[2 + j], total += (int8_t)block[2 + j];
                        start[c] = -128 * total;
                    }
                }
                for (int j = 0; j < QUADS; ++j) memcpy(q + (j * NC + c) * 4, values + 4 * j, 4);
            }
        }
}

/* Every row's blocks of 32 as bytes: xq = round(x / s) (+ 128 for Q8_0: unsigned), s = max |x| / 127
 * per block; `sum`: the block's float32 sum of x (Q4_1's m term). Rounding is to nearest even. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t x_stride, int unsigned_bytes,
                          uint8_t *xq, float *scale, float *sum) {
    const int64_t blocks = k / QK;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m128i offset = _mm_set1_epi8(unsigned_bytes ? (char)128 : 0);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float *src = x + r * x_stride + b * QK;
            const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
            const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
            const float s = largest / 127.0f;
            scale[r * blocks + b] = s;
            sum[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
            const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
            /* |x| * 127 / max rounds to at most 127: the signed saturation never clips */
            const __m128i a = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse)));
            const __m128i c = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse)));
            uint8_t *dst = xq + r * k + b * QK;
            _mm_storeu_si128((__m128i *)dst, _mm_add_epi8(a, offset));
            _mm_storeu_si128((__m128i *)(dst + 16), _mm_add_epi8(c, offset));
        }
}

/* out[r][col..col + cols) = the tile's ROWS rows x one panel, over every block of k; Q8 picks which
 * operand is unsigned (see the header). */
#define DEFINE_TILE(NAME, ROWS, Q8)                                                                               \
    static __attribute__((noinline)) void NAME(const uint8_t *xq, int64_t k, const uint8_t *panel,               \
                            const float *scale, const float *sum, int64_t blocks, const float *bias,             \
                            int64_t cols, float *out, int64_t n) {                                               \
        __m512 f[ROWS][NV];                                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)                                                   \
            _Pragma("GCC unroll 3") for (int v = 0; v < NV; ++v) f[r][v] = _mm512_setzero_ps();                  \
        for (int64_t b = 0; b < blocks; ++b) {                                                                   \
            const uint8_t *panel_block = panel + b * PANEL_BLOCK_BYTES;                                          \
            const float *d = (const float *)panel_block, *mm = d + NC;                                           \
            const uint8_t *q = (const uint8_t *)(mm + NC);                                                       \
            __m512i acc[ROWS][NV];                                                                               \
            _Pragma("GCC unroll 3") for (int v = 0; v < NV; ++v) {                                               \
                const __m512i start = Q8 ? _mm512_loadu_si512(mm + 16 * v) : _mm512_setzero_si512();             \
                _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) acc[r][v] = start;                        \
            }                                                                                                    \
            _Pragma("GCC unroll 8") for (int j = 0; j < QUADS; ++j) {                                            \
                const __m512i w0 = _mm512_loadu_si512(q + j * NC * 4);                                           \
                const __m512i w1 = _mm512_loadu_si512(q + j * NC * 4 + 64);                                      \
                const __m512i w2 = _mm512_loadu_si512(q + j * NC * 4 + 128);                                     \
                _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {                                         \
                    int32_t quad;                                                                                \
                    memcpy(&quad, xq + r * k + b * QK + 4 * j, sizeof quad);                                     \
                    const __m512i a = _mm512_set1_epi32(quad);                                                   \
                    if (Q8) {                                                                                    \
                        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, w0);                                       \
                        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a, w1);                                       \
                        acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], a, w2);                                       \
                    } else {                                                                                     \
                        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, a);                                       \
                        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, a);                                       \
                        acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], w2, a);                                       \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
            _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {                                             \
                const __m512 s = _mm512_set1_ps(scale[r * blocks + b]);                                          \
                const __m512 total = _mm512_set1_ps(sum[r * blocks + b]);                                        \
                _Pragma("GCC unroll 3") for (int v = 0; v < NV; ++v) {                                           \
                    const __m512 ds = _mm512_mul_ps(_mm512_loadu_ps(d + 16 * v), s);                             \
                    f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][v]), ds, f[r][v]);                       \
                    if (!Q8) f[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(mm + 16 * v), total, f[r][v]);           \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 3") for (int v = 0; v < NV; ++v) {                                                   \
            const int64_t left = cols - 16 * v;                                                                  \
            const __mmask16 mask = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);          \
            const __m512 add = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();  \
            _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)                                               \
                _mm512_mask_storeu_ps(out + r * n + 16 * v, mask, _mm512_add_ps(f[r][v], add));                  \
        }                                                                                                        \
    }
DEFINE_TILE(tile4_q4_1, 4, 0)
DEFINE_TILE(tile3_q4_1, 3, 0)
DEFINE_TILE(tile2_q4_1, 2, 0)
DEFINE_TILE(tile1_q4_1, 1, 0)
DEFINE_TILE(tile4_q8_0, 4, 1)
DEFINE_TILE(tile3_q8_0, 3, 1)
DEFINE_TILE(tile2_q8_0, 2, 1)
DEFINE_TILE(tile1_q8_0, 1, 1)

typedef void (*tile_fn)(const uint8_t *, int64_t, const uint8_t *, const float *, const float *, int64_t, const float *,
                        int64_t, float *, int64_t);

void int8_gemm(const float *x, int64_t m, int64_t k, int64_t x_stride, const uint8_t *packed, int64_t type,
               const float *bias, int64_t n, float *out) {
    static const tile_fn q4_1[TILE + 1] = {NULL, tile1_q4_1, tile2_q4_1, tile3_q4_1, tile4_q4_1};
    static const tile_fn q8_0[TILE + 1] = {NULL, tile1_q8_0, tile2_q8_0, tile3_q8_0, tile4_q8_0};
    const tile_fn *tiles = type == GGML_Q8_0 ? q8_0 : q4_1;
    const int64_t panels = (n + NC - 1) / NC, blocks = k / QK;
    uint8_t *xq = malloc((size_t)(m * k));
    float *scale = malloc(sizeof(float) * m * blocks), *sum = malloc(sizeof(float) * m * blocks);
    if (xq == NULL || scale == NULL || sum == NULL) abort();
    quantize_rows(x, m, k, x_stride, type == GGML_Q8_0, xq, scale, sum);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const uint8_t *panel = packed + p * blocks * PANEL_BLOCK_BYTES;
        const int64_t col = p * NC, cols = n - col < NC ? n - col : NC;
        for (int64_t row = 0; row < m; row += TILE) {
            const int64_t rows = m - row < TILE ? m - row : TILE;
            tiles[rows](xq + row * k, k, panel, scale + row * blocks, sum + row * blocks, blocks,
                        bias != NULL ? bias + col : NULL, cols, out + row * n + col, n);
        }
    }
    free(xq), free(scale), free(sum);
}

/* The same GEMM with the signature of decoder_layer.c's linear_fn (one entry point per type), so a
 * whole decoder layer run in C calls it like the skinny GEMM (engine/native_layers.py). */
void int8_gemm_q4_1(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *packed, const float *bias,
                    int64_t n, float *out) {
    int8_gemm(x, m, k, x_stride, packed, GGML_Q4_1, bias, n, out);
}

void int8_gemm_q8_0(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *packed, const float *bias,
                    int64_t n, float *out) {
    int8_gemm(x, m, k, x_stride, packed, GGML_Q8_0, bias, n, out);
}
#else
int64_t int8_gemm_supported(void) { return 0; }
#endif
