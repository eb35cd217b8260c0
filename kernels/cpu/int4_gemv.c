/* y[M, N] = x[M, K] @ W^T for up to 16 rows of x (decode steps), W in torch's int4 CPU packing as
 * runtime/quant/linear.py's Int4Matrix holds it: read in place, no repacked copy. bf16 x and y,
 * fp32 accumulation. torch's _weight_int4pack_mm_for_cpu converts the codes again for every row,
 * so its cost grows with each one (3072x576, weights streamed from memory: 41 us at 1 row, 106 at
 * 8, 201 at 16); here each block of codes is converted once per 8 rows while it sits in L1 (38,
 * 65, 120 us), faster than a packed bf16 copy up to 16 rows (oneDNN: 110, 122, 141 us).
 * Small matrices run on the calling thread, big ones over OpenMP threads (torch's runtime, see
 * native_kernels.py). A row's result does not depend on how many rows the call has.
 *
 * Packing (pack_block_n() = B: 64 on AVX-512 torch builds, 32 on AVX2): a full block of B rows is
 * stored k-major, B/2 bytes per k, row r in byte r % (B/2), nibble r / (B/2); the last N % B rows
 * form one block of (N % B)/2 bytes per k, row r in byte r / 2, nibble r % 2. scale_zeros is bf16
 * [K/32, N, 2]: w = (c - 8) * scale + zero.
 *
 * Each group of 32 k sums x * c in fp32, then adds scale * sum + (zero - 8 scale) * sum(x): the
 * weight is never dequantized. With AVX512-BF16 the sums are vdpbf16ps dot products (codes and x
 * are exact bf16, so the products are exact): 1.4-2.4x torch's kernel on the default model's
 * matrices at 1-7 rows with the weights in cache (benchmarks/int4_gemv.py). Otherwise fp32 FMAs in GCC vector extensions,
 * 16 floats a vector on AVX-512 (one register), 8 elsewhere (AVX2: one ymm; other targets:
 * whatever GCC lowers them to). */
#include <omp.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#if defined(__AVX512F__)
#include "vnni_common.h"
#endif

#define GROUP 32
#define MAX_ROWS 8      /* rows a block's accumulators hold; more rows go in chunks */
#define MAX_CALL_ROWS 16
/* Groups ahead of the one in use whose codes and scales a block's pass asks the memory system
 * for: the model's weights outgrow L3, so every forward streams them from DRAM, and the
 * hardware prefetcher alone left the FMAs waiting (decode forward, bf16 dots: batch 16 0.84x
 * the time, batch 1 0.83x). */
#define PREFETCH_GROUPS 2

#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

typedef struct {
    const uint8_t *packed;
    const uint32_t *sz; /* (scale, zero) bf16 pairs as one uint32: scale low, zero high */
    const uint16_t *xb; /* [M, K] bf16 x */
    const float *x;     /* [M, K] fp32 copy of x */
    const float *xsum;  /* [M, K / 32]: sum of x over each group */
    uint16_t *y;        /* [M, ldy] bf16 */
    int64_t n_rows, n_out, k, ldy, block;
} job;

/* The low and high nibbles of VL bytes as floats 0..15. AVX-512: a 16-entry table lookup
 * (vpermps reads only an index's low 4 bits, so no mask, and it runs beside the FMAs' ports
 * where a convert would compete). GCC lowers a __builtin_convertvector of bytes to scalar
 * inserts, 4x slower than the whole kernel, hence the intrinsics. */
static inline void load_codes(const uint8_t *p, vf *lo, vf *hi) {
#if VL == 16
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (vf)_mm512_permutexvar_ps(c, table);
    *hi = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table);
#else
    vi c;
#if defined(__AVX2__)
    c = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    for (int i = 0; i < VL; i++) c[i] = p[i];
#endif
    *lo = __builtin_convertvector(c & 15, vf);
    *hi = __builtin_convertvector(c >> 4, vf);
#endif
}

/* (scale, zero - 8 scale) of VL rows from their bf16 pairs. */
static inline void scale_offset(const uint32_t *p, vf *s, vf *o) {
    vu v;
    memcpy(&v, p, sizeof v);
    vu lo = v << 16, hi = v & 0xffff0000u;
    memcpy(s, &lo, sizeof lo);
    vf z;
    memcpy(&z, &hi, sizeof hi);
    *o = z - 8.0f * *s;
}

