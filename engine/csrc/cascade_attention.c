/* Cascade attention for a CPU decode step in float32: each sequence attends to its own keys
 * (own_item), then the decode queries of every sequence in a group attend *together* to the prefix
 * blocks they all share, and the two are merged through their log-sum-exps (cascade_decode_f32).
 *
 * Why a separate pass pays off on a CPU: the shared K/V is small and stays in cache, so the cost
 * is arithmetic, not memory traffic. Per-sequence attention (paged_attention.c) scores one query
 * vector against one key row at a time: dot products that end in a horizontal sum. Here the lanes
 * of one vector (16 with AVX-512, 8 with AVX2: LANES) hold LANES *query vectors* of the group
 * (members x query heads of one KV head), so the work becomes two small matrix products with a
 * register tile, like a GEMM microkernel:
 *   scores:  S[j][lane] += q[lane][d] * k[j][d]   (per d: one load of q^T[d], LANES keys' k[j][d]
 *            broadcast into LANES fused multiply-adds; LANES accumulators = a tile of keys)
 *   values:  O[d][lane] += p[j][lane] * v[j][d]   (per key: one load of p[j], LANES dims' v[j][d]
 *            broadcast into LANES fused multiply-adds; LANES accumulators = a tile of dims)
 * No horizontal sums and one vector load per LANES multiply-adds. The softmax over a chunk of keys
 * is lane-wise (a vertical max and sum), online across chunks (running max m, running sum l,
 * accumulators rescaled when m grows). Each group's prefix is first copied out of the paged cache
 * once per call: K transposed into key tiles, V rows side by side (pack_tile).
 *
 * Shared-part work items = (group, KV head, tile of LANES query vectors) run in parallel on torch's OpenMP
 * runtime (same libgomp soname, see engine/native.py). Each item ends by merging its result into
 * `out`: with the shared part's log-sum-exp s1 = m + log l and the own part's s2 (read from
 * `lse`), out = (o1 e^{s1} + o2 e^{s2}) / (e^{s1} + e^{s2}) exactly. Every query vector belongs
 * to one item, so items never write the same output.
 *
 * Built and loaded by engine/native.py (cc -O3 -march=native -fopenmp); the wrapper is
 * strategies/attention/cpu_paged_cascade.py.
 */
#include <stdlib.h>

#include "lanes.h"

#define KEY_TILE LANES   /* keys scored together in registers; also the side of the packing transpose */
#define DIM_TILE LANES   /* output dims accumulated together in registers */
#define KEY_CHUNK 256    /* keys per online-softmax update (a buffer of 256 score vectors) */
#define MAX_HEAD_DIM 256
#define MAX_OWN_VECTORS 64 /* query heads of one token in own_item */

/* scores[j] = q^T . k_j for the KEY_TILE keys of one packed tile (k_t[d * KEY_TILE + j] = k_j[d]). */
static inline void score_tile(const vf *q_t, const float *k_t, int64_t head_dim, vf *scores) {
    vf s[KEY_TILE];
    for (int j = 0; j < KEY_TILE; ++j) s[j] = (vf){0};
    for (int64_t d = 0; d < head_dim; ++d, k_t += KEY_TILE) {
        const vf q = q_t[d];
        for (int j = 0; j < KEY_TILE; ++j) s[j] = vfma(q, vbroadcast(k_t[j]), s[j]);
    }
    for (int j = 0; j < KEY_TILE; ++j) scores[j] = s[j];
}

/* acc[d0 + i] += sum_j weights[j] * values[j * head_dim + d0 + i] for i < width (inlined with
 * width = DIM_TILE: the accumulators stay in registers; the remainder of an odd head_dim takes the
 * generic path). */
static inline __attribute__((always_inline)) void accumulate_values(
    vf *acc, const vf *weights, const float *values, int64_t num_keys, int64_t head_dim, int64_t d0,
    int width) {
    vf a[DIM_TILE];
    for (int i = 0; i < width; ++i) a[i] = acc[d0 + i];
    for (int64_t j = 0; j < num_keys; ++j) {
        const vf p = weights[j];
        const float *value = values + j * head_dim + d0;
        for (int i = 0; i < width; ++i) a[i] = vfma(p, vbroadcast(value[i]), a[i]);
    }
    for (int i = 0; i < width; ++i) acc[d0 + i] = a[i];
}

