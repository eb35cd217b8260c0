/* y[M, N] = x[M, K] @ W^T for W in llama.cpp's K-quant types (Q4_K, Q5_K, Q6_K) and its legacy
 * Q4_0, Q5_0 and Q8_0, held in one compact record format that every call reads, decode and
 * prefill alike: no torch int4 packing beside it, no second copy, about the file's own bytes per
 * weight (Q4_K 4.63 bits against the file's 4.5, Q5_K 5.63 against 5.5, Q6_K 6.63 against 6.56;
 * the legacy types exactly the file's 4.5, 5.5 and 8.5). runtime/quant/kquant.py's KQuantMatrix
 * holds the records (its RECORD_BYTES: the sizes below).
 *
 * Records: one per 16 weight rows x 256 k (a super-block of each row), those of a 16-row block
 * one after another along k, so a block's pass is one stream. A record is a 320-byte header then
 * 8 groups of 32 k:
 *   header  Q4_K, Q5_K: d fp16 [16 rows] | dmin fp16 [16] | sc u8 [8 groups][16] | m u8 [8][16]
 *           Q6_K:       d fp16 [16] | 32 unused bytes | sc int8 [16 sub-blocks of 16 k][16]
 *   group   4 x 64 bytes of low nibbles: vector t covers k 8t..8t+3 (low nibble of byte j of
 *           lane i: row i, k 8t+j) and 8t+4..8t+7 (high nibbles); then the codes' high bits:
 *           Q5_K one 64-byte vector (bit t of byte (i, j): k 8t+j, bit 4+t: k 8t+4+j), Q6_K two
 *           (vector h holds t = 2h, 2h+1: bits 4(t%2)..+1 for k 8t+j, 4(t%2)+2..+3 for 8t+4+j).
 * The weight is the file's, exactly: Q4_K/Q5_K w = d sc c - dmin m (c 0..15 / 0..31), Q6_K
 * w = d sc (c - 32) (c 0..63), the integer scales and fp16 steps as the file holds them.
 * Legacy records: one per 16 rows x 32 k (so rows need only be a multiple of 32 long), a 32-byte
 * header of the rows' fp16 steps d, then one group of codes as above (Q4_0 as Q4_K's, Q5_0 as
 * Q5_K's) or, Q8_0, 8 vectors of whole bytes c + 128 (vector 2t: k 8t+j, 2t+1: k 8t+4+j);
 * w = d (c - mid), mid 8, 16 or 128.
 *
 * Each row of x is quantized per 16 to int8 (step xd = max|x| / 127; llama.cpp takes one step
 * per 256): one vpdpbusd multiplies 16 weight rows x 4 k of unsigned codes by int8 x. The
 * codes are centred in the integer sums (isum = sum (c - mid) xq, mid 8, 16 or 32), so x's int8
 * error meets c - mid rather than c. Per half group of 16: y += (d sc) xd isum; Q4_K/Q5_K per
 * group + (mid d sc - dmin m) sum(x), on the exact fp32 sum of x. Against steps per 32 and
 * uncentred codes this cut the relative error of a Q4_K product from 0.94% to 0.52% (Gaussian
 * x; 1.8% to 0.83% with heavy-tailed channels), below the int4 path's int8 kernel (0.61%,
 * 1.1%), for one more multiply-add per 16 k of a row.
 * Any number of rows: 8 rows of x per pass over a block's records, which stay in L1/L2 for the
 * next 8. A row's result does not depend on M, the threads, or its place in the call (integer
 * sums are exact and every float step is per row).
 * The K-quants' decode batches take the fine product instead (kquant_gemm_fine_bf16, below the
 * many-row product): its float work is once per super-block, not per 16 k, 1.1-1.5x faster from
 * 2 rows to 16 on Zen 5. This kernel stays the legacy types' decode kernel (kquant_decode_bf16). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#if defined(__AVX512F__)
#include "vnni_common.h"
#endif

/* GGML type ids (gguf-py's GGMLQuantizationType) */
enum { KQ_Q4_0 = 2, KQ_Q5_0 = 6, KQ_Q8_0 = 8, KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14 };
#define QK 256
#define ROWS 16
#define GROUP 32
#define CHUNK 8 /* rows of x per pass over a block's records */
/* Bytes ahead of the one in use that a pass asks the memory system for: a forward streams every
 * matrix from DRAM, and the hardware prefetcher alone leaves the dot products waiting. They are
 * asked into L2, not L1 (prefetcht2: locality 1): L1's few fill buffers, taken by prefetcht0,
 * held a batch-1 stream of the 1B's records at 24 GB/s in 4 KiB pages, L2's more at 26 (2 AVX-512
 * cores reading at most 29.5; benchmarks/NOTES.md). A thread's first WARM_BYTES are asked for at
 * once, before its first dot product. */
#define PREFETCH_BYTES 4096
#define PREFETCH_LOCALITY 1
#define WARM_BYTES 8192
/* For up to STREAM_MAX_M rows of x a thread reads MAX_STREAMS runs of blocks at once, a record
 * of each in turn: one core keeps more lines in flight over several streams than over one (a
 * pure read of 816 MB on 2 cores: 25.8 GB/s as one stream a core, 30.4 as 2, 31.4 as 4). Each
 * stream asks STREAM_PREFETCH_BYTES ahead (benchmarks/NOTES.md, session 29). */
#define MAX_STREAMS 3
#define STREAM_MAX_M 2
#define STREAM_PREFETCH_BYTES 2048
/* Whether the streams are used: set once at load (bindings.py's read_streams). They were
 * measured faster on an Intel Xeon only; on AMD Zen 5 one stream a thread is faster (the 1B's
 * batch-1 forward 13.2 ms against 22.4). */
static int use_streams = 1;
void kquant_use_streams(int on) { use_streams = on; }

/* The legacy types (one fp16 step per block of 32 k, no integer scales) have a record per
 * 16 rows x 32 k: their rows need only be a multiple of 32 long (Qwen2.5-0.5B's 896 is why
 * llama-quantize gives a Q4_K_M file Q5_0 and Q8_0 matrices). */
static int is_legacy(int type) { return type == KQ_Q4_0 || type == KQ_Q5_0 || type == KQ_Q8_0; }

/* Bytes of one group's codes in a record; 0 for a type it lacks. */
static int64_t group_bytes(int type) {
    switch (type) {
    case KQ_Q4_0: case KQ_Q4_K: return 256;
    case KQ_Q5_0: case KQ_Q5_K: return 320;
    case KQ_Q6_K: return 384;
    case KQ_Q8_0: return 512;
    default: return 0;
    }
}

/* Groups of 32 k a record holds, and its header's bytes (K-quants: steps, scales, mins of a
 * super-block; legacy types: the 16 rows' fp16 steps). */
static int record_groups(int type) { return is_legacy(type) ? 1 : 8; }
static int64_t header_bytes(int type) { return is_legacy(type) ? 32 : 320; }

static int64_t record_bytes(int type) {
    const int64_t g = group_bytes(type);
    return g ? header_bytes(type) + record_groups(type) * g : -1;
}

/* k of one record: 256 for the K-quants, 32 for the legacy types. */
static int64_t record_k(int type) { return GROUP * record_groups(type); }

/* The record's code centre (the weight is step (c - mid), or, Q4_K/Q5_K, that plus an offset). */
static int code_mid(int type) {
    switch (type) {
    case KQ_Q4_0: case KQ_Q4_K: return 8;
    case KQ_Q5_0: case KQ_Q5_K: return 16;
    case KQ_Q6_K: return 32;
    default: return 128; /* Q8_0: int8 codes held as c + 128 */
    }
}

