/* Decode attention straight from the paged KV cache: one pass over each sequence's K and V,
 * no gather copy. One work item per sequence (spread over OpenMP threads; a context past 1,024
 * tokens is one per part of up to 1,024, see `part_blocks_of`) walks its blocks;
 * a block's K (then V) is one contiguous run, read sequentially, and while it sits in L1 every
 * query head of every KV head uses it. (Splitting work by KV head instead read each row in
 * thirds and measured slower: the prefetcher then fetches the other heads' lines for nothing.)
 *
 * The loops walk blocks, then tokens, then KV heads, then the query heads sharing one: no
 * division in them (an int64 divide per token and head cost more than the arithmetic). Head
 * sizes 64 and 128 get their own copy of the vector path (attend_vec) with the size fixed at
 * compile time, so that K rows and the output accumulators stay in vector registers; other sizes
 * run the scalar loops (scores_of, softmax_rows, weighted_values) generically.
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
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16_bits.h"
#include "sum16.h"

#define INLINE static inline __attribute__((always_inline))

/* The cache's element i as fp32: `bf16` is a compile-time constant in every caller, so each copy
 * of the loops reads one type (a bf16 is a float's upper half: widening is exact). */
INLINE float kv_at(const void *kv, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)kv)[i]) : ((const float *)kv)[i];
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

/* The vector path, for head sizes that are a multiple of 16 (64 and 128 get their own copies).
 * The scalar loops above ran at 9 GB/s on one core of this machine, which reads 37 GB/s, bound
 * by latency: each score was a chain of 4 dependent FMAs and a horizontal sum. Here the 16
 * tokens' partial dot products are independent, and one transpose-and-add folds all 16 into one
 * vector of scores; the weighted sum keeps several query heads' accumulators in registers, so a
 * V row is read once for all the heads that share it; the next block is prefetched. 4 decodes of
 * 1,200 tokens, 30 layers of SmolLM2, one core: 23.9 -> 14.0 ms a step (9.3 -> 15.8 GB/s), with
 * scores and values still in two passes (attend_vec below does one).
 * GCC vector extensions of W floats, a vector register: 16 with AVX-512. Without it (AVX2, 16
 * registers of 8 floats) the 16-float form was lowered into pairs and spilled to the stack, and
 * ran at 6.9 GB/s on an AMD EPYC's 2 cores (64 decodes of 300 tokens, 30 layers): there a score
 * vector holds 8 keys, and the values pass takes 2 heads, 32 of their output floats at a time:
 * 14-16 GB/s (128 -> 56-61 ms). With AVX-512 the code compiles as it did before W. */
#if defined(__AVX512F__)
#define W 16
#define VALUE_HEADS(D) ((D) <= 64 ? 4 : 2) /* accumulators: at most 16 of the 32 vector registers */
#define VALUE_PASSES(D) 1                  /* values_tile's passes over a block's tokens */
#define sumw sum16
#else
#define W 8
#define VJ(D) 4
#define VALUE_HEADS(D) 2
#define VALUE_PASSES(D) ((D) / W / VJ(D))
#define sumw sum8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
#define MAX_D 128 /* the vector path's head sizes: 64 and 128 */
/* W floats at any float's address, read and written as one vector. A memcpy to or from a 16-float
 * vector can become two 256-bit moves through the stack and one 512-bit access, which the store
 * buffer cannot forward (it stalled the prefill kernel's values loop for a fifth of its time). */
typedef float vf_unaligned __attribute__((vector_size(4 * W), aligned(4)));
INLINE vf loadu(const float *p) { return *(const vf_unaligned *)p; }
INLINE void storeu(float *p, vf v) { *(vf_unaligned *)p = v; }

INLINE vf loadw(const void *kv, int64_t i, const int bf16) {
    if (!bf16) return loadu((const float *)kv + i);
#if defined(__AVX512F__)
    /* One vpmovzxwd to 512 bits and a shift. GCC's own conversion of the generic vector below
     * split it into four 128-bit vpmovzxwd, extracts and inserts (it prefers 256-bit vectors on
     * this CPU). 16 decodes of 350 tokens, 30 layers of SmolLM2, bf16, interleaved runs: one core
     * 29.7 -> 24.7 ms, two 15.6 -> 13.7. */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + i))), 16);
#else
    vh h;
    memcpy(&h, (const uint16_t *)kv + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16); /* a bf16 is a float's upper half */
#endif
}

