/* Decode attention straight from the paged KV cache: one pass over each sequence's K and V,
 * no gather copy. One work item per sequence (spread over OpenMP threads) walks its blocks
 * token row by token row, all heads at once: a block's K (then V) is one contiguous run, read
 * sequentially. (Splitting work by KV head instead read each row in thirds and measured
 * slower: the prefetcher then fetches the other heads' lines for nothing.)
 *
 * Layouts (fp32):
 *   query, out   [S, H, D] contiguous
 *   kv           one layer of the block-major cache: element (block, kv, token, head, d) at
 *                block * s_block + kv * s_kv + token * s_tok + head * s_head + d
 *   block_tables [S, max_blocks] int32, context_lens [S] int32
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void paged_decode_attention_f32(float *out, const float *query, const float *kv,
                                const int32_t *block_tables, const int32_t *context_lens,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head,
                                float scale, int num_threads) {
    const int64_t rep = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = context_lens[s];
        const int32_t *table = block_tables + s * max_blocks;
        const float *q = query + s * num_heads * head_dim;
        float *o = out + s * num_heads * head_dim;
        float *scores = (float *)malloc(sizeof(float) * num_heads * len);  /* [H, len] */
        for (int64_t t = 0; t < len; ++t) {
            const float *k_row = kv + table[t / block_size] * s_block + (t % block_size) * s_tok;
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *k = k_row + (h / rep) * s_head;
                const float *qh = q + h * head_dim;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < head_dim; ++d) acc += qh[d] * k[d];
                scores[h * len + t] = acc * scale;
            }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            float *sh = scores + h * len;
            float mx = -INFINITY;
            for (int64_t t = 0; t < len; ++t) mx = sh[t] > mx ? sh[t] : mx;
            float sum = 0.f;
            for (int64_t t = 0; t < len; ++t) { sh[t] = expf(sh[t] - mx); sum += sh[t]; }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
            for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = 0.f;
        }
        for (int64_t t = 0; t < len; ++t) {
            const float *v_row = kv + table[t / block_size] * s_block + s_kv + (t % block_size) * s_tok;
            for (int64_t h = 0; h < num_heads; ++h) {
                const float p = scores[h * len + t];
                const float *v = v_row + (h / rep) * s_head;
                float *oh = o + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) oh[d] += p * v[d];
            }
        }
        free(scores);
    }
}
