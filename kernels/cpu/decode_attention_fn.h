/* paged_decode_attention.c's entry point, as a pointer the decoder layers' C calls (its argument
 * list, as kernels/cpu/__init__.py's decode_attention passes it). kernels/cpu/__init__.py's build
 * hashes the headers a source includes with it. */
#ifndef PAGEDSERVE_DECODE_ATTENTION_FN_H
#define PAGEDSERVE_DECODE_ATTENTION_FN_H

#include <stdint.h>

typedef void (*decode_attention_fn)(float *out, const float *query, const void *kv, const int32_t *block_tables,
                                    const int32_t *context_lens, int64_t num_seqs, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                    int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head, float scale,
                                    int num_threads, int kv_bf16);

#endif
