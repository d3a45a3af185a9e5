/* GEMM for few rows over GGUF-quantized weights (Q4_1, Q8_0): out[M, N] = x[M, K] @ W^T (+ bias),
 * float32 activations and outputs, W kept in its GGUF blocks of 32 weights along K:
 *
 *   Q4_1 (20 bytes): float16 d, float16 m, 16 bytes of nibbles; byte j holds q_j (low nibble)
 *                    and q_{j+16} (high nibble); w = d * q + m
 *   Q8_0 (34 bytes): float16 d, 32 int8 q; w = d * q
 *
 * Exactness: d * q is exact in float32 (a 4- or 8-bit integer times an 11-bit float16 mantissa
 * fits in 24 bits), so fma(d, q, m) rounds once, exactly like the gguf package's (d * q) + m:
 * the weights this kernel multiplies with are BITWISE those of the float32 checkpoint that
 * engine/gguf_checkpoint.py writes; only the order of the sums differs from a float32 GEMM.
 *
 * Layout: the blocks are repacked once into panels of LANES output rows (one vector of output
 * columns), block-column-major: for each block of 32 k, the panel stores its LANES rows' d (then m)
 * as one float16 vector and their quants transposed, [16][LANES] bytes (Q4_1, the nibble pairing of
 * GGUF kept) or [32][LANES] (Q8_0). A panel is one contiguous stream of the file's own bytes (no
 * byte is added: 20 or 34 bytes per 32 weights, 6.4x / 3.8x fewer than float32), and one vector
 * load + widen gives the quants of LANES output columns at one k.
 *
 * Per panel and block, the 32 k of the block are dequantized ONCE into 32 vectors (2 KB, L1) and
 * every row of x uses them: register tiles of 8 rows x LANES columns (AVX-512; 4 x 8 with AVX2)
 * accumulate over the block's 32 k; fewer rows split k over independent accumulators so that
 * one row still has 8 (4) FMA chains in flight. Threads split the panels (OpenMP, static), each
 * streaming its own contiguous part of the weights. Rows are taken CHUNK at a time (the
 * accumulators of a chunk stay in L1); more rows than that dequantize again per chunk, but the
 * engine calls this only up to quant_gemm_max_rows() rows (measured crossover, below).
 *
 * ISA: AVX-512 (16-float vectors), or AVX2 with F16C and FMA (8); elsewhere the build fails
 * and the engine keeps the float32 weights (engine/quantized_gemm.py).
 */
#include <stdlib.h>

#include "gguf_blocks.h"
#include "lanes.h"

/* The vector type, its FMA and broadcast come from lanes.h (LANES = 16 with AVX-512, 8 with AVX2);
 * here only what reading GGUF blocks adds: float16 scales, widened quants, the tile sizes. */
