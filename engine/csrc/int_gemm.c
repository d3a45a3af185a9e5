/* Integer GEMM over GGUF-quantized weights (Q4_1, Q8_0) for CPUs without bfloat16 dot products:
 * out[M, N] = x[M, K] @ W^T (+ bias), float32 in and out, the products in 16-bit integers.
 *
 * Why: on a CPU with AVX2 and no AVX-512 (e.g. AMD Zen 3) a float32 FMA does 8 multiply-adds and
 * two of them issue per cycle; `vpmaddwd` multiplies 16 pairs of int16 and adds each pair into an
 * int32 lane, also two per cycle: twice the multiply-adds, less the `vpaddd` that accumulates each
 * product (measured ~1.6x the FMA's rate, docs/decisions.md, decision 20), so decode batches of
 * many rows and prompt steps, which are bound by arithmetic rather than by the weights' bytes, run
 * faster. This is llama.cpp's recipe for its quantized types (weights in integers, activations
 * quantized on the fly), with 16-bit activations instead of 8-bit ones.
 *
 * Exact weights: a GGUF block of 32 weights is w = d * q (Q8_0, q in -128..127) or d * q + m (Q4_1,
 * q in 0..15), and the kernel keeps q as int16 and d, m as float32, so it multiplies with the
 * float32 checkpoint's weights exactly (as quant_gemm.c does). The only rounding it adds is the
 * activations': each row's 32 values of a block become x ~ s * xq with xq = round(x / s) in
 * -32767..32767 and s the power of two that puts max |x| in [2^14, 2^15) (15 bits per block, finer
 * than float16's 11; bfloat16 has 8). A power of two keeps s * xq and s * d exact, so inputs that
 * are multiples of s (one-hot rows, small integers) give exactly the float32 products' sums. Per block, sum_k x_k w_k = s * d * sum_k xq_k q_k (+ m * sum_k x_k for Q4_1, with the
 * exact float32 sum of the block's x): the integer sum is exact (|xq q| <= 2^22, 32 terms < 2^31),
 * then scaled in float32. Its accuracy against float32 is measured, not assumed
 * (experiments/bench/bf16_accuracy.py, docs/decisions.md).
 *
 * Layout: panels of NC = 24 output columns (3 vectors of 8 int32 lanes). Per panel and block of
 * 32 k: the 24 columns' d, then m (float32, zero for Q8_0), then the quants as [16 k-pairs][24
 * columns][2] int16, so one 32-byte load holds 8 columns x 2 consecutive k, the shape `vpmaddwd`
 * multiplies against a broadcast pair (x[k], x[k + 1]). 1,728 bytes per panel block (L1).
 *
 * Loop order: threads split the panels (each streams its own part of the weights); per panel, a
 * chunk of rows keeps its float32 sums in L1 while the blocks go by, and every row tile of the
 * chunk reuses a block while it is in L1. A register tile is 3 rows x 24 columns: 9 int32
 * accumulators, 3 weight vectors and the broadcasts, within the 16 AVX2 registers.
 */
#include <immintrin.h>
#include <stdlib.h>

#include "common.h"
#include "gguf_blocks.h"

#if !(defined(__AVX2__) && defined(__FMA__))
#error "int_gemm.c needs AVX2 and FMA"
#endif

#define PAIRS 16     /* k-pairs per block */
#define NC 24        /* output columns per panel */
#define NV 3         /* 8-lane vectors per panel row */
#define CHUNK 48     /* rows whose float32 sums stay in L1 per panel (a multiple of 3: tiles do not straddle) */
#define PANEL_BLOCK_BYTES (2 * NC * sizeof(float) + PAIRS * NC * 2 * sizeof(int16_t))

/* Most rows of a decode batch the engine gives this kernel: the AVX2 skinny GEMM's limit (gemm.c);
 * from 5 rows (the quantized GEMM's limit with AVX2) to 32 it measured 1.2-1.4x faster than the
 * float32 skinny GEMM. Prompt steps up to PREFILL_MAX_ROWS (engine/integer_gemm.py) take it with
 * prefill_dtype=int16 (docs/decisions.md, decision 20). */
int64_t int_gemm_max_rows(void) { return 32; }

/* Bytes of the packed weight (0: unsupported type or K not a multiple of 32). */
int64_t int_packed_bytes(int64_t type, int64_t n, int64_t k) {
    if (block_bytes(type) == 0 || k % QK != 0) return 0;
    return (n + NC - 1) / NC * (k / QK) * (int64_t)PANEL_BLOCK_BYTES;
}