/* An IEEE half as a float, exactly (subnormals included). */
static float f32_from_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else if (exp) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else { /* zero or subnormal: man * 2^-24, exact in a float */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* File block sizes (ggml's block_q4_0, block_q5_0, block_q8_0, block_q4_K, block_q5_K,
 * block_q6_K). */
static int64_t block_bytes(int type) {
    switch (type) {
    case KQ_Q4_0: return 18;
    case KQ_Q5_0: return 22;
    case KQ_Q8_0: return 34;
    case KQ_Q4_K: return 144;
    case KQ_Q5_K: return 176;
    case KQ_Q6_K: return 210;
    default: return 0;
    }
}

/* One file super-block unpacked: codes, integer scales (and mins), fp16 steps. */
typedef struct {
    uint16_t d, dmin;
    uint8_t sc[16]; /* Q4_K/Q5_K: 8 per group of 32; Q6_K: 16 int8 per sub-block of 16 */
    uint8_t m[8];
    uint8_t q[QK];
} unpacked;

/* Q4_K/Q5_K's 6-bit scale and min of group j from the 12 packed bytes. */
static void scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static inline __attribute__((always_inline)) void unpack_block(int type, const uint8_t *b,
                                                               unpacked *o) {
    if (type == KQ_Q6_K) { /* ql[128] qh[64] scales[16] d */
        const uint8_t *ql = b, *qh = b + 128;
        memcpy(o->sc, b + 192, 16);
        memcpy(&o->d, b + 208, 2);
        o->dmin = 0;
        for (int n = 0; n < 2; n++, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                uint8_t *q = o->q + 128 * n + l;
                q[0] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                q[32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                q[64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                q[96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        return;
    }
    /* Q4_K: d dmin scales[12] qs[128]; Q5_K: d dmin scales[12] qh[32] qs[128] */
    memcpy(&o->d, b, 2);
    memcpy(&o->dmin, b + 2, 2);
    for (int j = 0; j < 8; j++) scale_min(j, b + 4, &o->sc[j], &o->m[j]);
    const uint8_t *qh = b + 16, *qs = b + (type == KQ_Q5_K ? 48 : 16);
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < 32; l++) {
            uint8_t lo = qs[32 * p + l] & 0xF, hi = qs[32 * p + l] >> 4;
            if (type == KQ_Q5_K) {
                lo |= (uint8_t)(((qh[l] >> (2 * p)) & 1) << 4);
                hi |= (uint8_t)(((qh[l] >> (2 * p + 1)) & 1) << 4);
            }
            o->q[64 * p + l] = lo, o->q[64 * p + 32 + l] = hi;
        }
}

/* A group's codes (q[i]: row i's 32 codes) into its record body (layout at the top). Inlined
 * into per-type copies of the repack (see kquant_repack): with the type a constant its branches
 * go, and a row's nibble pairs and high bits are joined 4 bytes at a time. The same bytes as
 * one byte at a time, 2.5-4.3x faster (one thread, 2048 x 2048, ms: Q4_K 1.5 -> 0.4, Q5_K
 * 2.7 -> 0.7, Q6_K 2.6 -> 0.6, Q4_0 2.5 -> 1.0, Q5_0 4.4 -> 2.1, Q8_0 1.4 -> 0.9). */
static inline __attribute__((always_inline)) void pack_group(int type, const uint8_t *const q[ROWS],
                                                             uint8_t *body) {
    if (type == KQ_Q8_0) { /* whole bytes: vector 2t k 8t+j, vector 2t+1 8t+4+j */
        for (int t = 0; t < 4; t++)
            for (int i = 0; i < ROWS; i++)
                for (int j = 0; j < 4; j++) {
                    body[64 * (2 * t) + 4 * i + j] = q[i][8 * t + j];
                    body[64 * (2 * t + 1) + 4 * i + j] = q[i][8 * t + 4 + j];
                }
        return;
    }
    for (int i = 0; i < ROWS; i++) {
        uint32_t high[2] = {0, 0}; /* the codes' bits above 4: Q5's one plane, Q6's two */
        for (int t = 0; t < 4; t++) {
            uint64_t c;
            memcpy(&c, q[i] + 8 * t, 8); /* little-endian: code 8t + j in byte j */
            const uint32_t lo = (uint32_t)c, hi = (uint32_t)(c >> 32); /* k 8t+j, 8t+4+j */
            const uint32_t nibbles = (lo & 0x0F0F0F0Fu) | (hi & 0x0F0F0F0Fu) << 4;
            memcpy(body + 64 * t + 4 * i, &nibbles, 4);
            if (type == KQ_Q5_K || type == KQ_Q5_0)
                high[0] |= ((lo >> 4) & 0x01010101u) << t | ((hi >> 4) & 0x01010101u) << (4 + t);
            else if (type == KQ_Q6_K)
                high[t / 2] |= ((lo >> 4) & 0x03030303u) << (4 * (t % 2)) |
                               ((hi >> 4) & 0x03030303u) << (4 * (t % 2) + 2);
        }
        if (type == KQ_Q5_K || type == KQ_Q5_0 || type == KQ_Q6_K)
            memcpy(body + 256 + 4 * i, &high[0], 4);
        if (type == KQ_Q6_K)
            memcpy(body + 256 + 64 + 4 * i, &high[1], 4);
    }
}

/* A legacy block (32 k of one row): its fp16 step and codes (Q8_0: c + 128, so 0..255). */
static inline __attribute__((always_inline)) void unpack_legacy(int type, const uint8_t *b,
                                                                uint16_t *d, uint8_t *q) {
    memcpy(d, b, 2);
    if (type == KQ_Q8_0) {
        for (int j = 0; j < GROUP; j++) q[j] = (uint8_t)((int8_t)b[2 + j] + 128);
        return;
    }
    uint32_t qh = 0;
    const uint8_t *qs = b + 2;
    if (type == KQ_Q5_0) memcpy(&qh, b + 2, 4), qs = b + 6;
    for (int j = 0; j < 16; j++) { /* ggml: k j from the low nibbles, j + 16 from the high */
        q[j] = (uint8_t)((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
        q[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
}

/* The legacy types' records: a header of the 16 rows' fp16 steps, then one group. */
static inline __attribute__((always_inline)) void repack_legacy(int type, const int64_t *rows,
                                                                int64_t n_out, int64_t n_rows,
                                                                int64_t k, uint8_t *records) {
    const int64_t rec = record_bytes(type), groups = k / GROUP;
    for (int64_t b = 0; b < n_rows / ROWS; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *r = records + (b * groups + g) * rec;
            uint8_t codes[ROWS][GROUP];
            const uint8_t *q[ROWS];
            memset(codes, type == KQ_Q8_0 ? 128 : 0, sizeof codes); /* padding rows: zero */
            for (int i = 0; i < ROWS; i++) {
                q[i] = codes[i];
                if (ROWS * b + i < n_out)
                    unpack_legacy(type, (const uint8_t *)rows[ROWS * b + i] + g * block_bytes(type),
                                  (uint16_t *)(void *)(r + 2 * i), codes[i]);
            }
            pack_group(type, q, r + header_bytes(type));
        }
}

/* kquant_repack's work for one type (inlined with the type a constant). */
static inline __attribute__((always_inline)) void repack(int type, const int64_t *rows,
                                                         int64_t n_out, int64_t n_rows, int64_t k,
                                                         uint8_t *records) {
    const int64_t gb = group_bytes(type), rec = record_bytes(type), sbs = k / QK;
    if (is_legacy(type)) {
        repack_legacy(type, rows, n_out, n_rows, k, records);
        return;
    }
    for (int64_t b = 0; b < n_rows / ROWS; b++)
        for (int64_t s = 0; s < sbs; s++) {
            uint8_t *r = records + (b * sbs + s) * rec;
            unpacked u[ROWS];
            memset(u, 0, sizeof u);
            for (int i = 0; i < ROWS && ROWS * b + i < n_out; i++)
                unpack_block(type, (const uint8_t *)rows[ROWS * b + i] + s * block_bytes(type),
                             &u[i]);
            for (int i = 0; i < ROWS; i++) {
                memcpy(r + 2 * i, &u[i].d, 2);
                if (type == KQ_Q6_K) {
                    for (int sub = 0; sub < 16; sub++) r[64 + 16 * sub + i] = u[i].sc[sub];
                } else {
                    memcpy(r + 32 + 2 * i, &u[i].dmin, 2);
                    for (int g = 0; g < 8; g++) {
                        r[64 + 16 * g + i] = u[i].sc[g];
                        r[192 + 16 * g + i] = u[i].m[g];
                    }
                }
            }
            for (int g = 0; g < 8; g++) {
                const uint8_t *q[ROWS];
                for (int i = 0; i < ROWS; i++) q[i] = u[i].q + GROUP * g;
                pack_group(type, q, r + header_bytes(type) + g * gb);
            }
        }
}

/* records: n_rows / 16 blocks x k / record_k records. rows[r]: the file bytes of weight row r
 * (k / record_k blocks) for r < n_out; rows n_out .. n_rows - 1 are zero weights. Returns 0, or
 * -1 for a shape or type it does not take. */
int kquant_repack(int type, const int64_t *rows, int64_t n_out, int64_t n_rows, int64_t k,
                  uint8_t *records) {
    if (!group_bytes(type) || k <= 0 || k % record_k(type) || n_rows % ROWS || n_out > n_rows ||
        n_out < 0)
        return -1;
    memset(records, 0, (size_t)(n_rows / ROWS * (k / record_k(type)) * record_bytes(type)));
    switch (type) { /* one copy of the repack per type, its branches folded away */
    case KQ_Q4_0: repack(KQ_Q4_0, rows, n_out, n_rows, k, records); break;
    case KQ_Q5_0: repack(KQ_Q5_0, rows, n_out, n_rows, k, records); break;
    case KQ_Q8_0: repack(KQ_Q8_0, rows, n_out, n_rows, k, records); break;
    case KQ_Q4_K: repack(KQ_Q4_K, rows, n_out, n_rows, k, records); break;
    case KQ_Q5_K: repack(KQ_Q5_K, rows, n_out, n_rows, k, records); break;
    default: repack(KQ_Q6_K, rows, n_out, n_rows, k, records); break;
    }
    return 0;
}

/* The code of row i (0..15 in its block) at k offset kk (0..record_k - 1) of a record. */
static int code_at(int type, const uint8_t *r, int i, int kk) {
    const int64_t gb = group_bytes(type);
    const int g = kk / GROUP, w = kk % GROUP, t = w / 8, high = (w % 8) >= 4, j = w % 4;
    const uint8_t *body = r + header_bytes(type) + g * gb;
    const int byte = 4 * i + j;
    if (type == KQ_Q8_0) return body[64 * (2 * t + high) + byte];
    int c = high ? body[64 * t + byte] >> 4 : body[64 * t + byte] & 0xF;
    if (type == KQ_Q5_K || type == KQ_Q5_0) c |= ((body[256 + byte] >> (t + 4 * high)) & 1) << 4;
    if (type == KQ_Q6_K) c |= ((body[256 + 64 * (t / 2) + byte] >> (4 * (t % 2) + 2 * high)) & 3)
                              << 4;
    return c;
}

/* out[i, :] = weight row ids[i] (fp32 [n, k]), in the order gguf-py's dequantization rounds:
 * (d sc) c - (dmin m), (d sc) (c - 32), or d (c - mid). Returns 0, or -1 for an id out of
 * range. */
int kquant_rows_f32(int type, const uint8_t *records, int64_t n_out, int64_t k,
                    const int64_t *ids, int64_t n, float *out) {
    const int64_t rec = record_bytes(type), rk = record_k(type), sbs = k / rk;
    if (rec < 0 || k <= 0 || k % rk) return -1;
    for (int64_t x = 0; x < n; x++)
        if (ids[x] < 0 || ids[x] >= n_out) return -1;
    for (int64_t x = 0; x < n; x++) {
        const int64_t b = ids[x] / ROWS;
        const int i = (int)(ids[x] % ROWS);
        for (int64_t s = 0; s < sbs; s++) {
            const uint8_t *r = records + (b * sbs + s) * rec;
            uint16_t dh, mh;
            memcpy(&dh, r + 2 * i, 2);
            memcpy(&mh, r + 32 + 2 * i, 2);
            const float d = f32_from_f16(dh);
            float *o = out + x * k + s * rk;
            for (int kk = 0; kk < rk; kk++) {
                const int c = code_at(type, r, i, kk);
                if (is_legacy(type)) {
                    o[kk] = d * (float)(c - code_mid(type));
                } else if (type == KQ_Q6_K) {
                    const float step = d * (float)(int8_t)r[64 + 16 * (kk / 16) + i];
                    o[kk] = step * (float)(c - 32);
                } else {
                    const float step = d * (float)r[64 + 16 * (kk / GROUP) + i];
                    const float min = f32_from_f16(mh) * (float)r[192 + 16 * (kk / GROUP) + i];
                    o[kk] = step * (float)c - min;
                }
            }
        }
    }
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
int kquant_available(void) { return 1; }

typedef struct {
    const uint8_t *records;
    const int8_t *xq;    /* [M, k] */
    const float *xd;     /* [M, k / 16] quantization steps */
    const float *xs;     /* [M, k / 32] fp32 sums of x */
    const int32_t *sq;   /* [M, k / 16] -mid x the sums of xq per 16: the centring's start */
    uint16_t *y;         /* [M, n_out] bf16 */
    int64_t n_out, k;
} job;

/* xq, xd (per 16), xs (per 32), sq (per 16: -mid sum xq) of bf16 x [M, k]. */
static void quantize_rows(const uint16_t *x, int64_t M, int64_t k, int mid, int8_t *xq,
                          float *xd, float *xs, int32_t *sq, int parallel) {
    const int64_t groups = k / GROUP;
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *p = x + m * k + g * GROUP;
            const __m512 a = f32x16_from_bf16(p), b = f32x16_from_bf16(p + 16);
            const float amax_a = _mm512_reduce_max_ps(_mm512_and_ps(a, abs_mask));
            const float amax_b = _mm512_reduce_max_ps(_mm512_and_ps(b, abs_mask));
            const int64_t i = m * groups + g;
            xd[2 * i] = amax_a / 127.0f;
            xd[2 * i + 1] = amax_b / 127.0f;
            xs[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
            const __m512 inv_a = _mm512_set1_ps(amax_a > 0.0f ? 127.0f / amax_a : 0.0f);
            const __m512 inv_b = _mm512_set1_ps(amax_b > 0.0f ? 127.0f / amax_b : 0.0f);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv_a)); /* |q| <= 127 */
            const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv_b));
            _mm_storeu_si128((__m128i *)(xq + m * k + g * GROUP), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(xq + m * k + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
            sq[2 * i] = -mid * _mm512_reduce_add_epi32(qa);
            sq[2 * i + 1] = -mid * _mm512_reduce_add_epi32(qb);
        }
}

/* sum over vectors t0 .. t1 - 1 of codes . x, in two chains below 3 rows (a lone row would
 * wait on vpdpbusd's latency). */
static inline __attribute__((always_inline)) __m512i dots(__m512i acc, const __m512i *c,
                                                          const int32_t *x4, int t0, int t1,
                                                          int M) {
    if (M < 3) {
        __m512i acc2 = _mm512_setzero_si512();
        for (int t = t0; t < t1; t += 2) {
            acc = dot_broadcast(acc, c[t], x4 + t);
            acc2 = dot_broadcast(acc2, c[t + 1], x4 + t + 1);
        }
        return _mm512_add_epi32(acc, acc2);
    }
    for (int t = t0; t < t1; t++) acc = dot_broadcast(acc, c[t], x4 + t);
    return acc;
}

/* Bits of h moved so that bit `from` of each byte lands on bit 4 (16-bit shifts: what crosses
 * from the other byte of a pair never reaches bits 4..5, which the caller keeps). */
static inline __m512i bits_to_4(__m512i h, int from) {
    return from <= 4 ? _mm512_slli_epi16(h, (unsigned)(4 - from))
                     : _mm512_srli_epi16(h, (unsigned)(from - 4));
}

/* A group's codes, whole: c[2t] byte (i, j) is row i's code at k 8t+j, c[2t+1] at 8t+4+j. */
static inline __attribute__((always_inline)) void group_codes(int type, const uint8_t *body,
                                                              __m512i *c) {
    if (type == KQ_Q8_0) {
        for (int q = 0; q < 8; q++) c[q] = _mm512_loadu_si512((const void *)(body + 64 * q));
        return;
    }
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m512i v = _mm512_loadu_si512((const void *)(body + 64 * t));
        c[2 * t] = _mm512_and_si512(v, nib);
        c[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    if (type == KQ_Q5_K || type == KQ_Q5_0) {
        const __m512i h = _mm512_loadu_si512((const void *)(body + 256));
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        for (int t = 0; t < 4; t++) {
            c[2 * t] = _mm512_or_si512(c[2 * t], _mm512_and_si512(bits_to_4(h, t), bit4));
            c[2 * t + 1] = _mm512_or_si512(c[2 * t + 1],
                                           _mm512_and_si512(bits_to_4(h, 4 + t), bit4));
        }
    } else if (type == KQ_Q6_K) {
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        for (int t = 0; t < 4; t++) {
            const __m512i h = _mm512_loadu_si512((const void *)(body + 256 + 64 * (t / 2)));
            const int at = 4 * (t % 2);
            c[2 * t] = _mm512_or_si512(c[2 * t], _mm512_and_si512(bits_to_4(h, at), bits45));
            c[2 * t + 1] = _mm512_or_si512(c[2 * t + 1],
                                           _mm512_and_si512(bits_to_4(h, at + 2), bits45));
        }
    }
}

/* Record r's 16 fp16 min steps dmin (Q4_K/Q5_K; zero for the types without mins). */
static inline __m512 record_dmin(int type, const uint8_t *r) {
    return type == KQ_Q4_K || type == KQ_Q5_K
               ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 32)))
               : _mm512_setzero_ps();
}

/* Group g's steps from record r's header: s[0] for k 0..15, s[1] for 16..31 (Q4_K/Q5_K one
 * d sc for both; Q6_K d sc per sub-block of 16), *mn the min term dmin m (zero for Q6_K), and the
 * code centre returned: w = s (c - mid) + (mid s - mn) for Q4_K/Q5_K, s (c - 32) for Q6_K. */
static inline __attribute__((always_inline)) int group_steps(int type, const uint8_t *r,
                                                             __m512 d, __m512 dmin, int g,
                                                             __m512 *s, __m512 *mn) {
    if (is_legacy(type)) { /* the record's one group: w = d (c - mid) */
        s[0] = s[1] = d;
        *mn = _mm512_setzero_ps();
        return code_mid(type);
    }
    if (type == KQ_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const __m128i sc = _mm_loadu_si128((const __m128i *)(r + 64 + 16 * (2 * g + h)));
            s[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        }
        *mn = _mm512_setzero_ps();
        return code_mid(type);
    }
    s[0] = s[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                       _mm_loadu_si128((const __m128i *)(r + 64 + 16 * g)))));
    *mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                  _mm_loadu_si128((const __m128i *)(r + 192 + 16 * g)))));
    return code_mid(type);
}

