/* Paged attention for the CPU, float32: queries attend to K/V read in place through the block table.
 *
 * First the step's new K/V rows are written into their cache slots (slot_mapping; vLLM's
 * reshape_and_cache). Then one work item = (sequence, chunk of up to MAX_VECTORS / num_heads
 * query tokens) with the query vectors of every head of those tokens. A cache slot holds the
 * K (or V) rows of all KV heads side by side, so an item reads whole contiguous slots, page by
 * page, and each K/V row serves all G query heads that share it (grouped-query attention
 * without copying KV heads). Slot of position t = block_tables[seq][t / block_size] * block_size
 * + t % block_size. Query token j of a sequence with query_len q and context_len c sits at
 * position c - q + j and sees keys 0..c - q + j (causal); decode (q = 1), prefill and chunked
 * prefill are one path.
 *
 * The arithmetic is laid out for the vector unit (LANES floats, lanes.h): a tile of LANES keys is
 * scored as LANES vectors of per-dim partial products, which lane_sums turns into one vector of
 * scores (no horizontal sum per key), with each key vector loaded once for up to SHARE query
 * vectors of its KV head; the softmax runs once per chunk of KEY_CHUNK keys (running max and
 * sum, accumulators rescaled: an online softmax across chunks); the values are accumulated
 * with a SHARE x DIM_SLICE register tile over the whole chunk, each value vector loaded once
 * for the SHARE queries. The K / V lines are requested one tile ahead, a KV head at a time, so
 * that the requests trickle out while the tile computes (docs/performance.md, section 3.4).
 * Items are independent and run in parallel on the OpenMP runtime that torch already loaded
 * (same libgomp soname), so the kernel shares torch's threads instead of starting a second pool.
 *
 * The cache holds float32, or bfloat16 (paged_attention_bf16kv: kv_cache_dtype=bfloat16, half the
 * bytes each step reads). A bfloat16 element is the top half of a float32, so a key or value vector
 * is LANES halves widened and shifted into place on load (the arithmetic stays float32), and the
 * new K/V are rounded to the nearest bfloat16 (ties to even, as torch's .to(torch.bfloat16)) on
 * their way into the cache. One source serves both: every function that touches the cache takes
 * `bf16` as a constant that the always-inline calls fold away, so each entry point gets its own
 * loops with no branch per element.
 *
 * Built and loaded by engine/native.py (cc -O3 -march=native -fopenmp).
 */
#include <stdlib.h>

#include "lanes.h"

typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));
typedef uint32_t vword __attribute__((vector_size(LANES * 4)));

