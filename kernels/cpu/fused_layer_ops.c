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
#include <stdlib.h>
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

/* The decode runner: every layer of a forward in one call, for batches whose matmuls all have a
 * matmul_op_fn (the K-quant and int4 kernels, bf16 models). It makes the calls that
 * runtime/models/fused_layers.py's loop makes, in its order and on the same buffers' contents,
 * so its results are the loop's bit for bit; what it saves is that loop's Python between them
 * (~25 us a layer on the default model, ~85 us on a 1B whose matmuls have just evicted the
 * interpreter from the caches). */

/* One matmul: its segments' products side by side (a weight fused from matrices of different
 * types: each segment's columns follow the previous one's), then y += bias (bf16 [n_out],
 * rounded as torch's bf16 y + bias; NULL: none). */
#define DECODE_MAX_SEGMENTS 4
typedef struct {
    matmul_op_fn fn;
    int64_t args[6];
    int64_t n_out;
} decode_segment;

typedef struct {
    int64_t segments;
    decode_segment segment[DECODE_MAX_SEGMENTS];
    const uint16_t *bias;
    int64_t n_out;
} decode_matmul;

/* What one layer's calls read besides the step's buffers. */
typedef struct {
    decode_matmul qkv, o, gate_up, down;
    const void *in_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm NULL: none */
    void *k_layer, *v_layer;
    float *k_scale, *v_scale; /* int8 pools' row scales, else NULL */
    float scale, softcap;
    int64_t window;
    int64_t rotary; /* its cos/sin tables: index into decode_step's */
} decode_layer;

/* paged_attention.c's paged_attention_batch, passed in by address (another library). */
typedef int (*attention_fn)(const void *plan, const void *q, const void *k_pool,
                            const void *v_pool, void *out, float scale, float softcap,
                            int64_t window, int dtype, int kv_dtype, const float *alibi,
                            const float *sinks, const float *k_scale, const float *v_scale);

/* One forward's sizes and bf16 buffers: residual [tokens, hidden] (the embeddings, updated in
 * place), normed [tokens, hidden], q and attn_out [tokens, heads head_dim], qkv [tokens,
 * qkv.n_out], h [tokens, hidden] (each block's output), gate_up [tokens, gate_up.n_out], act
 * [tokens, gate_up.n_out / 2]. */
typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim;
    float eps, offset;
    int64_t kv_dtype;
    const int64_t *out_slots;
    const void *const *cos, *const *sin;
    attention_fn attention;
    const void *plan;
    void *residual, *normed, *q, *attn_out, *qkv, *h, *gate_up, *act;
} decode_step;

static int run_matmul(const decode_matmul *m, const void *x, void *y, int64_t rows) {
    uint16_t *out = y;
    if (m->segments == 1) {
        const int rc = m->segment[0].fn(m->segment[0].args, x, y, rows);
        if (rc) return rc;
    } else { /* one row: the segments write into it in place; more: each through a copy */
        uint16_t *part = rows > 1 ? malloc(sizeof(uint16_t) * (size_t)(rows * m->n_out)) : NULL;
        if (rows > 1 && !part) return -1;
        int64_t col = 0;
        for (int64_t i = 0; i < m->segments; i++) {
            const decode_segment *g = m->segment + i;
            const int rc = g->fn(g->args, x, rows > 1 ? part : out + col, rows);
            if (rc) {
                free(part);
                return rc;
            }
            for (int64_t r = 0; rows > 1 && r < rows; r++)
                memcpy(out + r * m->n_out + col, part + r * g->n_out, sizeof(uint16_t) * g->n_out);
            col += g->n_out;
        }
        free(part);
    }
    for (int64_t r = 0; m->bias && r < rows; r++)
        for (int64_t i = 0; i < m->n_out; i++) {
            uint16_t *v = out + r * m->n_out + i;
            *v = bf16_from_f32(f32_from_bf16(*v) + f32_from_bf16(m->bias[i]));
        }
    return 0;
}

/* Runs layers[0 .. n_layers) on s's buffers; afterwards the last layer's output stream is
 * s->residual + s->h (added by the caller, as torch adds). Returns 0; 1 + the layer's index
 * times 8 + the step that failed (a matmul or attention refusal), nothing more run. */
int fused_decode_layers(const decode_step *s, const decode_layer *layers, int64_t n_layers) {
    const int64_t T = s->tokens, hidden = s->hidden, d = s->head_dim;
    const int kv = (int)s->kv_dtype;
    for (int64_t l = 0; l < n_layers; l++) {
        const decode_layer *L = layers + l;
        const int64_t fail = 1 + 8 * l;
        add_rms_norm(T, hidden, s->residual, l ? s->h : NULL, L->in_norm, s->normed, s->eps,
                     s->offset, DTYPE_BF16);
        if (run_matmul(&L->qkv, s->normed, s->qkv, T)) return (int)fail;
        fused_rope_store(T, s->qkv, L->qkv.n_out, s->heads, s->kv_heads, d, s->cos[L->rotary],
                         s->sin[L->rotary], s->out_slots, L->k_layer, L->v_layer, L->k_scale,
                         L->v_scale, s->q, L->q_norm, L->k_norm, s->eps, s->offset, DTYPE_BF16,
                         kv);
        if (s->attention(s->plan, s->q, L->k_layer, L->v_layer, s->attn_out, L->scale,
                         L->softcap, L->window, DTYPE_BF16, kv, NULL, NULL, L->k_scale,
                         L->v_scale))
            return (int)fail + 1;
        if (run_matmul(&L->o, s->attn_out, s->h, T)) return (int)fail + 2;
        add_rms_norm(T, hidden, s->residual, s->h, L->post_norm, s->normed, s->eps, s->offset,
                     DTYPE_BF16);
        if (run_matmul(&L->gate_up, s->normed, s->gate_up, T)) return (int)fail + 3;
        silu_mul(T, L->gate_up.n_out / 2, s->gate_up, s->act, DTYPE_BF16);
        if (run_matmul(&L->down, s->act, s->h, T)) return (int)fail + 4;
    }
    return 0;
}
