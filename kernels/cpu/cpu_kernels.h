/* What the CPU kernels beside this header (paged_attention.c, fused_layer_ops.c, int4_gemv.c,
 * greedy_pick.c) share, kept here once so their copies cannot drift apart: the dtype codes of
 * bindings.py's DTYPES, the scalar fp32 <-> bf16 conversions, and the vectorizable exps.
 * All static inline: each kernel compiles them with its own flags (bindings.py hashes this
 * header into every library's cache key). Vector-width code stays in the kernels. */
#ifndef FORKLM_CPU_KERNELS_H
#define FORKLM_CPU_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* A tensor's dtype as the bindings pass it (bindings.py's DTYPES). The 8-bit ones are KV-pool
 * formats only (--kv-cache-dtype): torch's float8_e5m2 and float8_e4m3fn, and int8 codes with
 * one float32 scale per token and KV head (int8_from_values below). */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2, DTYPE_FP8_E5M2 = 3, DTYPE_FP8_E4M3 = 4,
       DTYPE_INT8 = 5 };

/* A matmul in one form for fused_layer_ops.c's decode runner: y [rows, n_out] bf16 = x [rows, k]
 * bf16 @ W^T by a kernel library's `*_op` entry point, its matrix given by `args` (each entry
 * point says what they are). Returns 0, or the kernel's refusal (nonzero; nothing written). */
typedef int (*matmul_op_fn)(const int64_t *args, const void *x, void *y, int64_t rows);

static inline int64_t dtype_bytes(int dtype) {
    return dtype == DTYPE_F32 ? 4 : dtype >= DTYPE_FP8_E5M2 ? 1 : 2;
}

/* One head's n values x as int8 codes q and their scale (returned), as KVPool.store computes
 * them: scale = max |x| / 127 (1 for an all-zero head), q = x / scale rounded to nearest even
 * and clamped to +-127. All in fp32, division included, so the codes are bit-equal to torch's. */
static inline float int8_from_values(const float *x, int64_t n, int8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        /* clamped: with a subnormal max |x| the rounded scale can make x / scale 127.5 */
        const float r = nearbyintf(x[i] / scale);
        q[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    return scale;
}

/* The largest finite value of an 8-bit KV format: stores saturate to it (the pool clamps the
 * same way on the torch path, so an outlier never becomes inf or NaN). */
static inline float fp8_max(int dtype) { return dtype == DTYPE_FP8_E4M3 ? 448.0f : 57344.0f; }

/* fp32 -> e5m2 / e4m3fn, saturated to fp8_max, rounded to nearest even: bit-equal to torch's
 * x.clamp(-max, max).to(float8_*) (tests/test_fused_layers.py checks every bf16 value). */
static inline uint8_t fp8_from_f32(float f, int dtype) {
    const int mant_bits = dtype == DTYPE_FP8_E4M3 ? 3 : 2;
    const int bias = dtype == DTYPE_FP8_E4M3 ? 7 : 15;
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7f; /* NaN */
    float a = fabsf(f);
    if (a > fp8_max(dtype)) a = fp8_max(dtype);
    if (a < ldexpf(1.0f, 1 - bias)) /* subnormal: a multiple of 2^(1 - bias - mant_bits) */
        return sign | (uint8_t)nearbyintf(a * ldexpf(1.0f, bias - 1 + mant_bits));
    memcpy(&u, &a, 4);
    const int shift = 23 - mant_bits; /* drop the low mantissa bits, ties to even */
    u += ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);
    return sign | (uint8_t)((u >> shift) - ((uint32_t)(127 - bias) << mant_bits));
}

/* Round to nearest even, NaN -> 0xffff: what torch's vectorized float -> bfloat16 conversion
 * (the one tensor.to() takes) does; its scalar path would give 0x7fc0, also a NaN. */
static inline uint16_t bf16_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Exact: a bf16 is the high half of an fp32. */
static inline float f32_from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) = 2^n * exp(r): n an integer (held as a float) and r = x - n ln2 in |r| <= ln2/2. */
typedef struct {
    float n, r;
} exp_reduced;

/* Cody-Waite reduction, ln2 in two parts; x must keep 2^n a normal float (both callers clamp).
 * Plain arithmetic, so loops over it vectorize (libm's expf would not without -ffast-math). */
static inline exp_reduced exp_reduce(float x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    exp_reduced e;
    e.n = (x * 1.44269504088896341f + shifter) - shifter;
    e.r = x - e.n * 0.693145751953125f - e.n * 1.42860682030941723e-6f;
    return e;
}

/* 2^n for n in [-126, 127], from its exponent bits. */
static inline float f32_exp2i(int32_t n) {
    int32_t bits = (n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Horner's rule for the Taylor terms from r^5/5! down: p holds the higher terms folded so far
 * (1/6! for degree 6; 1/7! * r + 1/6! for degree 7). */
static inline float exp_taylor_tail(float p, float r) {
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    return p * r + 1.0f;
}

/* The two exps share the reduction and the polynomial's tail but keep their own Taylor degree, as each trades accuracy
 * for speed its own way: attention's softmax weights need ~2e-7 relative, so exp_nonpos saves a
 * multiply-add per score with degree 6 (and one 2^n factor: x <= 0); the fused SiLU is meant to
 * differ from torch's eager exp in the last bit at most, so exp_clamped pays for degree 7. */

/* exp(x) for x <= 0 (scores minus their max), to ~2e-7 relative: degree-6 Taylor polynomial. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x; /* keeps 2^n a normal float; exp(-87) ~ 1.6e-38 */
    const exp_reduced e = exp_reduce(x);
    const float p = exp_taylor_tail(1.0f / 720, e.r);
    return p * f32_exp2i((int32_t)e.n);
}

/* exp(x) to ~1 ulp for x in [-87, 88] (clamped outside): degree-7 Taylor polynomial. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const exp_reduced e = exp_reduce(x);
    const float p = exp_taylor_tail(1.0f / 5040 * e.r + 1.0f / 720, e.r);
    /* 2^n as two exact power-of-two factors (n <= 127 here, so one factor would do too: the
     * same bits either way) */
    int32_t half = (int32_t)e.n / 2;
    return p * f32_exp2i(half) * f32_exp2i((int32_t)e.n - half);
}

#endif