/* Blocks b, b + gap, ... (S of them, 16 weight rows each) for M (<= CHUNK) rows of x, their
 * records taken in turns: S streams from memory at once (S, M and type constants in each copy). */
static inline __attribute__((always_inline)) void run_blocks(const job *j, int64_t b, int64_t gap,
                                                             int S, int M, int type) {
    const int rg = record_groups(type);
    const int64_t sbs = j->k / record_k(type), gb = group_bytes(type), rec = record_bytes(type);
    const int64_t groups = j->k / GROUP;
    __m512 ys[MAX_STREAMS][CHUNK];
    for (int t = 0; t < S; t++)
        for (int m = 0; m < M; m++) ys[t][m] = _mm512_setzero_ps();
    for (int64_t s = 0; s < sbs; s++)
    for (int t = 0; t < S; t++) {
        const uint8_t *r = j->records + ((b + t * gap) * sbs + s) * rec;
        __m512 *y = ys[t];
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
        const __m512 dmin = record_dmin(type, r);
        for (int g = 0; g < rg; g++) {
            const uint8_t *body = r + header_bytes(type) + g * gb;
            for (int l = 0; l < gb; l += 64)
                __builtin_prefetch(body + (S == 1 ? PREFETCH_BYTES : STREAM_PREFETCH_BYTES) + l, 0,
                                   PREFETCH_LOCALITY);
            __m512i c[8];
            group_codes(type, body, c);
            const int64_t gi = s * rg + g; /* the group's index along k */
            __m512 step[2], mn;
            const int mid = group_steps(type, r, d, dmin, g, step, &mn);
            /* Q4_K/Q5_K: w = s (c - mid) + (mid s - mn), so x's int8 error meets centred codes
             * and the rest is taken on the exact sum of x */
            const __m512 offset = _mm512_fmsub_ps(_mm512_set1_ps((float)mid), step[0], mn);
            for (int m = 0; m < M; m++) {
                const int64_t i = m * groups + gi;
                const int32_t *x4 = (const int32_t *)(j->xq + m * j->k + gi * GROUP);
                /* sum (c - mid) xq per half: the dots on top of -mid sum xq */
                const __m512i a0 = dots(_mm512_set1_epi32(j->sq[2 * i]), c, x4, 0, 4, M);
                const __m512i a1 = dots(_mm512_set1_epi32(j->sq[2 * i + 1]), c, x4, 4, 8, M);
                const __m512 f0 = _mm512_cvtepi32_ps(a0), f1 = _mm512_cvtepi32_ps(a1);
                if (type == KQ_Q6_K) { /* a step per half */
                    y[m] = _mm512_fmadd_ps(f0, _mm512_mul_ps(step[0], _mm512_set1_ps(j->xd[2 * i])),
                                           y[m]);
                    y[m] = _mm512_fmadd_ps(f1, _mm512_mul_ps(step[1],
                                                             _mm512_set1_ps(j->xd[2 * i + 1])),
                                           y[m]);
                    continue;
                }
                /* one step for the group: y += s (xd0 a0 + xd1 a1), fewer vector operations
                 * than scaling each half (what bounds the kernel from 8 rows of x) */
                const __m512 t = _mm512_fmadd_ps(f0, _mm512_set1_ps(j->xd[2 * i]),
                                                 _mm512_mul_ps(f1, _mm512_set1_ps(j->xd[2 * i + 1])));
                y[m] = _mm512_fmadd_ps(t, step[0], y[m]);
                if (type == KQ_Q4_K || type == KQ_Q5_K)
                    y[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(j->xs[i]), y[m]);
            }
        }
    }
    for (int t = 0; t < S; t++) {
        const int64_t row0 = ROWS * (b + t * gap);
        const __mmask16 keep = row0 + ROWS <= j->n_out ? 0xffff
                               : (__mmask16)((1u << (j->n_out > row0 ? j->n_out - row0 : 0)) - 1);
        for (int m = 0; m < M; m++)
            _mm256_mask_storeu_epi16(j->y + m * j->n_out + row0, keep,
                                     (__m256i)_mm512_cvtneps_pbh(ys[t][m]));
    }
}

