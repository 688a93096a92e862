/* The parts of a bf16 decoder layer between its GEMMs, one C call each over the step's buffers
 * (kernels/cpu/decoder_layer_bf16.py strings them together with the GEMMs, which it calls as
 * the Python path does: the AMX kernel up to its rows, oneDNN's GEMM beyond, to which torch
 * exports no C entry point).
 *
 * The calls are the kernels the Python path runs (elementwise.c's *_bf16 forms, the decode
 * attention), on the same inputs in the same layouts, so the results are bit for bit its own;
 * what goes is the Python between them: the wrappers, the views, the K/V's scatter through
 * index_put and the query's widening in torch. */
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"
#include "decode_attention_fn.h"

typedef void (*norm_fn)(uint16_t *x, const uint16_t *delta, int64_t d_row, int64_t d_col, const uint16_t *w,
                        uint16_t *out, int64_t rows, int64_t dim, float eps, int num_threads);
typedef void (*rope_fn)(uint16_t *out, const uint16_t *x, int64_t x_row, int64_t x_head, int64_t x_col,
                        const uint16_t *cos_t, const uint16_t *sin_t, int64_t rows, int64_t heads, int64_t dim,
                        int num_threads);
typedef void (*silu_fn)(uint16_t *out, const uint16_t *gate_up, int64_t g_row, int64_t g_col, int64_t rows,
                        int64_t inter, int num_threads);

/* amx_gemm.c's entry point: out [m, n] = x [m, k] times a weight packed for it, plus bias. */
typedef void (*gemm_fn)(uint16_t *out, const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m,
                        int64_t n, int64_t k, int num_threads);

struct kernels {
    norm_fn add_rms_norm;
    rope_fn rope;
    silu_fn silu_mul;
    decode_attention_fn attend;  /* NULL where that kernel did not build */
    gemm_fn gemm;                /* NULL where there is no AMX */
};

struct layer {
    const uint16_t *input_norm, *post_norm;
    uint16_t *cache;  /* this layer's [blocks, 2, block_size, kv_heads, head_dim] slice of the KV cache */
    /* The projections packed for `gemm` and their biases (NULL: none), for bf16_decode_step. */
    const uint16_t *qkv, *o, *gate_up, *down;
    const uint16_t *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
};

/* The step's shapes and buffers, shared by every layer (each layer overwrites them). */
struct step {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int num_threads;
    uint16_t *residual;   /* [rows, hidden]: the residual stream, updated in place */
    uint16_t *normed;     /* [rows, hidden] */
    uint16_t *q, *k;      /* [rows, heads | kv_heads, head_dim]: rotated */
    uint16_t *attention;  /* [rows, heads, head_dim]: the decode attention's result, rounded */
    uint16_t *act;        /* [rows, inter] */
    uint16_t *qkv, *o, *gate_up, *mlp_out;  /* the projections' results, for bf16_decode_step */
    float *query32, *out32;                     /* [rows, heads, head_dim]: the decode attention's own */
    const uint16_t *cos_t, *sin_t;              /* [rows, head_dim] */
    const int64_t *slot_blocks, *slot_offsets;  /* [rows]: where each row's K/V goes */
    int64_t s_block, s_kv, s_tok;               /* the cache's strides, in elements */
    /* A step of decode rows alone (one query row per sequence): its block tables [rows,
     * max_blocks] and context lengths [rows], int32, for the attention here; NULL: the caller's. */
    const int32_t *block_tables, *context_lens;
    int64_t max_blocks, block_size;
    float scale;
};


/* residual += delta (none at the first layer; [rows, hidden] contiguous), then the input norm. */
void bf16_input_norm(const struct kernels *kn, const struct layer *l, const struct step *s, const uint16_t *delta) {
    kn->add_rms_norm(s->residual, delta, s->hidden, 1, l->input_norm, s->normed, s->rows, s->hidden, s->eps,
                     s->num_threads);
}