/* One key tile of a group's prefix (keys first .. first + KEY_TILE - 1), copied out of the paged
 * cache for all the group's work items, for every KV head at once (a slot holds all KV heads side
 * by side, so each cache line of the prefix is read once, in order). Per KV head, `packed` holds
 * its K as key tiles, then its V rows: `half` floats each. K tile t holds k_j[d] at
 * k_t[(t * head_dim + d) * KEY_TILE + j], zeros past the last key, so the score loop takes its
 * KEY_TILE broadcasts per d from one cache line; full tiles are transposed in registers, a partial
 * tile and a head_dim tail element by element. V rows lie side by side ([keys][head_dim]), so the
 * value loop walks one pointer. */
static void pack_tile(const float *k_cache, const float *v_cache, const int32_t *blocks, int64_t num_keys,
                      int64_t first, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float *packed,
                      int64_t half) {
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t tile_len = num_keys - first < KEY_TILE ? num_keys - first : KEY_TILE;
    int64_t rows[KEY_TILE]; /* offset of each key's slot in the caches */
    for (int64_t j = 0; j < tile_len; ++j) {
        const int64_t position = first + j;
        rows[j] = ((int64_t)blocks[position / block_size] * block_size + position % block_size) * slot_stride;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        float *k_t = packed + 2 * h * half + first * head_dim, *values = packed + (2 * h + 1) * half + first * head_dim;
        for (int64_t j = 0; j < tile_len; ++j)
            memcpy(values + j * head_dim, v_cache + rows[j] + h * head_dim, sizeof(float) * head_dim);
        int64_t d0 = 0;
        if (tile_len == KEY_TILE) {
            for (; d0 + KEY_TILE <= head_dim; d0 += KEY_TILE) {
                vf r[KEY_TILE];
                for (int j = 0; j < KEY_TILE; ++j) memcpy(&r[j], k_cache + rows[j] + h * head_dim + d0, sizeof r[j]);
                transpose_tile(r);
                for (int i = 0; i < KEY_TILE; ++i) memcpy(k_t + (d0 + i) * KEY_TILE, &r[i], sizeof r[i]);
            }
        }
        for (int64_t d = d0; d < head_dim; ++d)
            for (int64_t j = 0; j < KEY_TILE; ++j)
                k_t[d * KEY_TILE + j] = j < tile_len ? k_cache[rows[j] + h * head_dim + d] : 0.0f;
    }
}

/* One work item: query vectors first_vector .. first_vector + LANES - 1 of the group's KV head
 * kv_head (vector i = member i / group, query head kv_head * group + i % group) over the packed
 * prefix, then merged into their own parts in `out`. */
