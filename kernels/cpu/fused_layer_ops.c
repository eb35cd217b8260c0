/* The small steps between a decoder layer's matmuls, fused for short batches (decode, speculative
 * verify): residual add + RMSNorm, rotary on q and k + the K/V write into the paged pool, and
 * SiLU(gate) * up. Each replaces 6-12 torch ops whose per-call cost, not their arithmetic,
 * is what a batch-1 step spends outside its matmuls.
 *
 * Built and loaded by kernels/cpu/bindings.py with -ffp-contract=off and no -ffast-math: every
 * elementwise step rounds where torch's eager ops round (to bf16 after each op in a bf16 model),
 * so the only differences from the eager path are the RMS sum's order and exp's last bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define FUSED_MAX_HEAD_DIM 512

/* x rounded to the tensor dtype, kept as a float (identity for fp32). */
static inline float round_to(float x, int dtype) {
    return dtype == DTYPE_BF16 ? f32_from_bf16(bf16_from_f32(x)) : x;
}

static inline float load(const void *base, int64_t i, int dtype) {
    return dtype == DTYPE_BF16 ? f32_from_bf16(((const uint16_t *)base)[i])
                               : ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float x, int dtype) {
    if (dtype == DTYPE_BF16)
        ((uint16_t *)base)[i] = bf16_from_f32(x);
    else
        ((float *)base)[i] = x;
}

/* Rows of `dim` values. With add: residual += h (rounded to dtype, as torch's x + h), then
 * out = RMSNorm(residual) as runtime/models/layers.py's RMSNorm computes it:
 *   offset 0: w * (x * rsqrt(mean(x^2) + eps)).to(dtype)      (two roundings)
 *   offset c: (x * rsqrt(mean(x^2) + eps) * (c + w)).to(dtype) (one rounding)
 * residual, h and out are [rows, dim] contiguous; w [dim]; all of one dtype. */
/* out[oi..oi+dim) = RMSNorm(x[xi..xi+dim)) as runtime/models/layers.py's RMSNorm computes it:
 *   offset 0: w * (x * rsqrt(mean(x^2) + eps)).to(dtype)      (two roundings)
 *   offset c: (x * rsqrt(mean(x^2) + eps) * (c + w)).to(dtype) (one rounding) */
static inline __attribute__((always_inline)) void rms_norm_row(
        const void *x, int64_t xi, const void *w, void *out, int64_t oi, int64_t dim, float eps,
        float offset, int dtype) {
    /* 16 partial sums (one vector's lanes), added by a pairwise tree: faster and closer to
     * torch's blocked reduction than one running sum */
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16)
        for (int l = 0; l < 16; l++) {
            float v = load(x, xi + i + l, dtype);
            lanes[l] += v * v;
        }
    for (int l = 0; i < dim; i++, l++) {
        float v = load(x, xi + i, dtype);
        lanes[l] += v * v;
    }
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    float inv = 1.0f / sqrtf(lanes[0] / (float)dim + eps);
    for (int64_t j = 0; j < dim; j++) {
        float n = load(x, xi + j, dtype) * inv;
        float y = offset != 0.0f ? n * (offset + load(w, j, dtype))
                                 : round_to(n, dtype) * load(w, j, dtype);
        store(out, oi + j, y, dtype);
    }
}

/* Rows of `dim` values. With h: residual += h (rounded to dtype, as torch's x + h) first.
 * Then out = RMSNorm(residual). residual, h and out are [rows, dim] contiguous; w [dim]; all of
 * one dtype. */
static inline __attribute__((always_inline)) void add_rms_norm(
        int64_t rows, int64_t dim, void *residual, const void *h, const void *w, void *out,
        float eps, float offset, int dtype) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        if (h)
            for (int64_t i = 0; i < dim; i++)
                store(residual, base + i,
                      round_to(load(residual, base + i, dtype) + load(h, base + i, dtype), dtype),
                      dtype);
        rms_norm_row(residual, base, w, out, base, dim, eps, offset, dtype);
    }
}

