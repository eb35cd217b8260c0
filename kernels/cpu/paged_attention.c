/* Paged attention for short queries (decode, speculative verify) that reads K/V in place from
 * forklm's KV pool through each request's slot-table row: no gather, one pass per kv head.
 * Built and loaded by kernels/cpu/bindings.py (cc -O3 -march=native -fopenmp); fp32 math
 * throughout, so a given build's results do not depend on the thread count. */
#include <math.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__FLT16_MAX__)
#define PA_HAVE_F16 1
typedef _Float16 f16_t;
#else
#define PA_HAVE_F16 0
typedef uint16_t f16_t; /* placeholder: the fp16 entry reports "unsupported" */
#endif

/* Scratch floats per (token, kv head) kept on the stack; larger requests malloc. */
#define PA_STACK_FLOATS 8192

typedef struct {
    const void *q, *k_pool, *v_pool;
    void *out;
    const int64_t *slot_table, *tok_req, *tok_end;
    int64_t table_stride, num_heads, num_kv_heads, head_dim, row_stride, window;
    float scale, softcap;
    const float *alibi; /* [num_heads] ALiBi slopes, or NULL */
    const float *sinks; /* [num_heads] logits that join each softmax's denominator, or NULL */
    /* int8 pools: [num_slots, num_kv_heads] float32 scales of each K / V row (else NULL) */
    const float *k_scale, *v_scale;
} pa_job;

static inline void store_elem(void *base, int64_t i, float x, int dtype) {
    if (dtype == DTYPE_BF16)
        ((uint16_t *)base)[i] = bf16_from_f32(x);
    else if (dtype == DTYPE_F16)
        ((f16_t *)base)[i] = (f16_t)x;
    else
        ((float *)base)[i] = x;
}

/* 16 floats: GCC/clang vector extensions, lowered to one zmm (AVX-512) or two ymm (AVX2). */
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
#if PA_HAVE_F16
typedef f16_t f16x16 __attribute__((vector_size(32)));
#endif

/* 16 8-bit floats (e5m2 or e4m3fn) widened to fp32, exactly. With F16C: e5m2 is an fp16's
 * high byte, and e4m3's exponent and mantissa shifted into an fp16 read 2^-8 of their value,
 * subnormals included (one conversion instruction and a multiply; GCC scalarizes a _Float16
 * vector conversion, 3-4x slower). Elsewhere the fp32 bits are built in integers, subnormals
 * (exponent 0) as mantissa * 2^(1 - bias - mantissa bits). */
static inline v16 widen_fp8(u8x16 b, int dtype) {
    u16x16 w = __builtin_convertvector(b, u16x16);
#if defined(__F16C__)
    u16x16 h = dtype == DTYPE_FP8_E5M2 ? (u16x16)(w << 8) : ((w & 0x80) << 8) | ((w & 0x7f) << 7);
    __m256i hv;
    memcpy(&hv, &h, sizeof hv);
    v16 x;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtph_ps(hv);
    memcpy(&x, &f, sizeof x);
#else
    __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(hv));
    __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(hv, 1));
    memcpy(&x, &lo, sizeof lo);
    memcpy((char *)&x + sizeof lo, &hi, sizeof hi);
#endif
    return dtype == DTYPE_FP8_E5M2 ? x : x * 256.0f;
#else
    const int mant_bits = dtype == DTYPE_FP8_E4M3 ? 3 : 2, bias = dtype == DTYPE_FP8_E4M3 ? 7 : 15;
    u32x16 u = __builtin_convertvector(w, u32x16);
    u32x16 mag = u & 0x7f, sign = (u & 0x80) << 24;
    u32x16 normal = (mag << (23 - mant_bits)) + ((uint32_t)(127 - bias) << 23);
    v16 sub = __builtin_convertvector(mag & ((1u << mant_bits) - 1), v16) *
              ldexpf(1.0f, 1 - bias - mant_bits);
    u32x16 sub_bits, is_sub = (u32x16)((mag >> mant_bits) == 0);
    memcpy(&sub_bits, &sub, sizeof sub);
    u32x16 bits = (normal & ~is_sub) | (sub_bits & is_sub) | sign;
    v16 x;
    memcpy(&x, &bits, sizeof x);
    return x;
#endif
}

/* 16 int8 codes as fp32: sign-extended and converted with intrinsics where there are some (GCC
 * scalarizes __builtin_convertvector from int8 lanes, ~3x slower attention). */
static inline v16 widen_int8(const int8_t *p) {
    v16 x;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&x, &f, sizeof x);
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    memcpy(&x, &lo, sizeof lo);
    memcpy((char *)&x + sizeof lo, &hi, sizeof hi);
#else
    for (int l = 0; l < 16; l++) x[l] = (float)p[l];
