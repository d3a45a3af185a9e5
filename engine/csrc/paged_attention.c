/* Paged attention for the CPU, float32: queries attend to K/V read in place through the block table.
 *
 * First the step's new K/V rows are written into their cache slots (slot_mapping; vLLM's
 * reshape_and_cache). Then one work item = (sequence, chunk of up to MAX_VECTORS / num_heads
 * query tokens) with the query vectors of every head of those tokens. A cache slot holds the
 * K (or V) rows of all KV heads side by side, so an item reads whole contiguous slots, page by
 * page, and each K/V row serves all G query heads that share it (grouped-query attention
 * without copying KV heads). The item walks the context in tiles of KEY_TILE positions (slot of
 * position t = block_tables[seq][t / block_size] * block_size + t % block_size) with an online
 * softmax: running max m, running sum l, accumulator rescaled when m grows.
 * Query token j of a sequence with query_len q and context_len c sits at position c - q + j and
 * sees keys 0..c - q + j (causal); decode (q = 1), prefill and chunked prefill are one path.
 * Items are independent and run in parallel on the OpenMP runtime that torch already loaded
 * (same libgomp soname), so the kernel shares torch's threads instead of starting a second pool.
 *
 * Built and loaded by engine/native.py (cc -O3 -march=native -fopenmp).
 */
#include <stdlib.h>

#include "common.h"

#define MAX_VECTORS 64  /* query vectors per item: tokens per item * num_heads <= MAX_VECTORS */
#define MAX_HEAD_DIM 256
#define KEY_TILE 16     /* keys scored together before one softmax update (a multiple of 8) */

static void attend_item(
    const float *query, int64_t query_token_stride, const float *k_cache, const float *v_cache,
    const int32_t *block_table, int64_t context_len, int64_t query_len, int64_t first_row,
    int64_t num_rows, int64_t query_start, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *out, int64_t out_token_stride) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_vectors = num_rows * num_heads;
    float q[MAX_VECTORS][MAX_HEAD_DIM];
    float acc[MAX_VECTORS][MAX_HEAD_DIM];
    float running_max[MAX_VECTORS], running_sum[MAX_VECTORS];
    float scores[MAX_VECTORS][KEY_TILE];
    int64_t last_key[MAX_VECTORS];
    int64_t kv_offset[MAX_VECTORS]; /* offset of the vector's KV head inside a slot's row */
    const int64_t slot_stride = num_kv_heads * head_dim; /* floats between consecutive slots */

    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t token = query_start + first_row + r;
        for (int64_t h = 0; h < num_heads; ++h) {
            const int64_t v = r * num_heads + h;
            const float *src = query + token * query_token_stride + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) q[v][d] = src[d] * scale;
            kv_offset[v] = (h / group) * head_dim;
            memset(acc[v], 0, sizeof(float) * head_dim);
            running_max[v] = -INFINITY;
            running_sum[v] = 0.0f;
            last_key[v] = context_len - query_len + first_row + r;
        }
    }
    const int64_t keys = last_key[num_vectors - 1] + 1; /* the chunk's last token sees the most */
    for (int64_t tile_start = 0; tile_start < keys; tile_start += KEY_TILE) {
        const int64_t tile_len = keys - tile_start < KEY_TILE ? keys - tile_start : KEY_TILE;
        const float *key_rows[KEY_TILE], *value_rows[KEY_TILE];
        for (int64_t j = 0; j < tile_len; ++j) {
            const int64_t position = tile_start + j;
            const int64_t slot = (int64_t)block_table[position / block_size] * block_size + position % block_size;
            key_rows[j] = k_cache + slot * slot_stride;
            value_rows[j] = v_cache + slot * slot_stride;
        }
        /* Later tiles' slots sit in other pages (blocks) somewhere in the cache, which defeats the
         * hardware prefetcher at every block boundary: software prefetches ask for their K/V
         * lines ahead of use. The first tile asks for the whole second tile here; after that,
         * the value loop below asks for the tile after next, one key per value row, so the
         * requests trickle out while this tile computes instead of flooding the load queue in
         * one burst (1.4-1.5x faster per call than one burst per tile: docs/performance.md, 10). */
        const int64_t next_end = tile_start != 0 ? 0 : keys - KEY_TILE < KEY_TILE ? keys - KEY_TILE : KEY_TILE;
        for (int64_t j = 0; j < next_end; ++j) {
            const int64_t position = tile_start + KEY_TILE + j;
            const int64_t slot = (int64_t)block_table[position / block_size] * block_size + position % block_size;
            for (int64_t line = 0; line < slot_stride; line += 16) {
                __builtin_prefetch(k_cache + slot * slot_stride + line);
                __builtin_prefetch(v_cache + slot * slot_stride + line);
            }
        }
        for (int64_t v = 0; v < num_vectors; ++v) {
            const int64_t visible = last_key[v] - tile_start + 1; /* keys of this tile the vector sees */
            const int64_t count = visible < tile_len ? visible : tile_len;
            if (count <= 0) {
                for (int64_t j = 0; j < tile_len; ++j) scores[v][j] = 0.0f;
                continue;
            }
            float tile_max = -INFINITY;
            int64_t j = 0;
            if (head_dim % 8 == 0) {
                const int64_t offset = kv_offset[v];
                for (; j + 4 <= count; j += 4)
                    dot4(q[v], key_rows[j] + offset, key_rows[j + 1] + offset, key_rows[j + 2] + offset,
                         key_rows[j + 3] + offset, head_dim, scores[v] + j);
            }
            for (; j < count; ++j) scores[v][j] = dot(q[v], key_rows[j] + kv_offset[v], head_dim);
            for (j = 0; j < count; ++j) tile_max = scores[v][j] > tile_max ? scores[v][j] : tile_max;
            const float new_max = tile_max > running_max[v] ? tile_max : running_max[v];
            const float correction = expf(running_max[v] - new_max); /* 0 on the first tile */
            float *row = scores[v];
            for (int64_t j = count; j < KEY_TILE; ++j) row[j] = -INFINITY; /* masked: exp8 gives ~0 */
            float tile_sum = 0.0f;
            for (int64_t j = 0; j < KEY_TILE; j += 8) {
                f32x8 weights = exp8(load8(row + j) - new_max);
                weights = select8(load8(row + j) == -INFINITY + (f32x8){0}, (f32x8){0}, weights);
                store8(row + j, weights);
                for (int64_t lane = 0; lane < 8; ++lane) tile_sum += weights[lane];
            }
            running_sum[v] = running_sum[v] * correction + tile_sum;
            running_max[v] = new_max;
            if (correction != 1.0f) {
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) acc[v][d] *= correction;
            }
        }
        /* Value rows outer: each V row is read once for all query vectors of the item. */
        for (int64_t j = 0; j < tile_len; ++j) {
            const int64_t ahead = tile_start + 2 * KEY_TILE + j; /* key j of the tile after next */
            if (ahead < keys) {
                const int64_t slot = (int64_t)block_table[ahead / block_size] * block_size + ahead % block_size;
                for (int64_t line = 0; line < slot_stride; line += 16) {
                    __builtin_prefetch(k_cache + slot * slot_stride + line);
                    __builtin_prefetch(v_cache + slot * slot_stride + line);
                }
            }
            for (int64_t v = 0; v < num_vectors; ++v) {
                const float p = scores[v][j];
                if (p == 0.0f) continue;
                const float *value = value_rows[j] + kv_offset[v];
                float *a = acc[v];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * value[d];
            }
        }
    }
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t token = query_start + first_row + r;
        for (int64_t h = 0; h < num_heads; ++h) {
            const int64_t v = r * num_heads + h;
            float *dst = out + token * out_token_stride + h * head_dim;
            const float inverse = 1.0f / running_sum[v];
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[v][d] * inverse;
        }
    }
}

