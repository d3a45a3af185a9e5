/* One decoder layer of a decode-sized step in one call (float32, CPU): the same kernels the Python
 * layer calls one by one, called here in sequence, so the ~15 Python operations per layer (module
 * calls, wrappers, argument conversion, tensor allocations: ~70 us a layer, ~2 ms of a batch-1
 * step on SmolLM2) become one ctypes call.
 *
 * Nothing here computes: every step is an existing kernel, reached through a function pointer
 * that the caller looked up in that kernel's own library (engine/native_layers.py):
 *   add + RMSNorm, fused qkv linear, RoPE (in place on q and k), KV write + paged attention,
 *   o linear, add + RMSNorm, fused gate/up linear, SiLU-and-multiply, down linear.
 * A linear is a (function, weight, bias) triple with the skinny GEMM's signature, so any kernel
 * with that signature and its own weight format (a quantized GEMV, say) plugs in per linear; the
 * attention kernel is whatever the attention backend hands over (cpu_paged offers one).
 * All metadata is explicit in the arguments: no globals, nothing kept between calls.
 */
#include <stdint.h>
#include <string.h>

/* out[rows, out_features] = x[rows, in_features] (row stride x_stride) @ W^T (+ bias), W in the
 * kernel's own format (gemm.c: gemm_packed_f32) */
typedef void (*linear_fn)(const float *x, int64_t rows, int64_t in_features, int64_t x_stride, const void *weight,
                          const float *bias, int64_t out_features, float *out);
typedef void (*add_rms_norm_fn)(const float *x, float *residual, const float *weight, float eps, int64_t num_tokens,
                                int64_t hidden_size, int add_residual, float *out);
typedef void (*rope_fn)(float *x, int64_t token_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        const int64_t *positions, const float *cos_sin);
typedef void (*silu_and_mul_fn)(const float *gate_up, int64_t num_tokens, int64_t size, float *out);
/* paged_attention.c: paged_attention_f32 / _bf16kv (cascade_attention.c: cascade_decode_layer_f32):
 * the step's K/V written, then attention; the caches' dtype is the kernel's (float32 or bfloat16);
 * `context` is the backend's per-step plan (or NULL) */
typedef int (*attention_fn)(const float *query, int64_t query_token_stride, const float *new_keys,
                            const float *new_values, int64_t new_token_stride, const int64_t *slot_mapping,
                            int64_t num_tokens, void *k_cache, void *v_cache, const int32_t *block_tables,
                            int64_t block_table_stride, const int32_t *context_lens, const int32_t *query_start_loc,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, float *out, int64_t out_token_stride,
                            const void *context);

struct linear {
    linear_fn run;
    const void *weight;
    const float *bias; /* or NULL */
};

/* One layer's weights, built once per model (engine/native_layers.py: LayerWeights). */
struct layer_weights {
    struct linear qkv, o, gate_up, down;
    const float *input_norm, *post_attention_norm;
};

/* One step's shapes, metadata, kernels and scratch buffers, built once per step for all layers
 * (engine/native_layers.py: LayerStep). */
struct layer_step {
    add_rms_norm_fn add_rms_norm;
    rope_fn rope;
    silu_and_mul_fn silu_and_mul;
    attention_fn attention;
    int64_t num_tokens, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
    float eps, scale;
    const int64_t *positions;
    const float *cos_sin;
    const int64_t *slot_mapping;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *context_lens, *query_start_loc;
    int64_t num_seqs, block_size;
    float *normed, *qkv, *attention_out, *gate_up, *activation; /* [num_tokens, ...] scratch */
    const void *attention_context; /* the attention backend's per-step plan, passed through (or NULL) */
};

/* The layer on the residual stream, as DecoderLayer.forward carries it, with this layer's KV caches
 * ([num_blocks, block_size, num_kv_heads, head_dim], contiguous): on entry `hidden` holds
 * the previous layer's MLP output (the embeddings for the first layer, first_layer = 1) and
 * `residual` the stream before it (ignored for the first layer); on return `hidden` holds this
 * layer's MLP output and `residual` the stream before it. Returns the attention kernel's status
 * (0 = success). */
int decoder_layer_f32(const struct layer_weights *w, const struct layer_step *s, void *k_cache, void *v_cache,
                      float *hidden, float *residual, int first_layer) {
    const int64_t t = s->num_tokens, h = s->hidden_size, d = s->head_dim;
    const int64_t q_size = s->num_heads * d, qkv_size = (s->num_heads + 2 * s->num_kv_heads) * d;
    if (first_layer) memcpy(residual, hidden, sizeof(float) * t * h);
    s->add_rms_norm(hidden, residual, w->input_norm, s->eps, t, h, !first_layer, s->normed);
    w->qkv.run(s->normed, t, h, h, w->qkv.weight, w->qkv.bias, qkv_size, s->qkv);
    s->rope(s->qkv, qkv_size, t, s->num_heads + s->num_kv_heads, d, s->positions, s->cos_sin);
    const int status = s->attention(
        s->qkv, qkv_size, s->qkv + q_size, s->qkv + q_size + s->num_kv_heads * d, qkv_size, s->slot_mapping, t,
        k_cache, v_cache, s->block_tables, s->block_table_stride, s->context_lens, s->query_start_loc,
        s->num_seqs, s->num_heads, s->num_kv_heads, d, s->block_size, s->scale, s->attention_out, q_size,
        s->attention_context);
    if (status != 0) return status;
    w->o.run(s->attention_out, t, q_size, q_size, w->o.weight, w->o.bias, h, hidden);
    s->add_rms_norm(hidden, residual, w->post_attention_norm, s->eps, t, h, 1, s->normed);
    w->gate_up.run(s->normed, t, h, h, w->gate_up.weight, w->gate_up.bias, 2 * s->intermediate_size, s->gate_up);
    s->silu_and_mul(s->gate_up, t, s->intermediate_size, s->activation);
    w->down.run(s->activation, t, s->intermediate_size, s->intermediate_size, w->down.weight, w->down.bias, h, hidden);
    return 0;
}