#define ROWS_CASES(S, T)                                                                       \
    switch (M) {                                                                               \
    case 1: run_blocks(j, b, gap, S, 1, T); break;                                             \
    case 2: run_blocks(j, b, gap, S, 2, T); break;                                             \
    case 3: run_blocks(j, b, gap, S, 3, T); break;                                             \
    case 4: run_blocks(j, b, gap, S, 4, T); break;                                             \
    case 5: run_blocks(j, b, gap, S, 5, T); break;                                             \
    case 6: run_blocks(j, b, gap, S, 6, T); break;                                             \
    case 7: run_blocks(j, b, gap, S, 7, T); break;                                             \
    default: run_blocks(j, b, gap, S, 8, T); break;                                            \
    }
/* Streams take only the few rows of x that leave a thread waiting on memory (decode). */
#define STREAM_CASES(T)                                                                        \
    if (S == 1) ROWS_CASES(1, T)                                                               \
    else if (M == 1) run_blocks(j, b, gap, MAX_STREAMS, 1, T);                                 \
    else run_blocks(j, b, gap, MAX_STREAMS, 2, T);

static void run_q4(const job *j, int64_t b, int64_t gap, int S, int M) { STREAM_CASES(KQ_Q4_K) }
static void run_q5(const job *j, int64_t b, int64_t gap, int S, int M) { STREAM_CASES(KQ_Q5_K) }
static void run_q6(const job *j, int64_t b, int64_t gap, int S, int M) { STREAM_CASES(KQ_Q6_K) }
static void run_q4_0(const job *j, int64_t b, int64_t gap, int S, int M) { STREAM_CASES(KQ_Q4_0) }
static void run_q5_0(const job *j, int64_t b, int64_t gap, int S, int M) { STREAM_CASES(KQ_Q5_0) }
static void run_q8_0(const job *j, int64_t b, int64_t gap, int S, int M) { STREAM_CASES(KQ_Q8_0) }

/* Runs S blocks (b, b + gap, ...) for M rows of x; S is 1 or MAX_STREAMS (then M <= 2). */
typedef void (*block_runner)(const job *, int64_t, int64_t, int, int);

/* The S blocks b, b + gap, ... for all M rows of x, CHUNK rows at a time. */
static void run_chunks(block_runner run, const job *whole, int64_t M, int64_t b, int64_t gap,
                       int S) {
    const int64_t k = whole->k, groups = k / GROUP;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        const job part = {whole->records, whole->xq + m0 * k, whole->xd + 2 * m0 * groups,
                          whole->xs + m0 * groups, whole->sq + 2 * m0 * groups,
                          whole->y + m0 * whole->n_out, whole->n_out, k};
        run(&part, b, gap, S, (int)(M - m0 < CHUNK ? M - m0 : CHUNK));
    }
}

static block_runner runner_of(int type) {
    switch (type) {
    case KQ_Q4_0: return run_q4_0;
    case KQ_Q5_0: return run_q5_0;
    case KQ_Q8_0: return run_q8_0;
    case KQ_Q4_K: return run_q4;
    case KQ_Q5_K: return run_q5;
    case KQ_Q6_K: return run_q6;
    default: return NULL;
    }
}

/* y[M, n_out] bf16 = x[M, k] bf16 @ W^T over `records` (n_rows / 16 blocks), any M >= 1.
 * Above parallel_work multiply-adds (n_rows k M) the blocks are split over OpenMP threads.
 * Returns 0, or -1 for what it does not take (nothing written). */
int kquant_matmul_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                       int64_t k, int64_t parallel_work, const uint16_t *x, uint16_t *y,
                       int64_t M) {
    const block_runner run = runner_of(type);
    if (!run || M < 1 || k <= 0 || k % record_k(type) || n_rows % ROWS || n_out > n_rows)
        return -1;
    const int64_t groups = k / GROUP;
    int8_t *xq = malloc((size_t)(M * k) + sizeof(float) * 5 * (size_t)(M * groups));
    if (!xq) return -1;
    /* the floats after the int8 rows: M k is a multiple of 32, so they are aligned */
    float *xd = (float *)(xq + M * k), *xs = xd + 2 * M * groups;
    int32_t *sq = (int32_t *)(xs + M * groups);
    const int parallel = n_rows * k * M > parallel_work;
    quantize_rows(x, M, k, code_mid(type), xq, xd, xs, sq, parallel && M > 1);
    const int64_t blocks = (n_out + ROWS - 1) / ROWS;
    const int64_t block_stride = k / record_k(type) * record_bytes(type);
    const job whole = {records, xq, xd, xs, sq, y, n_out, k};
#pragma omp parallel if (parallel)
    { /* a thread's blocks are one run of the records, read front to back as `streams` runs */
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        const int streams =
            use_streams && M <= STREAM_MAX_M && b1 - b0 >= MAX_STREAMS ? MAX_STREAMS : 1;
        const int64_t gap = (b1 - b0) / streams; /* the streams' blocks b0 + i + gap s */
        const int64_t warm = gap * block_stride < WARM_BYTES ? gap * block_stride : WARM_BYTES;
        for (int s = 0; s < streams; s++)
            for (int64_t l = 0; l < warm; l += 64)
                __builtin_prefetch(records + (b0 + s * gap) * block_stride + l, 0,
                                   PREFETCH_LOCALITY);
        for (int64_t i = 0; i < gap; i++) run_chunks(run, &whole, M, b0 + i, gap, streams);
        for (int64_t b = b0 + streams * gap; b < b1; b++) /* what the streams left over */
            run_chunks(run, &whole, M, b, 0, 1);
    }
    free(xq);
    return 0;
}
/* A group's codes and the steps that make them weights, for dequantizing it. */
typedef struct {
    __m512i c[8];              /* group_codes */
    __m512 scale[2], offset[2]; /* per half group: w = scale c + offset */
} group_weights;

static inline __attribute__((always_inline)) void group_weights_of(int type, const uint8_t *r,
                                                                   int g, __m512 d, __m512 dmin,
                                                                   group_weights *gw) {
    group_codes(type, r + header_bytes(type) + g * group_bytes(type), gw->c);
    __m512 mn;
    const int mid = group_steps(type, r, d, dmin, g, gw->scale, &mn);
    for (int h = 0; h < 2; h++) /* w = s c - mn, or s c - mid s (exact: mid a power of 2) */
        gw->offset[h] = type == KQ_Q4_K || type == KQ_Q5_K
                            ? _mm512_sub_ps(_mm512_setzero_ps(), mn)
                            : _mm512_mul_ps(_mm512_set1_ps(-(float)mid), gw->scale[h]);
}

/* The 16 rows' weights (fp32) at k 8 (q / 2) + 4 (q % 2) + jj of the group: byte jj of c[q]. */
static inline __attribute__((always_inline)) __m512 weight_at(const group_weights *gw, int q,
                                                              int jj) {
    const __m512 code = _mm512_cvtepi32_ps(_mm512_and_si512(
        _mm512_srli_epi32(gw->c[q], (unsigned)(8 * jj)), _mm512_set1_epi32(0xFF)));
    return _mm512_fmadd_ps(code, gw->scale[q / 4], gw->offset[q / 4]);
}

/* Super-block s of block b into wt (bf16 [k, n_out], k-major: rows k 256 s .. 256 s + 255 of
 * the transposed weight, columns 16 b .. 16 b + 15, the last block's cut to n_out). */
static inline __attribute__((always_inline)) void
dequantize_record(int type, const uint8_t *records, int64_t b, int64_t s, int64_t k, int64_t n_out,
                  uint16_t *wt) {
    const int rg = record_groups(type);
    const int64_t sbs = k / record_k(type), rec = record_bytes(type);
    const int64_t row0 = ROWS * b;
    const __mmask16 keep = row0 + ROWS <= n_out ? 0xffff
                           : (__mmask16)((1u << (n_out > row0 ? n_out - row0 : 0)) - 1);
    const uint8_t *r = records + (b * sbs + s) * rec;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
    const __m512 dmin = record_dmin(type, r);
    for (int g = 0; g < rg; g++) {
        group_weights gw;
        group_weights_of(type, r, g, d, dmin, &gw);
        const int64_t k0 = (s * rg + g) * GROUP;
        for (int q = 0; q < 8; q++)
            for (int jj = 0; jj < 4; jj++) {
                const int64_t kk = 8 * (q / 2) + 4 * (q % 2) + jj; /* 16 k per half */
                _mm256_mask_storeu_epi16(wt + (k0 + kk) * n_out + row0, keep,
                                         (__m256i)_mm512_cvtneps_pbh(weight_at(&gw, q, jj)));
            }
    }
}