/* Writes the new K/V (rows of num_kv_heads * head_dim floats, `new_token_stride` apart) into the
 * caches at `slot_mapping`, then attends: each query row to its sequence's keys up to its causal
 * end. Returns 0 on success, 1 if head_dim or
 * num_heads exceeds the kernel's fixed buffers, 2 if the work list could not be allocated. */
int paged_attention_f32(
    const float *query, int64_t query_token_stride, const float *new_keys, const float *new_values,
    int64_t new_token_stride, const int64_t *slot_mapping, int64_t num_tokens, float *k_cache,
    float *v_cache, const int32_t *block_tables, int64_t block_table_stride,
    const int32_t *context_lens, const int32_t *query_start_loc, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
    float *out, int64_t out_token_stride) {
    if (head_dim > MAX_HEAD_DIM || num_heads > MAX_VECTORS || num_heads % num_kv_heads != 0) return 1;
    const int64_t slot_floats = num_kv_heads * head_dim;
#pragma omp parallel for if (num_tokens >= 256)
    for (int64_t t = 0; t < num_tokens; ++t) {
        memcpy(k_cache + slot_mapping[t] * slot_floats, new_keys + t * new_token_stride, sizeof(float) * slot_floats);
        memcpy(v_cache + slot_mapping[t] * slot_floats, new_values + t * new_token_stride, sizeof(float) * slot_floats);
    }
    const int64_t rows_per_item = MAX_VECTORS / num_heads;
    /* item_starts[b] = first work item of sequence b (one item per chunk of its query rows) */
    int64_t *item_starts = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (item_starts == NULL) return 2;
    item_starts[0] = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t query_len = query_start_loc[b + 1] - query_start_loc[b];
        const int64_t chunks = (query_len + rows_per_item - 1) / rows_per_item;
        item_starts[b + 1] = item_starts[b] + chunks;
    }
    const int64_t num_items = item_starts[num_seqs];
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
        int64_t lo = 0, hi = num_seqs - 1; /* sequence owning the item: last b with item_starts[b] <= item */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (item_starts[mid] <= item) lo = mid; else hi = mid - 1;
        }
        const int64_t b = lo, chunk = item - item_starts[b];
        const int64_t query_len = query_start_loc[b + 1] - query_start_loc[b];
        const int64_t first_row = chunk * rows_per_item;
        const int64_t num_rows = query_len - first_row < rows_per_item ? query_len - first_row : rows_per_item;
        attend_item(query, query_token_stride, k_cache, v_cache, block_tables + b * block_table_stride,
                    context_lens[b], query_len, first_row, num_rows,
                    query_start_loc[b], num_heads, num_kv_heads, head_dim, block_size, scale, out,
                    out_token_stride);
    }
    free(item_starts);
    return 0;
}
