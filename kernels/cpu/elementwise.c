/* The decoder layer's element-wise steps, each one pass over its rows, for fp32 activations and
 * for bf16 ones (the *_bf16 forms):
 *   add_rms_norm:  x += delta (the residual stream, in place), then out = w * x / rms(x)
 *   silu_mul:      out = silu(gate) * up, from the gate/up projection's [rows, 2 * inter]
 *   rope:          out = x * cos + rotate_half(x) * sin, for each head of each row
 * torch runs each as several passes, each reading and writing the whole activation (RMSNorm:
 * pow, mean, add, rsqrt, two muls); on SmolLM2 they took ~11% of an offline run (py-spy).
 * Inputs are read through (row, column) strides: the layers' products may be transposed views.
 * Rows are spread over OpenMP threads.
 *
 * The bf16 forms round to bf16 (to nearest, ties to even) wherever torch's bf16 ops round, so
 * that they compute what transformers computes in bf16: its add, its RMSNorm (fp32 statistics,
 * the normed row rounded, then times the bf16 weight), silu(gate) rounded then times up, and
 * each product and sum of the rotary form rounded. Their arithmetic is fp32 in between.
 */
#include <math.h>
#include <stdint.h>

#include "bf16_bits.h"

void add_rms_norm_f32(float *x, const float *delta, int64_t d_row, int64_t d_col, const float *w,
                      float *out, int64_t rows, int64_t dim, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = x + r * dim;
        if (delta) {
            const float *dr = delta + r * d_row;
            for (int64_t c = 0; c < dim; ++c) xr[c] += dr[c * d_col];
        }
        float sum = 0.f;
        for (int64_t c = 0; c < dim; ++c) sum += xr[c] * xr[c];
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t c = 0; c < dim; ++c) o[c] = w[c] * (xr[c] * inv);
    }
}

/* silu's exponent, -g, at most 88: e^88 is finite, where e^89 overflows. The build assumes no
 * infinities (-ffast-math), and its division (a reciprocal and a Newton step) turned g / (1 +
 * inf) into NaN: every gate value below -88.7 did (torch: -0). Now such a g gives g / (1 + e^88):
 * 0, or within 1e-36 of it. Above -88 nothing changes. */
#define SILU_EXP(g) fminf(-(g), 88.f)

void silu_mul_f32(float *out, const float *gate_up, int64_t g_row, int64_t g_col, int64_t rows,
                  int64_t inter, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * g_row, *u = g + inter * g_col;
        float *o = out + r * inter;
        if (g_col == 1) {  /* the common, contiguous case: a loop the compiler vectorizes */
            for (int64_t c = 0; c < inter; ++c) o[c] = g[c] / (1.f + expf(SILU_EXP(g[c]))) * u[c];
        } else {
            for (int64_t c = 0; c < inter; ++c) {
                const float gc = g[c * g_col];
                o[c] = gc / (1.f + expf(SILU_EXP(gc))) * u[c * g_col];
            }
        }
    }
}

/* One head's rotary form, x at column stride x_col: a constant 1 in the contiguous call, where
 * the loop vectorizes (restrict: out never overlaps its input); 256 rows of 9 heads of 64:
 * fp32 59 -> 33 us, bf16 (rope_head_bf16) 234 -> 62 us. */
static inline void rope_head_f32(float *restrict o, const float *restrict xh, int64_t x_col,
                                 const float *restrict cr, const float *restrict sr, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float a = xh[i * x_col], b = xh[(i + half) * x_col];
        o[i] = a * cr[i] - b * sr[i];
        o[i + half] = b * cr[i + half] + a * sr[i + half];
    }
}

/* x: [rows, heads, dim] at strides (x_row, x_head, x_col); cos, sin: [rows, dim] contiguous;
 * out: [rows, heads, dim] contiguous. */