#if VL == 16 && defined(__AVX512BF16__)
/* alo[m], ahi[m] = sum over the group's 32 k of x[m, k] * code, low and high nibbles of bytes
 * p[k * half + i]. AVX512-BF16: codes 0..15 are exact in bf16, so one vdpbf16ps multiplies 16
 * rows by a pair of k (x[k], x[k + 1] as they lie in memory) with exact products and fp32 sums:
 * half the instructions of the fp32 FMAs below once several rows share the codes. */
static inline __attribute__((always_inline)) void group_sums(const job *j, const uint8_t *p,
                                                             int64_t k0, int M, vf *alo,
                                                             vf *ahi) {
    const int64_t half = j->block / 2;
    const __m512i table = _mm512_set_epi16( /* bf16 of i & 15 at index i < 32 */
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
        0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
        0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    __m512 lo_sum[MAX_ROWS], hi_sum[MAX_ROWS];
    for (int m = 0; m < M; m++) lo_sum[m] = hi_sum[m] = _mm512_setzero_ps();
    for (int kk = 0; kk < GROUP; kk += 2) {
        __m128i b0 = _mm_loadu_si128((const __m128i *)(p + kk * half));
        __m128i b1 = _mm_loadu_si128((const __m128i *)(p + (kk + 1) * half));
        /* word 2i = byte i of k, word 2i + 1 = byte i of k + 1: row i's pair in lane i */
        __m512i w = _mm512_cvtepu8_epi16(
            _mm256_set_m128i(_mm_unpackhi_epi8(b0, b1), _mm_unpacklo_epi8(b0, b1)));
        __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(w, table); /* index: low 5 bits */
        __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
        for (int m = 0; m < M; m++) {
            uint32_t pair;
            memcpy(&pair, j->xb + m * j->k + k0 + kk, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            lo_sum[m] = _mm512_dpbf16_ps(lo_sum[m], lo, xv);
            hi_sum[m] = _mm512_dpbf16_ps(hi_sum[m], hi, xv);
        }
    }
    for (int m = 0; m < M; m++) alo[m] = (vf)lo_sum[m], ahi[m] = (vf)hi_sum[m];
}
#else
/* alo[m], ahi[m] = sum over the group's 32 k of x[m, k] * code, low and high nibbles of bytes
 * p[k * half + i], in fp32 FMAs. */
static inline __attribute__((always_inline)) void group_sums(const job *j, const uint8_t *p,
                                                             int64_t k0, int M, vf *alo,
                                                             vf *ahi) {
    /* Below 3 rows two sets of sums (even and odd k): one set alone waits on the FMA latency,
     * not the loads. */
    enum { SETS = 2 };
    const int64_t half = j->block / 2;
    const int sets = M < 3 ? SETS : 1;
    vf lo_sum[SETS][MAX_ROWS], hi_sum[SETS][MAX_ROWS];
    for (int t = 0; t < SETS; t++)
        for (int m = 0; m < M; m++) lo_sum[t][m] = hi_sum[t][m] = (vf){0};
    const float *xg = j->x + k0;
    for (int kk = 0; kk < GROUP; kk += sets) {
        for (int t = 0; t < sets; t++) {
            vf lo, hi;
            load_codes(p + (kk + t) * half, &lo, &hi);
            for (int m = 0; m < M; m++) {
                float xv = xg[m * j->k + kk + t];
                lo_sum[t][m] += xv * lo;
                hi_sum[t][m] += xv * hi;
            }
        }
    }
    for (int m = 0; m < M; m++) {
        alo[m] = lo_sum[0][m] + (sets == 2 ? lo_sum[1][m] : (vf){0});
        ahi[m] = hi_sum[0][m] + (sets == 2 ? hi_sum[1][m] : (vf){0});
    }
}
#endif

/* The `block` rows from row0 of a full block. Unit u: the low nibbles of bytes [u VL, u VL + VL)
 * of each k are rows row0 + u VL + i, the high nibbles rows row0 + half + u VL + i. Group by
 * group, all units, so each group's bytes are read once and in order (a unit at a time over the
 * whole K read every line twice, and with two threads the batch-1 forward was 10% slower than
 * torch's kernel instead of faster). M is a constant in each caller. */
static inline __attribute__((always_inline)) void block_rows(const job *j, int64_t row0, int M) {
    enum { MAX_UNITS = 4 }; /* 64-row blocks of 8-float vectors */
    const int64_t half = j->block / 2, k = j->k, groups = k / GROUP, units = half / VL;
    const uint8_t *blk = j->packed + row0 * (k / 2);
    vf ylo[MAX_UNITS][MAX_ROWS], yhi[MAX_UNITS][MAX_ROWS];
    for (int64_t u = 0; u < units; u++)
        for (int m = 0; m < M; m++) ylo[u][m] = yhi[u][m] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        if (g + PREFETCH_GROUPS < groups) {
            const uint8_t *next = blk + (g + PREFETCH_GROUPS) * GROUP * half;
            for (int64_t l = 0; l < GROUP * half; l += 64) __builtin_prefetch(next + l);
            const uint32_t *sz = j->sz + (g + PREFETCH_GROUPS) * j->n_rows + row0;
            for (int64_t l = 0; l < j->block; l += 16) __builtin_prefetch(sz + l);
        }
        for (int64_t u = 0; u < units; u++) {
            vf alo[MAX_ROWS], ahi[MAX_ROWS];
            group_sums(j, blk + g * GROUP * half + u * VL, g * GROUP, M, alo, ahi);
            vf slo, olo, shi, ohi;
            const uint32_t *szg = j->sz + g * j->n_rows + row0 + u * VL;
            scale_offset(szg, &slo, &olo);
            scale_offset(szg + half, &shi, &ohi);
            for (int m = 0; m < M; m++) {
                float xs = j->xsum[m * groups + g];
                ylo[u][m] += slo * alo[m] + olo * xs;
                yhi[u][m] += shi * ahi[m] + ohi * xs;
            }
        }
    }
    for (int64_t u = 0; u < units; u++)
        for (int m = 0; m < M; m++) {
            uint16_t *ym = j->y + m * j->ldy;
            for (int i = 0; i < VL; i++) {
                int64_t r = row0 + u * VL + i;
                if (r < j->n_out) ym[r] = bf16_from_f32(ylo[u][m][i]);
                if (r + half < j->n_out) ym[r + half] = bf16_from_f32(yhi[u][m][i]);
            }
        }
}

/* The last n_rows % block rows (a multiple of 16, fewer than a block): byte r / 2 of each k,
 * nibble r % 2. Small, so plain loops. */
static void tail_rows(const job *j, int M) {
    const int64_t row0 = j->n_rows / j->block * j->block, rows = j->n_rows - row0;
    const int64_t k = j->k, groups = k / GROUP, stride = rows / 2;
    const uint8_t *blk = j->packed + row0 * (k / 2);
    for (int64_t r = 0; r < rows && row0 + r < j->n_out; r++) {
        for (int m = 0; m < M; m++) {
            float y = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                float a = 0.0f;
                for (int kk = 0; kk < GROUP; kk++) {
                    int64_t kx = g * GROUP + kk;
                    int c = (blk[kx * stride + r / 2] >> (4 * (r % 2))) & 15;
                    a += j->x[m * k + kx] * (float)c;
                }
                uint32_t v = j->sz[g * j->n_rows + row0 + r];
                float s = f32_from_bf16((uint16_t)v), z = f32_from_bf16((uint16_t)(v >> 16));
                y += s * a + (z - 8.0f * s) * j->xsum[m * groups + g];
            }
            j->y[m * j->ldy + row0 + r] = bf16_from_f32(y);
        }
    }
}

