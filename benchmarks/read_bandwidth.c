/* The benchmark's memory-read probe (benchmarks/bandwidth.py): each of `threads` threads reads its
 * part of a buffer as `streams` runs side by side, 128 bytes of each in turn, asking 2 KiB ahead
 * of each into L2. One stream a core leaves DRAM bandwidth unused on these VMs (a core keeps
 * more lines in flight over several streams), so the floor takes the best of 1 to 4 streams:
 * the fastest this machine reads, not one access pattern's speed. */
#include <omp.h>
#include <stdint.h>

#define LINE_WORDS 16   /* 128 bytes */
#define AHEAD_WORDS 256 /* 2 KiB */

uint64_t read_streams(const uint64_t *data, int64_t words, int streams, int threads) {
    uint64_t folded = 0;
#pragma omp parallel num_threads(threads) reduction(^ : folded)
    {
        const int64_t t = omp_get_thread_num(), part = words / omp_get_num_threads();
        const int64_t run = part / streams / LINE_WORDS * LINE_WORDS;
        const uint64_t *base = data + t * part;
        uint64_t acc[LINE_WORDS] = {0};
        for (int64_t i = 0; i < run; i += LINE_WORDS)
            for (int s = 0; s < streams; s++) {
                const uint64_t *p = base + s * run + i;
                __builtin_prefetch(p + AHEAD_WORDS, 0, 1);
                __builtin_prefetch(p + AHEAD_WORDS + LINE_WORDS / 2, 0, 1);
                for (int w = 0; w < LINE_WORDS; w++) acc[w] ^= p[w];
            }
        for (int w = 0; w < LINE_WORDS; w++) folded ^= acc[w];
    }
    return folded;
}
