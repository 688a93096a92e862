/* Decode attention straight from the paged KV cache: one pass over each sequence's K and V,
 * no gather copy. One work item per sequence (spread over OpenMP threads) walks its blocks;
 * a block's K (then V) is one contiguous run, read sequentially, and while it sits in L1 every
 * query head of every KV head uses it. (Splitting work by KV head instead read each row in
 * thirds and measured slower: the prefetcher then fetches the other heads' lines for nothing.)
 *
 * The loops walk blocks, then tokens, then KV heads, then the query heads sharing one: no
 * division in them (an int64 divide per token and head cost more than the arithmetic). Head
 * sizes 64 and 128 get their own copy with the size fixed at compile time, so that a K row and
 * the output accumulators stay in vector registers; other sizes run the same loops generically.
 *
 * The cache holds fp32 or bf16 (`kv_bf16`); queries, scores and sums are fp32 either way, a bf16
 * element widened exactly as it is read, so a bf16 cache costs half the bytes and no precision
 * beyond its own.
 *
 * Layouts (strides in elements):
 *   query, out   [S, H, D] contiguous fp32
 *   kv           one layer of the block-major cache: element (block, kv, token, head, d) at
 *                block * s_block + kv * s_kv + token * s_tok + head * s_head + d
 *   block_tables [S, max_blocks] int32, context_lens [S] int32
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* The cache's element i as fp32: `bf16` is a compile-time constant in every caller, so each copy
 * of the loops reads one type (a bf16 is a float's upper half: widening is exact). */
INLINE float kv_at(const void *kv, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)kv)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)kv)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

typedef struct {
    int64_t num_heads, num_kv_heads, block_size, s_block, s_kv, s_tok, s_head;
    float scale;
} Shape;

/* scores[h * len + t] = scale * q_h . k_t for every head h and token t < len. */
INLINE void scores_of(float *scores, const float *q, const void *kv, const int32_t *table,
                      int64_t len, const Shape *sh, const int64_t D, const int bf16) {
    const int64_t rep = sh->num_heads / sh->num_kv_heads;
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += sh->block_size, ++b) {
        const int64_t block = (int64_t)table[b] * sh->s_block;
        const int64_t n = len - t0 < sh->block_size ? len - t0 : sh->block_size;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t k_row = block + i * sh->s_tok;
            for (int64_t g = 0, h = 0; g < sh->num_kv_heads; ++g) {
                const int64_t k = k_row + g * sh->s_head;
                for (int64_t r = 0; r < rep; ++r, ++h) {
                    const float *qh = q + h * D;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < D; ++d) acc += qh[d] * kv_at(kv, k + d, bf16);
                    scores[h * len + t0 + i] = acc * sh->scale;
                }
            }
        }
    }
}

/* o_h = sum_t p[h * len + t] v_t, a block at a time: one head's accumulator stays in registers
 * over the block's tokens (their V rows for that KV head are in L1 after the first head). */
INLINE void weighted_values(float *o, const float *p, const void *kv, const int32_t *table,
                            int64_t len, const Shape *sh, const int64_t D, const int bf16) {
    const int64_t rep = sh->num_heads / sh->num_kv_heads;
    for (int64_t d = 0; d < sh->num_heads * D; ++d) o[d] = 0.f;
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += sh->block_size, ++b) {
        const int64_t block = (int64_t)table[b] * sh->s_block + sh->s_kv;
        const int64_t n = len - t0 < sh->block_size ? len - t0 : sh->block_size;
        for (int64_t g = 0, h = 0; g < sh->num_kv_heads; ++g) {
            for (int64_t r = 0; r < rep; ++r, ++h) {
                float acc[D];
                const float *ph = p + h * len + t0;
                for (int64_t d = 0; d < D; ++d) acc[d] = o[h * D + d];
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t v = block + i * sh->s_tok + g * sh->s_head;
                    const float w = ph[i];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) acc[d] += w * kv_at(kv, v + d, bf16);
                }
                for (int64_t d = 0; d < D; ++d) o[h * D + d] = acc[d];
            }
        }
    }
}

INLINE void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (int64_t h = 0; h < rows; ++h) {
        float *s = scores + h * len;
        float mx = s[0]; /* not -INFINITY: the build assumes finite math (see kernels/cpu) */
        for (int64_t t = 1; t < len; ++t) mx = s[t] > mx ? s[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
    }
}

INLINE void attend(float *o, const float *q, const void *kv, const int32_t *table, int64_t len,
                   float *scores, const Shape *sh, const int64_t D, const int bf16) {
    scores_of(scores, q, kv, table, len, sh, D, bf16);
    softmax_rows(scores, sh->num_heads, len);
    weighted_values(o, scores, kv, table, len, sh, D, bf16);
}

/* One sequence; the copies for head sizes 64 and 128 and each cache type. */
#define ATTEND(NAME, D, BF16)                                                                    \
    static void NAME(float *o, const float *q, const void *kv, const int32_t *table, int64_t len, \
                     float *scores, const Shape *sh, int64_t head_dim) {                         \
        attend(o, q, kv, table, len, scores, sh, D, BF16);                                       \
    }
ATTEND(attend_f32_d64, 64, 0)
ATTEND(attend_f32_d128, 128, 0)
ATTEND(attend_f32_any, head_dim, 0)
ATTEND(attend_bf16_d64, 64, 1)
ATTEND(attend_bf16_d128, 128, 1)
ATTEND(attend_bf16_any, head_dim, 1)

typedef void (*attend_fn)(float *, const float *, const void *, const int32_t *, int64_t, float *,
                          const Shape *, int64_t);

static void paged_decode_attention(float *out, const float *query, const void *kv,
                                   const int32_t *block_tables, const int32_t *context_lens,
                                   int64_t num_seqs, int64_t head_dim, int64_t max_blocks,
                                   const Shape *sh, attend_fn fn, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = context_lens[s];
        float *scores = (float *)malloc(sizeof(float) * sh->num_heads * len); /* [H, len] */
        fn(out + s * sh->num_heads * head_dim, query + s * sh->num_heads * head_dim, kv,
           block_tables + s * max_blocks, len, scores, sh, head_dim);
        free(scores);
    }
}

/* query and out fp32; `kv_bf16`: the cache holds bf16 (read widened, summed in fp32), else fp32. */
void paged_decode_attention_f32(float *out, const float *query, const void *kv,
                                const int32_t *block_tables, const int32_t *context_lens,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head,
                                float scale, int num_threads, int kv_bf16) {
    const Shape sh = {num_heads, num_kv_heads, block_size, s_block, s_kv, s_tok, s_head, scale};
    attend_fn fn = kv_bf16 ? (head_dim == 64 ? attend_bf16_d64 : head_dim == 128 ? attend_bf16_d128 : attend_bf16_any)
                           : (head_dim == 64 ? attend_f32_d64 : head_dim == 128 ? attend_f32_d128 : attend_f32_any);
    paged_decode_attention(out, query, kv, block_tables, context_lens, num_seqs, head_dim, max_blocks, &sh, fn,
                           num_threads);
}