/* Full block b. */
static void run_block(const job *j, int64_t b, int M) {
    const int64_t row0 = b * j->block;
    switch (M) { /* M a constant in each copy: accumulators stay in registers */
    case 1: block_rows(j, row0, 1); break;
    case 2: block_rows(j, row0, 2); break;
    case 3: block_rows(j, row0, 3); break;
    case 4: block_rows(j, row0, 4); break;
    case 5: block_rows(j, row0, 5); break;
    case 6: block_rows(j, row0, 6); break;
    case 7: block_rows(j, row0, 7); break;
    default: block_rows(j, row0, 8); break;
    }
}

int int4_gemv_threads(void) { return omp_get_max_threads(); }

/* One packed matrix, described once (native_kernels.Int4Matrix keeps it beside its tensors). */
typedef struct {
    const uint8_t *packed;        /* torch's int4 CPU packing of n_rows rows */
    const uint16_t *scale_zeros;  /* bf16 [k / 32, n_rows, 2] */
    int64_t n_rows, n_out, k;     /* n_rows a multiple of 16 (>= n_out), k of 32 */
    int64_t block;                /* pack_block_n(): 32 or 64 */
    int64_t parallel_work;        /* above n_rows * k * M the OpenMP team splits the rows */
} int4_matrix;

/* y[M, n_out] (bf16, contiguous) = x[M, k] (bf16, contiguous) @ W^T, 1 <= M <= 7. Returns 0, or
 * -1 for a matrix or M it does not take (nothing written). */