static inline float bf16_to_float(uint16_t half) {
    const uint32_t word = (uint32_t)half << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

/* Round to the nearest bfloat16, ties to even; a NaN stays a (quiet) NaN: torch's rounding. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t word;
    memcpy(&word, &value, sizeof word);
    if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

/* The cache element `offset` elements into `cache` (float32, or bfloat16 when `bf16`). */
static inline __attribute__((always_inline)) const void *kv_at(const void *cache, int64_t offset, int bf16) {
    return (const char *)cache + offset * (bf16 ? 2 : 4);
}

/* LANES cache elements from `row` + d, as floats. */
static inline __attribute__((always_inline)) vf kv_load(const void *row, int64_t d, int bf16) {
    if (!bf16) return load_vf((const float *)row + d);
    vhalf halves;
    memcpy(&halves, (const uint16_t *)row + d, sizeof halves);
    return (vf)(__builtin_convertvector(halves, vword) << 16);
}

static inline __attribute__((always_inline)) float kv_scalar(const void *row, int64_t d, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

#define MAX_VECTORS 64  /* query vectors per item: tokens per item * num_heads <= MAX_VECTORS */
#define MAX_HEAD_DIM 256
#define KEY_CHUNK 256   /* keys scored before one softmax update (their scores stay in L1) */
#define PREFETCH_TILES 1 /* how far ahead (in key tiles) the K / V lines are requested */
#if LANES == 16
#define SHARE 4 /* query vectors of one KV head that share each K / V row load (32 registers) */
#else
#define SHARE 2 /* (16 registers) */
#endif
#define DIM_SLICE 4 /* vectors of head dims accumulated in registers in one pass over the values */

/* Calls `call(n)` with n = the run-time `count` (1 .. SHARE) as a compile-time constant, so that
 * each always-inline kernel below is specialised with its register arrays fully unrolled. */
#if SHARE == 4
#define WITH_SHARE(count, call) \
    switch (count) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; default: call(4); }
#else
#define WITH_SHARE(count, call) \
    switch (count) { case 1: call(1); break; default: call(2); }
#endif

/* Scores of n query vectors (rows of q, MAX_HEAD_DIM apart, all of the KV head the key rows point
 * at) against the LANES keys keys[0..LANES): out[s] lane j = q_s . k_j. Per group of four keys,
 * 4 n accumulators of per-dim partial products (each key vector loaded once for the n queries,
 * four independent FMA chains per query), then one lane_sums per query turns 16 (8) vectors of
 * partials into one vector of scores. */
static inline __attribute__((always_inline)) void score_keys(
    int n, const float *q, const void *const *keys, int64_t full, int64_t head_dim, vf *out, int bf16) {
    vf partial[SHARE][LANES];
    for (int j = 0; j < LANES; j += 4) {
        vf a[SHARE][4];
        for (int s = 0; s < n; ++s) a[s][0] = a[s][1] = a[s][2] = a[s][3] = (vf){0};
        for (int64_t d = 0; d < full; d += LANES) {
            const vf k0 = kv_load(keys[j], d, bf16), k1 = kv_load(keys[j + 1], d, bf16);
            const vf k2 = kv_load(keys[j + 2], d, bf16), k3 = kv_load(keys[j + 3], d, bf16);
            for (int s = 0; s < n; ++s) {
                const vf qv = load_vf(q + s * MAX_HEAD_DIM + d);
                a[s][0] = vfma(qv, k0, a[s][0]), a[s][1] = vfma(qv, k1, a[s][1]);
                a[s][2] = vfma(qv, k2, a[s][2]), a[s][3] = vfma(qv, k3, a[s][3]);
            }
        }
        for (int s = 0; s < n; ++s)
            partial[s][j] = a[s][0], partial[s][j + 1] = a[s][1], partial[s][j + 2] = a[s][2], partial[s][j + 3] = a[s][3];
    }
    for (int s = 0; s < n; ++s) {
        vf scores = lane_sums(partial[s]);
        if (full < head_dim) /* a head_dim that is not a multiple of LANES: the rest one by one */
            for (int j = 0; j < LANES; ++j)
                for (int64_t d = full; d < head_dim; ++d) scores[j] += q[s * MAX_HEAD_DIM + d] * kv_scalar(keys[j], d, bf16);
        out[s] = scores;
    }
}

/* acc_s[0 .. width * LANES) = acc_s * correction[s] + sum_j p_s[j] v_j for n query vectors (acc and p
 * rows MAX_HEAD_DIM and KEY_CHUNK apart; acc already offset to dim d) and the `count` value rows
 * values[j] (offset to the KV head) from dim d on: the n x width accumulators stay in registers over all keys, and
 * each value vector is loaded once for the n queries. */
static inline __attribute__((always_inline)) void accumulate_values(
    int n, int width, const float *p, const void *const *values, int64_t d, int64_t count,
    const float *correction, float *acc, int bf16) {
    vf a[SHARE][DIM_SLICE];
    for (int s = 0; s < n; ++s)
        for (int c = 0; c < width; ++c) a[s][c] = load_vf(acc + s * MAX_HEAD_DIM + c * LANES) * correction[s];
    for (int64_t j = 0; j < count; ++j) {
        vf v[DIM_SLICE];
        for (int c = 0; c < width; ++c) v[c] = kv_load(values[j], d + c * LANES, bf16);
        for (int s = 0; s < n; ++s) {
            const vf weight = vbroadcast(p[s * KEY_CHUNK + j]);
            for (int c = 0; c < width; ++c) a[s][c] = vfma(weight, v[c], a[s][c]);
        }
    }
    for (int s = 0; s < n; ++s)
        for (int c = 0; c < width; ++c) memcpy(acc + s * MAX_HEAD_DIM + c * LANES, &a[s][c], sizeof(vf));
}

static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch((const char *)row + line);
}

