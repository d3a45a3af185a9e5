/* Cascade attention, the shared part, for the CPU in float32: decode queries of every sequence in a
 * group attend *together* to the prefix blocks they all share, and the result is merged into each
 * sequence's own-part output (cpu_paged's kernel run from the prefix end, with log-sum-exps).
 *
 * Why a separate pass pays off on a CPU: per-sequence attention (paged_attention.c) scores one
 * query vector against one key row at a time: dot products that end in a horizontal sum, each key
 * row loaded again for every sequence. Here the 16 lanes of one 512-bit vector hold 16 *query
 * vectors* of the group (members x query heads of one KV head), so the work becomes two small
 * matrix products with a register tile, like a GEMM microkernel:
 *   scores:  S[j][lane] += q[lane][d] * k[j][d]   (per d: one load of q^T[d], 16 keys' k[j][d]
 *            broadcast into 16 fused multiply-adds; 16 accumulators = a tile of 16 keys)
 *   values:  O[d][lane] += p[j][lane] * v[j][d]   (per key: one load of p[j], 16 dims' v[j][d]
 *            broadcast into 16 fused multiply-adds; 16 accumulators = a tile of 16 dims)
 * No horizontal sums, one vector load per 16 FMAs, and each shared K/V row is read once per 16
 * query vectors instead of once per query head and sequence. The softmax over a chunk of keys is
 * lane-wise (a vertical max and sum), online across chunks (running max m, running sum l,
 * accumulators rescaled when m grows).
 *
 * One work item = (group, KV head, tile of 16 query vectors); items run in parallel on torch's
 * OpenMP runtime (same libgomp soname, see engine/native.py). Each item ends by merging its
 * result into `out`: with the shared part's log-sum-exp s1 = m + log l and the own part's s2 (read
 * from `lse`), out = (o1 e^{s1} + o2 e^{s2}) / (e^{s1} + e^{s2}) exactly. Every query vector
 * belongs to one item, so items never write the same output.
 *
 * Built and loaded by engine/native.py (cc -O3 -march=native -fopenmp); the wrapper is
 * strategies/attention/cpu_paged_cascade.py.
 */
#include <stdlib.h>

#include "common.h"

#define LANES 16       /* query vectors per work item: one per lane of a 16-float vector */
#define KEY_TILE 16    /* keys scored together in registers */
#define DIM_TILE 16    /* output dims accumulated together in registers */
#define KEY_CHUNK 256  /* keys per online-softmax update (scores buffer: 16 KB) */
#define MAX_HEAD_DIM 256

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