/* Software prefetch of the next block, into L2, spread over the current one: while a block's
 * scores read its K, the next block's K is asked for, and while its values read V, the next
 * block's V (a layer's block is a few KB of the cache, the next one a whole block's layers away,
 * and the hardware's prefetcher stops at each page it has not seen). `parts` calls to
 * prefetch_step ask for `lines` lines between them, a running remainder spreading them with no
 * division (two int64 divisions a call once took a third of the kernel's samples).
 * History: asked for all at once and into L1 (the first form), the next block's K and V (24 KB,
 * SmolLM2, fp32) evicted the block being read and stalled the loads behind a burst of misses:
 * 30 layers of 64 decodes of 300 tokens (Xeon, 2 threads) 64.0 -> 57.4 ms. Then into L2, both of
 * the next block's K and V during the first W keys of the scores: on a Xeon 46.0-49.1 -> 44.4-44.9
 * ms. On an AMD EPYC (Zen 3, AVX2: 32 KB L1, a score vector of 8 keys) that schedule left the
 * kernel at 13-16 GB/s where a plain walk of the same blocks reads 25-28; spread over all the
 * scores' keys, then split as here (V during the scores, the next K during the values, at most
 * one block in flight), best of 15 alternated runs: 64 x 300 56.6 -> 44.9 ms, 16 x 350 17.6 ->
 * 13.1, 4 x 1,200 14.1 -> 10.5, 64 x 100 22.5 -> 17.7. Which prefetch level made no difference.
 * On an AMD EPYC Zen 4 (AVX-512), that split asked for a block's V only a scores pass before its
 * values read it; asking a whole block ahead for both (the next K during the scores, the next V
 * during the values), best of 9 alternated, fp32: 64 decodes of 300-800 tokens 86.6 -> 77.2 ms,
 * 16 of 20-600 10.3 -> 9.3, 4 of 1,000-1,400 9.7 -> 8.5, 64 of 50-150 alike; bf16 64 x 300-800
 * 45.5 -> 42.8; the AVX2 build on the same CPU, fp32, 83.0 -> 76.5 and 9.2 -> 8.8. Two blocks
 * ahead measured no better, into L1 worse (100.5 ms). */
typedef struct {
    const char *line; /* the run's first line */
    int64_t lines, parts, done, remainder;
} Prefetch;

/* The run of `bytes` at `start`, in `parts` calls; an empty one where `start` is NULL. */
INLINE Prefetch prefetch_run(const char *start, int64_t bytes, int64_t parts) {
    Prefetch p = {start, start ? (bytes + 63) / 64 : 0, parts, 0, 0};
    return p;
}

/* Call j of `parts` asks for lines [j * lines / parts, (j + 1) * lines / parts). */
INLINE void prefetch_step(Prefetch *p) {
    for (p->remainder += p->lines; p->remainder >= p->parts; p->remainder -= p->parts, ++p->done)
        __builtin_prefetch(p->line + 64 * p->done, 0, 1); /* locality 1: L2 (x86's prefetcht2) */
}

/* o_h += sum_t p_h[t] v_t over one block's n tokens for RT query heads h0.. of one KV head (head
 * h's weights at p + h * p_stride): the RT heads' outputs stay in registers (without AVX-512,
 * VJ(D) vectors of each at a time), each V row (piece) is loaded once for them. A step of `ahead`
 * per token and pass over the tokens (VALUE_PASSES(D) of them). */