static void prefix_item(
    const float *query, int64_t query_token_stride, const float *k_t, const float *values, const int32_t *rows,
    int64_t num_rows, int64_t num_keys, int64_t kv_head, int64_t first_vector, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, float scale, float *out, int64_t out_token_stride, const float *lse) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t count = num_rows * group - first_vector < LANES ? num_rows * group - first_vector : LANES;
    int64_t token[LANES], head[LANES];
    vf q_t[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    vf scores[KEY_CHUNK];

    for (int64_t d = 0; d < head_dim; ++d) q_t[d] = acc[d] = (vf){0};
    for (int64_t lane = 0; lane < count; ++lane) { /* lanes past count stay 0: scores 0, never written */
        const int64_t vector = first_vector + lane;
        token[lane] = rows[vector / group];
        head[lane] = kv_head * group + vector % group;
        const float *q = query + token[lane] * query_token_stride + head[lane] * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_t[d][lane] = q[d] * scale;
    }
    vf running_max = vbroadcast(-INFINITY), running_sum = (vf){0};
    for (int64_t chunk = 0; chunk < num_keys; chunk += KEY_CHUNK) {
        const int64_t chunk_len = num_keys - chunk < KEY_CHUNK ? num_keys - chunk : KEY_CHUNK;
        vf chunk_max = vbroadcast(-INFINITY);
        for (int64_t j0 = 0; j0 < chunk_len; j0 += KEY_TILE) {
            vf tile[KEY_TILE];
            score_tile(q_t, k_t + (chunk + j0) * head_dim, head_dim, tile);
            const int64_t tile_len = chunk_len - j0 < KEY_TILE ? chunk_len - j0 : KEY_TILE;
            for (int64_t j = 0; j < tile_len; ++j) {
                scores[j0 + j] = tile[j];
                chunk_max = vmax(chunk_max, tile[j]);
            }
        }
        const vf new_max = vmax(running_max, chunk_max);
        const vf correction = vexp(running_max - new_max); /* ~0 on the first chunk (clamped), times 0 */
        running_sum *= correction;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
        for (int64_t j = 0; j < chunk_len; ++j) {
            scores[j] = vexp(scores[j] - new_max);
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

/* One sequence's own part, or a whole context for a sequence outside every group (first_key 0):
 * its decode query (all num_heads vectors) over keys first_key .. context_len - 1, read in place
 * through its block table, writing each vector's output to `out` and its log-sum-exp to `lse`.
 * The rows are short (a few dozen keys after a shared prefix), so this path avoids per-key
 * horizontal sums and fixed per-vector costs: a tile of LANES keys is scored as LANES vectors of
 * per-dim partial products (LANES-wide loads of q and k), turned into one vector of LANES scores
 * by lane_sums, so the online softmax of a tile is one vector max, one vexp and one sum. */
static void own_item(
    const float *query, int64_t query_token_stride, const float *k_cache, const float *v_cache,
    const int32_t *block_table, int64_t first_key, int64_t context_len, int64_t token, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
    int64_t out_token_stride, float *lse) {
    const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * head_dim;
    const int64_t full = head_dim / LANES * LANES; /* dims covered by whole vectors; the rest one by one */
    float q[MAX_OWN_VECTORS][MAX_HEAD_DIM], acc[MAX_OWN_VECTORS][MAX_HEAD_DIM];
    float running_max[MAX_OWN_VECTORS], running_sum[MAX_OWN_VECTORS];
    vi lane;
    for (int i = 0; i < LANES; ++i) lane[i] = i;
    for (int64_t h = 0; h < num_heads; ++h) {
        const float *src = query + token * query_token_stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[h][d] = src[d] * scale, acc[h][d] = 0.0f;
        running_max[h] = -INFINITY, running_sum[h] = 0.0f;
    }
    for (int64_t first = first_key; first < context_len; first += LANES) {
        const int64_t tile_len = context_len - first < LANES ? context_len - first : LANES;
        const float *key_rows[LANES], *value_rows[LANES];
        /* lanes past the tile re-read its first key: a real score, so the tile's max stands; their
         * weights are zeroed */
        for (int64_t j = 0; j < LANES; ++j) {
            const int64_t position = first + (j < tile_len ? j : 0);
            const int64_t slot = (int64_t)block_table[position / block_size] * block_size + position % block_size;
            key_rows[j] = k_cache + slot * slot_stride, value_rows[j] = v_cache + slot * slot_stride;
        }
        const vi valid = lane < (vi){0} + (int32_t)tile_len;
        for (int64_t h = 0; h < num_heads; ++h) {
            const int64_t offset = (h / group) * head_dim;
            vf partial[LANES];
            for (int j = 0; j < LANES; j += 4) { /* four keys at a time: four independent FMA chains */
                vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
                for (int64_t d = 0; d < full; d += LANES) {
                    const vf qv = load_vf(q[h] + d);
                    s0 = vfma(qv, load_vf(key_rows[j] + offset + d), s0);
                    s1 = vfma(qv, load_vf(key_rows[j + 1] + offset + d), s1);
                    s2 = vfma(qv, load_vf(key_rows[j + 2] + offset + d), s2);
                    s3 = vfma(qv, load_vf(key_rows[j + 3] + offset + d), s3);
                }
                partial[j] = s0, partial[j + 1] = s1, partial[j + 2] = s2, partial[j + 3] = s3;
            }
            vf scores = lane_sums(partial);
            if (full < head_dim)
                for (int j = 0; j < LANES; ++j) scores[j] += dot(q[h] + full, key_rows[j] + offset + full, head_dim - full);
            const float tile_max = lane_max(scores);
            const float new_max = tile_max > running_max[h] ? tile_max : running_max[h];
            const float correction = expf(running_max[h] - new_max); /* 0 on the first tile */
            const vf weights = vselect(valid, vexp(scores - new_max), (vf){0});
            running_sum[h] = running_sum[h] * correction + lane_sum(weights);
            running_max[h] = new_max;
            /* acc = acc * correction + sum_j weights[j] v_j, LANES dims at a time in a register */
            float *a = acc[h];
            int64_t d = 0;
            for (; d + 2 * LANES <= full; d += 2 * LANES) { /* two independent chains */
                vf sum0 = load_vf(a + d) * correction, sum1 = load_vf(a + d + LANES) * correction;
                for (int64_t j = 0; j < tile_len; ++j) {
                    const vf p = vbroadcast(weights[j]);
                    sum0 = vfma(p, load_vf(value_rows[j] + offset + d), sum0);
                    sum1 = vfma(p, load_vf(value_rows[j] + offset + d + LANES), sum1);
                }
                memcpy(a + d, &sum0, sizeof sum0), memcpy(a + d + LANES, &sum1, sizeof sum1);
            }
            for (; d < full; d += LANES) {
                vf sum = load_vf(a + d) * correction;
                for (int64_t j = 0; j < tile_len; ++j)
                    sum = vfma(vbroadcast(weights[j]), load_vf(value_rows[j] + offset + d), sum);
                memcpy(a + d, &sum, sizeof sum);
            }
            for (int64_t d = full; d < head_dim; ++d) {
                float sum = a[d] * correction;
                for (int64_t j = 0; j < tile_len; ++j) sum += weights[j] * value_rows[j][offset + d];
                a[d] = sum;
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        float *dst = out + token * out_token_stride + h * head_dim;
        const float inverse = 1.0f / running_sum[h];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[h][d] * inverse;
        lse[token * num_heads + h] = running_max[h] + logf(running_sum[h]);
    }
}

/* Floats of one group's packed prefix: K and V of every KV head, keys padded to whole tiles. */
static int64_t packed_floats(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim) {
    return num_kv_heads * 2 * ((num_keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE) * head_dim;
}

/* The workspace cascade_decode_f32 needs for these groups, in floats. */
int64_t cascade_workspace_floats(int64_t num_groups, const int64_t *block_starts, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size) {
    int64_t total = 0;
    for (int64_t g = 0; g < num_groups; ++g)
        total += packed_floats((block_starts[g + 1] - block_starts[g]) * block_size, num_kv_heads, head_dim);
    return total;
}

/* A whole decode step of one layer (one query token per sequence: token b = sequence b).
 *  1. The new K/V rows (num_kv_heads * head_dim floats, new_token_stride apart) are written into
 *     their cache slots (slot_mapping), as paged_attention_f32 does.
 *  2. Every group's prefix is packed into `workspace` (cascade_workspace_floats floats, owned by
 *     the caller so that it is not allocated and faulted in again in every layer), per KV head
 *     its K tiles then its V rows: a streaming read of the prefix that also leaves it in cache
 *     for step 3 (a copy kept across steps instead was measured slower: it is cold by the next
 *     step, docs/shared_prefix_attention.md). Meanwhile every sequence's own part runs (own_item
 *     from kv_starts[b]: the prefix end for members, 0 for everyone else), leaving its output in
 *     `out` and its log-sum-exp in `lse` [T, num_heads].
 *  3. The shared part of every (group, KV head, tile of LANES query vectors), merged into `out`.
 * Group g's members are the query tokens rows[row_starts[g] .. row_starts[g + 1]); they share the
 * blocks blocks[block_starts[g] .. block_starts[g + 1]) as their first blocks. Returns 0 on
 * success, 1 if head_dim exceeds MAX_HEAD_DIM, num_heads MAX_OWN_VECTORS or the heads do not
 * group, 2 if the work list could not be allocated, 3 if the workspace is too small. */
int cascade_decode_f32(
    const float *query, int64_t query_token_stride, const float *new_keys, const float *new_values,
    int64_t new_token_stride, const int64_t *slot_mapping, int64_t num_tokens, float *k_cache, float *v_cache,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *context_lens, const int32_t *kv_starts,
    int64_t num_groups, const int64_t *row_starts, const int32_t *rows, const int64_t *block_starts,
    const int32_t *blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, float *out, int64_t out_token_stride, float *lse, float *workspace, int64_t workspace_floats) {
    if (head_dim > MAX_HEAD_DIM || num_heads > MAX_OWN_VECTORS || num_heads % num_kv_heads != 0) return 1;
    if (workspace_floats < cascade_workspace_floats(num_groups, block_starts, num_kv_heads, head_dim, block_size))
        return 3;
    const int64_t group = num_heads / num_kv_heads, slot_floats = num_kv_heads * head_dim;
    /* item_starts[g]: first shared-part item of group g (num_kv_heads x tiles of its query vectors);
     * tile_starts[g]: first key tile of group g (the packing units);
     * packed_starts[g]: its packed prefix in the workspace */
    int64_t *item_starts = malloc(sizeof(int64_t) * 3 * (num_groups + 1));
    if (item_starts == NULL) return 2;
    int64_t *tile_starts = item_starts + num_groups + 1, *packed_starts = tile_starts + num_groups + 1;
    item_starts[0] = tile_starts[0] = packed_starts[0] = 0;
    for (int64_t g = 0; g < num_groups; ++g) {
        const int64_t tiles = ((row_starts[g + 1] - row_starts[g]) * group + LANES - 1) / LANES;
        const int64_t keys = (block_starts[g + 1] - block_starts[g]) * block_size;
        item_starts[g + 1] = item_starts[g] + num_kv_heads * tiles;
        tile_starts[g + 1] = tile_starts[g] + (keys + KEY_TILE - 1) / KEY_TILE;
        packed_starts[g + 1] = packed_starts[g] + packed_floats(keys, num_kv_heads, head_dim);
    }
    const int64_t num_items = item_starts[num_groups], num_units = tile_starts[num_groups];
#pragma omp parallel
    {
#pragma omp for
        for (int64_t t = 0; t < num_tokens; ++t) {
            memcpy(k_cache + slot_mapping[t] * slot_floats, new_keys + t * new_token_stride, sizeof(float) * slot_floats);
            memcpy(v_cache + slot_mapping[t] * slot_floats, new_values + t * new_token_stride, sizeof(float) * slot_floats);
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t unit = 0; unit < num_units; ++unit) { /* packing and own parts overlap */
            int64_t g = 0;
            while (tile_starts[g + 1] <= unit) ++g;
            const int64_t half = (packed_starts[g + 1] - packed_starts[g]) / num_kv_heads / 2;
            pack_tile(k_cache, v_cache, blocks + block_starts[g], (block_starts[g + 1] - block_starts[g]) * block_size,
                      (unit - tile_starts[g]) * KEY_TILE, num_kv_heads, head_dim, block_size,
                      workspace + packed_starts[g], half);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_tokens; ++b)
            own_item(query, query_token_stride, k_cache, v_cache, block_tables + b * block_table_stride,
                     kv_starts[b], context_lens[b], b, num_heads, num_kv_heads, head_dim, block_size, scale, out,
                     out_token_stride, lse);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            int64_t g = 0;
            while (item_starts[g + 1] <= item) ++g; /* few groups per step: a linear scan */
            const int64_t num_rows = row_starts[g + 1] - row_starts[g];
            const int64_t tiles = (num_rows * group + LANES - 1) / LANES;
            const int64_t h = (item - item_starts[g]) / tiles, tile = (item - item_starts[g]) % tiles;
            const int64_t half = (packed_starts[g + 1] - packed_starts[g]) / num_kv_heads / 2;
            const float *k_t = workspace + packed_starts[g] + 2 * h * half;
            prefix_item(query, query_token_stride, k_t, k_t + half, rows + row_starts[g], num_rows,
                        (block_starts[g + 1] - block_starts[g]) * block_size, h, tile * LANES, num_heads,
                        num_kv_heads, head_dim, scale, out, out_token_stride, lse);
        }
    }
    free(item_starts);
    return 0;
}

/* One step's groups and scratch, for whole decoder layers in C (strategies/attention/
 * cpu_paged_cascade.py: native_attention builds it once per step; every layer reads it). */
struct cascade_plan {
    const int32_t *kv_starts;
    int64_t num_groups;
    const int64_t *row_starts;
    const int32_t *rows;
    const int64_t *block_starts;
    const int32_t *blocks;
    float *lse;
    float *workspace;
    int64_t workspace_floats;
};

/* cascade_decode_f32 with the attention signature of decoder_layer.c: `context` is the step's
 * struct cascade_plan; query_start_loc and num_seqs are implied by a decode step (token b =
 * sequence b). */
int cascade_decode_layer_f32(
    const float *query, int64_t query_token_stride, const float *new_keys, const float *new_values,
    int64_t new_token_stride, const int64_t *slot_mapping, int64_t num_tokens, float *k_cache, float *v_cache,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *context_lens,
    const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float *out, int64_t out_token_stride, const void *context) {
    const struct cascade_plan *plan = context;
    (void)query_start_loc;
    (void)num_seqs;
    return cascade_decode_f32(query, query_token_stride, new_keys, new_values, new_token_stride, slot_mapping,
                              num_tokens, k_cache, v_cache, block_tables, block_table_stride, context_lens,
                              plan->kv_starts, plan->num_groups, plan->row_starts, plan->rows, plan->block_starts,
                              plan->blocks, num_heads, num_kv_heads, head_dim, block_size, scale, out,
                              out_token_stride, plan->lse, plan->workspace, plan->workspace_floats);
}
