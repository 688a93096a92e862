/* Weight-only linear layers for a few fp32 activation rows (decode at small batch), with fp32
 * accumulation:
 *   fp32:  out[m, n] = sum_k w[n, k] * x[m, k]
 *   int8:  out[m, n] = scale[n] * sum_k w[n, k] * x[m, k]
 *   bf16:  out[m, n] = sum_k w[n, k] * x[m, k]
 * A few rows are bound by reading the weight, which int8 makes a quarter of fp32's and bf16 a
 * half; torch has no fast CPU kernel for either here (int8: see workers/quantization.py; bf16:
 * without native bf16 FMA, torch's bf16 GEMM ran 2-4x slower than fp32's at 16-64 rows), and
 * MKL's fp32 GEMM reaches only half the memory bandwidth at 1 row and 8-12 rows on this CPU.
 * Each 8-wide piece of a weight row is widened once and used by every activation row of a block
 * (8, 4, 2 or 1 rows, fixed at compile time so that the accumulators stay in registers); output
 * rows are spread over OpenMP threads. Measured on SmolLM2's 30 decoder layers (2 cores), int8:
 * 1 row 10 ms against 58 ms for the fp32 GEMV, 8 rows 27 against 69 ms; fp32: 1 row 19 against
 * 36 ms, 8 rows 29 against 44, 12 rows 42 against 70, 16 rows 51 against 54 (MKL, weight-major as
 * the model calls it).
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

static inline float lanes(v8f v) {
    float s = 0.f;
    for (int l = 0; l < 8; ++l) s += v[l];
    return s;
}

/* ROWS known at compile time: the accumulators live in registers. Two pieces of 8 per step,
 * each into its own accumulator, so consecutive FMAs do not wait on each other. `scale` may be
 * NULL (no per-channel scale). */
#define GEMV_ROWS(T, ROWS)                                                                       \
    static void gemv_##T##_##ROWS(float *out, const float *x, const T##_w *w, const float *scale, \
                                  int64_t n_out, int64_t k_in, int num_threads) {                \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                    \
        for (int64_t n = 0; n < n_out; ++n) {                                                    \
            const T##_w *wn = w + n * k_in;                                                      \
            v8f a0[ROWS], a1[ROWS];                                                              \
            for (int m = 0; m < ROWS; ++m) a0[m] = a1[m] = (v8f){0};                             \
            int64_t k = 0;                                                                       \
            for (; k + 16 <= k_in; k += 16) {                                                    \
                const v8f w0 = widen8_##T(wn + k), w1 = widen8_##T(wn + k + 8);                 \
                for (int m = 0; m < ROWS; ++m) {                                                 \
                    a0[m] += w0 * load8(x + m * k_in + k);                                       \
                    a1[m] += w1 * load8(x + m * k_in + k + 8);                                   \
                }                                                                                \
            }                                                                                    \
            for (int m = 0; m < ROWS; ++m) {                                                     \
                float s = lanes(a0[m] + a1[m]);                                                  \
                for (int64_t kk = k; kk < k_in; ++kk) s += one_##T(wn[kk]) * x[m * k_in + kk];  \
                out[m * n_out + n] = scale ? s * scale[n] : s;                                   \
            }                                                                                    \
        }                                                                                        \
    }

/* Rows in blocks of 8, 4, 2, 1: each block one pass over the weight. */
#define GEMV(T)                                                                                  \
    GEMV_ROWS(T, 1)                                                                              \
    GEMV_ROWS(T, 2)                                                                              \
    GEMV_ROWS(T, 4)                                                                              \
    GEMV_ROWS(T, 8)                                                                              \
    static void gemv_##T(float *out, const float *x, const T##_w *w, const float *scale,         \
                         int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {           \
        int64_t m = 0;                                                                           \
        while (m < rows) {                                                                       \
            const int64_t left = rows - m;                                                       \
            const int64_t block = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;             \
            float *o = out + m * n_out;                                                          \
            const float *xm = x + m * k_in;                                                      \
            if (block == 8) gemv_##T##_8(o, xm, w, scale, n_out, k_in, num_threads);             \
            else if (block == 4) gemv_##T##_4(o, xm, w, scale, n_out, k_in, num_threads);        \
            else if (block == 2) gemv_##T##_2(o, xm, w, scale, n_out, k_in, num_threads);        \
            else gemv_##T##_1(o, xm, w, scale, n_out, k_in, num_threads);                        \
            m += block;                                                                          \
        }                                                                                        \
    }

typedef float f32_w;
typedef int8_t int8_w;
typedef uint16_t bf16_w;
GEMV(f32)
GEMV(int8)
GEMV(bf16)

void f32_gemv_f32(float *out, const float *x, const float *w,
                  int64_t rows, int64_t n_out, int64_t k_in, int num_threads) {
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