INLINE void values_tile(float *o, const float *p, const void *kv, int64_t v0, int64_t n, int64_t s_tok,
                        int64_t p_stride, int64_t h0, const int RT, const int64_t D, const int bf16,
                        Prefetch *ahead) {
#if defined(__AVX512F__)
    vf acc[4][MAX_D / W]; /* fixed sizes: registers once RT and D are constants */
    for (int r = 0; r < RT; ++r)
        for (int64_t j = 0; j < D / W; ++j) acc[r][j] = loadu(o + (h0 + r) * D + W * j);
    for (int64_t i = 0; i < n; ++i) {
        prefetch_step(ahead);
        vf v[MAX_D / W];
        for (int64_t j = 0; j < D / W; ++j) v[j] = loadw(kv, v0 + i * s_tok + W * j, bf16);
        for (int r = 0; r < RT; ++r) {
            const float w = p[(h0 + r) * p_stride + i];
            for (int64_t j = 0; j < D / W; ++j) acc[r][j] += w * v[j];
        }
    }
    for (int r = 0; r < RT; ++r)
        for (int64_t j = 0; j < D / W; ++j) storeu(o + (h0 + r) * D + W * j, acc[r][j]);
#else
    for (int64_t j0 = 0; j0 < D / W; j0 += VJ(D)) {
        vf acc[4][VJ(D)]; /* fixed sizes: registers once RT and D are constants */
        for (int r = 0; r < RT; ++r)
            for (int64_t j = 0; j < VJ(D); ++j) acc[r][j] = loadu(o + (h0 + r) * D + W * (j0 + j));
        for (int64_t i = 0; i < n; ++i) {
            prefetch_step(ahead);
            vf v[VJ(D)];
            for (int64_t j = 0; j < VJ(D); ++j) v[j] = loadw(kv, v0 + i * s_tok + W * (j0 + j), bf16);
            for (int r = 0; r < RT; ++r) {
                const float w = p[(h0 + r) * p_stride + i];
                for (int64_t j = 0; j < VJ(D); ++j) acc[r][j] += w * v[j];
            }
        }
        for (int r = 0; r < RT; ++r)
            for (int64_t j = 0; j < VJ(D); ++j) storeu(o + (h0 + r) * D + W * (j0 + j), acc[r][j]);
    }
#endif
}

/* Whether every one of the n floats is a bf16 (its low 16 bits zero), as a bf16 model's queries
 * are. Against a bf16 cache such a query's scores take AVX512-BF16's dot products (vdpbf16ps) on
 * the K rows as they are, where the widened loop widened each K row once per query head; the
 * products are exact in fp32 either way, only summed in another order (and subnormals flushed).
 * 16 decodes of 22-595 tokens, 30 layers of SmolLM2, 2 threads: 4.9 -> 4.6 ms. */
INLINE int bf16_exact(const float *x, int64_t n) {
    uint32_t low = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        low |= u & 0xffffu;
    }
    return low == 0;
}

/* One pass (the vector path): block by block, the block's scores for every head, then the
 * running softmax (each head's maximum and sum so far; its accumulated output rescaled when the
 * maximum grows), then the block's values. A block's K and V lie next to each other in the
 * cache, so the sequence's K/V is read once, front to back, and the scores never leave L1. (All
 * scores first, then all values, measured 8% slower: 18.5 against 17.1 ms for 4 x 1,200 tokens,
 * 46.0 against 43.7 for 32 x 300, interleaved runs.) `scores`: room for num_heads x block_size
 * floats.
 * Over the blocks [b_lo, b_hi) of the context only (a part of a split sequence, see `parts_of`)
 * when `part` is given: o is left unnormalized and each head's running maximum and sum go to
 * part->mx and part->sum, for `merge_parts`. */
typedef struct {
    float *mx, *sum; /* [num_heads] each */
} Partial;