/* wt = W^T as bf16 [k, n_out] (the k-major weight a GEMM of many rows of x takes). Returns 0,
 * or -1 for what it does not take. */
int kquant_dequantize_t_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                             int64_t k, uint16_t *wt) {
    if (!group_bytes(type) || k <= 0 || k % record_k(type) || n_rows % ROWS || n_out > n_rows)
        return -1;
    const int64_t blocks = (n_out + ROWS - 1) / ROWS, sbs = k / record_k(type);
    /* Each thread a range of blocks (columns), super-block by super-block: the rows of wt it
     * writes meanwhile (256 x its columns) stay in cache until whole lines are written. */
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        for (int64_t s = 0; s < sbs; s++)
            for (int64_t b = b0; b < b1; b++) switch (type) {
                case KQ_Q4_0: dequantize_record(KQ_Q4_0, records, b, s, k, n_out, wt); break;
                case KQ_Q5_0: dequantize_record(KQ_Q5_0, records, b, s, k, n_out, wt); break;
                case KQ_Q8_0: dequantize_record(KQ_Q8_0, records, b, s, k, n_out, wt); break;
                case KQ_Q4_K: dequantize_record(KQ_Q4_K, records, b, s, k, n_out, wt); break;
                case KQ_Q5_K: dequantize_record(KQ_Q5_K, records, b, s, k, n_out, wt); break;
                default: dequantize_record(KQ_Q6_K, records, b, s, k, n_out, wt); break;
                }
    }
    return 0;
}
/* ---- The many-row product (prefill chunks): kquant_gemm_bf16 ----
 * Above a few dozen rows the per-16 scaling above costs more than the dot products (~10 vector
 * operations beside 8 vpdpbusd per row of x and group of 32), so for many rows each row of x is
 * quantized per super-block of 256 k instead (one step, as llama.cpp's Q8_K), and a super-block's
 * sums stay in int32 across its groups:
 *   isum = sum_g sc_g sum_k c xq        (vpmulld by the group's integer scale)
 *   osum = sum_g o_g sum_k xq           (vpdpwssd on int16 pairs: two groups an instruction)
 *   y   += xd (d isum - e osum)         (once per super-block)
 * with o, e = m, dmin for Q4_K/Q5_K (w = d sc c - dmin m) and sc, 32 d for Q6_K (w = d sc (c - 32),
 * sc per sub-block of 16). The legacy types (a float step per 32 k of a weight row) take x per
 * 32 (as llama.cpp's Q8_0): y += (d xd) sum (c - mid) xq per group, the dots started from
 * -mid sum xq. Integer sums are exact (|isum| < 2^28), so a row's result is the same whatever the
 * call's rows, tiles or threads. Tiles of GEMM_TILE rows of x run against one 16-row block's
 * records, k in runs of GEMM_RUN_K (the run's records stay in L1 while every tile of GEMM_CHUNK
 * rows passes over them), with fp32 partial sums per thread. A thread takes up to
 * GEMM_STORE_BLOCKS adjacent blocks at once and stores their columns together: a block alone
 * writes 32 bytes into each of the chunk's rows of y, a row (and a 4 KiB page, a TLB miss) apart,
 * which took 9% of a 1B's 8192 x 2048 product on Zen 5; 4 blocks write whole lines.
 *
 * The fine product (decode batches of the K-quants): the same loop, x in finer steps. A step per
 * 256 k is set by the super-block's largest |x|, so where x has an outlier channel every other
 * value of the super-block keeps only a few levels. Each group of 32 takes instead the finest step
 * D / 2^sh, sh <= FINE_SHIFT, that its own largest |x| fits in 127 of (D the super-block's step);
 * its integer sum is shifted left by FINE_SHIFT - sh into the finest step's units before the
 * group's scale multiplies it, and the sums of xq (the mins' and Q6_K's offsets) are held in the
 * same units. One vpsllvd per row and group. Bounds with FINE_SHIFT 3: Q6_K's |isum| < 16 halves
 * x 16 x 63 x 127 x 128 x 8 < 2^31, the sums of xq per 32 < 32 x 127 x 8 < 2^15 (int16). With one
 * channel in 256 at 50 times the rest, the rms error against the exact product was 0.039 against
 * the per-16 kernel's 0.025-0.027 and the per-256 step's 0.101 (tests/test_kquant.py). It costs
 * 8-17% over the plain product's time at 16-128 rows where the records are in cache.
 *
 * Both products: the first tile of a run asks for the records' bytes PREFETCH_BYTES ahead (as
 * the per-16 kernel), since they come from memory once per chunk. Without it, on a 78 MB Q4_K
 * matrix, the product ran at half the per-16 kernel's speed at 4-8 rows, and 26.2 against 28.6 ms
 * at 128 rows, 7.1 against 9.8 at 32. */
#define GEMM_TILE 8
#define GEMM_RUN_K 2048
#define GEMM_CHUNK 256
#define GEMM_STORE_BLOCKS 4
#define FINE_SHIFT 3 /* groups' steps down to 1/8 of their super-block's */

/* acc += a . b per pair of int16 in each 32-bit lane, b the int32 at p broadcast (vpdpwssd's
 * memory operand, as dot_broadcast). */
static inline __m512i dot16_broadcast(__m512i acc, __m512i a, const int32_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
    return acc;
}

typedef struct {
    const uint8_t *records;
    const int8_t *xq;   /* [M, k] */
    const float *xd;    /* [M, k / 256] steps (legacy types: [M, k / 32]) */
    const int16_t *xs;  /* [M, k / 16] (Q6_K) or [M, k / 32]: sums of xq (fine: shifted) */
    const int32_t *sq;  /* legacy types: [M, k / 32], -mid sum xq */
    const int32_t *xl;  /* fine: [M, k / 32], each group's left shift (0..FINE_SHIFT) */
    int64_t k, sums;    /* sums: the xs per row */
    int ahead;          /* ask for the records' bytes PREFETCH_BYTES ahead (a run's first tile) */
} gemm_job;

/* One super-block of x (256 k at p) in fine steps: the super-block's step D = max|x| / 127,
 * and for each group of 32 the finest D / 2^sh (sh <= FINE_SHIFT) its largest |x| fits in 127
 * of: q = rint(x 2^sh 127 / max|x|), shift[g] = FINE_SHIFT - sh, sums16 the codes' sums per 16.
 * Returns D / 2^FINE_SHIFT, the unit every shifted sum is in. */
static inline float quantize_fine(const uint16_t *p, int8_t *q, int32_t *sums16,
                                  int32_t *shift) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 v[16];
    float amax[16], top = 0.0f;
    for (int u = 0; u < 16; u++) {
        v[u] = f32x16_from_bf16(p + 16 * u);
        amax[u] = _mm512_reduce_max_ps(_mm512_and_ps(v[u], abs_mask));
        top = amax[u] > top ? amax[u] : top;
    }
    const float inv = top > 0.0f ? 127.0f / top : 0.0f;
    for (int g = 0; g < 8; g++) {
        const float group_max = amax[2 * g] > amax[2 * g + 1] ? amax[2 * g] : amax[2 * g + 1];
        int sh = 0;
        while (sh < FINE_SHIFT && group_max * (float)(2 << sh) <= top) sh++;
        const __m512 scale = _mm512_set1_ps(inv * (float)(1 << sh)); /* exact: a power of 2 */
        for (int u = 2 * g; u < 2 * g + 2; u++) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[u], scale)); /* |c| <= 127 */
            _mm_storeu_si128((__m128i *)(q + 16 * u), _mm512_cvtsepi32_epi8(c));
            sums16[u] = _mm512_reduce_add_epi32(c);
        }
        shift[g] = FINE_SHIFT - sh;
    }
    return top / 127.0f / (float)(1 << FINE_SHIFT);
}

/* x rows quantized per 256 k: xq, xd, and the sums of xq per `per` k (16 or 32) into xs; with
 * xl, in fine steps (quantize_fine: xl the groups' shifts, xs the sums shifted). */
static void quantize_rows_256(const uint16_t *x, int64_t M, int64_t k, int per, int8_t *xq,
                              float *xd, int16_t *xs, int32_t *xl) {
    const int64_t sbs = k / QK;
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++)
        for (int64_t s = 0; s < sbs; s++) {
            int32_t sum16[16], shift[8] = {0};
            const uint16_t *p = x + m * k + s * QK;
            int8_t *q = xq + m * k + s * QK;
            if (xl) {
                xd[m * sbs + s] = quantize_fine(p, q, sum16, shift);
                memcpy(xl + m * (k / GROUP) + s * 8, shift, sizeof(shift));
            } else {
                xd[m * sbs + s] = quantize_int8(p, 16, q, sum16);
            }
            int16_t *o = xs + m * (k / per) + s * (QK / per);
            for (int u = 0; u < 16; u += per / 16) /* per 16, or pairs of them */
                o[u * 16 / per] = (int16_t)((per == 16 ? sum16[u] : sum16[u] + sum16[u + 1])
                                            << shift[u / 2]);
        }
}

/* x rows quantized per 32 k for the legacy types: xq, xd, and sq = -mid sum xq per 32. */
static void quantize_rows_32(const uint16_t *x, int64_t M, int64_t k, int mid, int8_t *xq,
                             float *xd, int32_t *sq) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            int32_t sums[2];
            xd[m * groups + g] = quantize_int8(x + m * k + g * GROUP, 2, xq + m * k + g * GROUP,
                                               sums);
            sq[m * groups + g] = -mid * (sums[0] + sums[1]);
        }
}