/* One work item: query rows first_row .. first_row + num_rows - 1 of one sequence, all heads.
 * Query vector v = (KV head h, row r, head in group g) sits at v = h * num_rows * group + r *
 * group + g, so the vectors sharing a KV head are consecutive and share every K / V row load in
 * groups of SHARE. Keys are taken in chunks of KEY_CHUNK: all scores of a chunk (tile by tile of
 * LANES keys, every KV head of a key tile while its slots are in L1), one softmax update per
 * vector (running max and sum, accumulators rescaled), then the values. */
static inline __attribute__((always_inline)) void attend_item(
    const float *query, int64_t query_token_stride, const void *k_cache, const void *v_cache,
    const int32_t *block_table, int64_t context_len, int64_t query_len, int64_t first_row,
    int64_t num_rows, int64_t query_start, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *out, int64_t out_token_stride, int bf16) {
    const int64_t group = num_heads / num_kv_heads, per_kv = num_rows * group;
    const int64_t num_vectors = num_rows * num_heads;
    const int64_t slot_stride = num_kv_heads * head_dim; /* elements between consecutive slots */
    const int64_t slot_bytes = slot_stride * (bf16 ? 2 : 4), head_bytes = head_dim * (bf16 ? 2 : 4);
    const int64_t full = head_dim / LANES * LANES;       /* dims covered by whole vectors */
    float q[MAX_VECTORS][MAX_HEAD_DIM], acc[MAX_VECTORS][MAX_HEAD_DIM];
    float scores[MAX_VECTORS][KEY_CHUNK];
    float running_max[MAX_VECTORS], running_sum[MAX_VECTORS], correction[MAX_VECTORS];
    int64_t last_key[MAX_VECTORS], rows[KEY_CHUNK];
    vi lane;
    for (int i = 0; i < LANES; ++i) lane[i] = i;
    /* The first tiles' lines, before the queries are set up (later tiles: see the tile loop). */
    for (int64_t position = 0; position < PREFETCH_TILES * LANES && position < context_len; ++position) {
        const int64_t row = ((int64_t)block_table[position / block_size] * block_size + position % block_size) * slot_stride;
        prefetch_row(kv_at(k_cache, row, bf16), slot_bytes);
        prefetch_row(kv_at(v_cache, row, bf16), slot_bytes);
    }

    for (int64_t v = 0; v < num_vectors; ++v) {
        const int64_t kv_head = v / per_kv, r = v % per_kv / group, head = kv_head * group + v % group;
        const float *src = query + (query_start + first_row + r) * query_token_stride + head * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[v][d] = src[d] * scale, acc[v][d] = 0.0f;
        running_max[v] = -INFINITY, running_sum[v] = 0.0f;
        last_key[v] = context_len - query_len + first_row + r;
    }
    const int64_t keys = context_len - query_len + first_row + num_rows; /* the item's last row sees the most */
    for (int64_t chunk = 0; chunk < keys; chunk += KEY_CHUNK) {
        const int64_t chunk_len = keys - chunk < KEY_CHUNK ? keys - chunk : KEY_CHUNK;
        const int64_t tiles = (chunk_len + LANES - 1) / LANES;
        for (int64_t j = 0; j < tiles * LANES; ++j) { /* lanes past the chunk re-read its first key (masked) */
            const int64_t position = chunk + (j < chunk_len ? j : 0);
            rows[j] = ((int64_t)block_table[position / block_size] * block_size + position % block_size) * slot_stride;
        }
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t first = tile * LANES, tile_start = chunk + first;
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                /* Slots sit in pages (blocks) scattered over the cache, which stops the hardware
                 * prefetcher at every block boundary: while this KV head of the tile is scored, ask
                 * for its K and V lines PREFETCH_TILES tiles ahead, so the requests trickle out. */
                for (int64_t position = tile_start + PREFETCH_TILES * LANES; position < tile_start + (PREFETCH_TILES + 1) * LANES && position < keys; ++position) {
                    const int64_t row = ((int64_t)block_table[position / block_size] * block_size + position % block_size) * slot_stride + h * head_dim;
                    prefetch_row(kv_at(k_cache, row, bf16), head_bytes);
                    prefetch_row(kv_at(v_cache, row, bf16), head_bytes);
                }
                const void *key_rows[LANES];
                for (int j = 0; j < LANES; ++j) key_rows[j] = kv_at(k_cache, rows[first + j] + h * head_dim, bf16);
                for (int64_t v0 = h * per_kv; v0 < (h + 1) * per_kv; v0 += SHARE) {
                    const int n = (h + 1) * per_kv - v0 < SHARE ? (int)((h + 1) * per_kv - v0) : SHARE;
                    vf tile_scores[SHARE];
#define SCORE(N) score_keys(N, q[v0], key_rows, full, head_dim, tile_scores, bf16)
                    WITH_SHARE(n, SCORE)
#undef SCORE
                    for (int s = 0; s < n; ++s) { /* causal and chunk-end mask: -inf */
                        int64_t visible = last_key[v0 + s] - tile_start + 1;
                        visible = visible < chunk_len - first ? visible : chunk_len - first;
                        const vf masked = vselect(lane < (vi){0} + (int32_t)(visible > 0 ? visible : 0), tile_scores[s],
                                                  (vf){0} - INFINITY);
                        memcpy(scores[v0 + s] + first, &masked, sizeof masked);
                    }
                }
            }
        }
        /* Online softmax: each vector's chunk max (a vector with no visible key here keeps its max:
         * correction 1, all weights 0; the first chunk always holds key 0, visible to all). */
        for (int64_t v = 0; v < num_vectors; ++v) {
            vf top = load_vf(scores[v]);
            for (int64_t first = LANES; first < tiles * LANES; first += LANES) top = vmax(top, load_vf(scores[v] + first));
            const float chunk_max = lane_max(top);
            const float new_max = chunk_max > running_max[v] ? chunk_max : running_max[v];
            vf sum = {0};
            for (int64_t first = 0; first < tiles * LANES; first += LANES) {
                const vf s = load_vf(scores[v] + first);
                const vf weights = vselect(s == (vf){0} - INFINITY, (vf){0}, vexp(s - new_max));
                memcpy(scores[v] + first, &weights, sizeof weights);
                sum += weights;
            }
            correction[v] = expf(running_max[v] - new_max); /* 0 on the first chunk */
            running_sum[v] = running_sum[v] * correction[v] + lane_sum(sum);
            running_max[v] = new_max;
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const void *value_rows[KEY_CHUNK];
            for (int64_t j = 0; j < chunk_len; ++j) value_rows[j] = kv_at(v_cache, rows[j] + h * head_dim, bf16);
            for (int64_t v0 = h * per_kv; v0 < (h + 1) * per_kv; v0 += SHARE) {
                const int n = (h + 1) * per_kv - v0 < SHARE ? (int)((h + 1) * per_kv - v0) : SHARE;
                int64_t d = 0;
#define VALUES(N) accumulate_values(N, width, scores[v0], value_rows, d, chunk_len, correction + v0, acc[v0] + d, bf16)
                for (; d + DIM_SLICE * LANES <= full; d += DIM_SLICE * LANES) {
                    const int width = DIM_SLICE;
                    WITH_SHARE(n, VALUES)
                }
                for (; d < full; d += LANES) { /* fewer than DIM_SLICE vectors of dims left */
                    const int width = 1;
                    WITH_SHARE(n, VALUES)
                }
#undef VALUES
                for (int s = 0; s < n; ++s) /* the rest of a head_dim that is not a multiple of LANES */
                    for (int64_t dim = full; dim < head_dim; ++dim) {
                        float sum = acc[v0 + s][dim] * correction[v0 + s];
                        for (int64_t j = 0; j < chunk_len; ++j) sum += scores[v0 + s][j] * kv_scalar(value_rows[j], dim, bf16);
                        acc[v0 + s][dim] = sum;
                    }
            }
        }
    }
    for (int64_t v = 0; v < num_vectors; ++v) {
        const int64_t kv_head = v / per_kv, r = v % per_kv / group, head = kv_head * group + v % group;
        float *dst = out + (query_start + first_row + r) * out_token_stride + head * head_dim;
        const float inverse = 1.0f / running_sum[v];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[v][d] * inverse;
    }
}

