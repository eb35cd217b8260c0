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