int int4_gemv_bf16(const int4_matrix *w, const uint16_t *x, uint16_t *y, int64_t M) {
    const int64_t n_rows = w->n_rows, n_out = w->n_out, k = w->k, block = w->block;
    if (M < 1 || M > MAX_CALL_ROWS || k <= 0 || k % GROUP || n_rows % 16 || n_out > n_rows ||
        (block != 32 && block != 64) || block / 2 % VL)
        return -1;
    const int64_t groups = k / GROUP;
    float *xf = malloc(sizeof(float) * M * (k + groups));
    if (!xf) return -1;
    float *xsum = xf + M * k;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int kk = 0; kk < GROUP; kk++) {
                float v = f32_from_bf16(x[m * k + g * GROUP + kk]);
                xf[m * k + g * GROUP + kk] = v;
                s += v;
            }
            xsum[m * groups + g] = s;
        }
    const job j = {w->packed, (const uint32_t *)w->scale_zeros, x, xf, xsum, y, n_rows, n_out, k,
                   n_out, block};
    /* Rows in chunks of at most MAX_ROWS, each chunk over a block while its codes are in L1. */
    const int chunks = (int)((M + MAX_ROWS - 1) / MAX_ROWS);
    job parts[(MAX_CALL_ROWS + MAX_ROWS - 1) / MAX_ROWS];
    int rows_of[(MAX_CALL_ROWS + MAX_ROWS - 1) / MAX_ROWS];
    for (int c = 0; c < chunks; c++) {
        const int64_t m0 = (int64_t)c * MAX_ROWS;
        parts[c] = j;
        parts[c].xb += m0 * k, parts[c].x += m0 * k, parts[c].xsum += m0 * groups;
        parts[c].y += m0 * n_out;
        rows_of[c] = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
    }
    const int64_t blocks = n_rows / block;
    const int m = (int)M;
    if (n_rows * k * M <= w->parallel_work) {
        for (int64_t b = 0; b < blocks; b++)
            for (int c = 0; c < chunks; c++) run_block(&parts[c], b, rows_of[c]);
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int c = 0; c < chunks; c++) run_block(&parts[c], b, rows_of[c]);
    }
    if (n_rows % block) tail_rows(&j, m);
    free(xf);
    return 0;
}

/* Where packed row r's codes lie (torch's packing, see the top of this file): the code at k is
 * (base[k * stride] >> shift) & 15. */
typedef struct {
    const uint8_t *base;
    int64_t stride;
    int shift;
} row_codes;

static inline row_codes row_at(const int4_matrix *w, int64_t r) {
    const int64_t full = w->n_rows / w->block * w->block;
    int64_t start, half, col, nibble;
    if (r < full) {
        start = r / w->block * w->block, half = w->block / 2;
        col = (r - start) % half, nibble = (r - start) / half;
    } else {
        start = full, half = (w->n_rows - full) / 2;
        col = (r - start) / 2, nibble = (r - start) % 2;
    }
    return (row_codes){w->packed + start * (w->k / 2) + col, half, (int)(4 * nibble)};
}

static inline int code_in(row_codes rc, int64_t kx) {
    return (rc.base[kx * rc.stride] >> rc.shift) & 15;
}

/* The 4-bit code of packed row r at k. */
static inline int code_at(const int4_matrix *w, int64_t r, int64_t kx) {
    return code_in(row_at(w, r), kx);
}

/* Dequantized weight w' = (c - 8) * scale + zero of packed row r at k (no FMA: each product and
 * sum rounds to fp32, as Int4Matrix.rows' torch ops do). */
__attribute__((optimize("fp-contract=off"))) static inline float weight_at(
    const int4_matrix *w, int64_t r, int64_t kx) {
    const uint16_t *sz = w->scale_zeros + ((kx / GROUP) * w->n_rows + r) * 2;
    const float product = (float)(code_at(w, r, kx) - 8) * f32_from_bf16(sz[0]);
    return product + f32_from_bf16(sz[1]);
}

/* out[n, K] (fp32) = weight rows ids[0..n) (each < n_out), as Int4Matrix.rows computes them.
 * lo_bits > 0: the matrix holds split codes, each chunk of K as [hi chunk, lo chunk] along
 * K' = 2 K; a weight is hi * 2^lo_bits + lo. Returns 0, or -1 for an id out of range. */
