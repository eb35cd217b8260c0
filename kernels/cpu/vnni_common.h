/* What the int8 (AVX512-VNNI) matmul kernels (int4_gemv.c, kquant_vnni.c) share: the bf16 load of
 * their activations and their inner dot-product step. A header of its own, included only where
 * the intrinsics are (immintrin.h would clash with greedy_pick.c's names). */
#ifndef FORKLM_VNNI_COMMON_H
#define FORKLM_VNNI_COMMON_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)

/* 16 bf16 at p as fp32 (exact: a bf16 is the high half of an fp32). */
static inline __m512 f32x16_from_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The int8 kernels' activation quantizer: n (<= 16) vectors of 16 bf16 at p as int8 codes into
 * q, with one step max|x| / 127 (x times 127 / max|x|, rounded to nearest even: |code| <= 127);
 * each vector's code sum into sums[u]; returns the step. */
static inline __attribute__((always_inline)) float quantize_int8(const uint16_t *p, int n,
                                                                 int8_t *q, int32_t *sums) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 v[16], amax = _mm512_setzero_ps();
    for (int u = 0; u < n; u++) {
        v[u] = f32x16_from_bf16(p + 16 * u);
        amax = _mm512_max_ps(amax, _mm512_and_ps(v[u], abs_mask));
    }
    const float top = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    for (int u = 0; u < n; u++) {
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[u], inv));
        _mm_storeu_si128((__m128i *)(q + 16 * u), _mm512_cvtsepi32_epi8(c));
        sums[u] = _mm512_reduce_add_epi32(c);
    }
    return top / 127.0f;
}
#endif

#if defined(__AVX512VNNI__)
/* acc += codes (u8) . the 4 int8 at p, broadcast to every lane, as vpdpbusd's memory operand
 * (the intrinsic made GCC emit a separate broadcast: 7% slower). The int8 kernels' inner step. */
static inline __m512i dot_broadcast(__m512i acc, __m512i codes, const int32_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*p));
    return acc;
}
#endif

#endif
