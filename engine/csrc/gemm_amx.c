/* Decode- and chunk-sized GEMM on AMX tiles: out[M, N] (float32) = x[M, K] (float32) @ W^T (+ bias),
 * with W in gemm_bf16.c's bfloat16 panels, on CPUs with AMX (amx_tile, amx_bf16).
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
 * Two register blockings, both over all k, so each C tile is stored once:
 *   - one block of 16 rows (decode batches up to 16): per panel, three C tiles (16 x 48), each
 *     k step one A tile and the panel's three B tiles; panels split over the threads;
 *   - more rows: 2 x 2 C tiles, 32 rows x 32 columns (two 16-column tiles, counted across
 *     panels: tile j is third j % 3 of panel j / 3), each k step two A and two B tiles for four
 *     TDPBF16PS, so every tile loaded serves two products instead of 0.75 (the 1 x 3 block's 4
 *     loads per 3 products kept the tile unit waiting on L2). Column pairs are the outer loop,
 *     split over the threads: each weight tile streams from memory once and stays in L1 while
 *     every row pair uses it; the next column pair's lines are prefetched meanwhile.
 * Around them (decision 24):
 *   - x is rounded to bfloat16 (VCVTNE2PS2BF16, round to nearest even) by all threads at once,
 *     into a copy zero-padded to whole tiles (16 or 32 rows, 32 k) that the calling thread keeps
 *     between calls (no allocation, no page faults per call); padded rows and k contribute exact zeros;
 *   - a k tail (pairs not a multiple of 16) reads its B rows from a zero-padded copy of the
 *     tile's last rows, never past the weight;
 *   - C tiles of a whole 16 x 32 block are stored into out (+ bias there); edge blocks and the
 *     16-row path store to a scratch tile and copy the valid rows and columns (+ bias) out.
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
 * steps (oneDNN's prepacked copies above; this kernel re-reads x once per column pair, so its lead
 * over them shrinks with the rows, to 1.3x at 256: decision 24). */
int64_t gemm_amx_max_rows(void) { return 256; }

/* The bfloat16 copy of x, zero-padded: this thread's, grown when a call needs more (kept between
 * calls: the engine calls this kernel some 120 times a step with the same few shapes). */
static __thread uint16_t *x_copy;
static __thread size_t x_copy_elements;

static uint16_t *bf16_copy_of_x(size_t elements) {
    if (elements > x_copy_elements) {
        free(x_copy);
        x_copy = aligned_alloc(64, (elements * sizeof(uint16_t) + 63) / 64 * 64);
        if (x_copy == NULL) {
            fprintf(stderr, "gemm_packed_bf16_amx: out of memory for a %zu-element bfloat16 copy of x\n", elements);
            abort();
        }
        x_copy_elements = elements;
    }
    return x_copy;
}

/* Row r of x rounded to bfloat16 into dst (padded_k elements: k values then zeros); a row past m
 * (a padding row of the last tile) is all zeros. */
static inline void round_row(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t padded_k, int64_t r,
                             uint16_t *dst) {
    if (r >= m) {
        memset(dst, 0, sizeof(uint16_t) * padded_k);
        return;
    }
    const float *src = x + r * x_stride;
    for (int64_t kk = 0; kk < padded_k; kk += 32) {
        const int64_t left = k - kk;
        const __mmask16 low = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const __mmask16 high = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
        const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, src + kk + 16), _mm512_maskz_loadu_ps(low, src + kk));
        _mm512_storeu_si512(dst + kk, (__m512i)pairs);
    }
}

/* All eight tiles 16 rows x 64 bytes. A constant, never built on the stack: GCC's _tile_loadconfig
 * declares a read of 8 bytes of its operand, so stores to the rest of a local config may be
 * dropped as dead once the call is inlined (LDTILECFG then faults on the stale bytes). */
static const tile_config TILES_16X64 __attribute__((aligned(64))) = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static inline void configure_tiles(void) { _tile_loadconfig(&TILES_16X64); }