#endif
    return x;
}

/* 16 elements from base[i..i+16) as fp32. */
static inline v16 load16(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_INT8) { /* codes; the row's scale is applied to its score / weight */
        return widen_int8((const int8_t *)base + i);
    }
    if (dtype == DTYPE_FP8_E5M2 || dtype == DTYPE_FP8_E4M3) {
        u8x16 b;
        memcpy(&b, (const uint8_t *)base + i, sizeof b);
        return widen_fp8(b, dtype);
    }
    if (dtype == DTYPE_BF16) {
        u16x16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (v16)(__builtin_convertvector(h, u32x16) << 16);
    }
#if PA_HAVE_F16
    if (dtype == DTYPE_F16) {
        f16x16 h;
        memcpy(&h, (const f16_t *)base + i, sizeof h);
        return __builtin_convertvector(h, v16);
    }
#endif
    v16 x;
    memcpy(&x, (const float *)base + i, sizeof x);
    return x;
}

/* The lanes' sum by a fixed pairwise tree: the same order on every ISA. */
static inline float hsum(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* The lane sums of four vectors, each by hsum's tree (so bit-equal to four hsum calls), with
 * the shuffles shared: half the work per sum. */
static inline v4 hsum4(v16 p0, v16 p1, v16 p2, v16 p3) {
    /* [p0 lanes 0-7 + 8-15 | p1 likewise], the same for p2, p3 */
    v16 a = __builtin_shufflevector(p0, p1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(p0, p1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 b = __builtin_shufflevector(p2, p3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(p2, p3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* [p0 0-3 + 4-7 | p1 | p2 | p3] */
    v16 c = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    /* per vector: (x0 + x2), (x1 + x3), then their sum */
    v8 d = __builtin_shufflevector(c, c, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(c, c, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(d, d, 0, 2, 4, 6) + __builtin_shufflevector(d, d, 1, 3, 5, 7);
}

/* Keys ahead that a pass asks the memory system for: slots scatter over the pool, so the
 * hardware prefetcher cannot guess the next row. The scores pass asks for the V rows too, so
 * the weighted sum finds them in L2: decode attention is bound by DRAM (batch 16 x 300 keys
 * reads 3.7 MB a layer), and this took batch 16 / 8 to 0.87-0.94x the time (16 keys ahead,
 * K only: 8). They are asked into L2 (prefetcht2), whose queue holds more lines in flight than
 * L1's fill buffers: 0.81x the time at batch 16 x 450 keys, 0.87x at batch 1 (a 1B's 32/8
 * heads; Intel Xeon, benchmarks/NOTES.md session 27). */
#define PA_PREFETCH 16

static inline void prefetch_row(const void *base, int64_t i, int dtype, int64_t bytes) {
    const char *p = (const char *)base + i * dtype_bytes(dtype);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

/* One (token, kv head): the group's query heads against keys [start, end) of the token's
 * request, each K and V row read once for the whole group. `d` (a multiple of 16) is a
 * compile-time constant in the specialized callers below. An int8 pool's row scales multiply
 * each key's score and each value's softmax weight (not the softmax's denominator). */
static inline __attribute__((always_inline)) void attend(const pa_job *jb, int64_t t, int64_t h,
                                                         int dtype, int kv_dtype, int64_t d) {
    const int64_t group = jb->num_heads / jb->num_kv_heads, nc = d / 16;
    const int64_t end = jb->tok_end[t];
    const int64_t start = (jb->window > 0 && end > jb->window) ? end - jb->window : 0;
    const int64_t n = end - start;
    const int64_t *slots = jb->slot_table + jb->tok_req[t] * jb->table_stride + start;
    const int64_t q_off = (t * jb->num_heads + h * group) * d; /* first head of the group */
    if (n <= 0) {
        for (int64_t i = 0; i < group * d; i++) store_elem(jb->out, q_off + i, 0.0f, dtype);
        return;
    }
    /* scratch (in v16 units): q [group, nc] | acc [group, nc] | scores [group, n] floats */
    const int64_t need = 2 * group * nc + (group * n + 15) / 16;
    v16 stack_buf[need <= PA_STACK_FLOATS / 16 ? need : 1];
    v16 *buf = need <= PA_STACK_FLOATS / 16 ? stack_buf
                                             : aligned_alloc(64, (size_t)need * sizeof(v16));
    if (!buf) return; /* out of memory: the output is left as is (never reached in practice) */
    v16 *q = buf, *acc = buf + group * nc;
    float *sc = (float *)(acc + group * nc);
    for (int64_t i = 0; i < group * nc; i++) {
        q[i] = load16(jb->q, q_off + 16 * i, dtype);
        acc[i] = (v16){0};
    }
    const int64_t kv_off = h * d, kvh = jb->num_kv_heads;
    const int64_t row_bytes = d * dtype_bytes(kv_dtype);
    const int scaled = kv_dtype == DTYPE_INT8;
    /* Pass 1: scores, four keys at a time (their lane sums share the shuffles), then the rest. */
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        int64_t base[4];
        for (int r = 0; r < 4; r++) {
            base[r] = slots[j + r] * jb->row_stride + kv_off;
            if (j + r + PA_PREFETCH < n) {
                const int64_t ahead = slots[j + r + PA_PREFETCH] * jb->row_stride + kv_off;
                prefetch_row(jb->k_pool, ahead, kv_dtype, row_bytes);
                prefetch_row(jb->v_pool, ahead, kv_dtype, row_bytes);
            }
        }
        v16 k[4][nc];
        for (int r = 0; r < 4; r++)
            for (int64_t c = 0; c < nc; c++) k[r][c] = load16(jb->k_pool, base[r] + 16 * c, kv_dtype);
        v4 key_scale = {1.0f, 1.0f, 1.0f, 1.0f};
        if (scaled)
            for (int r = 0; r < 4; r++) key_scale[r] = jb->k_scale[slots[j + r] * kvh + h];
        for (int64_t g = 0; g < group; g++) {
            v16 part[4];
            for (int r = 0; r < 4; r++) {
                part[r] = q[g * nc] * k[r][0];
                for (int64_t c = 1; c < nc; c++) part[r] += q[g * nc + c] * k[r][c];
            }
            v4 sums4 = hsum4(part[0], part[1], part[2], part[3]) * jb->scale;
            if (scaled) sums4 *= key_scale;
            memcpy(sc + g * n + j, &sums4, sizeof sums4);
        }
    }
    for (; j < n; j++) {
        const int64_t base = slots[j] * jb->row_stride + kv_off;
        if (j + PA_PREFETCH < n) prefetch_row(jb->k_pool, slots[j + PA_PREFETCH] * jb->row_stride + kv_off, kv_dtype, row_bytes);
        v16 k[nc];
        for (int64_t c = 0; c < nc; c++) k[c] = load16(jb->k_pool, base + 16 * c, kv_dtype);
        const float key_scale = scaled ? jb->k_scale[slots[j] * kvh + h] : 1.0f;
        for (int64_t g = 0; g < group; g++) {
            v16 part = q[g * nc] * k[0];
            for (int64_t c = 1; c < nc; c++) part += q[g * nc + c] * k[c];
            sc[g * n + j] = hsum(part) * jb->scale;
            if (scaled) sc[g * n + j] *= key_scale;
        }
    }
    /* Softmax numerators in place, with soft-capping first when the layer has it, and ALiBi's
     * slope * (key - query position): key j sits at start + j, the query at end - 1. A sink
     * (gpt-oss) is one more score with no value: it joins the max and the denominator. */
    float sums[group];
    for (int64_t g = 0; g < group; g++) {
        float *s = sc + g * n;
        if (jb->softcap > 0.0f)
            for (int64_t j = 0; j < n; j++) s[j] = jb->softcap * tanhf(s[j] / jb->softcap);
        if (jb->alibi) {
            const float slope = jb->alibi[h * group + g];
            for (int64_t j = 0; j < n; j++) s[j] += slope * (float)(start + j + 1 - end);
        }
        const float sink = jb->sinks ? jb->sinks[h * group + g] : -INFINITY;
        float m = jb->sinks && sink > s[0] ? sink : s[0];
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        float sum = jb->sinks ? exp_nonpos(sink - m) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            float p = exp_nonpos(s[j] - m);
            s[j] = p;
            sum += p;
        }
        sums[g] = sum;
    }
    /* Pass 2: weighted sum of the V rows, two keys per step so each accumulator is loaded and
     * stored once per two multiply-adds (the same additions in the same order as one by one). */
    for (j = 0; j + 2 <= n; j += 2) {
        const int64_t base0 = slots[j] * jb->row_stride + kv_off;
        const int64_t base1 = slots[j + 1] * jb->row_stride + kv_off;
        if (j + PA_PREFETCH + 1 < n) {
            prefetch_row(jb->v_pool, slots[j + PA_PREFETCH] * jb->row_stride + kv_off, kv_dtype, row_bytes);
            prefetch_row(jb->v_pool, slots[j + PA_PREFETCH + 1] * jb->row_stride + kv_off, kv_dtype, row_bytes);
        }
        v16 v0[nc], v1[nc];
        for (int64_t c = 0; c < nc; c++) {
            v0[c] = load16(jb->v_pool, base0 + 16 * c, kv_dtype);
            v1[c] = load16(jb->v_pool, base1 + 16 * c, kv_dtype);
        }
        const float s0 = scaled ? jb->v_scale[slots[j] * kvh + h] : 1.0f;
        const float s1 = scaled ? jb->v_scale[slots[j + 1] * kvh + h] : 1.0f;
        for (int64_t g = 0; g < group; g++) {
            float p0 = sc[g * n + j], p1 = sc[g * n + j + 1];
            if (scaled) p0 *= s0, p1 *= s1;
            for (int64_t c = 0; c < nc; c++) {
                v16 a = acc[g * nc + c];
                a += p0 * v0[c];
                a += p1 * v1[c];
                acc[g * nc + c] = a;
            }
        }
    }
    for (; j < n; j++) {
        const int64_t base = slots[j] * jb->row_stride + kv_off;
        v16 v[nc];
        for (int64_t c = 0; c < nc; c++) v[c] = load16(jb->v_pool, base + 16 * c, kv_dtype);
        const float s0 = scaled ? jb->v_scale[slots[j] * kvh + h] : 1.0f;
        for (int64_t g = 0; g < group; g++) {
            const float p = scaled ? sc[g * n + j] * s0 : sc[g * n + j];
            for (int64_t c = 0; c < nc; c++) acc[g * nc + c] += p * v[c];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < nc; c++)
            for (int l = 0; l < 16; l++)
                store_elem(jb->out, q_off + (g * nc + c) * 16 + l, acc[g * nc + c][l] / sums[g],
                           dtype);
    if (buf != stack_buf) free(buf);
}

typedef void (*attend_fn)(const pa_job *, int64_t, int64_t);

/* Specializations: q's dtype, the pool's and the common head sizes as constants, so the inner
 * loops unroll. KV_SAME: the pool holds q's dtype. */
#define KV_SAME -1
#define PA_SPECIALIZE(NAME, DTYPE, KV, D)                                               \
    static void NAME(const pa_job *jb, int64_t t, int64_t h) {                          \
        attend(jb, t, h, DTYPE, (KV) == KV_SAME ? (DTYPE) : (KV), (D) ? (D) : jb->head_dim); \
    }
#define PA_SIZES(PREFIX, DTYPE, KV)              \
    PA_SPECIALIZE(PREFIX##_64, DTYPE, KV, 64)    \
    PA_SPECIALIZE(PREFIX##_128, DTYPE, KV, 128)  \
    PA_SPECIALIZE(PREFIX##_any, DTYPE, KV, 0)
#define PA_ROW(PREFIX) {PREFIX##_64, PREFIX##_128, PREFIX##_any}
PA_SIZES(attend_f32, DTYPE_F32, KV_SAME)
PA_SIZES(attend_bf16, DTYPE_BF16, KV_SAME)
PA_SIZES(attend_f32_e5m2, DTYPE_F32, DTYPE_FP8_E5M2)
PA_SIZES(attend_bf16_e5m2, DTYPE_BF16, DTYPE_FP8_E5M2)
PA_SIZES(attend_f32_e4m3, DTYPE_F32, DTYPE_FP8_E4M3)
PA_SIZES(attend_bf16_e4m3, DTYPE_BF16, DTYPE_FP8_E4M3)
PA_SIZES(attend_f32_i8, DTYPE_F32, DTYPE_INT8)
PA_SIZES(attend_bf16_i8, DTYPE_BF16, DTYPE_INT8)
#if PA_HAVE_F16
PA_SIZES(attend_f16, DTYPE_F16, KV_SAME)
PA_SIZES(attend_f16_e5m2, DTYPE_F16, DTYPE_FP8_E5M2)
PA_SIZES(attend_f16_e4m3, DTYPE_F16, DTYPE_FP8_E4M3)
PA_SIZES(attend_f16_i8, DTYPE_F16, DTYPE_INT8)
#define PA_F16_ROW(PREFIX) PA_ROW(PREFIX)
#else
#define PA_F16_ROW(PREFIX) {0, 0, 0}
#endif

/* The kernel for q's dtype (f32, bf16, f16: that one needs the compiler's _Float16) over a
 * pool of kv_dtype (the same, an 8-bit float, or int8 codes with row scales). */
static attend_fn pick(int dtype, int kv_dtype, int64_t d) {
    static const attend_fn table[3][4][3] = {
        /* kv: same as q, e5m2, e4m3, int8 */
        {PA_ROW(attend_f32), PA_ROW(attend_f32_e5m2), PA_ROW(attend_f32_e4m3),
         PA_ROW(attend_f32_i8)},
        {PA_ROW(attend_bf16), PA_ROW(attend_bf16_e5m2), PA_ROW(attend_bf16_e4m3),
         PA_ROW(attend_bf16_i8)},
        {PA_F16_ROW(attend_f16), PA_F16_ROW(attend_f16_e5m2), PA_F16_ROW(attend_f16_e4m3),
         PA_F16_ROW(attend_f16_i8)},
    };
    if (dtype < 0 || dtype > 2) return 0;
    const int kv = kv_dtype == dtype ? 0 : kv_dtype == DTYPE_FP8_E5M2 ? 1
                 : kv_dtype == DTYPE_FP8_E4M3 ? 2 : kv_dtype == DTYPE_INT8 ? 3 : -1;
    if (kv < 0) return 0;
    return table[dtype][kv][d == 64 ? 0 : d == 128 ? 1 : 2];
}

/* The OpenMP team size a parallel call would use: torch.get_num_threads() when this library
 * shares torch's libgomp (the dynamic linker binds libgomp.so.1 to the copy torch loaded). */
int paged_attention_threads(void) { return omp_get_max_threads(); }

/* 1 when this build handles queries of `dtype` over a pool of `kv_dtype` (fp16 queries need the
 * compiler's _Float16). */
int paged_attention_supports(int dtype, int kv_dtype) { return pick(dtype, kv_dtype, 64) != 0; }

/* One batch's token -> request map, shared by all its layers' calls. */
typedef struct {
    const int64_t *slot_table, *tok_req, *tok_end;
    int64_t table_stride, num_tokens, num_heads, num_kv_heads, head_dim, row_stride;
    /* Up to this many multiply-adds (keys x query heads x head_dim, over the batch) the call
     * stays on the calling thread: below it, waking the other OpenMP threads costs more than
     * they save (it depends on the wait policy: native_kernels.py picks it). */
    int64_t parallel_work;
} pa_batch;

/* Attention of the batch's queries over one layer's pool; returns 0, or -1 for an unsupported
 * dtype / shape (nothing written).
 *   q, out   [num_tokens, num_heads, head_dim] contiguous, the pool's dtype
 *   k_pool, v_pool  [num_slots, num_kv_heads, head_dim] contiguous (row_stride elements a slot)
 *   token t belongs to request tok_req[t] and sees keys [start, tok_end[t]), start = 0 or
 *   tok_end[t] - window with a sliding window; key j lives in slot
 *   slot_table[tok_req[t] * table_stride + j]. softcap 0 = none, window 0 = none.
 *   alibi: [num_heads] float32 slopes, head h's scores + alibi[h] * (j - (tok_end[t] - 1));
 *   NULL = none. sinks: [num_heads] fp32 or NULL = none. kv_dtype: the pool's (dtype's, or
 *   DTYPE_FP8_*, or DTYPE_INT8 with k_scale / v_scale [num_slots, num_kv_heads] float32: key
 *   j's K row in head h is k_pool's codes times k_scale[slot * num_kv_heads + h]).
 * The caller guarantees tok_end[t] <= table_stride and every slot read < num_slots. */
int paged_attention_batch(const pa_batch *b, const void *q, const void *k_pool,
                          const void *v_pool, void *out, float scale, float softcap,
                          int64_t window, int dtype, int kv_dtype, const float *alibi,
                          const float *sinks, const float *k_scale, const float *v_scale) {
    const int64_t kvh = b->num_kv_heads, d = b->head_dim;
    attend_fn fn = pick(dtype, kv_dtype, d);
    if (!fn || kvh <= 0 || b->num_heads % kvh || d <= 0 || d % 16) return -1;
    if (kv_dtype == DTYPE_INT8 && (!k_scale || !v_scale)) return -1;
    const pa_job jb = {q, k_pool, v_pool, out, b->slot_table, b->tok_req, b->tok_end,
                       b->table_stride, b->num_heads, kvh, d, b->row_stride, window, scale,
                       softcap, alibi, sinks, k_scale, v_scale};
    int64_t keys = 0;
    for (int64_t t = 0; t < b->num_tokens; t++) {
        int64_t end = b->tok_end[t];
        keys += (window > 0 && end > window) ? window : end;
    }
    if (keys * b->num_heads * d <= b->parallel_work) { /* no OpenMP team at all: ~2 us saved */
        for (int64_t t = 0; t < b->num_tokens; t++)
            for (int64_t h = 0; h < kvh; h++) fn(&jb, t, h);
        return 0;
    }
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < b->num_tokens; t++)
        for (int64_t h = 0; h < kvh; h++) fn(&jb, t, h);
    return 0;
}

/* The same with the batch's fields as arguments (see paged_attention_batch), parallel above
 * PA_PARALLEL_WORK multiply-adds. */
#ifndef PA_PARALLEL_WORK
#define PA_PARALLEL_WORK 2000000
#endif
int paged_attention(const void *q, const void *k_pool, const void *v_pool, void *out,
                    const int64_t *slot_table, int64_t table_stride, const int64_t *tok_req,
                    const int64_t *tok_end, int64_t num_tokens, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t row_stride, float scale,
                    float softcap, int64_t window, int dtype, const float *sinks) {
    const pa_batch b = {slot_table, tok_req, tok_end, table_stride, num_tokens, num_heads,
                        num_kv_heads, head_dim, row_stride, PA_PARALLEL_WORK};
    return paged_attention_batch(&b, q, k_pool, v_pool, out, scale, softcap, window, dtype, dtype,
                                 0, sinks, 0, 0);
}

/* ---- Prefill: many new tokens per request (paged_prefill_bf16) ----
 * The kernel above reads every K/V row once per query token: right for decode, but a prefill
 * chunk's queries share their keys, and torch's SDPA (what prefill ran before) does ~80-140
 * GFLOP/s here on a causal 512-2048 token prompt, with the GQA group folded into a mask that
 * hides the causal structure from it. This is flash attention with bf16 dot products
 * (vdpbf16ps, fp32 sums), for a bf16 pool and bf16 queries, no window, cap, ALiBi or sinks:
 * per (request, kv head) the keys are gathered once through the slot table into pair-interleaved
 * blocks of 16 (K: 16 keys x 2 dims a vector; V: 2 keys x 16 dims), then rows of (token, query
 * head) pairs, PF_BLOCK at a time, pass over the keys PF_STEP a step, PF_ROWS rows at a time:
 * scores in fp32, an online softmax (one max and sum per row and step), the weights rounded to
 * bf16 for the value product. A row's result depends only on its own query and keys. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)

/* 2^x for x <= 0, ~2e-7 relative: 2^n 2^f, f = x - n in [-1/2, 1/2], 2^f by a degree-6
 * polynomial in f ln 2. Below -125 (and masked lanes, -inf) it gives ~2^-125: the caller masks
 * those lanes to zero (a weight under 2^-125 of the largest is nothing to a bf16 product). */
static inline __m512 pf_exp2(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Keys a step of the online softmax takes: PF_BLOCKS blocks of 16 (one max, sum and rescale
 * per row a step). The gathered keys are padded to a multiple of it. */
#define PF_BLOCKS 4
#define PF_STEP (16 * PF_BLOCKS)

/* The keys [0, n) of one kv head of a request into kp (blocks of 16 keys: [d / 2 pairs][16]
 * uint32 bf16 pairs) and vp ([key pairs][d] uint32 pairs), up to n rounded up to PF_STEP with
 * zero keys. */
static void pf_gather(const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
                      int64_t n, int64_t h, int64_t row_stride, int64_t d, uint32_t *kp,
                      uint32_t *vp) {
    const int64_t pairs = d / 2, padded = (n + PF_STEP - 1) / PF_STEP * PF_STEP;
    for (int64_t j = 0; j < padded; j++) {
        uint32_t *kd = kp + (j / 16) * pairs * 16 + j % 16;
        uint16_t *vd = (uint16_t *)(vp + (j / 2) * d) + (j % 2);
        if (j >= n) {
            for (int64_t p = 0; p < pairs; p++) kd[p * 16] = 0;
            for (int64_t c = 0; c < d; c++) vd[2 * c] = 0;
            continue;
        }
        const uint16_t *kr = k_pool + slots[j] * row_stride + h * d;
        const uint16_t *vr = v_pool + slots[j] * row_stride + h * d;
        uint32_t pr[pairs];
        memcpy(pr, kr, sizeof pr);
        for (int64_t p = 0; p < pairs; p++) kd[p * 16] = pr[p];
        for (int64_t c = 0; c < d; c++) vd[2 * c] = vr[c];
    }
}

#define PF_ROWS 4   /* rows a step of the registers takes */
#define PF_BLOCK 32 /* rows that share a key step while it is in L1 */

/* One key step (keys k0 .. k0 + PF_STEP - 1, kb and vb its K and V blocks) for R rows: their
 * running outputs o (fp32 [R][D]), maxima m and sums l (of 2^(scores in log2 units)) updated.
 * vis[i]: row i's keys of the step (the rest masked). D and R constants in each copy. */
static inline __attribute__((always_inline)) void pf_step(const uint32_t *kb, const uint32_t *vb,
                                                         const uint32_t *const *qr,
                                                         const int64_t *vis, float *o, float *m,
                                                         float *l, __m512 log2_scale, int R,
                                                         int64_t D) {
    const int64_t pairs = D / 2, nc = D / 16;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 s[PF_ROWS][PF_BLOCKS];
    for (int i = 0; i < R; i++)
        for (int u = 0; u < PF_BLOCKS; u++) s[i][u] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh qp[PF_ROWS]; /* each row's query pair p, in every lane */
        for (int i = 0; i < R; i++) qp[i] = (__m512bh)_mm512_set1_epi32((int)qr[i][p]);
        for (int u = 0; u < PF_BLOCKS; u++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(kb + (u * pairs + p) * 16));
            for (int i = 0; i < R; i++) s[i][u] = _mm512_dpbf16_ps(s[i][u], kv, qp[i]);
        }
    }
    __m512i pw[PF_ROWS][PF_BLOCKS / 2]; /* each row's weights as bf16 key pairs */
    __m512 acc[PF_ROWS][8];
    for (int i = 0; i < R; i++) {
        for (int64_t c = 0; c < nc; c++) acc[i][c] = _mm512_loadu_ps(o + i * D + 16 * c);
        if (vis[i] <= 0) { /* no key of this step: weights zero, nothing rescaled */
            for (int u = 0; u < PF_BLOCKS / 2; u++) pw[i][u] = _mm512_setzero_si512();
            continue;
        }
        __m512 top = ninf;
        __mmask16 keep[PF_BLOCKS];
        for (int u = 0; u < PF_BLOCKS; u++) {
            const int64_t left = vis[i] - 16 * u;
            keep[u] = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            s[i][u] = _mm512_mask_mul_ps(ninf, keep[u], s[i][u], log2_scale);
            top = _mm512_max_ps(top, s[i][u]);
        }
        const float step_max = _mm512_reduce_max_ps(top);
        if (step_max > m[i]) { /* a new max: rescale what came before (2^-inf = 0 at first) */
            const float alpha = exp2f(m[i] - step_max);
            const __m512 va = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < nc; c++) acc[i][c] = _mm512_mul_ps(acc[i][c], va);
            l[i] *= alpha;
            m[i] = step_max;
        }
        const __m512 mv = _mm512_set1_ps(m[i]);
        __m512 sum = _mm512_setzero_ps();
        for (int u = 0; u < PF_BLOCKS; u += 2) {
            const __m512 w0 = _mm512_maskz_mov_ps(keep[u], pf_exp2(_mm512_sub_ps(s[i][u], mv)));
            const __m512 w1 = _mm512_maskz_mov_ps(keep[u + 1],
                                                  pf_exp2(_mm512_sub_ps(s[i][u + 1], mv)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(w0, w1));
            pw[i][u / 2] = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
        }
        l[i] += _mm512_reduce_add_ps(sum);
    }
    for (int j = 0; j < PF_STEP / 2; j++) {
        __m512bh wj[PF_ROWS]; /* key pair j's weights of each row, in every lane */
        for (int i = 0; i < R; i++)
            wj[i] = (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(j % 16), pw[i][j / 16]);
        for (int64_t c = 0; c < nc; c++) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512((const void *)(vb + j * D + 16 * c));
            for (int i = 0; i < R; i++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], vv, wj[i]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int64_t c = 0; c < nc; c++) _mm512_storeu_ps(o + i * D + 16 * c, acc[i][c]);
}

/* One (request, kv head): tokens t0 .. t1 - 1, whose rows are (token, query head of the group)
 * in token-major order; PF_BLOCK rows at a time pass over the keys a step at a time, each step
 * taken by PF_ROWS rows at a time while its K and V blocks stay in L1. A row's result depends
 * only on its own query and keys. */
static inline __attribute__((always_inline)) void pf_item(const pa_batch *b, const uint16_t *q,
                                                         uint16_t *out, const uint32_t *kp,
                                                         const uint32_t *vp, int64_t h,
                                                         int64_t t0, int64_t t1, float scale,
                                                         int64_t D) {
    const int64_t g = b->num_heads / b->num_kv_heads, rows = (t1 - t0) * g, pairs = D / 2;
    const __m512 log2_scale = _mm512_set1_ps(scale * 1.44269504088896341f);
    float o[PF_BLOCK * 128] __attribute__((aligned(64))), m[PF_BLOCK], l[PF_BLOCK];
    const uint32_t *qr[PF_BLOCK];
    int64_t tok[PF_BLOCK], hq[PF_BLOCK], end[PF_BLOCK];
    for (int64_t r0 = 0; r0 < rows; r0 += PF_BLOCK) {
        const int n = (int)(rows - r0 < PF_BLOCK ? rows - r0 : PF_BLOCK);
        int64_t kmax = 0;
        for (int i = 0; i < n; i++) {
            tok[i] = t0 + (r0 + i) / g, hq[i] = h * g + (r0 + i) % g;
            end[i] = b->tok_end[tok[i]];
            qr[i] = (const uint32_t *)(q + (tok[i] * b->num_heads + hq[i]) * D);
            m[i] = -INFINITY, l[i] = 0.0f;
            kmax = end[i] > kmax ? end[i] : kmax;
        }
        memset(o, 0, sizeof(float) * (size_t)(n * D));
        for (int64_t k0 = 0; k0 < kmax; k0 += PF_STEP) {
            const uint32_t *kb = kp + (k0 / 16) * pairs * 16, *vb = vp + (k0 / 2) * D;
            for (int i0 = 0; i0 < n; i0 += PF_ROWS) {
                const int R = n - i0 < PF_ROWS ? n - i0 : PF_ROWS;
                int64_t vis[PF_ROWS], seen = 0;
                for (int i = 0; i < R; i++) vis[i] = end[i0 + i] - k0, seen |= vis[i] > 0;
                if (!seen) continue; /* rows that end before this step */
                float *oi = o + i0 * D;
                switch (R) {
                case 1: pf_step(kb, vb, qr + i0, vis, oi, m + i0, l + i0, log2_scale, 1, D); break;
                case 2: pf_step(kb, vb, qr + i0, vis, oi, m + i0, l + i0, log2_scale, 2, D); break;
                case 3: pf_step(kb, vb, qr + i0, vis, oi, m + i0, l + i0, log2_scale, 3, D); break;
                default: pf_step(kb, vb, qr + i0, vis, oi, m + i0, l + i0, log2_scale, PF_ROWS, D);
                }
            }
        }
        for (int i = 0; i < n; i++) {
            const __m512 inv = _mm512_set1_ps(l[i] > 0.0f ? 1.0f / l[i] : 0.0f);
            uint16_t *dst = out + (tok[i] * b->num_heads + hq[i]) * D;
            for (int64_t c = 0; c < D / 16; c++)
                _mm256_storeu_si256((__m256i *)(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_mul_ps(_mm512_loadu_ps(o + i * D + 16 * c), inv)));
        }
    }
}

int paged_prefill_available(void) { return 1; }

/* Attention of the batch's tokens (any number per request; a request's tokens adjacent, as
 * packed) over one layer's bf16 pool, causal by tok_end as paged_attention_batch's (no window,
 * cap, ALiBi or sinks). head_dim 64 or 128. Returns 0, or -1 for what it does not take. */
int paged_prefill_bf16(const pa_batch *b, const uint16_t *q, const uint16_t *k_pool,
                       const uint16_t *v_pool, uint16_t *out, float scale) {
    const int64_t d = b->head_dim, kvh = b->num_kv_heads, n = b->num_tokens;
    if ((d != 64 && d != 128) || kvh <= 0 || b->num_heads % kvh || n <= 0) return -1;
    /* requests as runs of tokens: run r is tokens first[r] .. first[r + 1] - 1, seeing keys
     * [0, keys[r]) (its tokens' furthest end) */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * n + 1));
    if (!first) return -1;
    int64_t *keys = first + n + 1, runs = 0, most = 0;
    for (int64_t t = 0; t < n; t++) {
        if (t == 0 || b->tok_req[t] != b->tok_req[t - 1]) keys[runs] = 0, first[runs++] = t;
        keys[runs - 1] = b->tok_end[t] > keys[runs - 1] ? b->tok_end[t] : keys[runs - 1];
        most = b->tok_end[t] > most ? b->tok_end[t] : most;
    }
    first[runs] = n;
    /* each thread's gathered keys: kp, then vp (d / 2 uint32 a key each) */
    const int64_t padded = (most + PF_STEP - 1) / PF_STEP * PF_STEP;
    const int threads = omp_get_max_threads();
    uint32_t *scratch = aligned_alloc(64, sizeof(uint32_t) * (size_t)(padded * d * threads));
    if (!scratch) {
        free(first);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        uint32_t *kp = scratch + (size_t)omp_get_thread_num() * (size_t)(padded * d);
        uint32_t *vp = kp + padded * d / 2;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < runs; r++)
            for (int64_t h = 0; h < kvh; h++) {
                const int64_t t0 = first[r], t1 = first[r + 1];
                pf_gather(k_pool, v_pool, b->slot_table + b->tok_req[t0] * b->table_stride,
                          keys[r], h, b->row_stride, d, kp, vp);
                if (d == 64)
                    pf_item(b, q, out, kp, vp, h, t0, t1, scale, 64);
                else
                    pf_item(b, q, out, kp, vp, h, t0, t1, scale, 128);
            }
    }
    free(scratch);
    free(first);
    return 0;
}
#else
int paged_prefill_available(void) { return 0; }
int paged_prefill_bf16(const pa_batch *b, const uint16_t *q, const uint16_t *k_pool,
                       const uint16_t *v_pool, uint16_t *out, float scale) {
    (void)b, (void)q, (void)k_pool, (void)v_pool, (void)out, (void)scale;
    return -1;
}
#endif