#if defined(__AVX512F__)
#define CHAINS 8 /* independent accumulators per tile: 2 FMA pipes x 4 cycles of latency */
#define MR 8     /* rows per register tile */
static inline vf load_halves(const uint8_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi widen_u8(const uint8_t *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi widen_i8(const uint8_t *p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vf to_float(vi q) { return (vf)_mm512_cvtepi32_ps((__m512i)q); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define CHAINS 4
#define MR 4
static inline vf load_halves(const uint8_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vi widen_u8(const uint8_t *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi widen_i8(const uint8_t *p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vf to_float(vi q) { return (vf)_mm256_cvtepi32_ps((__m256i)q); }
#else
#error "quant_gemm.c needs AVX-512, or AVX2 with F16C and FMA"
#endif

/* Most rows for which this kernel measured faster than the float32 skinny GEMM (gemm.c) on the
 * 30 layers' shapes of SmolLM2-135M with weights streamed from memory (docs/quantized_weights.md). */
int64_t quant_gemm_max_rows(void) { return LANES == 16 ? 14 : 4; }

/* Bytes of the packed weight (0: unsupported type or K not a multiple of 32). */
int64_t quant_packed_bytes(int64_t type, int64_t n, int64_t k) {
    if (block_bytes(type) == 0 || k % QK != 0) return 0;
    return (n + LANES - 1) / LANES * (k / QK) * LANES * block_bytes(type);
}

/* raw: the GGUF tensor, n rows of k / 32 blocks; packed: quant_packed_bytes(type, n, k) bytes.
 * Rows past n (the last panel's padding) are zero: d = m = 0, so their weights are 0. */
void quant_pack(const uint8_t *raw, int64_t type, int64_t n, int64_t k, uint8_t *packed) {
    const int64_t bytes = block_bytes(type), blocks = k / QK, panels = (n + LANES - 1) / LANES;
    const int64_t scales = type == GGML_Q4_1 ? 2 : 1; /* float16 values before the quants */
#pragma omp parallel for
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *dst = packed + (p * blocks + b) * LANES * bytes;
            for (int64_t c = 0; c < LANES; ++c) {
                const int64_t row = p * LANES + c;
                const uint8_t *block = raw + (row * blocks + b) * bytes;
                for (int64_t s = 0; s < scales; ++s)
                    for (int64_t byte = 0; byte < 2; ++byte)
                        dst[s * 2 * LANES + 2 * c + byte] = row < n ? block[2 * s + byte] : 0;
                for (int64_t j = 0; j < bytes - 2 * scales; ++j)
                    dst[2 * scales * LANES + j * LANES + c] = row < n ? block[2 * scales + j] : 0;
            }
        }
}

/* acc[r] (r < ROWS) = x[r, :] @ W[panel's LANES rows, :]^T for one panel of blocks of type TYPE.
 * xt holds the tile's ROWS rows interleaved, xt[k * ROWS + r] (one pointer and constant offsets:
 * eight row pointers would not fit in the general registers). SPLIT accumulators per row
 * (consecutive k go round-robin to them, summed at the end) keep CHAINS FMAs in flight. Each
 * block's weights are dequantized in registers once, one vector per k, and used by every row. */
#define DEFINE_TILE(NAME, TYPE, BYTES, ROWS, SPLIT)                                                   \
    static __attribute__((noinline)) void NAME(const float *xt, const uint8_t *panel, int64_t blocks, vf *acc) { \
        vf c[ROWS][SPLIT];                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)                                        \
            _Pragma("GCC unroll 8") for (int s = 0; s < SPLIT; ++s) c[r][s] = (vf){0};              \
        for (int64_t b = 0; b < blocks; ++b, xt += QK * ROWS) {                                       \
            const uint8_t *src = panel + b * LANES * BYTES;                                              \
            const vf d = load_halves(src);                                                          \
            if (TYPE == GGML_Q4_1) { /* k = j and j + 16 share a byte */                              \
                const vf m = load_halves(src + 2 * LANES);                                             \
                _Pragma("GCC unroll 16") for (int j = 0; j < QK / 2; ++j) {                           \
                    const vi q = widen_u8(src + 4 * LANES + j * LANES);                                   \
                    const vf lo = vfma(d, to_float(q & 15), m), hi = vfma(d, to_float(q >> 4), m);  \
                    const int s = (j % (SPLIT / 2)) * 2;                                              \
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {                          \
                        c[r][s] = vfma(vbroadcast(xt[j * ROWS + r]), lo, c[r][s]);                     \
                        c[r][s + 1] = vfma(vbroadcast(xt[(j + QK / 2) * ROWS + r]), hi, c[r][s + 1]);  \
                    }                                                                                 \
                }                                                                                     \
            } else {                                                                                  \
                _Pragma("GCC unroll 32") for (int j = 0; j < QK; ++j) {                               \
                    const vf w = d * to_float(widen_i8(src + 2 * LANES + j * LANES));                     \
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)                            \
                        c[r][j % SPLIT] = vfma(vbroadcast(xt[j * ROWS + r]), w, c[r][j % SPLIT]);      \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {                                      \
            vf sum = c[r][0];                                                                       \
            _Pragma("GCC unroll 8") for (int s = 1; s < SPLIT; ++s) sum += c[r][s];                   \
            acc[r] = sum;                                                                             \
        }                                                                                             \
    }
/* Tiles of 8 (AVX-512), 4, 2 and 1 rows: 16, 8, 8 and 8 accumulators (AVX2: 8, 4 and 4). */
#if MR == 8
#define DEFINE_TILE8(PREFIX, TYPE, BYTES) DEFINE_TILE(PREFIX##_tile8, TYPE, BYTES, 8, 2)
#else
#define DEFINE_TILE8(PREFIX, TYPE, BYTES)
#endif
#define DEFINE_TILES(PREFIX, TYPE, BYTES)                         \
    DEFINE_TILE8(PREFIX, TYPE, BYTES)                             \
    DEFINE_TILE(PREFIX##_tile4, TYPE, BYTES, 4, 2)                \
    DEFINE_TILE(PREFIX##_tile2, TYPE, BYTES, 2, CHAINS / 2)       \
    DEFINE_TILE(PREFIX##_tile1, TYPE, BYTES, 1, CHAINS)
DEFINE_TILES(q4_1, GGML_Q4_1, Q4_1_BYTES)
DEFINE_TILES(q8_0, GGML_Q8_0, Q8_0_BYTES)

/* Rows of the register tile that starts at row `row` of m: 8 (AVX-512) or 4, then 4, 2, 1. */
static inline int64_t tile_rows(int64_t row, int64_t m) {
    const int64_t left = m - row;
    return left >= MR ? MR : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* The tiles by type (0: Q4_1, 1: Q8_0) and rows. */
typedef void tile_fn(const float *xt, const uint8_t *panel, int64_t blocks, vf *acc);
#if MR == 8
#define TILE8(PREFIX) , [8] = PREFIX##_tile8
#else
#define TILE8(PREFIX)
#endif
static tile_fn *const TILES[2][MR + 1] = {
    {[1] = q4_1_tile1, [2] = q4_1_tile2, [4] = q4_1_tile4 TILE8(q4_1)},
    {[1] = q8_0_tile1, [2] = q8_0_tile2, [4] = q8_0_tile4 TILE8(q8_0)},
};

void quant_gemm(const float *x, int64_t m, int64_t k, int64_t x_stride, const uint8_t *packed, int64_t type,
                const float *bias, int64_t n, float *out) {
    const int64_t panels = (n + LANES - 1) / LANES, blocks = k / QK, bytes = LANES * block_bytes(type);
    /* x interleaved per register tile: tile rows [t, t + R) at xt + t * k, as [k][R]. */
    float *xt = malloc(sizeof(float) * m * k);
    if (xt == NULL) abort();
    for (int64_t t = 0, rows; t < m; t += rows) {
        rows = tile_rows(t, m);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t kk = 0; kk < k; ++kk) xt[t * k + kk * rows + r] = x[(t + r) * x_stride + kk];
    }
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const uint8_t *panel = packed + p * blocks * bytes;
        const int64_t col = p * LANES, cols = n - col < LANES ? n - col : LANES;
        for (int64_t t = 0, rows; t < m; t += rows) {
            rows = tile_rows(t, m);
            vf acc[MR];
            TILES[type == GGML_Q4_1 ? 0 : 1][rows](xt + t * k, panel, blocks, acc);
            for (int64_t r = 0; r < rows; ++r) {
                float values[LANES];
                memcpy(values, &acc[r], sizeof values);
                if (bias != NULL)
                    for (int64_t c = 0; c < cols; ++c) values[c] += bias[col + c];
                memcpy(out + (t + r) * n + col, values, sizeof(float) * cols);
            }
        }
    }
    free(xt);
}

/* The same GEMM with the signature of decoder_layer.c's linear_fn (one entry point per type), so a
 * whole decoder layer run in C calls it like the skinny GEMM (engine/native_layers.py). */
void quant_gemm_q4_1(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *packed, const float *bias,
                     int64_t n, float *out) {
    quant_gemm(x, m, k, x_stride, packed, GGML_Q4_1, bias, n, out);
}

void quant_gemm_q8_0(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *packed, const float *bias,
                     int64_t n, float *out) {
    quant_gemm(x, m, k, x_stride, packed, GGML_Q8_0, bias, n, out);
}