#if defined(__AVX512F__)
static inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#else /* two halves: one ymm FMA each where the CPU has AVX2 + FMA */
static inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
    const f32x8 lo = fma8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                          __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                          __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    const f32x8 hi = fma8(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                          __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                          __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

static inline f32x16 broadcast16(float v) { return (f32x16){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

static inline f32x16 select16(i32x16 mask, f32x16 if_true, f32x16 if_false) {
    return (f32x16)(((i32x16)if_true & mask) | ((i32x16)if_false & ~mask));
}

static inline f32x16 max16(f32x16 a, f32x16 b) { return select16(a > b, a, b); }

DEFINE_VECTOR_EXP(exp16, f32x16, i32x16, select16) /* exp8's polynomial (common.h) on 16 lanes */

/* scores[j] = q^T . k_j for the KEY_TILE keys of one packed tile (k_t[d * KEY_TILE + j] = k_j[d]). */
static inline void score_tile(const f32x16 *q_t, const float *k_t, int64_t head_dim, f32x16 *scores) {
    f32x16 s[KEY_TILE];
    for (int j = 0; j < KEY_TILE; ++j) s[j] = (f32x16){0};
    for (int64_t d = 0; d < head_dim; ++d, k_t += KEY_TILE) {
        const f32x16 q = q_t[d];
        for (int j = 0; j < KEY_TILE; ++j) s[j] = fma16(q, broadcast16(k_t[j]), s[j]);
    }
    for (int j = 0; j < KEY_TILE; ++j) scores[j] = s[j];
}

/* acc[d0 + i] += sum_j weights[j] * values[j * head_dim + d0 + i] for i < width (inlined with
 * width = 16: the accumulators stay in registers; the remainder of an odd head_dim takes the
 * generic path). */
static inline __attribute__((always_inline)) void accumulate_values(
    f32x16 *acc, const f32x16 *weights, const float *values, int64_t num_keys, int64_t head_dim, int64_t d0,
    int width) {
    f32x16 a[DIM_TILE];
    for (int i = 0; i < width; ++i) a[i] = acc[d0 + i];
    for (int64_t j = 0; j < num_keys; ++j) {
        const f32x16 p = weights[j];
        const float *value = values + j * head_dim + d0;
        for (int i = 0; i < width; ++i) a[i] = fma16(p, broadcast16(value[i]), a[i]);
    }
    for (int i = 0; i < width; ++i) acc[d0 + i] = a[i];
}

/* r[i][l] <- r[l][i] for a 16 x 16 block: four stages, each swapping the off-diagonal k x k
 * sub-blocks of every 2k x 2k block (k = 8, 4, 2, 1) with two-vector shuffles. */
static inline void transpose16(f32x16 r[16]) {
    for (int i = 0; i < 8; ++i) {
        const f32x16 a = r[i], b = r[i + 8];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        r[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 16; ++i) {
        if (i & 4) continue;
        const f32x16 a = r[i], b = r[i + 4];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        r[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int i = 0; i < 16; ++i) {
        if (i & 2) continue;
        const f32x16 a = r[i], b = r[i + 2];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        r[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    for (int i = 0; i < 16; i += 2) {
        const f32x16 a = r[i], b = r[i + 1];
        r[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        r[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
}

/* The group's prefix K and V of one KV head, copied out of the paged cache once per call for all
 * its work items. K is packed as key tiles: tile t holds k_j[d] of its KEY_TILE keys at
 * k_t[(t * head_dim + d) * KEY_TILE + j], zeros past the last key, so the score loop takes its 16
 * broadcasts per d from one cache line; full tiles are transposed 16 x 16 in registers, a partial
 * tile and a head_dim tail element by element. V rows are copied side by side ([keys][head_dim]),
 * so the value loop walks one pointer. */
static void pack_prefix(const float *k_cache, const float *v_cache, const int32_t *blocks, int64_t num_keys,
                        int64_t kv_head, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float *k_t,
                        float *values) {
    const int64_t slot_stride = num_kv_heads * head_dim;
    for (int64_t first = 0; first < num_keys; first += KEY_TILE, k_t += head_dim * KEY_TILE) {
        const int64_t tile_len = num_keys - first < KEY_TILE ? num_keys - first : KEY_TILE;
        const float *key_rows[KEY_TILE];
        for (int64_t j = 0; j < tile_len; ++j) {
            const int64_t position = first + j;
            const int64_t slot = (int64_t)blocks[position / block_size] * block_size + position % block_size;
            key_rows[j] = k_cache + slot * slot_stride + kv_head * head_dim;
            memcpy(values + position * head_dim, v_cache + slot * slot_stride + kv_head * head_dim,
                   sizeof(float) * head_dim);
        }
        int64_t d0 = 0;
        if (tile_len == KEY_TILE) {
            for (; d0 + KEY_TILE <= head_dim; d0 += KEY_TILE) {
                f32x16 r[KEY_TILE];
                for (int j = 0; j < KEY_TILE; ++j) memcpy(&r[j], key_rows[j] + d0, sizeof r[j]);
                transpose16(r);
                for (int i = 0; i < KEY_TILE; ++i) memcpy(k_t + (d0 + i) * KEY_TILE, &r[i], sizeof r[i]);
            }
        }
        for (int64_t d = d0; d < head_dim; ++d)
            for (int64_t j = 0; j < KEY_TILE; ++j) k_t[d * KEY_TILE + j] = j < tile_len ? key_rows[j][d] : 0.0f;
    }
}

static void prefix_item(
    const float *query, int64_t query_token_stride, const float *k_t, const float *values, const int32_t *rows,
    int64_t num_rows, int64_t num_keys, int64_t kv_head, int64_t first_vector, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, float scale, float *out, int64_t out_token_stride, const float *lse) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t count = num_rows * group - first_vector < LANES ? num_rows * group - first_vector : LANES;
    int64_t token[LANES], head[LANES];
    f32x16 q_t[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    f32x16 scores[KEY_CHUNK];

    for (int64_t d = 0; d < head_dim; ++d) q_t[d] = acc[d] = (f32x16){0};
    for (int64_t lane = 0; lane < count; ++lane) { /* lanes past count stay 0: scores 0, never written */
        const int64_t vector = first_vector + lane;
        token[lane] = rows[vector / group];
        head[lane] = kv_head * group + vector % group;
        const float *q = query + token[lane] * query_token_stride + head[lane] * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_t[d][lane] = q[d] * scale;
    }
    f32x16 running_max = broadcast16(-INFINITY), running_sum = (f32x16){0};
    for (int64_t chunk = 0; chunk < num_keys; chunk += KEY_CHUNK) {
        const int64_t chunk_len = num_keys - chunk < KEY_CHUNK ? num_keys - chunk : KEY_CHUNK;
        f32x16 chunk_max = broadcast16(-INFINITY);
        for (int64_t j0 = 0; j0 < chunk_len; j0 += KEY_TILE) {
            f32x16 tile[KEY_TILE];
            score_tile(q_t, k_t + (chunk + j0) * head_dim, head_dim, tile);
            const int64_t tile_len = chunk_len - j0 < KEY_TILE ? chunk_len - j0 : KEY_TILE;
            for (int64_t j = 0; j < tile_len; ++j) {
                scores[j0 + j] = tile[j];
                chunk_max = max16(chunk_max, tile[j]);
            }
        }
        const f32x16 new_max = max16(running_max, chunk_max);
        const f32x16 correction = exp16(running_max - new_max); /* ~0 on the first chunk (clamped), times 0 */
        running_sum *= correction;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
        for (int64_t j = 0; j < chunk_len; ++j) {
            scores[j] = exp16(scores[j] - new_max);
            running_sum += scores[j];
        }
        running_max = new_max;
        int64_t d0 = 0;
        for (; d0 + DIM_TILE <= head_dim; d0 += DIM_TILE)
            accumulate_values(acc, scores, values + chunk * head_dim, chunk_len, head_dim, d0, DIM_TILE);
        if (d0 < head_dim)
            accumulate_values(acc, scores, values + chunk * head_dim, chunk_len, head_dim, d0, (int)(head_dim - d0));
    }
    for (int64_t lane = 0; lane < count; ++lane) {
        const float shared_lse = running_max[lane] + logf(running_sum[lane]);
        const float own_lse = lse[token[lane] * num_heads + head[lane]];
        const float top = shared_lse > own_lse ? shared_lse : own_lse;
        const float shared_weight = expf(shared_lse - top), own_weight = expf(own_lse - top);
        const float total = shared_weight + own_weight;
        const float shared_scale = shared_weight / (total * running_sum[lane]), own_scale = own_weight / total;
        float *dst = out + token[lane] * out_token_stride + head[lane] * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[d][lane] * shared_scale + dst[d] * own_scale;
    }
}

/* Group g's members are the query tokens rows[row_starts[g] .. row_starts[g + 1]) (one decode token
 * each); they share the blocks blocks[block_starts[g] .. block_starts[g + 1]) as their first
 * blocks. `out` [T, num_heads, head_dim] (token stride out_token_stride) holds each member's own-part
 * output and `lse` [T, num_heads] its log-sum-exp; both parts are merged into `out`. Two phases in
 * one parallel region: pack each (group, KV head)'s prefix keys, then the items. Returns 0 on
 * success, 1 if head_dim exceeds MAX_HEAD_DIM or the heads do not group, 2 if the work buffers
 * could not be allocated. */
int cascade_prefix_attention_f32(
    const float *query, int64_t query_token_stride, const float *k_cache, const float *v_cache,
    int64_t num_groups, const int64_t *row_starts, const int32_t *rows, const int64_t *block_starts,
    const int32_t *blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, float *out, int64_t out_token_stride, const float *lse) {
    if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0) return 1;
    const int64_t group = num_heads / num_kv_heads;
    /* item_starts[g]: first work item of group g (num_kv_heads x tiles of its query vectors);
     * packed_starts[g]: its packed prefix, per KV head padded keys x head_dim floats of K, then of V */
    int64_t *item_starts = malloc(sizeof(int64_t) * 2 * (num_groups + 1));
    if (item_starts == NULL) return 2;
    int64_t *packed_starts = item_starts + num_groups + 1;
    item_starts[0] = packed_starts[0] = 0;
    for (int64_t g = 0; g < num_groups; ++g) {
        const int64_t tiles = ((row_starts[g + 1] - row_starts[g]) * group + LANES - 1) / LANES;
        const int64_t keys = (block_starts[g + 1] - block_starts[g]) * block_size;
        item_starts[g + 1] = item_starts[g] + num_kv_heads * tiles;
        packed_starts[g + 1] = packed_starts[g] + num_kv_heads * 2 * ((keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE) * head_dim;
    }
    float *packed = aligned_alloc(64, sizeof(float) * packed_starts[num_groups]);
    if (packed == NULL) {
        free(item_starts);
        return 2;
    }
    const int64_t num_items = item_starts[num_groups];
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < num_groups * num_kv_heads; ++unit) {
            const int64_t g = unit / num_kv_heads, h = unit % num_kv_heads;
            const int64_t half = (packed_starts[g + 1] - packed_starts[g]) / num_kv_heads / 2;
            float *k_t = packed + packed_starts[g] + 2 * h * half;
            pack_prefix(k_cache, v_cache, blocks + block_starts[g], (block_starts[g + 1] - block_starts[g]) * block_size,
                        h, num_kv_heads, head_dim, block_size, k_t, k_t + half);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            int64_t g = 0;
            while (item_starts[g + 1] <= item) ++g; /* few groups per step: a linear scan */
            const int64_t num_rows = row_starts[g + 1] - row_starts[g];
            const int64_t tiles = (num_rows * group + LANES - 1) / LANES;
            const int64_t h = (item - item_starts[g]) / tiles, tile = (item - item_starts[g]) % tiles;
            const int64_t half = (packed_starts[g + 1] - packed_starts[g]) / num_kv_heads / 2;
            const float *k_t = packed + packed_starts[g] + 2 * h * half;
            prefix_item(query, query_token_stride, k_t, k_t + half, rows + row_starts[g], num_rows,
                        (block_starts[g + 1] - block_starts[g]) * block_size, h, tile * LANES, num_heads,
                        num_kv_heads, head_dim, scale, out, out_token_stride, lse);
        }
    }
    free(packed);
    free(item_starts);
    return 0;
}