/* The valid rows (of 16 from first_row) and columns of a stored C block (`stride` floats a row), + bias. */
static inline void copy_out(const float *scratch, int64_t stride, int64_t first_row, int64_t m, int64_t col,
                            int64_t cols, const float *bias, int64_t n, float *out) {
    const int64_t rows = m - first_row < TILE_ROWS ? m - first_row : TILE_ROWS;
    for (int64_t r = 0; r < rows; ++r) {
        float *dst = out + (first_row + r) * n + col;
        const float *src = scratch + r * stride;
        if (bias != NULL)
            for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bias[col + c];
        else
            memcpy(dst, src, sizeof(float) * cols);
    }
}

/* One block of 16 rows (m <= 16): per panel, 16 x 48 in three C tiles. Called by every thread of
 * the caller's parallel region (the panels are shared out by an orphaned omp for). */
static void one_row_block(const uint16_t *a, int64_t m, int64_t pairs, int64_t padded_k, const uint32_t *weight,
                          const float *bias, int64_t n, float *out) {
    const int64_t k_blocks = padded_k / (2 * TILE_PAIRS), full_blocks = pairs / TILE_PAIRS, tail_pairs = pairs % TILE_PAIRS;
    const int64_t panels = (n + NR - 1) / NR;
    configure_tiles();
    float scratch[TILE_ROWS * NR] __attribute__((aligned(64)));
    uint32_t tail[TILE_PAIRS * NR] __attribute__((aligned(64)));
    memset(tail, 0, sizeof tail);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const uint32_t *panel = weight + p * pairs * NR;
        if (tail_pairs) memcpy(tail, panel + full_blocks * TILE_PAIRS * NR, sizeof(uint32_t) * tail_pairs * NR);
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
        const int64_t col = p * NR;
        copy_out(scratch, NR, 0, m, col, n - col < NR ? n - col : NR, bias, n, out);
    }
    _tile_release();
}

/* The B tile of 16-column tile j (third j % 3 of panel j / 3), or NULL past the last panel. */
static inline const uint32_t *column_tile(const uint32_t *weight, int64_t j, int64_t pairs, int64_t panel_tiles) {
    return j < panel_tiles ? weight + j / 3 * pairs * NR + j % 3 * 16 : NULL;
}

/* Two or more row blocks (a is zero-padded to whole pairs of them): 32 x 32 blocks in 2 x 2 C tiles.
 * Called by every thread of the caller's parallel region, like one_row_block. */