/* raw: the GGUF tensor, n rows of k / 32 blocks; packed: int_packed_bytes(type, n, k) bytes.
 * Columns past n (the last panel's padding) get d = m = q = 0: their weights are 0. */
void int_pack(const uint8_t *raw, int64_t type, int64_t n, int64_t k, uint8_t *packed) {
    const int64_t bytes = block_bytes(type), blocks = k / QK, panels = (n + NC - 1) / NC;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *dst = packed + (p * blocks + b) * PANEL_BLOCK_BYTES;
            float *d = (float *)dst, *m = d + NC;
            int16_t *q = (int16_t *)(m + NC);
            for (int64_t c = 0; c < NC; ++c) {
                const int64_t row = p * NC + c;
                int16_t values[QK] = {0};
                d[c] = m[c] = 0.0f;
                if (row < n) {
                    const uint8_t *block = raw + (row * blocks + b) * bytes;
                    d[c] = half_to_float(block);
                    if (type == GGML_Q4_1) {
                        m[c] = half_to_float(block + 2);
                        for (int j = 0; j < QK / 2; ++j) values[j] = block[4 + j] & 15, values[j + QK / 2] = block[4 + j] >> 4;
                    } else {
                        for (int j = 0; j < QK; ++j) values[j] = (int8_t)block[2 + j];
                    }
                }
                for (int j = 0; j < PAIRS; ++j) q[(j * NC + c) * 2] = values[2 * j], q[(j * NC + c) * 2 + 1] = values[2 * j + 1];
            }
        }
}

/* Rows of the register tile that starts at row `row` of m: 3, then 2, 1. Tiles start at multiples
 * of 3 (only the last one is shorter). */
static inline int64_t tile_rows(int64_t row, int64_t m) {
    const int64_t left = m - row;
    return left >= 3 ? 3 : left;
}

static inline float horizontal_max(__m256 v) {
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
}

static inline float horizontal_sum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* One row's block of 32: xq = round(x / s) as 16 int32 pairs (x[2j], x[2j + 1]), s = 2^(e - 15) for
 * max |x| = f * 2^e, f in [0.5, 1), so max |x| / s lies in [16384, 32768); the float32 sum of x.
 * Rounding is to nearest even, as lrintf; the one value that can round up to 2^15 is clamped. */
static void quantize_block(const float *src, int32_t pairs[PAIRS], float *scale, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
        total = _mm256_add_ps(total, v[i]);
    }
    const float largest = horizontal_max(top);
    int e = 0;
    frexpf(largest, &e);
    *scale = largest > 0.0f ? ldexpf(1.0f, e - 15) : 0.0f;
    *sum = horizontal_sum(total);
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? ldexpf(1.0f, 15 - e) : 0.0f);
    const __m256i low = _mm256_set1_epi16(-32767);
    for (int i = 0; i < 4; i += 2) {
        /* packs works within 128-bit lanes: [a0..3 b0..3 a4..7 b4..7]; the permute restores k order */
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inverse));
        const __m256i packed = _mm256_max_epi16(_mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8), low);
        _mm256_storeu_si256((__m256i *)(pairs + 8 * (i / 2)), packed);
    }
}

/* x as int16, interleaved per register tile: the tile of rows [t, t + R) at xq + t * k holds, per
 * block, its 16 k-pairs x R rows ([16][R][2], so a tile reads its broadcasts at constant offsets
 * from one pointer); with each row's per-block scale and float32 sum. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t x_stride, int16_t *xq, float *scale, float *sum) {
    const int64_t blocks = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
        const int64_t t = r / 3 * 3, rows = tile_rows(t, m), local = r - t;
        for (int64_t b = 0; b < blocks; ++b) {
            int32_t pairs[PAIRS];
            quantize_block(x + r * x_stride + b * QK, pairs, scale + r * blocks + b, sum + r * blocks + b);
            int32_t *dst = (int32_t *)(xq + t * k + b * QK * rows) + local;
            for (int j = 0; j < PAIRS; ++j) memcpy(dst + j * rows, pairs + j, sizeof(int32_t));
        }
    }
}

/* facc[r][0..24) += one block's dot products for ROWS rows (xq: the tile's block, [16][ROWS][2]),
 * scaled: s_r * d_c * (integer sum) + m_c * sum_r. */
