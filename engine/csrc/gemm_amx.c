/* Decode-sized GEMM on AMX tiles: out[M, N] (float32) = x[M, K] (float32) @ W^T (+ bias), with W
 * in gemm_bf16.c's bfloat16 panels, on CPUs with AMX (amx_tile, amx_bf16).
 *
 * AMX adds eight tile registers of up to 16 rows x 64 bytes and one instruction, TDPBF16PS, that
 * multiplies a 16 x 32 bfloat16 tile A by a 32 x 16 tile B held as 16 rows of 16 column pairs and
 * adds the 16 x 16 float32 products into a tile C: 8,192 multiply-adds per instruction, 256 times
 * one AVX-512 FMA. The B layout is exactly gemm_bf16.c's panel (per pair of k, the panel's 48
 * columns as (W[c][k], W[c][k+1])): a B tile is 16 consecutive pair rows of one 16-column third
 * of a panel, loaded with the panel's 192-byte row stride. So this kernel reads the same packed
 * weight as the AVX512-BF16 one, and gives the same products (bfloat16 x bfloat16 is exact in
 * float32); only the order of the float32 sums differs.
 *
 * Per panel (48 columns) and per block of 16 rows of x: three C tiles (16 x 48 float32) over all
 * k, each step one A tile (16 rows x 32 k of x in bfloat16) and three B tiles. Panels are the
 * outer loop, split over the OpenMP threads, so each panel streams from memory once and the row
 * blocks after the first re-read it from cache.
 *   - x is rounded to bfloat16 once per call, into a copy zero-padded to whole tiles (16 rows,
 *     32 k): padded rows and k contribute exact zeros;
 *   - a k tail (pairs not a multiple of 16) reads its B rows from a zero-padded copy of the
 *     panel's last rows, never past the panel;
 *   - C tiles are stored to a 16 x 48 scratch, and the valid rows and columns (+ bias) copied out.
 * Every thread configures its tiles (all eight 16 rows x 64 bytes) at the start of the parallel
 * region and releases them at its end; the process must hold the kernel's permission for AMX
 * state (arch_prctl ARCH_REQ_XCOMP_PERM), which gemm_amx_supported() requests.
 *
 * Built only where the compiler targets AMX (-march=native on such a CPU); elsewhere
 * gemm_amx_supported() returns 0 and the engine keeps the AVX512-BF16 or float32 kernels.
 */
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ROWS 16  /* rows of x per A / C tile */
#define TILE_PAIRS 16 /* k pairs per A / B tile: 32 bfloat16 = 64 bytes per row */
#define NR 48         /* columns per panel (gemm_bf16.c): three 16-column B / C tiles */

/* The LDTILECFG operand (palette 1): bytes per row and rows of each tile register. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 where this build has AMX and the kernel grants this process AMX state (asked once; repeated
 * requests are harmless), else 0. */
int64_t gemm_amx_supported(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* The most rows the engine gives this kernel: decode batches and the default scheduler's 256-token
 * steps (oneDNN's prepacked copies above; this kernel re-reads x once per panel, so its lead over
 * them shrinks with the rows: decision 24). */
int64_t gemm_amx_max_rows(void) { return 256; }

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* The linear_fn of decoder_layer.c (weight: gemm_bf16.c's pack_weight_bf16 panels). */
void gemm_packed_bf16_amx(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *weight,
                          const float *bias, int64_t n, float *out) {
    const int64_t pairs = (k + 1) / 2, k_blocks = (pairs + TILE_PAIRS - 1) / TILE_PAIRS;
    const int64_t full_blocks = pairs / TILE_PAIRS, tail_pairs = pairs % TILE_PAIRS;
    const int64_t padded_k = k_blocks * 2 * TILE_PAIRS, row_blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t panels = (n + NR - 1) / NR;
    uint16_t *xb = calloc((size_t)(row_blocks > 0 ? row_blocks : 1) * TILE_ROWS * padded_k, sizeof(uint16_t));
    if (xb == NULL) {
        fprintf(stderr, "gemm_packed_bf16_amx: out of memory for the %lld x %lld bfloat16 copy of x\n", (long long)m, (long long)k);
        abort();
    }
    for (int64_t r = 0; r < m; ++r)
        for (int64_t kk = 0; kk < k; ++kk) xb[r * padded_k + kk] = to_bf16(x[r * x_stride + kk]);
#pragma omp parallel
    {
        tile_config config = {0};
        config.palette_id = 1;
        for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
        _tile_loadconfig(&config);
        float scratch[TILE_ROWS * NR] __attribute__((aligned(64)));
        uint32_t tail[TILE_PAIRS * NR] __attribute__((aligned(64)));
        memset(tail, 0, sizeof tail);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint32_t *panel = (const uint32_t *)weight + p * pairs * NR;
            if (tail_pairs) memcpy(tail, panel + full_blocks * TILE_PAIRS * NR, sizeof(uint32_t) * tail_pairs * NR);
            const int64_t col = p * NR, cols = n - col < NR ? n - col : NR;
            for (int64_t block = 0; block < row_blocks; ++block) {
                const uint16_t *a = xb + block * TILE_ROWS * padded_k;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                for (int64_t kb = 0; kb < k_blocks; ++kb) {
                    const uint32_t *b = kb < full_blocks ? panel + kb * TILE_PAIRS * NR : tail;
                    _tile_loadd(3, a + kb * 2 * TILE_PAIRS, padded_k * sizeof(uint16_t));
                    _tile_loadd(4, b, NR * sizeof(uint32_t));
                    _tile_loadd(5, b + 16, NR * sizeof(uint32_t));
                    _tile_loadd(6, b + 32, NR * sizeof(uint32_t));
                    _tile_dpbf16ps(0, 3, 4);
                    _tile_dpbf16ps(1, 3, 5);
                    _tile_dpbf16ps(2, 3, 6);
                }
                _tile_stored(0, scratch, NR * sizeof(float));
                _tile_stored(1, scratch + 16, NR * sizeof(float));
                _tile_stored(2, scratch + 32, NR * sizeof(float));
                const int64_t first_row = block * TILE_ROWS, rows = m - first_row < TILE_ROWS ? m - first_row : TILE_ROWS;
                for (int64_t r = 0; r < rows; ++r) {
                    float *dst = out + (first_row + r) * n + col;
                    const float *src = scratch + r * NR;
                    if (bias != NULL)
                        for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bias[col + c];
                    else
                        memcpy(dst, src, sizeof(float) * cols);
                }
            }
        }
        _tile_release();
    }
    free(xb);
}
#else
int64_t gemm_amx_supported(void) { return 0; }
#endif