void rope_f32(float *out, const float *x, int64_t x_row, int64_t x_head, int64_t x_col,
              const float *cos_t, const float *sin_t, int64_t rows, int64_t heads, int64_t dim,
              int num_threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float *cr = cos_t + r * dim, *sr = sin_t + r * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xh = x + r * x_row + h * x_head;
            float *o = out + (r * heads + h) * dim;
            if (x_col == 1)
                rope_head_f32(o, xh, 1, cr, sr, half);
            else
                rope_head_f32(o, xh, x_col, cr, sr, half);
        }
    }
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, int64_t d_row, int64_t d_col,
                       const uint16_t *w, uint16_t *out, int64_t rows, int64_t dim, float eps,
                       int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t *xr = x + r * dim;
        if (delta) {
            const uint16_t *dr = delta + r * d_row;
            if (d_col == 1)
                for (int64_t c = 0; c < dim; ++c) xr[c] = f32_to_bf16(bf16_to_f32(xr[c]) + bf16_to_f32(dr[c]));
            else
                for (int64_t c = 0; c < dim; ++c) xr[c] = f32_to_bf16(bf16_to_f32(xr[c]) + bf16_to_f32(dr[c * d_col]));
        }
        float sum = 0.f;
        for (int64_t c = 0; c < dim; ++c) {
            const float v = bf16_to_f32(xr[c]);
            sum += v * v;
        }
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        uint16_t *o = out + r * dim;
        for (int64_t c = 0; c < dim; ++c)
            o[c] = f32_to_bf16(bf16_to_f32(w[c]) * round_bf16(bf16_to_f32(xr[c]) * inv));
    }
}

void silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t g_row, int64_t g_col, int64_t rows,
                   int64_t inter, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *g = gate_up + r * g_row, *u = g + inter * g_col;
        uint16_t *o = out + r * inter;
        if (g_col == 1) {  /* contiguous: the loop vectorizes (256 rows: 480 -> 221 us) */
            for (int64_t c = 0; c < inter; ++c) {
                const float gc = bf16_to_f32(g[c]);
                o[c] = f32_to_bf16(round_bf16(gc / (1.f + expf(SILU_EXP(gc)))) * bf16_to_f32(u[c]));
            }
        } else {
            for (int64_t c = 0; c < inter; ++c) {
                const float gc = bf16_to_f32(g[c * g_col]);
                o[c] = f32_to_bf16(round_bf16(gc / (1.f + expf(SILU_EXP(gc)))) * bf16_to_f32(u[c * g_col]));
            }
        }
    }
}

/* rope_head_f32 in bf16, each product and the sum rounded as torch rounds them. */
static inline void rope_head_bf16(uint16_t *restrict o, const uint16_t *restrict xh, int64_t x_col,
                                  const uint16_t *restrict cr, const uint16_t *restrict sr, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float a = bf16_to_f32(xh[i * x_col]), b = bf16_to_f32(xh[(i + half) * x_col]);
        o[i] = f32_to_bf16(round_bf16(a * bf16_to_f32(cr[i])) - round_bf16(b * bf16_to_f32(sr[i])));
        o[i + half] = f32_to_bf16(round_bf16(b * bf16_to_f32(cr[i + half])) +
                                  round_bf16(a * bf16_to_f32(sr[i + half])));
    }
}

/* As rope_f32, on bf16 x, cos and sin. */
void rope_bf16(uint16_t *out, const uint16_t *x, int64_t x_row, int64_t x_head, int64_t x_col,
               const uint16_t *cos_t, const uint16_t *sin_t, int64_t rows, int64_t heads, int64_t dim,
               int num_threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *cr = cos_t + r * dim, *sr = sin_t + r * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t *xh = x + r * x_row + h * x_head;
            uint16_t *o = out + (r * heads + h) * dim;
            if (x_col == 1)
                rope_head_bf16(o, xh, 1, cr, sr, half);
            else
                rope_head_bf16(o, xh, x_col, cr, sr, half);
        }
    }
}
