/* Helpers shared by servelab's C kernels (float32, CPU). */
#ifndef SERVELAB_COMMON_H
#define SERVELAB_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Eight floats as one value (GCC/Clang vector extensions): lowered to one AVX register where
 * the CPU has AVX, to narrower registers or scalars elsewhere, so the code stays portable. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f32x8 select8(i32x8 mask, f32x8 if_true, f32x8 if_false) {
    return (f32x8)(((i32x8)if_true & mask) | ((i32x8)if_false & ~mask));
}

/* exp of a vector of floats (DEFINE_VECTOR_EXP makes one per vector width: exp8 here, the
 * 16-lane one in cascade_attention.c): Cephes' expf polynomial on x = n ln2 + r, |r| <= ln2 / 2, then 2^n
 * through the exponent bits; within 2 ulp of expf for x in [-87, 88]. Inputs outside are
 * clamped: below -87 the result (< 2e-38) stands in for 0, above 88 for +inf. Written with
 * vector types because GCC does not vectorise the bit cast of 2^n inside a scalar loop. */
#define DEFINE_VECTOR_EXP(name, fvec, ivec, select)                                                   \
    static inline fvec name(fvec x) {                                                                 \
        const fvec zero = {0};                                                                        \
        x = select(x < zero - 87.0f, zero - 87.0f, x);                                                \
        x = select(x > zero + 88.0f, zero + 88.0f, x);                                                \
        /* n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to an integer (exact because  \
         * |x / ln2| < 2^22, and contraction / reassociation are off in C11). */                       \
        const fvec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                        \
        const fvec r = x - n * 0.693359375f + n * 2.12194440e-4f;                                     \
        fvec p = zero + 1.9875691500e-4f;                                                             \
        p = p * r + 1.3981999507e-3f;                                                                 \
        p = p * r + 8.3334519073e-3f;                                                                 \
        p = p * r + 4.1665795894e-2f;                                                                 \
        p = p * r + 1.6666665459e-1f;                                                                 \
        p = p * r + 5.0000001201e-1f;                                                                 \
        p = p * r * r + r + 1.0f;                                                                     \
        const ivec two_to_n = (__builtin_convertvector(n, ivec) + 127) << 23;                         \
        return p * (fvec)two_to_n;                                                                    \
    }

DEFINE_VECTOR_EXP(exp8, f32x8, i32x8, select8)

#if defined(__FMA__)
#include <immintrin.h>
static inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fmadd_ps(a, b, c); }
#else
static inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) { return a * b + c; }
#endif

static inline float sum8(f32x8 value) {
    return ((value[0] + value[1]) + (value[2] + value[3])) + ((value[4] + value[5]) + (value[6] + value[7]));
}

static inline f32x8 load8(const float *source) {
    f32x8 value;
    memcpy(&value, source, sizeof value);
    return value;
}

static inline void store8(float *target, f32x8 value) { memcpy(target, &value, sizeof value); }

/* Four dot products of q with k0..k3 (n a multiple of 8): four independent FMA chains, so the
 * FMA latency is hidden (one chain per dot would wait on itself every instruction). */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3,
                        int64_t n, float *out) {
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t d = 0; d < n; d += 8) {
        const f32x8 qv = load8(q + d);
        a0 = fma8(qv, load8(k0 + d), a0);
        a1 = fma8(qv, load8(k1 + d), a1);
        a2 = fma8(qv, load8(k2 + d), a2);
        a3 = fma8(qv, load8(k3 + d), a3);
    }
    out[0] = sum8(a0), out[1] = sum8(a1), out[2] = sum8(a2), out[3] = sum8(a3);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
    return sum;
}
#endif
