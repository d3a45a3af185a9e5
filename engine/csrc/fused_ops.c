/* Fused elementwise kernels for the decoder's CPU float32 path (vLLM's fused_add_rms_norm,
 * silu_and_mul and rotary_embedding). Each replaces several PyTorch ops, i.e. several passes over
 * the activations and several dispatches per layer, by one parallel loop over tokens.
 * Built and loaded by engine/native.py; Python wrappers and reference forms in engine/fused_ops.py.
 */
#include "lanes.h"

/* residual[t] += x[t] (when add_residual), then out[t] = residual[t] / rms(residual[t]) * weight.
 * x and out may be the same buffer. Sums in float32, like F.rms_norm on float32. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float eps,
                      int64_t num_tokens, int64_t hidden_size, int add_residual, float *out) {
#pragma omp parallel for if (num_tokens >= 4)
    for (int64_t t = 0; t < num_tokens; ++t) {
        float *row = residual + t * hidden_size;
        const float *in = x + t * hidden_size;
        float *dst = out + t * hidden_size;
        float sum_squares = 0.0f;
        if (add_residual) {
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < hidden_size; ++i) {
                row[i] += in[i];
                sum_squares += row[i] * row[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < hidden_size; ++i) sum_squares += row[i] * row[i];
        }
        const float inverse_rms = 1.0f / sqrtf(sum_squares / (float)hidden_size + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden_size; ++i) dst[i] = row[i] * inverse_rms * weight[i];
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, size + i] for i < size (gate, then up). */
void silu_and_mul_f32(const float *gate_up, int64_t num_tokens, int64_t size, float *out) {
#pragma omp parallel for if (num_tokens >= 4)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *restrict gate = gate_up + t * 2 * size, *restrict up = gate + size;
        float *restrict dst = out + t * size;
        int64_t i = 0;
        for (; i + LANES <= size; i += LANES) { /* the vector unit's full width (lanes.h): 16 with AVX-512 */
            const vf g = load_vf(gate + i), u = load_vf(up + i);
            const vf value = g / (1.0f + vexp(-g)) * u;
            memcpy(dst + i, &value, sizeof value);
        }
        for (; i < size; ++i) dst[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* RoPE in HF's rotate_half convention, in place on the first `num_heads` heads of every token:
 * x[t, h, :] = x * cos + rotate_half(x) * sin with cos/sin of position positions[t], read from
 * cos_sin [max_positions, 2, head_dim] (row 0 cos, row 1 sin; both halves repeat the frequencies). */
void rope_f32(float *x, int64_t token_stride, int64_t num_tokens, int64_t num_heads,
              int64_t head_dim, const int64_t *positions, const float *cos_sin) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (num_tokens >= 4)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *cos = cos_sin + positions[t] * 2 * head_dim, *sin = cos + head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            float *head = x + t * token_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float first = head[i], second = head[half + i];
                head[i] = first * cos[i] - second * sin[i];
                head[half + i] = second * cos[half + i] + first * sin[half + i];
            }
        }
    }
}