/* Legacy record r (group g along k) against rows m0 .. m0 + T - 1 of x: y[m] += their part. */
static inline __attribute__((always_inline)) void gemm_legacy_record(const gemm_job *j,
                                                                     const uint8_t *r, int64_t g,
                                                                     int64_t m0, int T, int type,
                                                                     __m512 *y) {
    const int64_t k = j->k, groups = k / GROUP;
    __m512i c[8];
    group_codes(type, r + header_bytes(type), c);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
    for (int m = 0; m < T; m++) {
        const int64_t i = (m0 + m) * groups + g;
        const int32_t *x4 = (const int32_t *)(j->xq + (m0 + m) * k + g * GROUP);
        __m512i a = _mm512_set1_epi32(j->sq[i]), a2 = _mm512_setzero_si512();
        for (int q = 0; q < 8; q += 2) { /* two chains: vpdpbusd's latency */
            a = dot_broadcast(a, c[q], x4 + q);
            a2 = dot_broadcast(a2, c[q + 1], x4 + q + 1);
        }
        a = _mm512_add_epi32(a, a2);
        y[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(d, _mm512_set1_ps(j->xd[i])),
                               y[m]);
    }
}

/* Record r (super-block s) against rows m0 .. m0 + T - 1 of x: y[m] += their part of the
 * product for the record's 16 weight rows. T and type constants in each copy. */
static inline __attribute__((always_inline)) void gemm_record(const gemm_job *j, const uint8_t *r,
                                                              int64_t s, int64_t m0, int T,
                                                              int type, int fine, __m512 *y) {
    const int64_t gb = group_bytes(type), k = j->k, groups = k / GROUP;
    __m512i isum[GEMM_TILE];
    for (int m = 0; m < T; m++) isum[m] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) {
        const uint8_t *body = r + header_bytes(type) + g * gb;
        if (j->ahead) /* the run's records come from memory: ask ahead, as the per-16 kernel */
            for (int l = 0; l < gb; l += 64)
                __builtin_prefetch(body + PREFETCH_BYTES + l, 0, PREFETCH_LOCALITY);
        __m512i c[8];
        group_codes(type, body, c);
        if (type == KQ_Q6_K) { /* an integer scale per half group (16 k) */
            const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + 64 + 32 * g)));
            const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + 80 + 32 * g)));
            for (int m = 0; m < T; m++) {
                const int32_t *x4 = (const int32_t *)(j->xq + (m0 + m) * k + s * QK + g * GROUP);
                __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
                for (int q = 0; q < 4; q++) a0 = dot_broadcast(a0, c[q], x4 + q);
                for (int q = 4; q < 8; q++) a1 = dot_broadcast(a1, c[q], x4 + q);
                __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(a0, s0), _mm512_mullo_epi32(a1, s1));
                if (fine) /* into the super-block's finest step */
                    t = _mm512_sllv_epi32(t, _mm512_set1_epi32(j->xl[(m0 + m) * groups + s * 8 + g]));
                isum[m] = _mm512_add_epi32(isum[m], t);
            }
        } else {
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r + 64 + 16 * g)));
            for (int m = 0; m < T; m++) {
                const int32_t *x4 = (const int32_t *)(j->xq + (m0 + m) * k + s * QK + g * GROUP);
                __m512i a = _mm512_setzero_si512(), a2 = _mm512_setzero_si512();
                for (int q = 0; q < 8; q += 2) { /* two chains: vpdpbusd's latency */
                    a = dot_broadcast(a, c[q], x4 + q);
                    a2 = dot_broadcast(a2, c[q + 1], x4 + q + 1);
                }
                a = _mm512_add_epi32(a, a2);
                if (fine) /* into the super-block's finest step */
                    a = _mm512_sllv_epi32(a, _mm512_set1_epi32(j->xl[(m0 + m) * groups + s * 8 + g]));
                isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(a, sc));
            }
        }
    }
    /* the offsets' multipliers as int16 pairs: lane i (o_2p, o_2p+1) of weight row i */
    const int pairs = type == KQ_Q6_K ? 8 : 4;
    __m512i o[8];
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    for (int p = 0; p < pairs; p++) {
        const uint8_t *at = r + (type == KQ_Q6_K ? 64 : 192) + 32 * p;
        const __m128i lo = _mm_loadu_si128((const __m128i *)at);
        const __m128i hi = _mm_loadu_si128((const __m128i *)(at + 16));
        o[p] = type == KQ_Q6_K
                   ? _mm512_or_si512(_mm512_and_si512(_mm512_cvtepi8_epi32(lo), low16),
                                     _mm512_slli_epi32(_mm512_cvtepi8_epi32(hi), 16))
                   : _mm512_or_si512(_mm512_cvtepu8_epi32(lo),
                                     _mm512_slli_epi32(_mm512_cvtepu8_epi32(hi), 16));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
    const __m512 e = type == KQ_Q6_K ? _mm512_mul_ps(d, _mm512_set1_ps(32.0f)) : record_dmin(type, r);
    const int64_t sbs = k / QK;
    for (int m = 0; m < T; m++) {
        const int32_t *xs2 = (const int32_t *)(j->xs + (m0 + m) * j->sums + s * 2 * pairs);
        __m512i osum = _mm512_setzero_si512();
        for (int p = 0; p < pairs; p++) osum = dot16_broadcast(osum, o[p], xs2 + p);
        const __m512 t = _mm512_fnmadd_ps(e, _mm512_cvtepi32_ps(osum),
                                          _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[m])));
        y[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(j->xd[(m0 + m) * sbs + s]), y[m]);
    }
}

/* Records s0 .. s1 - 1 of block b against rows m0 .. m0 + T - 1: acc[m] (fp32, 16 weight rows)
 * += their part. */
static inline __attribute__((always_inline)) void gemm_tile(const gemm_job *j, int64_t b,
                                                            int64_t s0, int64_t s1, int64_t m0,
                                                            int T, int type, int fine,
                                                            float *acc) {
    const int64_t sbs = j->k / record_k(type), rec = record_bytes(type);
    __m512 y[GEMM_TILE];
    for (int m = 0; m < T; m++) y[m] = _mm512_loadu_ps(acc + 16 * m);
    for (int64_t s = s0; s < s1; s++)
        if (is_legacy(type))
            gemm_legacy_record(j, j->records + (b * sbs + s) * rec, s, m0, T, type, y);
        else
            gemm_record(j, j->records + (b * sbs + s) * rec, s, m0, T, type, fine, y);
    for (int m = 0; m < T; m++) _mm512_storeu_ps(acc + 16 * m, y[m]);
}

#define GEMM_TILE_CASES(TYPE, FINE)                                                            \
    switch (T) {                                                                               \
    case 1: gemm_tile(j, b, s0, s1, m0, 1, TYPE, FINE, acc); break;                            \
    case 2: gemm_tile(j, b, s0, s1, m0, 2, TYPE, FINE, acc); break;                            \
    case 3: gemm_tile(j, b, s0, s1, m0, 3, TYPE, FINE, acc); break;                            \
    case 4: gemm_tile(j, b, s0, s1, m0, 4, TYPE, FINE, acc); break;                            \
    case 5: gemm_tile(j, b, s0, s1, m0, 5, TYPE, FINE, acc); break;                            \
    case 6: gemm_tile(j, b, s0, s1, m0, 6, TYPE, FINE, acc); break;                            \
    case 7: gemm_tile(j, b, s0, s1, m0, 7, TYPE, FINE, acc); break;                            \
    default: gemm_tile(j, b, s0, s1, m0, GEMM_TILE, TYPE, FINE, acc); break;                   \
    }

typedef void (*gemm_runner)(const gemm_job *, int64_t, int64_t, int64_t, int64_t, int, float *);
static void gemm_q4(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0, int T,
                    float *acc) { GEMM_TILE_CASES(KQ_Q4_K, 0) }
static void gemm_q5(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0, int T,
                    float *acc) { GEMM_TILE_CASES(KQ_Q5_K, 0) }
static void gemm_q6(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0, int T,
                    float *acc) { GEMM_TILE_CASES(KQ_Q6_K, 0) }
static void gemm_q4_0(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0, int T,
                      float *acc) { GEMM_TILE_CASES(KQ_Q4_0, 0) }
static void gemm_q5_0(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0, int T,
                      float *acc) { GEMM_TILE_CASES(KQ_Q5_0, 0) }
static void gemm_q8_0(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0, int T,
                      float *acc) { GEMM_TILE_CASES(KQ_Q8_0, 0) }

static void gemm_q4_fine(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0,
                         int T, float *acc) { GEMM_TILE_CASES(KQ_Q4_K, 1) }
static void gemm_q5_fine(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0,
                         int T, float *acc) { GEMM_TILE_CASES(KQ_Q5_K, 1) }
static void gemm_q6_fine(const gemm_job *j, int64_t b, int64_t s0, int64_t s1, int64_t m0,
                         int T, float *acc) { GEMM_TILE_CASES(KQ_Q6_K, 1) }

static gemm_runner gemm_runner_of(int type, int fine) {
    if (fine) switch (type) {
        case KQ_Q4_K: return gemm_q4_fine;
        case KQ_Q5_K: return gemm_q5_fine;
        case KQ_Q6_K: return gemm_q6_fine;
        default: return NULL;
        }
    switch (type) {
    case KQ_Q4_0: return gemm_q4_0;
    case KQ_Q5_0: return gemm_q5_0;
    case KQ_Q8_0: return gemm_q8_0;
    case KQ_Q4_K: return gemm_q4;
    case KQ_Q5_K: return gemm_q5;
    case KQ_Q6_K: return gemm_q6;
    default: return NULL;
    }
}

/* y[M, n_out] bf16 = x[M, k] bf16 @ W^T over the records of any type, x quantized per 256 k
 * (K-quants; with `fine`, in the fine steps of quantize_fine) or per 32 (legacy types; above),
 * on OpenMP threads where `parallel`. Returns 0, or -1 for what it does not take (nothing
 * written). */