#define DEFINE_TILE(NAME, ROWS)                                                                                  \
    static __attribute__((noinline)) void NAME(const int16_t *xq, const uint8_t *panel_block, const float *scale, \
                            const float *sum, int64_t blocks, int has_m, float *facc) {                          \
        const float *d = (const float *)panel_block, *mm = d + NC;                                               \
        const int16_t *q = (const int16_t *)(mm + NC);                                                           \
        __m256i acc[ROWS][NV];                                                                                   \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)                                                   \
            _Pragma("GCC unroll 3") for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();             \
        _Pragma("GCC unroll 8") for (int j = 0; j < PAIRS; ++j) {                                                \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + j * NC * 2));                            \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + j * NC * 2 + 16));                       \
            const __m256i w2 = _mm256_loadu_si256((const __m256i *)(q + j * NC * 2 + 32));                       \
            _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {                                             \
                int32_t pair;                                                                                    \
                memcpy(&pair, xq + (j * ROWS + r) * 2, sizeof pair);                                         \
                const __m256i a = _mm256_set1_epi32(pair);                                                       \
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, w0));                               \
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, w1));                               \
                acc[r][2] = _mm256_add_epi32(acc[r][2], _mm256_madd_epi16(a, w2));                               \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {                                                 \
            const __m256 s = _mm256_set1_ps(scale[r * blocks]), total = _mm256_set1_ps(sum[r * blocks]);         \
            _Pragma("GCC unroll 3") for (int v = 0; v < NV; ++v) {                                               \
                __m256 f = _mm256_loadu_ps(facc + r * NC + 8 * v);                                               \
                const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(d + 8 * v), s);                                  \
                f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]), ds, f);                                       \
                if (has_m) f = _mm256_fmadd_ps(_mm256_loadu_ps(mm + 8 * v), total, f);                           \
                _mm256_storeu_ps(facc + r * NC + 8 * v, f);                                                      \
            }                                                                                                    \
        }                                                                                                        \
    }
DEFINE_TILE(tile3, 3)
DEFINE_TILE(tile2, 2)
DEFINE_TILE(tile1, 1)

void int_gemm(const float *x, int64_t m, int64_t k, int64_t x_stride, const uint8_t *packed, int64_t type,
              const float *bias, int64_t n, float *out) {
    const int64_t panels = (n + NC - 1) / NC, blocks = k / QK;
    const int has_m = type == GGML_Q4_1;
    int16_t *xq = malloc(sizeof(int16_t) * m * k);
    float *scale = malloc(sizeof(float) * m * blocks), *sum = malloc(sizeof(float) * m * blocks);
    if (xq == NULL || scale == NULL || sum == NULL) abort();
    quantize_rows(x, m, k, x_stride, xq, scale, sum);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const uint8_t *panel = packed + p * blocks * PANEL_BLOCK_BYTES;
        const int64_t col = p * NC, cols = n - col < NC ? n - col : NC;
        float facc[CHUNK * NC];
        for (int64_t first = 0; first < m; first += CHUNK) {
            const int64_t rows = m - first < CHUNK ? m - first : CHUNK;
            memset(facc, 0, sizeof(float) * rows * NC);
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t *panel_block = panel + b * PANEL_BLOCK_BYTES;
                for (int64_t r = 0, tile; r < rows; r += tile) {
                    const int64_t row = first + r;
                    tile = tile_rows(row, m);
                    const int16_t *tile_x = xq + row * k + b * QK * tile;
                    const float *tile_scale = scale + row * blocks + b, *tile_sum = sum + row * blocks + b;
                    if (tile == 3) tile3(tile_x, panel_block, tile_scale, tile_sum, blocks, has_m, facc + r * NC);
                    else if (tile == 2) tile2(tile_x, panel_block, tile_scale, tile_sum, blocks, has_m, facc + r * NC);
                    else tile1(tile_x, panel_block, tile_scale, tile_sum, blocks, has_m, facc + r * NC);
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                float *dst = out + (first + r) * n + col;
                for (int64_t c = 0; c < cols; ++c) dst[c] = facc[r * NC + c] + (bias != NULL ? bias[col + c] : 0.0f);
            }
        }
    }
    free(xq), free(scale), free(sum);
}

/* The same GEMM with the signature of decoder_layer.c's linear_fn (one entry point per type), so a
 * whole decoder layer run in C calls it like the skinny GEMM (engine/native_layers.py). */
void int_gemm_q4_1(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *packed, const float *bias,
                   int64_t n, float *out) {
    int_gemm(x, m, k, x_stride, packed, GGML_Q4_1, bias, n, out);
}

void int_gemm_q8_0(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *packed, const float *bias,
                   int64_t n, float *out) {
    int_gemm(x, m, k, x_stride, packed, GGML_Q8_0, bias, n, out);
}
