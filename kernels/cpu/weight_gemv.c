/* Weight-only linear layers for a few fp32 activation rows (decode at small batch), with fp32
 * accumulation:
 *   fp32:  out[m, n] = sum_k w[n, k] * x[m, k]
 *   int8:  out[m, n] = scale[n] * sum_k w[n, k] * x[m, k]
 *   bf16:  out[m, n] = sum_k w[n, k] * x[m, k]
 * A few rows are bound by reading the weight, which int8 makes a quarter of fp32's and bf16 a
 * half; torch has no fast CPU kernel for either here (int8: see workers/quantization.py; bf16:
 * without native bf16 FMA, torch's bf16 GEMM ran 2-4x slower than fp32's at 16-64 rows), and
 * MKL's fp32 GEMM reaches only half the memory bandwidth at 1 row and 8-12 rows on this CPU.
 * Weight rows go in tiles of 4, each tile against the activation rows 4 at a time (see TILE);
 * output tiles are spread over OpenMP threads; one activation row has its own loop (ROW), and so
 * do fp32's 2-16 rows on AVX-512 (STREAM).
 * Measured on SmolLM2's 30 decoder layers, against the previous kernel (one weight row at a time
 * against blocks of 8, 4, 2 or 1 activation rows) and MKL, ms, best of 3 interleaved runs:
 *   fp32, 2 threads:  4 rows 12.1 / 19.4 / 42.4, 8 rows 22.2 / 36.2 / 55.6, 16 rows 40.6 / 53.6 / 66.9
 *   fp32, 1 thread:   5 rows 21.5 / 24.6 / 43.8, 8 rows 33.1 / 47.6 / 45.5, 16 rows 67.7 / 83.9 / 66.8
 *   bf16, 2 threads:  4 rows 8.0 / 12.4, 8 rows 14.7 / 22.5, 16 rows 26.4 / 35.2; int8 unchanged.
 */
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#if defined(__AVX2__)
#include <immintrin.h>
static inline v8f widen8_int8(const int8_t *p) {  /* one vpmovsxbd and one vcvtdq2ps */
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline v8f widen8_bf16(const uint16_t *p) {  /* a bf16 is a float's upper half */
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#else
static inline v8f widen8_int8(const int8_t *p) {
    v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, v8i), v8f);
}
static inline v8f widen8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}
#endif