static void row_block_pairs(const uint16_t *a, int64_t m, int64_t pairs, int64_t padded_k, const uint32_t *weight,
                            const float *bias, int64_t n, float *out) {
    const int64_t k_blocks = padded_k / (2 * TILE_PAIRS), full_blocks = pairs / TILE_PAIRS, tail_pairs = pairs % TILE_PAIRS;
    const int64_t row_pairs = (m + 2 * TILE_ROWS - 1) / (2 * TILE_ROWS);
    const int64_t column_tiles = (n + 15) / 16, panel_tiles = (n + NR - 1) / NR * 3, column_pairs = (column_tiles + 1) / 2;
    const int64_t a_stride = padded_k * sizeof(uint16_t), b_stride = NR * sizeof(uint32_t);
    /* The next column pair's weight lines are requested while this one computes, spread over its
     * k steps: a tile load that misses to memory waits for all its 16 lines. From two row pairs up
     * (33+ rows): with one, the requests crowd its few k steps and the B = 32 decode step measured
     * slower with them than without (and the 16-row path slower with the next panel's). */
    const int64_t prefetch_lines = row_pairs < 2 ? 0 : (2 * pairs + row_pairs * k_blocks - 1) / (row_pairs * k_blocks);
    configure_tiles();
    float scratch[TILE_ROWS * 32] __attribute__((aligned(64)));
    /* B tiles of the k tail (16 pair rows of 16 columns, 48 apart like a panel), zero past the weight */
    uint32_t tails[2][TILE_PAIRS * NR] __attribute__((aligned(64)));
    memset(tails, 0, sizeof tails);
#pragma omp for schedule(static)
    for (int64_t cp = 0; cp < column_pairs; ++cp) {
        const uint32_t *b[2], *next[2];
        for (int t = 0; t < 2; ++t) {
            b[t] = column_tile(weight, 2 * cp + t, pairs, panel_tiles);
            next[t] = column_tile(weight, 2 * cp + 2 + t, pairs, panel_tiles);
            for (int64_t row = 0; row < tail_pairs; ++row)
                if (b[t] != NULL) memcpy(tails[t] + row * NR, b[t] + (full_blocks * TILE_PAIRS + row) * NR, 16 * sizeof(uint32_t));
        }
        int64_t prefetched = 0; /* lines of the next column pair requested so far (2 per pair row) */
        const int64_t col = 2 * cp * 16, cols = n - col < 32 ? n - col : 32;
        for (int64_t rp = 0; rp < row_pairs; ++rp) {
            const uint16_t *a0 = a + rp * 2 * TILE_ROWS * padded_k, *a1 = a0 + TILE_ROWS * padded_k;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < k_blocks; ++kb) {
                const int full = kb < full_blocks;
                for (int64_t line = 0; line < prefetch_lines && prefetched < 2 * pairs; ++line, ++prefetched)
                    if (next[prefetched % 2] != NULL) _mm_prefetch((const char *)(next[prefetched % 2] + prefetched / 2 * NR), _MM_HINT_T0);
                _tile_loadd(4, a0 + kb * 2 * TILE_PAIRS, a_stride);
                _tile_loadd(6, full ? b[0] + kb * TILE_PAIRS * NR : tails[0], b_stride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(5, a1 + kb * 2 * TILE_PAIRS, a_stride);
                _tile_dpbf16ps(2, 5, 6);
                _tile_loadd(7, full && b[1] != NULL ? b[1] + kb * TILE_PAIRS * NR : tails[1], b_stride); /* past the last panel: zeros */
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
            for (int half = 0; half < 2; ++half) {
                const int64_t first_row = (2 * rp + half) * TILE_ROWS;
                if (first_row >= m) break;
                /* a whole 16 x 32 block goes straight into out (+ bias in place), an edge one via the scratch */
                const int whole = first_row + TILE_ROWS <= m && cols == 32;
                float *c = whole ? out + first_row * n + col : scratch;
                const int64_t c_stride = (whole ? n : 32) * sizeof(float);
                if (half == 0) {
                    _tile_stored(0, c, c_stride);
                    _tile_stored(1, c + 16, c_stride);
                } else {
                    _tile_stored(2, c, c_stride);
                    _tile_stored(3, c + 16, c_stride);
                }
                if (!whole)
                    copy_out(scratch, 32, first_row, m, col, cols, bias, n, out);
                else if (bias != NULL)
                    for (int64_t r = 0; r < TILE_ROWS; ++r)
                        for (int64_t j = 0; j < 32; ++j) c[r * n + j] += bias[col + j];
            }
        }
    }
    _tile_release();
}

/* The linear_fn of decoder_layer.c (weight: gemm_bf16.c's pack_weight_bf16 panels). */
void gemm_packed_bf16_amx(const float *x, int64_t m, int64_t k, int64_t x_stride, const void *weight,
                          const float *bias, int64_t n, float *out) {
    if (m <= 0) return;
    const int64_t pairs = (k + 1) / 2, k_blocks = (pairs + TILE_PAIRS - 1) / TILE_PAIRS, padded_k = k_blocks * 2 * TILE_PAIRS;
    const int64_t block_rows = m <= TILE_ROWS ? TILE_ROWS : 2 * TILE_ROWS; /* rows of the register block */
    const int64_t padded_m = (m + block_rows - 1) / block_rows * block_rows;
    uint16_t *a = bf16_copy_of_x((size_t)padded_m * padded_k);
#pragma omp parallel /* one region: the rounding's omp for ends in a barrier, then the tiles */
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < padded_m; ++r) round_row(x, x_stride, m, k, padded_k, r, a + r * padded_k);
        if (m <= TILE_ROWS)
            one_row_block(a, m, pairs, padded_k, weight, bias, n, out);
        else
            row_block_pairs(a, m, pairs, padded_k, weight, bias, n, out);
    }
}
#else
int64_t gemm_amx_supported(void) { return 0; }
#endif