static int records_product(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                           int64_t k, const uint16_t *x, uint16_t *y, int64_t M, int fine,
                           int parallel) {
    const gemm_runner run = gemm_runner_of(type, fine);
    if (!run || M < 1 || k <= 0 || k % record_k(type) || n_rows % ROWS || n_out > n_rows)
        return -1;
    const int legacy = is_legacy(type), per = type == KQ_Q6_K ? 16 : 32;
    const int64_t steps = k / record_k(type), sums = legacy ? 0 : k / per;
    /* the int8 rows, then the steps, then the sums (legacy: -mid sum xq, int32), then the
     * fine steps' shifts */
    const size_t shifts = fine ? (size_t)(M * (k / GROUP)) : 0;
    int8_t *xq = malloc((size_t)(M * k) + sizeof(float) * (size_t)(M * steps) +
                        sizeof(int32_t) * ((size_t)(M * (legacy ? steps : sums)) + shifts));
    if (!xq) return -1;
    float *xd = (float *)(xq + M * k); /* M k is a multiple of 32: aligned */
    int16_t *xs = (int16_t *)(xd + M * steps);
    int32_t *sq = (int32_t *)(xd + M * steps);
    int32_t *xl = fine ? sq + M * (legacy ? steps : sums) : NULL;
    if (legacy)
        quantize_rows_32(x, M, k, code_mid(type), xq, xd, sq);
    else
        quantize_rows_256(x, M, k, per, xq, xd, xs, xl);
    const gemm_job first = {records, xq, xd, xs, sq, xl, k, sums, 1}, rest = {
        records, xq, xd, xs, sq, xl, k, sums, 0};
    const int64_t run_records = GEMM_RUN_K / record_k(type);
    const int64_t blocks = (n_out + ROWS - 1) / ROWS;
    const int threads = omp_get_max_threads();
    /* blocks a thread takes at once: fewer where that would leave a thread without any */
    int64_t together = blocks / (2 * threads);
    together = together < 1 ? 1 : together > GEMM_STORE_BLOCKS ? GEMM_STORE_BLOCKS : together;
    const int64_t groups = (blocks + together - 1) / together;
    float *accs = aligned_alloc(64, sizeof(float) * 16 * GEMM_STORE_BLOCKS * GEMM_CHUNK *
                                        (size_t)threads);
    if (!accs) {
        free(xq);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float *const mine = accs + (size_t)omp_get_thread_num() * 16 * GEMM_STORE_BLOCKS * GEMM_CHUNK;
        for (int64_t c0 = 0; c0 < M; c0 += GEMM_CHUNK) {
            const int64_t rows = M - c0 < GEMM_CHUNK ? M - c0 : GEMM_CHUNK;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t b0 = g * together;
                const int64_t nb = blocks - b0 < together ? blocks - b0 : together;
                for (int64_t i = 0; i < nb; i++) {
                    float *acc = mine + i * 16 * GEMM_CHUNK;
                    memset(acc, 0, sizeof(float) * 16 * (size_t)rows);
                    for (int64_t s0 = 0; s0 < steps; s0 += run_records) {
                        const int64_t s1 = s0 + run_records < steps ? s0 + run_records : steps;
                        for (int64_t m = 0; m < rows; m += GEMM_TILE) {
                            const int T = (int)(rows - m < GEMM_TILE ? rows - m : GEMM_TILE);
                            run(m ? &rest : &first, b0 + i, s0, s1, c0 + m, T, acc + 16 * m);
                        }
                    }
                }
                for (int64_t m = 0; m < rows; m++)
                    for (int64_t i = 0; i < nb; i++) {
                        const int64_t row0 = ROWS * (b0 + i);
                        const __mmask16 keep = row0 + ROWS <= n_out ? 0xffff
                                               : (__mmask16)((1u << (n_out - row0)) - 1);
                        const __m512 sums = _mm512_loadu_ps(mine + i * 16 * GEMM_CHUNK + 16 * m);
                        _mm256_mask_storeu_epi16(y + (c0 + m) * n_out + row0, keep,
                                                 (__m256i)_mm512_cvtneps_pbh(sums));
                    }
            }
        }
    }
    free(accs);
    free(xq);
    return 0;
}

int kquant_gemm_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out, int64_t k,
                     const uint16_t *x, uint16_t *y, int64_t M) {
    return records_product(type, records, n_rows, n_out, k, x, y, M, 0, 1);
}

/* The fine product (K-quants only): y[M, n_out] bf16 = x[M, k] bf16 @ W^T, x in fine steps,
 * on OpenMP threads above parallel_work multiply-adds (n_rows k M). */
int kquant_gemm_fine_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                          int64_t k, int64_t parallel_work, const uint16_t *x, uint16_t *y,
                          int64_t M) {
    return records_product(type, records, n_rows, n_out, k, x, y, M, 1,
                           n_rows * k * M > parallel_work);
}

/* The decode kernel (batches below runtime/quant/kquant.py's GEMM_MIN_ROWS): the fine product
 * for the K-quants (a 1B's decode step at batch 8: 25.5 ms against the per-16 kernel's 32.9; at
 * batch 1 within 0-8% of it, where each matrix streams from memory once, and the same for every
 * batch size, so a request's tokens are the same alone and batched), the per-16 kernel for the
 * legacy types. */
int kquant_decode_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                       int64_t k, int64_t parallel_work, const uint16_t *x, uint16_t *y,
                       int64_t M) {
    if (is_legacy(type))
        return kquant_matmul_bf16(type, records, n_rows, n_out, k, parallel_work, x, y, M);
    return kquant_gemm_fine_bf16(type, records, n_rows, n_out, k, parallel_work, x, y, M);
}
/* ---- The many-row product on AMX tiles: kquant_gemm_amx_bf16 ----
 * Where the CPU runs AMX (and the kernel grants this process the tile state), each 16-row
 * block's records are dequantized to bf16 (the weights dense_t rounds to: w in fp32, then to
 * the nearest bf16) a run of AMX_RUN_K k at a time, straight into the tiles' pair layout, and
 * multiplied with x as it is (bf16, no int8 step) by tdpbf16ps: a 16 x 16 x 32 product an
 * instruction, fp32 sums. Two blocks (32 weight rows) against two 16-row tiles of x: four
 * accumulator tiles, two of x, two of weights. A run's weights (32 rows x AMX_RUN_K, 32 KB)
 * stay in L1 while every 32-row tile of the chunk (AMX_CHUNK rows) passes over them; the
 * partial sums wait in an fp32 buffer between runs. Each weight is dequantized once per run and
 * chunk. A row's result does not depend on the call's other rows. */
#define AMX_RUN_K 512
#define AMX_CHUNK 256
#define AMX_GROUP 8
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where AMX-TILE and AMX-BF16 run here: the CPU has them (cpuid), the OS saves their state
 * (XCR0 bits 17-18), and the kernel let this process use the tile data (arch_prctl; without
 * that the first tile instruction dies with SIGILL, as on VMs that list AMX but hold it off). */
