/* A decoder layer's work on either side of its attention, for a step of fp32 rows (a decode
 * step's, or any step's where the projections have packed weights C can call): two C calls a layer in
 * place of ~20 Python-level operations (the norms, the four projections, the two rotary passes,
 * the cache writes, the gated activation, the splits and reshapes between them).
 *
 * Why: a one-row decode step of SmolLM2 spent ~8 of its 26 ms in Python and torch's dispatch
 * between the kernels (perf, the engine thread), and each of those operations runs cold: the
 * weights streamed in between evict the interpreter's data, so one costs 2-3x what it costs in a
 * loop of its own.
 *
 * Every step calls the very kernels the Python path calls (their pointers are handed in:
 * weight_gemv.c's f32_gemv_f32 and int8_gemv_f32; beyond the step's kernel_rows the packed GEMM,
 * MKL's cblas_sgemm_compute or packed_gemm.c's packed_gemm_f32_cblas; elementwise.c's
 * add_rms_norm_f32, rope_f32 and silu_mul_f32), on the same inputs in the same layouts, so the
 * results are bit for bit the Python path's. */
#include <stdint.h>
#include <string.h>

#include "decode_attention_fn.h"

typedef void (*gemv_fn)(float *out, const float *x, const float *w, int64_t rows, int64_t n_out,
                        int64_t k_in, int num_threads);
typedef void (*gemv_int8_fn)(float *out, const float *x, const int8_t *w, const float *scale, int64_t rows,
                             int64_t n_out, int64_t k_in, int num_threads);
typedef void (*norm_fn)(float *x, const float *delta, int64_t d_row, int64_t d_col, const float *w,
                        float *out, int64_t rows, int64_t dim, float eps, int num_threads);
typedef void (*rope_fn)(float *out, const float *x, int64_t x_row, int64_t x_head, int64_t x_col,
                        const float *cos_t, const float *sin_t, int64_t rows, int64_t heads, int64_t dim,
                        int num_threads);
typedef void (*silu_fn)(float *out, const float *gate_up, int64_t g_row, int64_t g_col, int64_t rows,
                        int64_t inter, int num_threads);
/* cblas_sgemm_compute (LP64 MKL: int arguments), on a weight packed by cblas_sgemm_pack; or
 * packed_gemm.c's entry point of the same type, on a weight in its panels. */
typedef void (*packed_gemm_fn)(int layout, int transa, int transb, int m, int n, int k, const float *a, int lda,
                               const void *b, int ldb, float beta, float *c, int ldc);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_PACKED = 151 };

struct kernels {
    gemv_fn gemv;
    norm_fn add_rms_norm;
    rope_fn rope;
    silu_fn silu_mul;
    gemv_int8_fn gemv_int8;
    packed_gemm_fn packed_gemm;  /* the GEMM the layers' packed weights are for; NULL: none */
};

/* One layer's weights, each contiguous [out, in]: fp32, or int8 where the projection has a scale
 * (quantization="int8": per output channel, fp32). Norms and qkv_bias (may be NULL) are fp32. */
struct layer {
    const float *input_norm;
    const void *qkv;
    const float *qkv_bias;
    const void *o;
    const float *post_norm;
    const void *gate_up, *down;
    float *cache;  /* this layer's [blocks, 2, block_size, kv_heads, head_dim] slice of the KV cache */
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    /* The fp32 projections' packed copies (NULL: none), for rows beyond the step's kernel_rows. */
    const void *qkv_packed, *o_packed, *gate_up_packed, *down_packed;
};

/* The step's shapes and buffers, shared by every layer (each layer overwrites them). */
struct step {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int num_threads;
    float *residual;  /* [rows, hidden]: the residual stream, updated in place */
    float *normed;    /* [rows, hidden] */
    float *qkv;       /* [rows, (heads + 2 kv_heads) head_dim]: the projection, v read from it */
    float *q, *k;     /* [rows, heads | kv_heads, head_dim]: rotated */
    float *o;         /* [rows, hidden] */
    float *gate_up;   /* [rows, 2 inter] */
    float *act;       /* [rows, inter] */
    float *mlp_out;   /* [rows, hidden]: the layer's output, the next layer's delta */
    const float *cos_t, *sin_t;                 /* [rows, head_dim] */
    const int64_t *slot_blocks, *slot_offsets;  /* [rows]: where each row's K/V goes */
    int64_t s_block, s_kv, s_tok;               /* the cache's strides, in floats */
    int64_t kernel_rows;  /* up to this many rows fp32 projections take the C kernel, beyond it the packed GEMM */
};

/* x @ w^T for the layer's projection `w`: the int8 kernel where it has a scale; fp32, the C kernel
 * up to the step's kernel_rows and the packed GEMM beyond (as workers/models/llama.py's `linear`). */