static inline float one_f32(float w) { return w; }
static inline float one_int8(int8_t w) { return (float)w; }
static inline float one_bf16(uint16_t w) {
    const uint32_t bits = (uint32_t)w << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8f widen8_f32(const float *p) { return load8(p); }  /* nothing to widen */

static inline float lanes8(v8f v) {
    float s = 0.f;
    for (int l = 0; l < 8; ++l) s += v[l];
    return s;
}

/* The tiles' and ROW's vector: 16 lanes where the CPU has AVX-512, else 8. int8 and widened bf16
 * are bound by their arithmetic (widening, then an FMA per lane), which 16 lanes halve in
 * instructions: SmolLM2's 30 decoder layers, 2 threads, Xeon, weights on huge pages, 8 -> 16
 * lanes: int8 1 row 4.94 -> 4.25 ms, 4 rows 5.34 -> 4.63, 8 rows 10.34 -> 8.27, 16 rows 20.09 ->
 * 16.23. */
#if defined(__AVX512F__)
#define VW 16
typedef float vwf __attribute__((vector_size(64), aligned(4)));
static inline vwf widenw_int8(const int8_t *p) {
    return (vwf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vwf widenw_bf16(const uint16_t *p) {
    return (vwf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#else
#define VW 8
typedef float vwf __attribute__((vector_size(32), aligned(4)));
static inline vwf widenw_int8(const int8_t *p) { return (vwf)widen8_int8(p); }
static inline vwf widenw_bf16(const uint16_t *p) { return (vwf)widen8_bf16(p); }
#endif
static inline vwf loadw(const float *p) { return *(const vwf *)p; }
static inline vwf widenw_f32(const float *p) { return loadw(p); }

static inline float lanesw(vwf v) {
    float s = 0.f;
    for (int l = 0; l < VW; ++l) s += v[l];
    return s;
}

/* Software prefetches fill L2 only (x86's prefetcht2): into L1 as well, a tile's prefetch of the
 * next tile evicted the rows the tile was still reading. The one-row loop asks for the weight a
 * page ahead (the hardware's streamer restarts at each 4 KiB page). SmolLM2's 30 decoder layers
 * (Xeon with AVX-512, 2 threads, fp32, weights on huge pages), before -> after: 1 row 20.4 -> 18.5
 * ms, 3 rows 23.4 -> 21.6, 5 rows 24.4 -> 22.5, 8 rows 27.2 -> 25.3, 16 rows 38.9 -> 35.2; int8
 * 1 row 10.3 -> 7.5, bf16 1 row 14.4 -> 11.1. */
#define PREFETCH_L2 1
#define ROW_AHEAD 4096

/* One activation row: one weight row at a time, two pieces of W lanes per step into two accumulators
 * (consecutive FMAs do not wait on each other). The weight is one sequential stream, which the
 * hardware prefetcher follows better than a tile's interleaved rows: 1 row measured 15 against
 * 17 ms on one core, 10 against 13 on two (30 layers). */
#define ROW(T, W)                                                                                \
    static void row_##T(float *out, const float *x, const T##_w *w, const float *scale,          \
                        int64_t n_out, int64_t k_in, int num_threads) {                          \
        const int64_t lanes = sizeof(v##W##f) / sizeof(float);                                   \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                    \
        for (int64_t n = 0; n < n_out; ++n) {                                                    \
            const T##_w *wn = w + n * k_in;                                                      \
            v##W##f a0 = {0}, a1 = {0};                                                          \
            int64_t k = 0;                                                                       \
            for (; k + 2 * lanes <= k_in; k += 2 * lanes) {                                      \
                for (int64_t b = 0; b < 2 * lanes * (int64_t)sizeof(T##_w); b += 64)             \
                    __builtin_prefetch((const char *)(wn + k) + ROW_AHEAD + b, 0, PREFETCH_L2);  \
                a0 += widen##W##_##T(wn + k) * load##W(x + k);                                   \
                a1 += widen##W##_##T(wn + k + lanes) * load##W(x + k + lanes);                   \
            }                                                                                    \
            float s = lanes##W(a0 + a1);                                                         \
            for (; k < k_in; ++k) s += one_##T(wn[k]) * x[k];                                    \
            out[n] = scale ? s * scale[n] : s;                                                   \
        }                                                                                        \
    }

/* A tile: W_TILE weight rows n.. (`nw` of them real; the rest repeat row n and are not stored)
 * times M activation rows, M known at compile time so that the W_TILE x M accumulators live in
 * registers. Each 8-wide piece of a weight row is widened once and used by M activation rows,
 * and each piece of an activation row by W_TILE weight rows: 2 FMAs per load, where one weight
 * row at a time made a load per FMA and bound 8 rows on a core to 30 GFLOP/s. `scale` may be
 * NULL (no per-channel scale). */
#define W_TILE 4
#define TILE(T, M)                                                                               \
    static inline void tile_##T##_##M(float *out, const float *x, const T##_w *w, const float *scale, \
                                      int64_t n, int64_t nw, int64_t n_out, int64_t k_in) {      \
        const T##_w *wr[W_TILE];                                                                 \
        for (int j = 0; j < W_TILE; ++j) wr[j] = w + (n + (j < nw ? j : 0)) * k_in;              \
        vwf acc[W_TILE][M];                                                                      \
        for (int j = 0; j < W_TILE; ++j)                                                         \
            for (int m = 0; m < M; ++m) acc[j][m] = (vwf){0};                                    \
        int64_t k = 0;                                                                           \
        const T##_w *next = w + (n + W_TILE) * k_in; /* the next tile's rows, contiguous */      \
        const int64_t ahead = n + 2 * W_TILE <= n_out ? W_TILE * k_in : 0;                       \
        for (; k + VW <= k_in; k += VW) {                                                        \
            if (ahead) /* the next tile's rows, a step's share at a time, on every pass over the \
                        * tile's rows: prefetching on the first pass only measured slower (16    \
                        * rows, 2 threads: 39-44 against 36-38 ms for 30 layers). Into L2 only  \
                        * (locality 1): into L1 it evicted the tile being read (see PREFETCH_L2) */ \
                for (int64_t b = 0; b < W_TILE * VW * (int64_t)sizeof(T##_w); b += 64)           \
                    __builtin_prefetch((const char *)(next + W_TILE * k) + b, 0, PREFETCH_L2);   \
            vwf wv[W_TILE];                                                                      \
            for (int j = 0; j < W_TILE; ++j) wv[j] = widenw_##T(wr[j] + k);                      \
            for (int m = 0; m < M; ++m) {                                                        \
                const vwf xv = loadw(x + m * k_in + k);                                          \
                for (int j = 0; j < W_TILE; ++j) acc[j][m] += wv[j] * xv;                        \
            }                                                                                    \
        }                                                                                        \
        for (int j = 0; j < nw; ++j)                                                             \
            for (int m = 0; m < M; ++m) {                                                        \
                float s = lanesw(acc[j][m]);                                                     \
                for (int64_t kk = k; kk < k_in; ++kk) s += one_##T(wr[j][kk]) * x[m * k_in + kk]; \
                out[m * n_out + n + j] = scale ? s * scale[n + j] : s;                           \
            }                                                                                    \
    }

/* Output columns in tiles of W_TILE over OpenMP threads; within a tile, the activation rows four
 * at a time, while the tile's weight rows stay in L1: the weight is read from memory once
 * whatever the row count. */
#define GEMV(T, RW)                                                                              \
    TILE(T, 1)                                                                                   \
    TILE(T, 2)                                                                                   \
    TILE(T, 3)                                                                                   \
    TILE(T, 4)                                                                                   \
    ROW(T, RW)                                                                                   \
    static void gemv_##T(float *out, const float *x, const T##_w *w, const float *scale,         \
                         int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {           \
        if (rows == 1) {                                                                         \
            row_##T(out, x, w, scale, n_out, k_in, num_threads);                                 \
            return;                                                                              \
        }                                                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                    \
        for (int64_t n = 0; n < n_out; n += W_TILE) {                                            \
            const int64_t nw = n_out - n < W_TILE ? n_out - n : W_TILE;                          \
            for (int64_t m = 0; m < rows; m += 4) {                                              \
                float *o = out + m * n_out;                                                      \
                const float *xm = x + m * k_in;                                                  \
                switch (rows - m < 4 ? rows - m : 4) {                                           \
                case 1: tile_##T##_1(o, xm, w, scale, n, nw, n_out, k_in); break;                \
                case 2: tile_##T##_2(o, xm, w, scale, n, nw, n_out, k_in); break;                \
                case 3: tile_##T##_3(o, xm, w, scale, n, nw, n_out, k_in); break;                \
                default: tile_##T##_4(o, xm, w, scale, n, nw, n_out, k_in); break;               \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

typedef float f32_w;
typedef int8_t int8_w;
typedef uint16_t bf16_w;
GEMV(f32, 8) /* one fp32 row is bound by memory, where 8 lanes measured ~2% faster than 16 */
GEMV(int8, w)
GEMV(bf16, w)

/* fp32 on AVX-512: 2 to 16 activation rows against one weight row at a time, VW (16) lanes a step.
 * The weight streams once, sequentially, as in ROW, where a tile's four interleaved rows
 * streamed slower, and each 64-byte piece of it meets all M rows (M loads of x, which stays in
 * L1, and M FMAs per weight load). Up to 8 rows each row sums into two accumulators (U = 2),
 * so that consecutive FMAs into one do not wait on each other; from 9 rows, 2M accumulators
 * would not fit the 32 registers, and M chains are enough. SmolLM2's 30 decoder layers (Xeon,
 * 2 threads, weights on huge pages), tiles -> this, ms: 2 rows 14.5 -> 12.2, 5 rows 17.0 -> 14.5,
 * 8 rows 19.1 -> 16.2, 12 rows 23.1 -> 18.4, 16 rows 28.2 -> 23.4 (1 row: ROW, 12.7). */
#if defined(__AVX512F__)
#include "sum16.h"

/* acc[u][m] (U x M vectors, zeroed here) += weight row wn's pieces times x's rows, k from its
 * value on while U pieces of VW lanes fit in k_in. */
#define STREAM_SUMS(M, U)                                                                        \
    for (int u = 0; u < U; ++u)                                                                  \
        for (int m = 0; m < M; ++m) acc[u][m] = (vwf){0};                                        \
    for (; k + VW * U <= k_in; k += VW * U)                                                      \
        for (int u = 0; u < U; ++u) {                                                            \
            const float *wk = wn + k + VW * u;                                                   \
            __builtin_prefetch((const char *)wk + ROW_AHEAD, 0, PREFETCH_L2);                    \
            const vwf wv = loadw(wk);                                                            \
            for (int m = 0; m < M; ++m)                                                          \
                acc[u][m] += wv * loadw(x + m * k_in + k + VW * u);                              \
        }

#define STREAM(M, U)                                                                             \
    static void stream_f32_##M(float *out, const float *x, const float *w,                       \
                               int64_t n_out, int64_t k_in, int num_threads) {                   \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                    \
        for (int64_t n = 0; n < n_out; ++n) {                                                    \
            const float *wn = w + n * k_in;                                                      \
            vwf acc[U][M];                                                                       \
            int64_t k = 0;                                                                       \
            STREAM_SUMS(M, U)                                                                    \
            for (; k + VW <= k_in; k += VW) {                                                    \
                const vwf wv = loadw(wn + k);                                                    \
                for (int m = 0; m < M; ++m) acc[0][m] += wv * loadw(x + m * k_in + k);           \
            }                                                                                    \
            for (int m = 0; m < M; ++m) {                                                        \
                vwf sum = acc[0][m];                                                             \
                for (int u = 1; u < U; ++u) sum += acc[u][m];                                    \
                float s = lanesw(sum);                                                           \
                for (int64_t kk = k; kk < k_in; ++kk) s += wn[kk] * x[m * k_in + kk];            \
                out[m * n_out + n] = s;                                                          \
            }                                                                                    \
        }                                                                                        \
    }
STREAM(2, 2) STREAM(3, 2) STREAM(4, 2) STREAM(5, 2) STREAM(6, 2) STREAM(7, 2) STREAM(8, 2)
STREAM(9, 1) STREAM(10, 1) STREAM(11, 1) STREAM(12, 1) STREAM(13, 1) STREAM(14, 1) STREAM(15, 1)
STREAM(16, 1)

/* STREAM for 3 to 7 rows, 16 output channels at a time: each channel's sums are kept as vectors
 * and the 16 are folded into one vector of outputs by sum16 (45 shuffles and adds), where one
 * horizontal sum per channel and row cost ~8 (rows x 8 per channel). Needs n_out a multiple of
 * 16 and k_in of 32 (no tail), else STREAM. SmolLM2's 30 decoder layers (2 threads, weights on
 * huge pages), ms: 3 rows 12.98 -> 12.51, 4 rows 13.15 -> 12.62, 5 rows 14.44 -> 13.81, 6 rows
 * 14.15 -> 13.55; 2 and 8 rows measured the same or slower (16 rows: gate/up 9.9 -> 11.1, the
 * 16 KB of partial sums crowding L1), so 2 rows keep STREAM, and so do 8-16 where their x fits
 * in L1 (below).
 *
 * Each channel reads all the rows' x, from L1 while it fits beside the weight streaming through:
 * rows x k_in floats beyond GROUP_X_BYTES go in chunks of rows that fit (at most 7, which also
 * bounds the partial sums), each chunk passing over the group's 16 weight rows in turn (from L2
 * after the first chunk: 16 x k_in floats). A row's sums run in the same order whatever its
 * chunk and row count. On an AMD EPYC Zen 4 (32 KB of L1), SmolLM2's down projection (k_in
 * 1,536: 6 KB of x a row) in one piece took ~4 ms at 1-4 rows, 5.5-6.4 at 5, 8.2-9.0 at 7 and
 * 8.0-9.8 at 8 (30 layers, 2 threads), where the k_in 576 projections stayed flat to 6 rows.
 * All four projections, 30 layers, medians of 7 alternated runs, one piece (STREAM from 8 rows)
 * -> chunks of at most 24 KB of x: 5 rows 19.45 -> 18.83 ms, 7 rows 20.31 -> 18.22, 8 rows 23.80
 * -> 22.09, 10 rows 25.45 -> 23.00, 12 rows 31.86 -> 27.56, 16 rows 53.75 -> 33.86; a 16 KB
 * budget split 3 and 4 rows of the down projection too and measured between the two. */
#ifndef GROUP_X_BYTES
#define GROUP_X_BYTES (24 << 10)
#endif
/* Chunks re-read the group's weight rows from L2, so only where those fit in it with room to
 * spare (k_in up to 8,192 floats); a wider weight keeps one piece (a 7B model's down projection,
 * k_in 11,008-14,336, would otherwise read its group's 0.7-0.9 MB again from L3 for every row). */
#define GROUP_W_BYTES (512 << 10)

static inline int chunks_pay(int64_t k_in) { return 16 * k_in * (int64_t)sizeof(float) <= GROUP_W_BYTES; }

/* One group of 16 channels for M rows (x and out at those rows' first). */
#define GROUP_ROWS(M)                                                                            \
    static inline __attribute__((always_inline)) void group_rows_##M(                          \
        float *out, const float *x, const float *w, int64_t group, int64_t n_out, int64_t k_in) { \
        sum16_f part[M][16];                                                                     \
        for (int j = 0; j < 16; ++j) {                                                           \
            const float *wn = w + (group * 16 + j) * k_in;                                       \
            vwf acc[2][M];                                                                       \
            int64_t k = 0;                                                                       \
            STREAM_SUMS(M, 2)                                                                    \
            for (int m = 0; m < M; ++m) part[m][j] = (sum16_f)(acc[0][m] + acc[1][m]);           \
        }                                                                                        \
        for (int m = 0; m < M; ++m) *(vwf *)(out + m * n_out + group * 16) = (vwf)sum16(part[m]); \
    }
GROUP_ROWS(1) GROUP_ROWS(2) GROUP_ROWS(3) GROUP_ROWS(4) GROUP_ROWS(5) GROUP_ROWS(6) GROUP_ROWS(7)

/* Rows m0 .. m0 + m of one group (m <= 7). */
static inline void group_rows(float *out, const float *x, const float *w, int64_t group, int64_t n_out,
                              int64_t k_in, int64_t m0, int64_t m) {
    float *o = out + m0 * n_out;
    const float *xm = x + m0 * k_in;
    switch (m) {
    case 1: group_rows_1(o, xm, w, group, n_out, k_in); break;
    case 2: group_rows_2(o, xm, w, group, n_out, k_in); break;
    case 3: group_rows_3(o, xm, w, group, n_out, k_in); break;
    case 4: group_rows_4(o, xm, w, group, n_out, k_in); break;
    case 5: group_rows_5(o, xm, w, group, n_out, k_in); break;
    case 6: group_rows_6(o, xm, w, group, n_out, k_in); break;
    default: group_rows_7(o, xm, w, group, n_out, k_in); break;
    }
}

/* Whether the grouped form takes this weight (else STREAM). */
static inline int groups_fit(int64_t n_out, int64_t k_in) { return n_out % 16 == 0 && k_in % (2 * VW) == 0; }

static void stream_grouped_f32(float *out, const float *x, const float *w, int64_t rows, int64_t n_out,
                               int64_t k_in, int num_threads) {
    /* Chunks of at most `fit` rows (7 at most: group_rows' copies), as even as they come (5 rows
     * of 6 KB: 3 and 2). */
    int64_t fit = chunks_pay(k_in) ? GROUP_X_BYTES / (k_in * (int64_t)sizeof(float)) : 7;
    fit = fit < 1 ? 1 : fit > 7 ? 7 : fit;
    const int64_t chunks = (rows + fit - 1) / fit, chunk = (rows + chunks - 1) / chunks;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t group = 0; group < n_out / 16; ++group)
        for (int64_t m0 = 0; m0 < rows; m0 += chunk)
            group_rows(out, x, w, group, n_out, k_in, m0, rows - m0 < chunk ? rows - m0 : chunk);
}

typedef void (*stream_fn)(float *, const float *, const float *, int64_t, int64_t, int);
static const stream_fn STREAMS[17] = {
    NULL, NULL, stream_f32_2, stream_f32_3, stream_f32_4, stream_f32_5, stream_f32_6, stream_f32_7, stream_f32_8,
    stream_f32_9, stream_f32_10, stream_f32_11, stream_f32_12, stream_f32_13, stream_f32_14, stream_f32_15,
    stream_f32_16,
};
#endif

void f32_gemv_f32(float *out, const float *x, const float *w,
                  int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
#if defined(__AVX512F__)
    /* 3-7 rows grouped; 8-16 too where their x would not fit in L1 in one piece: where it does,
     * STREAM's one pass beat the grouped form's chunks (SmolLM2's gate/up, 8-10 rows: 10.2-10.3
     * against 11.1-11.7 ms). */
    if (rows >= 3 && rows <= 16 && groups_fit(n_out, k_in)
        && (rows <= 7 || (rows * k_in * (int64_t)sizeof(float) > GROUP_X_BYTES && chunks_pay(k_in)))) {
        stream_grouped_f32(out, x, w, rows, n_out, k_in, num_threads);
        return;
    }
    if (rows >= 2 && rows <= 16) {
        STREAMS[rows](out, x, w, n_out, k_in, num_threads);
        return;
    }
#endif
    gemv_f32(out, x, w, NULL, rows, n_out, k_in, num_threads);
}

void int8_gemv_f32(float *out, const float *x, const int8_t *w, const float *scale,
                   int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    gemv_int8(out, x, w, scale, rows, n_out, k_in, num_threads);
}

void bf16_gemv_f32(float *out, const float *x, const uint16_t *w,
                   int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    gemv_bf16(out, x, w, NULL, rows, n_out, k_in, num_threads);
}

/* bf16 activations times bf16 weights on a CPU with AVX512-BF16: vdpbf16ps multiplies 32 bf16
 * pairs and adds them into 16 fp32 sums, so neither side is widened first (the widening kernel
 * above spends its time converting from 8 rows on). out[m, n] = bf16(sum_k w[n, k] * x[m, k]),
 * summed in fp32, rounded to nearest even as torch rounds a bf16 GEMM's result. The same
 * W_TILE x (up to 4) tiles of weight rows and activation rows as TILE, 32 columns a step, the
 * next tile prefetched. Returns 0 (nothing computed) where the CPU or the compiler lacks
 * AVX512-BF16. */
#if defined(__AVX512BF16__)
static inline uint16_t round_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define DP_TILE(M)                                                                               \
    static inline void dp_tile_##M(uint16_t *out, const uint16_t *x, const uint16_t *w, int64_t n, \
                                   int64_t nw, int64_t n_out, int64_t k_in) {                    \
        const uint16_t *wr[W_TILE];                                                              \
        for (int j = 0; j < W_TILE; ++j) wr[j] = w + (n + (j < nw ? j : 0)) * k_in;              \
        __m512 acc[W_TILE][M];                                                                   \
        for (int j = 0; j < W_TILE; ++j)                                                         \
            for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();                         \
        const uint16_t *next = w + (n + W_TILE) * k_in;                                          \
        const int64_t ahead = n + 2 * W_TILE <= n_out ? W_TILE * k_in : 0;                       \
        for (int64_t k = 0; k < k_in; k += 32) {                                                 \
            const __mmask32 mask = k_in - k >= 32 ? 0xffffffffu : (1u << (k_in - k)) - 1u;       \
            if (ahead)                                                                           \
                for (int64_t b = 0; b < W_TILE * 64; b += 64)                                    \
                    __builtin_prefetch((const char *)(next + W_TILE * k) + b);                   \
            __m512bh wv[W_TILE];                                                                 \
            for (int j = 0; j < W_TILE; ++j)                                                     \
                wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[j] + k);                     \
            for (int m = 0; m < M; ++m) {                                                        \
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * k_in + k);  \
                for (int j = 0; j < W_TILE; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv[j], xv); \
            }                                                                                    \
        }                                                                                        \
        for (int j = 0; j < nw; ++j)                                                             \
            for (int m = 0; m < M; ++m)                                                          \
                out[m * n_out + n + j] = round_to_bf16(_mm512_reduce_add_ps(acc[j][m]));         \
    }
DP_TILE(1)
DP_TILE(2)
DP_TILE(3)
DP_TILE(4)

int bf16_gemv_bf16(uint16_t *out, const uint16_t *x, const uint16_t *w,
                   int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < n_out; n += W_TILE) {
        const int64_t nw = n_out - n < W_TILE ? n_out - n : W_TILE;
        for (int64_t m = 0; m < rows; m += 4) {
            uint16_t *o = out + m * n_out;
            const uint16_t *xm = x + m * k_in;
            switch (rows - m < 4 ? rows - m : 4) {
            case 1: dp_tile_1(o, xm, w, n, nw, n_out, k_in); break;
            case 2: dp_tile_2(o, xm, w, n, nw, n_out, k_in); break;
            case 3: dp_tile_3(o, xm, w, n, nw, n_out, k_in); break;
            default: dp_tile_4(o, xm, w, n, nw, n_out, k_in); break;
            }
        }
    }
    return 1;
}
#else
int bf16_gemv_bf16(uint16_t *out, const uint16_t *x, const uint16_t *w,
                   int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
    (void)out; (void)x; (void)w; (void)rows; (void)n_out; (void)k_in; (void)num_threads;
    return 0;
}
#endif
