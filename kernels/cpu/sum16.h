/* sum16(v): lane j of the result is the sum of v[j]'s 16 lanes, for 16 vectors of 16 floats at
 * once: pairs interleaved within 128-bit chunks, then 64-bit pairs, then chunks (45 shuffles and
 * adds for 16 sums, where one horizontal sum each takes ~8). Shared by the decode attention (16
 * keys' partial dot products) and the weight kernel (16 output channels' partial sums).
 * kernels/cpu/__init__.py's build hashes the headers a source includes with it. */
#ifndef PAGEDSERVE_SUM16_H
#define PAGEDSERVE_SUM16_H

#include <stdint.h>

typedef float sum16_f __attribute__((vector_size(64)));
typedef int32_t sum16_i __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) sum16_f sum16_pair(sum16_f a, sum16_f b, sum16_i lo, sum16_i hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

static inline __attribute__((always_inline)) sum16_f sum16(const sum16_f *v) {
    const sum16_i lo32 = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
    const sum16_i hi32 = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31};
    const sum16_i lo64 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const sum16_i hi64 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const sum16_i lo128 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const sum16_i hi128 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    sum16_f quad[4];
    for (int k = 0; k < 4; ++k) { /* quad[k] chunk c: sums of chunk c of v[4k..4k+3] */
        const sum16_f *w = v + 4 * k;
        quad[k] = sum16_pair(sum16_pair(w[0], w[1], lo32, hi32), sum16_pair(w[2], w[3], lo32, hi32), lo64, hi64);
    }
    return sum16_pair(sum16_pair(quad[0], quad[1], lo128, hi128), sum16_pair(quad[2], quad[3], lo128, hi128),
                      lo128, hi128);
}

/* sum8(v): the same for 8 vectors of 8 floats (AVX2's registers): lane j is the sum of v[j]. */
typedef float sum8_f __attribute__((vector_size(32)));
typedef int32_t sum8_i __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) sum8_f sum8_pair(sum8_f a, sum8_f b, sum8_i lo, sum8_i hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

static inline __attribute__((always_inline)) sum8_f sum8(const sum8_f *v) {
    const sum8_i lo32 = {0, 8, 1, 9, 4, 12, 5, 13}, hi32 = {2, 10, 3, 11, 6, 14, 7, 15};
    const sum8_i lo64 = {0, 1, 8, 9, 4, 5, 12, 13}, hi64 = {2, 3, 10, 11, 6, 7, 14, 15};
    const sum8_i lo128 = {0, 1, 2, 3, 8, 9, 10, 11}, hi128 = {4, 5, 6, 7, 12, 13, 14, 15};
    return sum8_pair(sum8_pair(sum8_pair(v[0], v[1], lo32, hi32), sum8_pair(v[2], v[3], lo32, hi32), lo64, hi64),
                     sum8_pair(sum8_pair(v[4], v[5], lo32, hi32), sum8_pair(v[6], v[7], lo32, hi32), lo64, hi64),
                     lo128, hi128);
}

#endif