INLINE void attend_vec(float *o, const float *q, const void *kv, const int32_t *table, int64_t len,
                       float *scores, const Shape *sh, const int64_t D, const int bf16, int64_t b_lo, int64_t b_hi,
                       const Partial *part) {
    const int64_t H = sh->num_heads, rep = H / sh->num_kv_heads, bs = sh->block_size;
    if (b_hi * bs < len) len = b_hi * bs; /* the part's last token */
#if defined(__AVX512BF16__)
    const int q_bf16 = bf16 && bf16_exact(q, H * D);
#endif
    const int tile = VALUE_HEADS(D);
    const int64_t elem = bf16 ? 2 : 4;
    float mx[H], sum[H];
    for (int64_t h = 0; h < H; ++h) mx[h] = -3.0e38f, sum[h] = 0.f; /* finite: see softmax_rows */
    for (int64_t d = 0; d < H * D; ++d) o[d] = 0.f;
    for (int64_t b = b_lo, t0 = b_lo * bs; t0 < len; t0 += bs, ++b) {
        const int64_t block = (int64_t)table[b] * sh->s_block;
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const char *k_next = t0 + bs < len ? (const char *)kv + (int64_t)table[b + 1] * sh->s_block * elem : NULL;
        const int64_t n_next = len - t0 - bs < bs ? len - t0 - bs : bs;
        /* The scores step once per head and group of W keys, the values once per token, tile and
         * pass. (Once per key, the scores' steps were a loop and a branch beside each key's 8 FMAs:
         * stepping per group of keys, with the whole-vector store of the scores below, 64 decodes of
         * 300 tokens, 30 layers, AMD EPYC, 2 threads, 15 alternated runs: 47.1 -> 44.4 ms.) */
        Prefetch k_ahead = prefetch_run(k_next, n_next * sh->s_tok * elem, H * ((n + W - 1) / W));
        Prefetch v_ahead = prefetch_run(k_next ? k_next + sh->s_kv * elem : NULL, n_next * sh->s_tok * elem,
                                        sh->num_kv_heads * ((rep + tile - 1) / tile) * n * VALUE_PASSES(D));
        for (int64_t i0 = 0; i0 < n; i0 += W) {
            const int64_t m = n - i0 < W ? n - i0 : W;
            for (int64_t g = 0, h = 0; g < sh->num_kv_heads; ++g) {
                const int64_t k0 = block + i0 * sh->s_tok + g * sh->s_head;
                for (int64_t r = 0; r < rep; ++r, ++h) {
                    prefetch_step(&k_ahead);
                    vf part[W];
#if defined(__AVX512BF16__)
                    if (bf16 && q_bf16) { /* see bf16_exact */
                        __m512bh qb[MAX_D / 32];
                        for (int64_t j = 0; j < D / 32; ++j)
                            qb[j] = _mm512_cvtne2ps_pbh((__m512)loadu(q + h * D + 32 * j + 16),
                                                        (__m512)loadu(q + h * D + 32 * j));
                        for (int64_t i = 0; i < W; ++i) {
                            __m512 p = _mm512_setzero_ps();
                            if (i < m) {
                                const uint16_t *k = (const uint16_t *)kv + k0 + i * sh->s_tok;
                                for (int64_t j = 0; j < D / 32; ++j)
                                    p = _mm512_dpbf16_ps(p, qb[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
                            }
                            part[i] = (vf)p;
                        }
                    } else
#endif
                    {
                        vf qv[MAX_D / W];
                        for (int64_t j = 0; j < D / W; ++j) qv[j] = loadu(q + h * D + W * j);
                        for (int64_t i = 0; i < W; ++i) {
                            vf p = {0};
                            if (i < m)
                                for (int64_t j = 0; j < D / W; ++j)
                                    p += qv[j] * loadw(kv, k0 + i * sh->s_tok + W * j, bf16);
                            part[i] = p;
                        }
                    }
                    const vf sc = sumw(part) * sh->scale;
                    if (m == W) storeu(scores + h * bs + i0, sc); /* GCC made the loop a `rep movs` */
                    else for (int64_t i = 0; i < m; ++i) scores[h * bs + i0 + i] = sc[i];
                }
            }
        }
        for (int64_t h = 0; h < H; ++h) {
            float *s = scores + h * bs, bmax = mx[h];
            for (int64_t i = 0; i < n; ++i) bmax = s[i] > bmax ? s[i] : bmax;
            if (bmax > mx[h]) { /* earlier terms shrink by exp(old - new) */
                const float c = expf(mx[h] - bmax);
                sum[h] *= c;
                for (int64_t d = 0; d < D; ++d) o[h * D + d] *= c;
                mx[h] = bmax;
            }
            float add = 0.f;
#pragma omp simd reduction(+ : add)
            for (int64_t i = 0; i < n; ++i) { s[i] = expf(s[i] - bmax); add += s[i]; }
            sum[h] += add;
        }
        for (int64_t g = 0; g < sh->num_kv_heads; ++g) {
            const int64_t v0 = block + sh->s_kv + g * sh->s_head;
            for (int64_t r0 = 0; r0 < rep; r0 += tile) {
                const int64_t h0 = g * rep + r0;
                switch (rep - r0 < tile ? rep - r0 : tile) {
                case 1: values_tile(o, scores, kv, v0, n, sh->s_tok, bs, h0, 1, D, bf16, &v_ahead); break;
                case 2: values_tile(o, scores, kv, v0, n, sh->s_tok, bs, h0, 2, D, bf16, &v_ahead); break;
                case 3: values_tile(o, scores, kv, v0, n, sh->s_tok, bs, h0, 3, D, bf16, &v_ahead); break;
                default: values_tile(o, scores, kv, v0, n, sh->s_tok, bs, h0, 4, D, bf16, &v_ahead); break;
                }
            }
        }
    }
    if (part) {
        memcpy(part->mx, mx, sizeof mx);
        memcpy(part->sum, sum, sizeof sum);
        return;
    }
    for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.f / sum[h];
        for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inv;
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
                   float *scores, const Shape *sh, const int64_t D, const int bf16, const int vec,
                   int64_t b_lo, int64_t b_hi, const Partial *part) {
    if (vec) {
        attend_vec(o, q, kv, table, len, scores, sh, D, bf16, b_lo, b_hi, part);
        return;
    }
    scores_of(scores, q, kv, table, len, sh, D, bf16);
    softmax_rows(scores, sh->num_heads, len);
    weighted_values(o, scores, kv, table, len, sh, D, bf16);
}

/* One sequence, or the blocks [b_lo, b_hi) of it (the vector path only); the copies for head
 * sizes 64 and 128 and each cache type. */
#define ATTEND(NAME, D, BF16, VEC)                                                                    \
    static void NAME(float *o, const float *q, const void *kv, const int32_t *table, int64_t len,      \
                     float *scores, const Shape *sh, int64_t head_dim, int64_t b_lo, int64_t b_hi,     \
                     const Partial *part) {                                                           \
        attend(o, q, kv, table, len, scores, sh, D, BF16, VEC, b_lo, b_hi, part);                     \
    }
ATTEND(attend_f32_d64, 64, 0, 1)
ATTEND(attend_f32_d128, 128, 0, 1)
ATTEND(attend_f32_any, head_dim, 0, 0)
ATTEND(attend_bf16_d64, 64, 1, 1)
ATTEND(attend_bf16_d128, 128, 1, 1)
ATTEND(attend_bf16_any, head_dim, 1, 0)

typedef void (*attend_fn)(float *, const float *, const void *, const int32_t *, int64_t, float *,
                          const Shape *, int64_t, int64_t, int64_t, const Partial *);

/* A context past DECODE_SPLIT_FROM tokens splits into parts of about equal length, one per
 * PART_TOKENS tokens begun (whole blocks; the last part may be a little shorter), each its own
 * work item, merged after (flash-decoding): one sequence's decode then runs on every thread,
 * not one. Whether and where a context splits depends on its length alone, never on the batch,
 * so a sequence's result is the same bits whatever else the step holds (a speculative verify
 * step's rows match the plain decodes of the same positions). Shorter contexts stay whole: a
 * batch of them already spreads over the threads, and each part's first block goes
 * unprefetched. SmolLM2's shape, 30 layers, 2 threads, Zen 4 (decode_attention_split.py): one
 * stream of 1,200-8,192 tokens 1.39-1.49x faster in fp32, 1.33-1.76x in bf16; a batch of 32
 * streams of 1-2k tokens within the runs' noise in fp32 (0.97-1.03x), 3-9% slower in bf16 (with
 * parts of 512 tokens: 5-8% in both). */
#ifndef DECODE_SPLIT_FROM
#define DECODE_SPLIT_FROM 1024 /* benchmarks/decode_attention_split.py builds the kernel without it */
#endif
#define PART_TOKENS 1024

/* The blocks in each part of a context of `len` tokens (all of them: one part). */
static int64_t part_blocks_of(int64_t len, int64_t block_size) {
    const int64_t blocks = (len + block_size - 1) / block_size;
    if (len <= DECODE_SPLIT_FROM) return blocks;
    const int64_t parts = (len + PART_TOKENS - 1) / PART_TOKENS;
    return (blocks + parts - 1) / parts;
}

static int64_t parts_of(int64_t len, int64_t block_size) {
    if (len <= DECODE_SPLIT_FROM) return 1; /* also an empty context: no division by its 0 blocks */
    const int64_t blocks = (len + block_size - 1) / block_size, part_blocks = part_blocks_of(len, block_size);
    return (blocks + part_blocks - 1) / part_blocks;
}

/* o = the parts' outputs combined: each part's unnormalized output and sums rescaled to the
 * largest maximum among them, summed in part order, then normalized. */
static void merge_parts(float *o, const float *part_o, const float *mx, const float *sum, int64_t parts,
                        int64_t num_heads, int64_t head_dim) {
    for (int64_t h = 0; h < num_heads; ++h) {
        float top = mx[h], total = 0.f;
        for (int64_t p = 1; p < parts; ++p) top = mx[p * num_heads + h] > top ? mx[p * num_heads + h] : top;
        float *oh = o + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) oh[d] = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
            const float c = expf(mx[p * num_heads + h] - top);
            total += sum[p * num_heads + h] * c;
            const float *ph = part_o + (p * num_heads + h) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) oh[d] += ph[d] * c;
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < head_dim; ++d) oh[d] *= inv;
    }
}