/* residual += the attention's output projection, then the post-attention norm. */
void bf16_post_attention_norm(const struct kernels *kn, const struct layer *l, const struct step *s,
                              const uint16_t *o) {
    kn->add_rms_norm(s->residual, o, s->hidden, 1, l->post_norm, s->normed, s->rows, s->hidden, s->eps,
                     s->num_threads);
}

/* From the QKV projection ([rows, (heads + 2 kv_heads) head_dim], contiguous): q and k rotated,
 * k and v written to each row's cache slot, and for a step of decode rows the attention itself. */
void bf16_attention(const struct kernels *kn, const struct layer *l, const struct step *s, const uint16_t *qkv) {
    const int64_t rows = s->rows, d = s->head_dim;
    const int64_t q_size = s->heads * d, kv_size = s->kv_heads * d, width = q_size + 2 * kv_size;
    kn->rope(s->q, qkv, width, d, 1, s->cos_t, s->sin_t, rows, s->heads, d, s->num_threads);
    kn->rope(s->k, qkv + q_size, width, d, 1, s->cos_t, s->sin_t, rows, s->kv_heads, d, s->num_threads);
    for (int64_t r = 0; r < rows; ++r) {
        if (s->slot_blocks[r] < 0) continue;  /* a padding row (none on the CPU): no slot of its own */
        uint16_t *slot = l->cache + s->slot_blocks[r] * s->s_block + s->slot_offsets[r] * s->s_tok;
        memcpy(slot, s->k + r * kv_size, kv_size * sizeof(uint16_t));
        memcpy(slot + s->s_kv, qkv + r * width + q_size + kv_size, kv_size * sizeof(uint16_t));
    }
    if (!s->block_tables) return;
    const int64_t n = rows * q_size;
    for (int64_t i = 0; i < n; ++i) s->query32[i] = bf16_to_f32(s->q[i]);  /* widened exactly */
    kn->attend(s->out32, s->query32, l->cache, s->block_tables, s->context_lens, rows, s->heads, s->kv_heads, d,
               s->block_size, s->max_blocks, s->s_block, s->s_kv, s->s_tok, d, s->scale, s->num_threads, 1);
    for (int64_t i = 0; i < n; ++i) s->attention[i] = f32_to_bf16(s->out32[i]);
}

/* silu(gate) * up of the gate/up projection ([rows, 2 inter], contiguous) into act. */
void bf16_silu_mul(const struct kernels *kn, const struct step *s, const uint16_t *gate_up) {
    kn->silu_mul(s->act, gate_up, 2 * s->inter, 1, s->rows, s->inter, s->num_threads);
}

/* A step of decode rows whose every projection takes the AMX kernel: every layer in one call, as
 * the calls above and the Python path's GEMMs would run it, into mlp_out. What the layers'
 * Python loop cost between the calls goes too. */
void bf16_decode_step(const struct kernels *kn, const struct layer *layers, int64_t num_layers,
                      const struct step *s) {
    const int64_t rows = s->rows, q_size = s->heads * s->head_dim;
    const int64_t width = q_size + 2 * s->kv_heads * s->head_dim;
    for (int64_t i = 0; i < num_layers; ++i) {
        const struct layer *l = layers + i;
        bf16_input_norm(kn, l, s, i ? s->mlp_out : NULL);
        kn->gemm(s->qkv, s->normed, l->qkv, l->qkv_bias, rows, width, s->hidden, s->num_threads);
        bf16_attention(kn, l, s, s->qkv);
        kn->gemm(s->o, s->attention, l->o, l->o_bias, rows, s->hidden, q_size, s->num_threads);
        bf16_post_attention_norm(kn, l, s, s->o);
        kn->gemm(s->gate_up, s->normed, l->gate_up, l->gate_up_bias, rows, 2 * s->inter, s->hidden, s->num_threads);
        bf16_silu_mul(kn, s, s->gate_up);
        kn->gemm(s->mlp_out, s->act, l->down, l->down_bias, rows, s->hidden, s->inter, s->num_threads);
    }
}