__attribute__((optimize("fp-contract=off"))) int int4_rows_f32(
    const int4_matrix *w, const int64_t *ids, int64_t n, int lo_bits, int64_t chunk,
    float *out) {
    const int64_t kp = w->k, k = lo_bits ? kp / 2 : kp;
    if (lo_bits && (chunk <= 0 || k % chunk)) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= w->n_out) return -1;
    const float mult = (float)(1 << lo_bits);
    for (int64_t i = 0; i < n; i++) {
        float *o = out + i * k;
        if (!lo_bits) {
            for (int64_t kx = 0; kx < kp; kx++) o[kx] = weight_at(w, ids[i], kx);
            continue;
        }
        for (int64_t c0 = 0; c0 < k; c0 += chunk)
            for (int64_t j = 0; j < chunk; j++) {
                const float hi = weight_at(w, ids[i], 2 * c0 + j) * mult; /* exact */
                o[c0 + j] = hi + weight_at(w, ids[i], 2 * c0 + chunk + j);
            }
    }
    return 0;
}

/* ---- int8 dot products (AVX512-VNNI vpdpbusd) --------------------------------------------
 * The same weights repacked once into records of 16 rows x 32 k (one group): 4 x 64 bytes of
 * codes, vector t covering k = 8 t .. 8 t + 7 of the group, 32-bit lane i = row i, byte j: low
 * nibble c(i, 8 t + j), high nibble c(i, 8 t + 4 + j); then the 16 rows' (scale, zero) bf16
 * pairs (64 bytes). Records of a 16-row block lie group after group: one stream per block, the
 * same bytes per weight as torch's packing. Each row of x is quantized per group of 32 to int8
 * (d = max|x| / 127, xq = rint(x / d), llama.cpp's approach for its Q8 activations), so one
 * vpdpbusd multiplies 16 rows x 4 k (64 multiply-adds against vdpbf16ps' 32). The integer sum
 * starts at -8 sum(xq), so it is sum (c - 8) xq: the int8 error of x is weighted by the centred
 * codes. y += scale * d * isum + zero * (exact fp32 sum of x over the group). */
#define VNNI_RECORD 320
#define VNNI_CHUNK 8 /* rows of x per pass over a block's records */
/* Records ahead of the one in use that a pass asks the memory system for. A forward streams
 * every matrix from DRAM (the model's records outgrow L3), and the hardware prefetcher alone
 * left the dot products waiting: decode forward at batch 16 0.86x the time, at batch 1 0.96x. */
#define VNNI_PREFETCH_RECORDS 12
/* Up to VNNI_STREAM_MAX_M rows of x, a thread reads VNNI_STREAMS runs of its blocks at once
 * (kquant_vnni.c's MAX_STREAMS: one core keeps more lines in flight over several streams). */
#define VNNI_STREAMS 3
#define VNNI_STREAM_MAX_M 2

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
int int4_vnni_available(void) { return 1; }

/* out: n_rows / 16 * k / 32 records, from the matrix in torch's packing. */
int int4_vnni_repack(const int4_matrix *w, uint8_t *out) {
    const int64_t groups = w->k / GROUP, blocks = w->n_rows / 16;
    if (w->n_rows % 16 || w->k % GROUP) return -1;
    /* serial: an OpenMP team on the loading thread would stay behind it, and libgomp throttles
     * every team's spin once it manages more threads than cores (runtime/cpu_threads.py) */
    for (int64_t b = 0; b < blocks; b++) {
        row_codes rows[16]; /* each row's place found once, not per code */
        for (int i = 0; i < 16; i++) rows[i] = row_at(w, 16 * b + i);
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *rec = out + (b * groups + g) * VNNI_RECORD;
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 16; i++)
                    for (int j = 0; j < 4; j++) {
                        const int64_t kx = g * GROUP + 8 * t + j;
                        rec[64 * t + 4 * i + j] =
                            (uint8_t)(code_in(rows[i], kx) | code_in(rows[i], kx + 4) << 4);
                    }
            memcpy(rec + 256, w->scale_zeros + (g * w->n_rows + 16 * b) * 2, 64);
        }
    }
    return 0;
}

typedef struct {
    const uint8_t *records;
    const int8_t *xq;   /* [M, k] */
    const float *d;     /* [M, k / 32] quantization steps */
    const float *xs;    /* [M, k / 32] fp32 sums of x */
    const int32_t *sq;  /* [M, k / 32] sums of xq */
    uint16_t *y;        /* [M, n_out] bf16 */
    int64_t n_out, k;
} vnni_job;