/* One head of `d` values rotated as layers.py's _rotate does: x * cos + cat(-x2, x1) * sin,
 * rounding after each multiply and the add. */
static inline void rotate_head(const void *x, int64_t xi, const void *cos, const void *sin,
                               int64_t ci, void *y, int64_t yi, int64_t d, int dtype) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        float a = round_to(load(x, xi + i, dtype) * load(cos, ci + i, dtype), dtype);
        float other = i < half ? -load(x, xi + i + half, dtype) : load(x, xi + i - half, dtype);
        float b = round_to(other * load(sin, ci + i, dtype), dtype);
        store(y, yi + i, a + b, dtype);
    }
}

/* One head's n values from src[si..] (of dtype) to the pool's row at pool[pi..] (of kv_dtype),
 * as the pool's torch path stores them: a copy, each value rounded to an 8-bit float, or int8
 * codes with the head's scale written to *scale. */
static inline __attribute__((always_inline)) void store_kv(const void *src, int64_t si,
                                                           void *pool, int64_t pi, int64_t n,
                                                           float *scale, int dtype,
                                                           int kv_dtype) {
    if (kv_dtype == dtype) {
        int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
        memcpy((char *)pool + pi * elem, (const char *)src + si * elem, (size_t)(n * elem));
    } else if (kv_dtype == DTYPE_INT8) {
        float x[FUSED_MAX_HEAD_DIM];
        for (int64_t i = 0; i < n; i++) x[i] = load(src, si + i, dtype);
        *scale = int8_from_values(x, n, (int8_t *)pool + pi);
    } else {
        for (int64_t i = 0; i < n; i++)
            ((uint8_t *)pool)[pi + i] = fp8_from_f32(load(src, si + i, dtype), kv_dtype);
    }
}

/* qkv [tokens, qkv_stride] holds each token's q heads, then k heads, then v heads (d values
 * each). Writes rotated q to q_out [tokens, heads * d]; rotated k and v to rows out_slots[t] of
 * k_layer / v_layer [slots, kv_heads * d] (of kv_dtype: dtype, an 8-bit float, or int8 codes
 * with their scales in k_scale / v_scale [slots, kv_heads], else NULL). cos / sin [tokens, d]
 * are the tokens' table rows in the same dtype. q_norm / k_norm [d] (or NULL): an RMSNorm of
 * each q / k head before its rotation. The caller checks out_slots against the pool and
 * d <= FUSED_MAX_HEAD_DIM. */
static inline __attribute__((always_inline)) void rope_store(
        int64_t tokens, const void *qkv, int64_t qkv_stride, int64_t heads, int64_t kv_heads,
        int64_t d, const void *cos, const void *sin, const int64_t *out_slots, void *k_layer,
        void *v_layer, float *k_scale, float *v_scale, void *q_out, const void *q_norm,
        const void *k_norm, float eps, float offset, int dtype, int kv_dtype) {
    int64_t kv_row = kv_heads * d;
    float normed[FUSED_MAX_HEAD_DIM]; /* one head after its norm (bf16 values use half of it) */
    float rotated[FUSED_MAX_HEAD_DIM]; /* a k head in dtype before an 8-bit pool's rounding */
    for (int64_t t = 0; t < tokens; t++) {
        int64_t src = t * qkv_stride, ci = t * d, slot = out_slots[t];
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const void *x = qkv, *norm = h < heads ? q_norm : k_norm;
            int64_t xi = src + h * d;
            if (norm) { /* Qwen3's per-head q/k RMSNorm, before the rotation */
                rms_norm_row(qkv, xi, norm, normed, 0, d, eps, offset, dtype);
                x = normed;
                xi = 0;
            }
            if (h < heads)
                rotate_head(x, xi, cos, sin, ci, q_out, (t * heads + h) * d, d, dtype);
            else if (kv_dtype == dtype)
                rotate_head(x, xi, cos, sin, ci, k_layer, slot * kv_row + (h - heads) * d, d,
                            dtype);
            else {
                rotate_head(x, xi, cos, sin, ci, rotated, 0, d, dtype);
                store_kv(rotated, 0, k_layer, slot * kv_row + (h - heads) * d, d,
                         k_scale ? k_scale + slot * kv_heads + h - heads : 0, dtype, kv_dtype);
            }
        }
        for (int64_t h = 0; h < kv_heads; h++)
            store_kv(qkv, src + (heads + kv_heads + h) * d, v_layer, slot * kv_row + h * d, d,
                     v_scale ? v_scale + slot * kv_heads + h : 0, dtype, kv_dtype);
    }
}