int kquant_amx_available(void) {
    static int state = -1; /* asked once; the answer never changes within a process */
    if (state >= 0) return state;
    unsigned a = 0, b = 0, c = 0, d = 0;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const int cpu = (d >> 24 & 1) && (d >> 22 & 1); /* AMX-TILE, AMX-BF16 */
    int os = 0;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (c >> 27 & 1) { /* OSXSAVE: xgetbv may run */
        unsigned lo, hi;
        __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        os = (lo >> 17 & 3) == 3;
    }
    state = cpu && os && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Group g of record r (type constant) as one weight tile: 16 lines of 64 bytes, line p holding
 * for each of the 16 weight rows its bf16 weights at k 2p and 2p + 1 (tdpbf16ps's B layout). */
static inline __attribute__((always_inline)) void group_tile(int type, const uint8_t *r, int g,
                                                             __m512 d, __m512 dmin,
                                                             uint16_t *tile) {
    group_weights gw; /* the weights dequantize_record writes */
    group_weights_of(type, r, g, d, dmin, &gw);
    /* (w at k 2p of the 16 rows | w at 2p + 1) -> (row 0: 2p, 2p + 1 | row 1: ...) */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    for (int q = 0; q < 8; q++) /* c[q]: k 8 (q / 2) + 4 (q % 2) + jj at byte jj */
        for (int jj = 0; jj < 4; jj += 2) {
            const __m512 w[2] = {weight_at(&gw, q, jj), weight_at(&gw, q, jj + 1)};
            const int line = (8 * (q / 2) + 4 * (q % 2) + jj) / 2;
            _mm512_storeu_si512((void *)(tile + 32 * line),
                                _mm512_permutexvar_epi16(pairs,
                                                         (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0])));
        }
}

/* Weights of block b (16 rows) for k k0 .. k0 + kn - 1 as kn / 32 tiles of 512 bf16, one after
 * another along k; zeros for a block past the records (the odd last of a pair). */
static inline __attribute__((always_inline)) void block_tiles(int type, const uint8_t *records,
                                                              int64_t blocks, int64_t b,
                                                              int64_t k, int64_t k0, int64_t kn,
                                                              uint16_t *tiles) {
    if (b >= blocks) {
        memset(tiles, 0, sizeof(uint16_t) * 16 * (size_t)kn);
        return;
    }
    const int64_t rk = record_k(type), rec = record_bytes(type), sbs = k / rk;
    for (int64_t kk = k0; kk < k0 + kn; kk += rk) {
        const uint8_t *r = records + (b * sbs + kk / rk) * rec;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
        const __m512 dmin = record_dmin(type, r);
        for (int g = 0; g < record_groups(type); g++)
            group_tile(type, r, g, d, dmin, tiles + 16 * (kk - k0 + GROUP * g));
    }
}

static void amx_tiles_of(int type, const uint8_t *records, int64_t blocks, int64_t b, int64_t k,
                         int64_t k0, int64_t kn, uint16_t *tiles) {
    switch (type) {
    case KQ_Q4_0: block_tiles(KQ_Q4_0, records, blocks, b, k, k0, kn, tiles); break;
    case KQ_Q5_0: block_tiles(KQ_Q5_0, records, blocks, b, k, k0, kn, tiles); break;
    case KQ_Q8_0: block_tiles(KQ_Q8_0, records, blocks, b, k, k0, kn, tiles); break;
    case KQ_Q4_K: block_tiles(KQ_Q4_K, records, blocks, b, k, k0, kn, tiles); break;
    case KQ_Q5_K: block_tiles(KQ_Q5_K, records, blocks, b, k, k0, kn, tiles); break;
    default: block_tiles(KQ_Q6_K, records, blocks, b, k, k0, kn, tiles); break;
    }
}

/* acc (fp32, 32 columns a row) += x rows [a0 + 16 t] (t < n_tiles: 1 or 2, each 16 rows, row
 * stride lda elements) @ the run's weight tiles w0, w1 (steps of 32 k). Tiles 0-3 sum, 4-5 x,
 * 6-7 weights. */
__attribute__((target("amx-tile,amx-bf16"), noinline)) static void
amx_run(const uint16_t *a0, const uint16_t *a1, int64_t lda, const uint16_t *w0,
        const uint16_t *w1, int64_t steps, float *acc, int two) {
    const int64_t sa = 2 * lda, sc = 32 * sizeof(float);
    _tile_loadd(0, acc, sc);
    _tile_loadd(1, acc + 16, sc);
    if (two) {
        _tile_loadd(2, acc + 16 * 32, sc);
        _tile_loadd(3, acc + 16 * 32 + 16, sc);
    }
    for (int64_t t = 0; t < steps; t++) {
        _tile_loadd(4, a0 + 32 * t, sa);
        _tile_loadd(6, w0 + 512 * t, 64);
        _tile_loadd(7, w1 + 512 * t, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + 32 * t, sa);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (two) {
        _tile_stored(2, acc + 16 * 32, sc);
        _tile_stored(3, acc + 16 * 32 + 16, sc);
    }
    _tile_stored(0, acc, sc);
    _tile_stored(1, acc + 16, sc);
}

/* This thread's tile configuration: 8 tiles of 16 rows x 64 bytes. In asm with the whole
 * configuration as its memory operand: GCC 12's _tile_loadconfig let the stores of all but its
 * first 33 bytes be dropped (-march=x86-64-v4 with the target attribute), and ldtilecfg faulted
 * (#GP) on the stack's leftovers. */
static __attribute__((noinline)) void amx_begin(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

static __attribute__((noinline)) void amx_end(void) { __asm__ volatile("tilerelease" ::: "memory"); }

/* y[M, n_out] bf16 = x[M, k] bf16 @ W^T over the records of any type, on AMX tiles (above).
 * Returns 0, or -1 for what it does not take or where AMX does not run (nothing written). */
int kquant_gemm_amx_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                         int64_t k, const uint16_t *x, uint16_t *y, int64_t M) {
    if (!group_bytes(type) || M < 1 || k <= 0 || k % record_k(type) || n_rows % ROWS ||
        n_out > n_rows || !kquant_amx_available())
        return -1;
    const int64_t blocks = n_rows / ROWS, pairs = (n_out + 2 * ROWS - 1) / (2 * ROWS);
    const int64_t full = M / 16 * 16; /* rows in whole 16-row tiles of x; the rest padded */
    const int threads = omp_get_max_threads();
    /* pairs a thread takes at a time: up to AMX_GROUP, fewer where that would leave a thread
     * idle */
    int64_t group = pairs / threads < AMX_GROUP ? pairs / threads : AMX_GROUP;
    if (group < 1) group = 1;
    const int64_t groups = (pairs + group - 1) / group;
    /* per thread: a run's weight tiles (bf16, two blocks) and the group's partial sums (fp32,
     * 32 columns per row of a chunk); beside them, x's last rows zero-padded to 16 */
    const size_t tile_bytes = sizeof(uint16_t) * 2 * 16 * AMX_RUN_K;
    const size_t sums = 32 * AMX_CHUNK; /* floats of a pair's partial sums */
    const size_t per_thread = tile_bytes + sizeof(float) * sums * (size_t)group;
    uint16_t *pad = calloc(16 * (size_t)k, sizeof(uint16_t));
    uint8_t *scratch = aligned_alloc(64, per_thread * (size_t)threads);
    if (!pad || !scratch) {
        free(pad), free(scratch);
        return -1;
    }
    if (M > full) memcpy(pad, x + full * k, sizeof(uint16_t) * (size_t)((M - full) * k));
#pragma omp parallel num_threads(threads)
    {
        amx_begin();
        uint16_t *w = (uint16_t *)(scratch + (size_t)omp_get_thread_num() * per_thread);
        float *accs = (float *)((uint8_t *)w + tile_bytes);
        for (int64_t c0 = 0; c0 < M; c0 += AMX_CHUNK) {
            const int64_t rows = M - c0 < AMX_CHUNK ? M - c0 : AMX_CHUNK;
            const int64_t tiles = (rows + 15) / 16;
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < groups; gi++) {
                const int64_t p0 = gi * group, p1 = p0 + group < pairs ? p0 + group : pairs;
                for (int64_t p = p0; p < p1; p++)
                    memset(accs + sums * (p - p0), 0, sizeof(float) * 32 * 16 * (size_t)tiles);
                /* runs of AMX_RUN_K k (a multiple of every record's k), the last what is left:
                 * the chunk's x over a run stays in L2 while the group's pairs pass over it */
                for (int64_t k0 = 0; k0 < k; k0 += AMX_RUN_K) {
                    const int64_t kn = k - k0 < AMX_RUN_K ? k - k0 : AMX_RUN_K;
                    for (int64_t p = p0; p < p1; p++) {
                        float *acc = accs + sums * (p - p0);
                        amx_tiles_of(type, records, blocks, 2 * p, k, k0, kn, w);
                        amx_tiles_of(type, records, blocks, 2 * p + 1, k, k0, kn,
                                     w + 16 * AMX_RUN_K);
                        for (int64_t t = 0; t < tiles; t += 2) {
                            const int64_t m = c0 + 16 * t;
                            const uint16_t *a0 = (m < full ? x + m * k : pad) + k0;
                            const uint16_t *a1 = (m + 16 < full ? x + (m + 16) * k : pad) + k0;
                            amx_run(a0, a1, k, w, w + 16 * AMX_RUN_K, kn / 32,
                                    acc + 32 * 16 * t, t + 1 < tiles);
                        }
                    }
                }
                for (int64_t p = p0; p < p1; p++)
                    for (int h = 0; h < 2; h++) {
                        const int64_t c = 2 * ROWS * p + 16 * h;
                        if (c >= n_out) break;
                        const __mmask16 keep = c + 16 <= n_out
                                                   ? 0xffff
                                                   : (__mmask16)((1u << (n_out - c)) - 1);
                        const float *acc = accs + sums * (p - p0) + 16 * h;
                        for (int64_t m = 0; m < rows; m++)
                            _mm256_mask_storeu_epi16(
                                y + (c0 + m) * n_out + c, keep,
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + 32 * m)));
                    }
            }
        }
        amx_end();
    }
    free(scratch);
    free(pad);
    return 0;
}
#else
int kquant_available(void) { return 0; }
int kquant_amx_available(void) { return 0; }
int kquant_gemm_amx_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                         int64_t k, const uint16_t *x, uint16_t *y, int64_t M) {
    (void)type, (void)records, (void)n_rows, (void)n_out, (void)k, (void)x, (void)y, (void)M;
    return -1;
}
int kquant_dequantize_t_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out,
                             int64_t k, uint16_t *wt) {
    (void)type, (void)records, (void)n_rows, (void)n_out, (void)k, (void)wt;
    return -1;
}
/* The entry points of kquant_matmul_bf16's form, refusing in this build. */
#define REFUSED_MATMUL(name)                                                                    \
    int name(int type, const uint8_t *records, int64_t n_rows, int64_t n_out, int64_t k,        \
             int64_t parallel_work, const uint16_t *x, uint16_t *y, int64_t M) {                \
        (void)type, (void)records, (void)n_rows, (void)n_out, (void)k, (void)parallel_work;     \
        (void)x, (void)y, (void)M;                                                              \
        return -1;                                                                              \
    }
REFUSED_MATMUL(kquant_matmul_bf16)
REFUSED_MATMUL(kquant_gemm_fine_bf16)
REFUSED_MATMUL(kquant_decode_bf16)
int kquant_gemm_bf16(int type, const uint8_t *records, int64_t n_rows, int64_t n_out, int64_t k,
                     const uint16_t *x, uint16_t *y, int64_t M) {
    (void)type, (void)records, (void)n_rows, (void)n_out, (void)k, (void)x, (void)y, (void)M;
    return -1;
}
#endif

/* kquant_matmul_bf16 as a matmul_op_fn (cpu_kernels.h): args {type, records, n_rows, n_out, k,
 * parallel_work}. */
int kquant_matmul_op(const int64_t *args, const void *x, void *y, int64_t rows) {
    return kquant_matmul_bf16((int)args[0], (const uint8_t *)(intptr_t)args[1], args[2], args[3],
                              args[4], args[5], x, y, rows);
}

/* kquant_gemm_fine_bf16 and kquant_decode_bf16 as matmul_op_fns: args as kquant_matmul_op's. */
int kquant_gemm_fine_op(const int64_t *args, const void *x, void *y, int64_t rows) {
    return kquant_gemm_fine_bf16((int)args[0], (const uint8_t *)(intptr_t)args[1], args[2],
                                 args[3], args[4], args[5], x, y, rows);
}
int kquant_decode_op(const int64_t *args, const void *x, void *y, int64_t rows) {
    return kquant_decode_bf16((int)args[0], (const uint8_t *)(intptr_t)args[1], args[2], args[3],
                              args[4], args[5], x, y, rows);
}