static void project(const struct kernels *kn, const struct step *s, float *out, const float *x, const void *w,
                    const float *scale, const void *packed, int64_t n_out, int64_t k_in) {
    if (scale)
        kn->gemv_int8(out, x, (const int8_t *)w, scale, s->rows, n_out, k_in, s->num_threads);
    else if (packed && s->rows > s->kernel_rows)
        kn->packed_gemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_PACKED, (int)s->rows, (int)n_out, (int)k_in, x,
                        (int)k_in, packed, (int)k_in, 0.0f, out, (int)n_out);
    else
        kn->gemv(out, x, (const float *)w, s->rows, n_out, k_in, s->num_threads);
}

/* residual += delta (none at the first layer), the input norm, the QKV projection (+ bias), the
 * rotary form of q and k, and k and v written to the row's cache slot. */
void decoder_pre_attention_f32(const struct kernels *kn, const struct layer *l, const struct step *s,
                               const float *delta) {
    const int64_t rows = s->rows, d = s->head_dim;
    const int64_t q_size = s->heads * d, kv_size = s->kv_heads * d, width = q_size + 2 * kv_size;
    kn->add_rms_norm(s->residual, delta, s->hidden, 1, l->input_norm, s->normed, rows, s->hidden, s->eps,
                     s->num_threads);
    project(kn, s, s->qkv, s->normed, l->qkv, l->qkv_scale, l->qkv_packed, width, s->hidden);
    if (l->qkv_bias)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < width; ++c) s->qkv[r * width + c] += l->qkv_bias[c];
    kn->rope(s->q, s->qkv, width, d, 1, s->cos_t, s->sin_t, rows, s->heads, d, s->num_threads);
    kn->rope(s->k, s->qkv + q_size, width, d, 1, s->cos_t, s->sin_t, rows, s->kv_heads, d, s->num_threads);
    for (int64_t r = 0; r < rows; ++r) {
        if (s->slot_blocks[r] < 0) continue;  /* a padding row (none on the CPU): no slot of its own */
        float *slot = l->cache + s->slot_blocks[r] * s->s_block + s->slot_offsets[r] * s->s_tok;
        memcpy(slot, s->k + r * kv_size, kv_size * sizeof(float));
        memcpy(slot + s->s_kv, s->qkv + r * width + q_size + kv_size, kv_size * sizeof(float));
    }
}

/* The output projection of the attention's result ([rows, heads * head_dim], contiguous), added
 * to the residual stream and normed, then the MLP: gate/up, silu(gate) * up, down (mlp_out). */
void decoder_post_attention_f32(const struct kernels *kn, const struct layer *l, const struct step *s,
                                const float *attention) {
    const int64_t rows = s->rows, q_size = s->heads * s->head_dim;
    project(kn, s, s->o, attention, l->o, l->o_scale, l->o_packed, s->hidden, q_size);
    kn->add_rms_norm(s->residual, s->o, s->hidden, 1, l->post_norm, s->normed, rows, s->hidden, s->eps,
                     s->num_threads);
    project(kn, s, s->gate_up, s->normed, l->gate_up, l->gate_up_scale, l->gate_up_packed, 2 * s->inter, s->hidden);
    kn->silu_mul(s->act, s->gate_up, 2 * s->inter, 1, rows, s->inter, s->num_threads);
    project(kn, s, s->mlp_out, s->act, l->down, l->down_scale, l->down_packed, s->hidden, s->inter);
}

/* A step whose every row is one sequence's next token (a decode, or a token of a small draft
 * chunk, each with its own context length): every layer in one call, the attention on the decode
 * kernel as the CPU backend runs it (one query row per step row, fp32 cache), into `attention`
 * ([rows, heads, head_dim]). What the layers' Python loop and the backend's wrapper cost between
 * the C calls, ~1.5 ms of a one-row step, goes too. */
void decoder_decode_step_f32(const struct kernels *kn, const struct layer *layers, int64_t num_layers,
                             const struct step *s, decode_attention_fn attend, float *attention,
                             const int32_t *block_tables, const int32_t *context_lens, int64_t max_blocks,
                             int64_t block_size, float scale) {
    for (int64_t i = 0; i < num_layers; ++i) {
        const struct layer *l = layers + i;
        decoder_pre_attention_f32(kn, l, s, i ? s->mlp_out : NULL);
        attend(attention, s->q, l->cache, block_tables, context_lens, s->rows, s->heads, s->kv_heads, s->head_dim,
               block_size, max_blocks, s->s_block, s->s_kv, s->s_tok, s->head_dim, scale, s->num_threads, 0);
        decoder_post_attention_f32(kn, l, s, attention);
    }
}
