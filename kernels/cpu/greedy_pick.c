/* The sampler's greedy pick on the CPU: each logits row's argmax in one vectorized pass (torch's
 * CPU argmax of a [16, 49152] batch takes ~0.45 ms, and the sampler's general path also runs a
 * log_softmax over the whole vocabulary first: ~1 ms of a ~20 ms decode step).
 *
 * Built and loaded by kernels/cpu/bindings.py (-O3 -march=native). Picks what torch.argmax
 * picks: the first index of the maximum, or of the first NaN in a row that has one. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline float load(const void *base, int64_t i, int dtype) {
    return dtype == DTYPE_BF16 ? f32_from_bf16(((const uint16_t *)base)[i])
                               : ((const float *)base)[i];
}

/* 16 values from base[i..i+16) as fp32. */
static inline v16 load16(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16) {
        u16x16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (v16)(__builtin_convertvector(h, u32x16) << 16);
    }
    v16 x;
    memcpy(&x, (const float *)base + i, sizeof x);
    return x;
}

/* where(mask, a, b) lane by lane (C has no vector ?:); mask lanes are all ones or zero. */
static inline v16 select(i16v mask, v16 a, v16 b) { return (v16)((mask & (i16v)a) | (~mask & (i16v)b)); }

/* One row's argmax: the max and the first index holding it, in one pass; a NaN check. */
static inline __attribute__((always_inline)) int64_t pick_row(const void *row, int64_t vocab,
                                                              int dtype) {
    const int64_t body = vocab / 64 * 64;
    /* per lane of 4 vectors: the max and the first index holding it (strict >, so the earliest
     * wins); four chains, so the loop is not bound by one compare-and-blend's latency */
    v16 vmax[4];
    i16v vat[4], vnan = {0}, lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int c = 0; c < 4; c++) vmax[c] = (v16){0} - INFINITY, vat[c] = (i16v){0};
    for (int64_t i = 0; i < body; i += 64)
        for (int c = 0; c < 4; c++) {
            v16 x = load16(row, i + 16 * c, dtype);
            i16v more = x > vmax[c];
            vnan |= x != x;
            vmax[c] = select(more, x, vmax[c]);
            vat[c] = (more & (lane_index + (int32_t)(i + 16 * c))) | (~more & vat[c]);
        }
    float m = -INFINITY;
    int64_t at = vocab; /* no value above -inf: index 0, as torch.argmax */
    int nan = 0;
    for (int c = 0; c < 4 && body; c++)
        for (int l = 0; l < 16; l++)
            if (vmax[c][l] > m || (vmax[c][l] == m && vat[c][l] < at)) m = vmax[c][l], at = vat[c][l];
    for (int l = 0; l < 16; l++) nan |= vnan[l] != 0;
    for (int64_t i = body; i < vocab; i++) {
        float x = load(row, i, dtype);
        nan |= x != x;
        if (x > m) m = x, at = i;
    }
    if (nan) {
        int64_t i = 0;
        while (load(row, i, dtype) == load(row, i, dtype)) i++;
        return i;
    }
    return at < vocab && m > -INFINITY ? at : 0;
}

/* ids[r] = argmax of row r < rows of logits (row r at logits + r * row_stride elements, `vocab`
 * of fp32 (0) or bf16 (1)). */
void greedy_pick(int64_t rows, int64_t vocab, const void *logits, int64_t row_stride, int dtype,
                 int64_t *ids) {
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)logits + r * row_stride * elem;
        ids[r] = dtype == DTYPE_BF16 ? pick_row(row, vocab, DTYPE_BF16)
                                     : pick_row(row, vocab, DTYPE_F32);
    }
}