/* xq, d, xs, sq of bf16 x [M, k]. */
static void quantize_rows(const uint16_t *x, int64_t M, int64_t k, int8_t *xq, float *d,
                          float *xs, int32_t *sq) {
    const int64_t groups = k / GROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *p = x + m * k + g * GROUP;
            const int64_t i = m * groups + g;
            int32_t sums[2];
            d[i] = quantize_int8(p, 2, xq + m * k + g * GROUP, sums);
            xs[i] = _mm512_reduce_add_ps(_mm512_add_ps(f32x16_from_bf16(p),
                                                       f32x16_from_bf16(p + 16)));
            sq[i] = sums[0] + sums[1];
        }
}

/* 8-bit records for the split matrices of Q8_0 (Int4Matrix lo_bits 4, chunk 32: kernel codes
 * [hi + 8 | lo] per chunk along K' = 2K, hi group zero 0, lo group zero 8 s, both scale s). They
 * hold u8 = 16 c_hi + c_lo = code + 128 over the original K, so w = s (u8 - 128), and one
 * vpdpbusd multiplies 16 rows x 4 k: half the instructions and bytes of the doubled-K int4
 * records. Record (16 rows x 32 k): vector t (k = 4 t .. 4 t + 3), lane i = row i, byte j =
 * code(i, 4 t + j); then the 16 rows' scales as fp32 (64 bytes). */
#define VNNI8_RECORD 576

/* out: n_rows / 16 * (k / 2) / 32 records; -1 (nothing promised in out) where the matrix is
 * not a Q8_0 split of that form. */
int int8_vnni_repack(const int4_matrix *w, uint8_t *out) {
    const int64_t k8 = w->k / 2, groups = k8 / GROUP, blocks = w->n_rows / 16;
    if (w->n_rows % 16 || w->k % (2 * GROUP)) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        row_codes rows[16];
        for (int i = 0; i < 16; i++) rows[i] = row_at(w, 16 * b + i);
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *rec = out + (b * groups + g) * VNNI8_RECORD;
            for (int t = 0; t < 8; t++)
                for (int i = 0; i < 16; i++)
                    for (int j = 0; j < 4; j++) {
                        const int64_t kx = 64 * g + 4 * t + j;
                        rec[64 * t + 4 * i + j] =
                            (uint8_t)(16 * code_in(rows[i], kx) + code_in(rows[i], kx + GROUP));
                    }
            float *scales = (float *)(rec + 512);
            for (int i = 0; i < 16; i++) {
                const int64_t r = 16 * b + i;
                const uint16_t *hi = w->scale_zeros + ((2 * g) * w->n_rows + r) * 2;
                const uint16_t *lo = w->scale_zeros + ((2 * g + 1) * w->n_rows + r) * 2;
                const float s = f32_from_bf16(hi[0]);
                if (hi[0] != lo[0] || f32_from_bf16(hi[1]) != 0.0f ||
                    f32_from_bf16(lo[1]) != 8.0f * s)
                    return -1;
                scales[i] = s;
            }
        }
    }
    return 0;
}