/* Writes the new K/V (rows of num_kv_heads * head_dim floats, `new_token_stride` apart) into the
 * caches at `slot_mapping` (rounded to bfloat16 when `bf16`), then attends: each query row to its
 * sequence's keys up to its causal end. Returns 0 on success, 1 if head_dim or num_heads exceeds
 * the kernel's fixed buffers, 2 if the work list could not be allocated. */
static inline __attribute__((always_inline)) int paged_attention(
    const float *query, int64_t query_token_stride, const float *new_keys, const float *new_values,
    int64_t new_token_stride, const int64_t *slot_mapping, int64_t num_tokens, void *k_cache,
    void *v_cache, const int32_t *block_tables, int64_t block_table_stride,
    const int32_t *context_lens, const int32_t *query_start_loc, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
    float *out, int64_t out_token_stride, int bf16) {
    if (head_dim > MAX_HEAD_DIM || num_heads > MAX_VECTORS || num_heads % num_kv_heads != 0) return 1;
    const int64_t slot_floats = num_kv_heads * head_dim;
#pragma omp parallel for if (num_tokens >= 256)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *key = new_keys + t * new_token_stride, *value = new_values + t * new_token_stride;
        if (bf16) {
            uint16_t *k_slot = (uint16_t *)k_cache + slot_mapping[t] * slot_floats;
            uint16_t *v_slot = (uint16_t *)v_cache + slot_mapping[t] * slot_floats;
            for (int64_t i = 0; i < slot_floats; ++i) k_slot[i] = float_to_bf16(key[i]), v_slot[i] = float_to_bf16(value[i]);
        } else {
            memcpy((float *)k_cache + slot_mapping[t] * slot_floats, key, sizeof(float) * slot_floats);
            memcpy((float *)v_cache + slot_mapping[t] * slot_floats, value, sizeof(float) * slot_floats);
        }
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
#define ATTEND(BF16) attend_item(query, query_token_stride, k_cache, v_cache, block_tables + b * block_table_stride, \
                               context_lens[b], query_len, first_row, num_rows, query_start_loc[b], num_heads,  \
                               num_kv_heads, head_dim, block_size, scale, out, out_token_stride, BF16)
        if (bf16) ATTEND(1); else ATTEND(0); /* each call specialised for its cache dtype */
#undef ATTEND
    }
    free(item_starts);
    return 0;
}

/* The entry points, one per cache dtype, with decoder_layer.c's attention signature; `context` is a
 * per-step plan this kernel does not need. */
#define ENTRY_POINT(name, bf16)                                                                                         \
    int name(const float *query, int64_t query_token_stride, const float *new_keys, const float *new_values,          \
             int64_t new_token_stride, const int64_t *slot_mapping, int64_t num_tokens, void *k_cache, void *v_cache, \
             const int32_t *block_tables, int64_t block_table_stride, const int32_t *context_lens,                   \
             const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,              \
             int64_t head_dim, int64_t block_size, float scale, float *out, int64_t out_token_stride,                \
             const void *context) {                                                                                  \
        (void)context;                                                                                               \
        return paged_attention(query, query_token_stride, new_keys, new_values, new_token_stride, slot_mapping,      \
                               num_tokens, k_cache, v_cache, block_tables, block_table_stride, context_lens,         \
                               query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out, \
                               out_token_stride, bf16);                                                              \
    }
ENTRY_POINT(paged_attention_f32, 0)
ENTRY_POINT(paged_attention_bf16kv, 1) /* kv_cache_dtype=bfloat16 */
#undef ENTRY_POINT