static void paged_decode_attention(float *out, const float *query, const void *kv,
                                   const int32_t *block_tables, const int32_t *context_lens,
                                   int64_t num_seqs, int64_t head_dim, int64_t max_blocks,
                                   const Shape *sh, attend_fn fn, int vec, int num_threads) {
    const int64_t H = sh->num_heads, bs = sh->block_size;
    /* Work items: a sequence (part -1), or one part of a split one; the parts first, so that the
     * dynamic schedule ends evenly. Sequence s runs in parts[s] parts, whose partial results sit
     * at first_part[s] onward (-1: not split). */
    int64_t *parts = malloc(sizeof(int64_t) * (num_seqs + 1)), *first_part = malloc(sizeof(int64_t) * (num_seqs + 1));
    int64_t num_parts = 0, num_whole = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        parts[s] = vec ? parts_of(context_lens[s], bs) : 1;
        first_part[s] = parts[s] > 1 ? num_parts : -1;
        num_parts += parts[s] > 1 ? parts[s] : 0;
        num_whole += parts[s] == 1;
    }
    int32_t(*items)[2] = malloc(sizeof *items * (num_whole + num_parts + 1));
    float *part_o = NULL, *part_mx = NULL, *part_sum = NULL;
    if (num_parts) {
        part_o = malloc(sizeof(float) * num_parts * H * head_dim);
        part_mx = malloc(sizeof(float) * num_parts * H * 2);
        part_sum = part_mx + num_parts * H;
    }
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        for (int64_t j = 0; parts[s] > 1 && j < parts[s]; ++j) items[n][0] = (int32_t)s, items[n++][1] = (int32_t)j;
    for (int64_t s = 0; s < num_seqs; ++s)
        if (parts[s] == 1) items[n][0] = (int32_t)s, items[n++][1] = -1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) {
            const int64_t s = items[i][0], j = items[i][1], len = context_lens[s];
            /* The vector path keeps one block's scores, [H, block_size]; the scalar loops all of
             * them, [H, len]. (Sized by the context for both, SmolLM2's 9 heads at 32k tokens took
             * 1.2 MB a sequence and layer where the vector path uses 576 bytes.) */
            const int64_t tokens = vec || len < bs ? bs : len;
            float *scores = (float *)malloc(sizeof(float) * H * tokens);
            const float *q = query + s * H * head_dim;
            const int32_t *table = block_tables + s * max_blocks;
            if (j < 0) {
                fn(out + s * H * head_dim, q, kv, table, len, scores, sh, head_dim, 0, (len + bs - 1) / bs, NULL);
            } else {
                const int64_t at = first_part[s] + j, part_blocks = part_blocks_of(len, bs);
                const Partial part = {part_mx + at * H, part_sum + at * H};
                fn(part_o + at * H * head_dim, q, kv, table, len, scores, sh, head_dim, j * part_blocks,
                   (j + 1) * part_blocks, &part);
            }
            free(scores);
        }
        if (num_parts) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t s = 0; s < num_seqs; ++s) {
                const int64_t at = first_part[s];
                if (at >= 0)
                    merge_parts(out + s * H * head_dim, part_o + at * H * head_dim, part_mx + at * H, part_sum + at * H,
                                parts[s], H, head_dim);
            }
        }
    }
    free(items);
    free(parts);
    free(first_part);
    free(part_o);
    free(part_mx);
}

/* query and out fp32; `kv_bf16`: the cache holds bf16 (read widened, summed in fp32), else fp32. */
void paged_decode_attention_f32(float *out, const float *query, const void *kv,
                                const int32_t *block_tables, const int32_t *context_lens,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head,
                                float scale, int num_threads, int kv_bf16) {
    const Shape sh = {num_heads, num_kv_heads, block_size, s_block, s_kv, s_tok, s_head, scale};
    const int vec = head_dim == 64 || head_dim == 128;
    attend_fn fn = kv_bf16 ? (head_dim == 64 ? attend_bf16_d64 : head_dim == 128 ? attend_bf16_d128 : attend_bf16_any)
                           : (head_dim == 64 ? attend_f32_d64 : head_dim == 128 ? attend_f32_d128 : attend_f32_any);
    paged_decode_attention(out, query, kv, block_tables, context_lens, num_seqs, head_dim, max_blocks, &sh, fn,
                           vec, num_threads);
}
