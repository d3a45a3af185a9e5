/* The GGUF block types the block GEMMs read (quant_gemm.c, int_gemm.c, int8_gemm.c): Q4_1 (32
 * weights w = d * q + m, d and m float16, q 4-bit) and Q8_0 (w = d * q, q int8), their ggml_type
 * ids as in the GGUF file and their bytes per block. */
#ifndef SERVELAB_GGUF_BLOCKS_H
#define SERVELAB_GGUF_BLOCKS_H
#include <stdint.h>
#include <string.h>

#define QK 32        /* weights per GGUF block */
#define GGML_Q4_1 3  /* ggml_type ids, as in the GGUF file */
#define GGML_Q8_0 8
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34

/* Bytes of one block of `type` (0: a type the kernels do not read). */
static inline int64_t block_bytes(int64_t type) { return type == GGML_Q4_1 ? Q4_1_BYTES : type == GGML_Q8_0 ? Q8_0_BYTES : 0; }

#if defined(__F16C__)
#include <immintrin.h>
/* A block's float16 scale (d or m) at `p`, as float32. */
static inline float half_to_float(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, sizeof bits);
    return _cvtsh_ss(bits);
}
#endif
#endif