/* Blocks b, b + gap, ... (S of them, 16 rows each) for M rows of x, their records taken in
 * turns (S streams from memory at once, as the K-quant kernel's); S, M and `eight` (the 8-bit
 * records of int8_vnni_repack, else the int4 ones) are constants in each copy, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void vnni_blocks(const vnni_job *j, int64_t b,
                                                              int64_t gap, int S, int M,
                                                              int eight) {
    const int64_t groups = j->k / GROUP, record = eight ? VNNI8_RECORD : VNNI_RECORD;
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    const __m512i high_halves = _mm512_set1_epi32((int)0xffff0000u);
    __m512 ys[VNNI_STREAMS][VNNI_CHUNK];
    for (int s = 0; s < S; s++)
        for (int m = 0; m < M; m++) ys[s][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
    for (int s = 0; s < S; s++) {
        const uint8_t *rec = j->records + ((b + s * gap) * groups + g) * record;
        __m512 *y = ys[s];
        for (int l = 0; l < record; l += 64) __builtin_prefetch(rec + VNNI_PREFETCH_RECORDS * record + l);
        __m512i c[8];
        __m512 scale, zero = _mm512_setzero_ps();
        if (eight) {
            for (int t = 0; t < 8; t++) c[t] = _mm512_loadu_si512((const void *)(rec + 64 * t));
            scale = _mm512_loadu_ps((const void *)(rec + 512));
        } else {
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512((const void *)(rec + 64 * t));
                c[2 * t] = _mm512_and_si512(v, low_nibbles);
                c[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
            }
            const __m512i sz = _mm512_loadu_si512((const void *)(rec + 256));
            scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
            zero = _mm512_castsi512_ps(_mm512_and_si512(sz, high_halves));
        }
        for (int m = 0; m < M; m++) {
            const int64_t i = m * groups + g;
            const int32_t *x4 = (const int32_t *)(j->xq + m * j->k + g * GROUP);
            /* the codes' offset: sum (c - offset) xq */
            __m512i acc = _mm512_set1_epi32(-(eight ? 128 : 8) * j->sq[i]);
            if (M < 3) { /* two chains: a lone row would wait on vpdpbusd's latency */
                __m512i acc2 = _mm512_setzero_si512();
                for (int t = 0; t < 8; t += 2) {
                    acc = dot_broadcast(acc, c[t], x4 + t);
                    acc2 = dot_broadcast(acc2, c[t + 1], x4 + t + 1);
                }
                acc = _mm512_add_epi32(acc, acc2);
            } else {
                for (int t = 0; t < 8; t++) acc = dot_broadcast(acc, c[t], x4 + t);
            }
            const __m512 step = _mm512_mul_ps(scale, _mm512_set1_ps(j->d[i]));
            y[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), step, y[m]);
            if (!eight) y[m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(j->xs[i]), y[m]);
        }
    }
    for (int s = 0; s < S; s++) {
        const int64_t row0 = 16 * (b + s * gap);
        const __mmask16 keep = row0 + 16 <= j->n_out ? 0xffff
                               : (__mmask16)((1u << (j->n_out > row0 ? j->n_out - row0 : 0)) - 1);
        for (int m = 0; m < M; m++)
            _mm256_mask_storeu_epi16(j->y + m * j->n_out + row0, keep,
                                     (__m256i)_mm512_cvtneps_pbh(ys[s][m]));
    }
}

static inline __attribute__((always_inline)) void vnni_rows(const vnni_job *j, int64_t b,
                                                            int64_t gap, int S, int M, int eight) {
    if (S > 1) { /* streams: M <= VNNI_STREAM_MAX_M */
        if (M == 1) vnni_blocks(j, b, gap, VNNI_STREAMS, 1, eight);
        else vnni_blocks(j, b, gap, VNNI_STREAMS, 2, eight);
        return;
    }
    switch (M) {
    case 1: vnni_blocks(j, b, 0, 1, 1, eight); break;
    case 2: vnni_blocks(j, b, 0, 1, 2, eight); break;
    case 3: vnni_blocks(j, b, 0, 1, 3, eight); break;
    case 4: vnni_blocks(j, b, 0, 1, 4, eight); break;
    case 5: vnni_blocks(j, b, 0, 1, 5, eight); break;
    case 6: vnni_blocks(j, b, 0, 1, 6, eight); break;
    case 7: vnni_blocks(j, b, 0, 1, 7, eight); break;
    default: vnni_blocks(j, b, 0, 1, 8, eight); break;
    }
}

static void vnni4_run_block(const vnni_job *j, int64_t b, int64_t gap, int S, int M) {
    vnni_rows(j, b, gap, S, M, 0);
}
static void vnni8_run_block(const vnni_job *j, int64_t b, int64_t gap, int S, int M) {
    vnni_rows(j, b, gap, S, M, 1);
}

/* y[M, n_out] bf16 = x[M, k] bf16 @ W^T over `records` (n_rows / 16 blocks, k / 32 records
 * each), every block run by `run_block`. Returns 0, or -1 for what it does not take. */
