/* The decoder layer's element-wise steps for fp32 activations, each one pass over its rows:
 *   add_rms_norm:  x += delta (the residual stream, in place), then out = w * x / rms(x)
 *   silu_mul:      out = silu(gate) * up, from the gate/up projection's [rows, 2 * inter]
 *   rope:          out = x * cos + rotate_half(x) * sin, for each head of each row
 * torch runs each as several passes, each reading and writing the whole activation (RMSNorm:
 * pow, mean, add, rsqrt, two muls); on SmolLM2 they took ~11% of an offline run (py-spy).
 * Inputs are read through (row, column) strides: the layers' products may be transposed views.
 * Rows are spread over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

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

void silu_mul_f32(float *out, const float *gate_up, int64_t g_row, int64_t g_col, int64_t rows,
                  int64_t inter, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * g_row, *u = g + inter * g_col;
        float *o = out + r * inter;
        if (g_col == 1) {  /* the common, contiguous case: a loop the compiler vectorizes */
            for (int64_t c = 0; c < inter; ++c) o[c] = g[c] / (1.f + expf(-g[c])) * u[c];
        } else {
            for (int64_t c = 0; c < inter; ++c) {
                const float gc = g[c * g_col];
                o[c] = gc / (1.f + expf(-gc)) * u[c * g_col];
            }
        }
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
            for (int64_t i = 0; i < half; ++i) {
                const float a = xh[i * x_col], b = xh[(i + half) * x_col];
                o[i] = a * cr[i] - b * sr[i];
                o[i + half] = b * cr[i + half] + a * sr[i + half];
            }
        }
    }
}