/* gate_up [rows, 2 * inter] = [gate | up] -> out [rows, inter] = silu(gate) * up, rounded after
 * the silu and after the product as torch's F.silu(gate) * up. */
static inline __attribute__((always_inline)) void silu_mul(int64_t rows, int64_t inter,
                                                           const void *gate_up, void *out, int dtype) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t g0 = r * 2 * inter, u0 = g0 + inter, o0 = r * inter;
        for (int64_t i = 0; i < inter; i++) {
            float g = load(gate_up, g0 + i, dtype);
            float s = round_to(g / (1.0f + exp_clamped(-g)), dtype);
            store(out, o0 + i, s * load(gate_up, u0 + i, dtype), dtype);
        }
    }
}

/* The entry points: one copy of each step per dtype, so the compiler sees the dtype as a
 * constant and vectorizes the loads, stores and roundings. */
void fused_add_rms_norm(int64_t rows, int64_t dim, void *residual, const void *h, const void *w,
                        void *out, float eps, float offset, int dtype) {
    if (dtype == DTYPE_BF16)
        add_rms_norm(rows, dim, residual, h, w, out, eps, offset, DTYPE_BF16);
    else
        add_rms_norm(rows, dim, residual, h, w, out, eps, offset, DTYPE_F32);
}

void fused_rope_store(int64_t tokens, const void *qkv, int64_t qkv_stride, int64_t heads,
                      int64_t kv_heads, int64_t d, const void *cos, const void *sin,
                      const int64_t *out_slots, void *k_layer, void *v_layer, float *k_scale,
                      float *v_scale, void *q_out, const void *q_norm, const void *k_norm,
                      float eps, float offset, int dtype, int kv_dtype) {
#define ROPE_STORE(DTYPE, KV)                                                                  \
    rope_store(tokens, qkv, qkv_stride, heads, kv_heads, d, cos, sin, out_slots, k_layer,      \
               v_layer, k_scale, v_scale, q_out, q_norm, k_norm, eps, offset, DTYPE, KV)
#define ROPE_STORE_KV(DTYPE)                         \
    if (kv_dtype == DTYPE_FP8_E5M2)                  \
        ROPE_STORE(DTYPE, DTYPE_FP8_E5M2);           \
    else if (kv_dtype == DTYPE_FP8_E4M3)             \
        ROPE_STORE(DTYPE, DTYPE_FP8_E4M3);           \
    else if (kv_dtype == DTYPE_INT8)                 \
        ROPE_STORE(DTYPE, DTYPE_INT8);               \
    else                                             \
        ROPE_STORE(DTYPE, DTYPE)
    if (dtype == DTYPE_BF16) {
        ROPE_STORE_KV(DTYPE_BF16);
    } else {
        ROPE_STORE_KV(DTYPE_F32);
    }
#undef ROPE_STORE_KV
#undef ROPE_STORE
}

int fused_max_head_dim(void) { return FUSED_MAX_HEAD_DIM; }

void fused_silu_mul(int64_t rows, int64_t inter, const void *gate_up, void *out, int dtype) {
    if (dtype == DTYPE_BF16)
        silu_mul(rows, inter, gate_up, out, DTYPE_BF16);
    else
        silu_mul(rows, inter, gate_up, out, DTYPE_F32);
}