static int vnni_matmul(const uint8_t *records, int64_t n_rows, int64_t n_out, int64_t k,
                       int64_t parallel_work, const uint16_t *x, uint16_t *y, int64_t M,
                       void (*run_block)(const vnni_job *, int64_t, int64_t, int, int)) {
    const int64_t groups = k / GROUP;
    if (M < 1 || M > MAX_CALL_ROWS || n_rows % 16 || k <= 0 || k % GROUP || n_out > n_rows)
        return -1;
    int8_t *xq = malloc((size_t)(M * k) + sizeof(float) * 3 * (size_t)(M * groups));
    if (!xq) return -1;
    /* the floats after the int8 rows: M k is a multiple of 32, so they are 4-byte aligned */
    float *d = (float *)(xq + M * k), *xs = d + M * groups;
    int32_t *sq = (int32_t *)(xs + M * groups);
    quantize_rows(x, M, k, xq, d, xs, sq);
    const int chunks = (int)((M + VNNI_CHUNK - 1) / VNNI_CHUNK);
    vnni_job parts[(MAX_CALL_ROWS + VNNI_CHUNK - 1) / VNNI_CHUNK];
    int rows_of[(MAX_CALL_ROWS + VNNI_CHUNK - 1) / VNNI_CHUNK];
    for (int c = 0; c < chunks; c++) {
        const int64_t m0 = (int64_t)c * VNNI_CHUNK;
        parts[c] = (vnni_job){records, xq + m0 * k, d + m0 * groups, xs + m0 * groups,
                              sq + m0 * groups, y + m0 * n_out, n_out, k};
        rows_of[c] = (int)(M - m0 < VNNI_CHUNK ? M - m0 : VNNI_CHUNK);
    }
    const int64_t blocks = (n_out + 15) / 16;
#pragma omp parallel if (n_rows * k * M > parallel_work)
    { /* a thread's blocks are one run of the records, read as `streams` runs at once */
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        const int streams = M <= VNNI_STREAM_MAX_M && b1 - b0 >= VNNI_STREAMS ? VNNI_STREAMS : 1;
        const int64_t gap = (b1 - b0) / streams; /* the streams' blocks b0 + i + gap s */
        for (int64_t i = 0; i < gap; i++)
            for (int c = 0; c < chunks; c++) run_block(&parts[c], b0 + i, gap, streams, rows_of[c]);
        for (int64_t b = b0 + streams * gap; b < b1; b++) /* what the streams left over */
            for (int c = 0; c < chunks; c++) run_block(&parts[c], b, 0, 1, rows_of[c]);
    }
    free(xq);
    return 0;
}

/* y[M, n_out] bf16 = x[M, k] bf16 @ W^T over the records of int4_vnni_repack; 1 <= M <= 16.
 * Returns 0, or -1 for what it does not take (nothing written). */
int int4_vnni_bf16(const int4_matrix *w, const uint8_t *records, const uint16_t *x, uint16_t *y,
                   int64_t M) {
    return vnni_matmul(records, w->n_rows, w->n_out, w->k, w->parallel_work, x, y, M,
                       vnni4_run_block);
}

/* The same over the records of int8_vnni_repack (w: the split matrix they came from), x [M, k / 2]. */
int int8_vnni_bf16(const int4_matrix *w, const uint8_t *records, const uint16_t *x, uint16_t *y,
                   int64_t M) {
    if (w->k % (2 * GROUP)) return -1;
    return vnni_matmul(records, w->n_rows, w->n_out, w->k / 2, w->parallel_work, x, y, M,
                       vnni8_run_block);
}
#else
int int4_vnni_available(void) { return 0; }
int int4_vnni_repack(const int4_matrix *w, uint8_t *out) { (void)w, (void)out; return -1; }
int int4_vnni_bf16(const int4_matrix *w, const uint8_t *records, const uint16_t *x, uint16_t *y,
                   int64_t M) {
    (void)w, (void)records, (void)x, (void)y, (void)M;
    return -1;
}
int int8_vnni_repack(const int4_matrix *w, uint8_t *out) { (void)w, (void)out; return -1; }
int int8_vnni_bf16(const int4_matrix *w, const uint8_t *records, const uint16_t *x, uint16_t *y,
                   int64_t M) {
    (void)w, (void)records, (void)x, (void)y, (void)M;
    return -1;
}
#endif

/* The three products as matmul_op_fn (cpu_kernels.h): args {the int4_matrix} for int4_gemv_op,
 * {the int4_matrix, its records} for the VNNI ones. */
int int4_gemv_op(const int64_t *args, const void *x, void *y, int64_t rows) {
    return int4_gemv_bf16((const int4_matrix *)(intptr_t)args[0], x, y, rows);
}

int int4_vnni_op(const int64_t *args, const void *x, void *y, int64_t rows) {
    return int4_vnni_bf16((const int4_matrix *)(intptr_t)args[0],
                          (const uint8_t *)(intptr_t)args[1], x, y, rows);
}

int int8_vnni_op(const int64_t *args, const void *x, void *y, int64_t rows) {
    return int8_vnni_bf16((const int4_matrix *)(intptr_t)args[0],
                          (const uint8_t *)(intptr_t)args[1], x, y, rows);
}
