/* Prefill attention straight from the paged KV cache, flash-style: for fp32 queries over fp32
 * caches, and (on CPUs with AVX512-BF16) bf16 queries over bf16 caches, head sizes 64 and 128,
 * every prompt chunk of a step (fresh, or over cached context) in one call, with no gather copy,
 * no mask tensor and no [rows, context] score matrix.
 *
 * Work is split into tiles: one KV head and up to TILE consecutive query positions of one
 * sequence, whose rows are those positions' `rep` query heads sharing that KV head (GQA), so a
 * K/V block read once serves TILE * rep rows. A tile transposes its rows' queries once, [D][rows],
 * then walks its context block by block, KEYS keys at a time: a score vector holds W rows' scores
 * for one key, built by D FMAs of a query column and a broadcast element of the key row as the
 * cache holds it (2 row vectors x KB keys per pass); the running softmax (each row's maximum and
 * sum so far, its output rescaled when the maximum grows) is then W rows at a time, its
 * exponentials inline (vexp); then the block's V rows are added into a few rows' accumulators at
 * a time. Causality is a mask on the scores of the groups the diagonal crosses; blocks past a
 * tile's last position are never read.
 * Tiles go to OpenMP threads dynamically: causal tiles late in a prompt cost more than early ones.
 *
 * Why: torch's SDPA ran these shapes (SmolLM2: 9 query / 3 KV heads of 64, prompts of 20-600
 * tokens) at 43-65 GFLOP/s on this machine's 2 cores against 176 for a GEMM, and chunks over
 * cached context first gathered their blocks and built a boolean mask.
 *
 * bf16: the scores take vdpbf16ps, a query row vector holding W rows' pairs of elements (the
 * queries transposed into [D/2][rows] pairs, unscaled: the scale multiplies the fp32 scores) and
 * a key's pair broadcast, so products are exact and sums fp32, as in the decode kernel. The values
 * take vdpbf16ps too, over pairs of keys (values_pass_bf16): the weights rounded to bf16 for it, as
 * a GPU's flash attention rounds its probabilities, the sums fp32; the output is rounded to bf16
 * (nearest, even) once. On an AMD EPYC (Zen 4, 2 cores), SmolLM2's 16 benchmark prompts (21-593
 * tokens), one layer: torch's bf16 SDPA 36-46 ms, this kernel's fp32 path 16-19 ms, its bf16 path
 * 12-15 ms with V widened to fp32 for FMAs; pairs of keys in dot products took a further 10-18% off
 * prompts of 100-2,000 tokens (3-6% at 128).
 *
 * Layouts (strides in elements):
 *   query, out   [T, H, D] contiguous, the cache's dtype (the step's rows; sequence s's rows start at
 *                q_start[s])
 *   kv           one layer of the block-major cache: element (block, kv, token, head, d) at
 *                block * s_block + kv * s_kv + token * s_tok + head * s_head + d
 *   block_tables [S, max_blocks] int32; q_start, q_len, ctx_len [S] int32 (query i of sequence s
 *                sits at position ctx_len - q_len + i and attends to keys 0..that position)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_bits.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAS_BF16 1
#else
#define HAS_BF16 0
#endif

#define INLINE static inline __attribute__((always_inline))
#define TILE 16     /* query positions per tile */
#define MAX_REP 8   /* query heads per KV head */
#define MAX_D 128

/* The vector width: a register's floats. With AVX-512, the values pass keeps 4 rows' whole output
 * in registers (16 vectors at D = 64). Without it (AVX2: 16 registers of 8 floats) GCC lowered
 * 16-float vectors into pairs and spilled them to the stack (9 GFLOP/s on an AMD EPYC's 2 cores);
 * there the values pass takes 2 rows at a time, 32 of their output floats at a time (8
 * accumulators and 4 V vectors in registers), and a scores pass 2 row vectors x 4 keys.
 *
 * History (AMD EPYC, AVX2, 2 threads; /tmp harness: SmolLM2's 30 layers, alternated, median):
 * the first form transposed each group of keys into [D][KEYS] for every tile that read it and
 * ran the softmax a row at a time, with libmvec's expf, a call around which the loop's vector
 * registers were saved. Transposing the queries instead (once per tile) and the softmax across
 * rows, with libmvec's expf still: 0.81-0.84x. With vexp: 1.16-1.39x. Softmax steps of 16 keys
 * instead of 8: 1.07-1.11x more. */
#if defined(__AVX512F__)
#define W 16
#define KB 8                  /* keys per scores pass (of up to 2 row vectors) */
#define RT 4                  /* rows per values pass */
#else
#define W 8
#define KB 4
#define RTV 2                 /* rows per values pass */
#define VJ(D) 4               /* output vectors per row in a values pass */
#endif
#define KEYS 16               /* keys per step of the running softmax (at most a block's) */

typedef float vf __attribute__((vector_size(W * 4)));
/* Keeps a vector in a register from here on, where it is one (an empty asm that "changes" it). */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif
typedef int32_t vi __attribute__((vector_size(W * 4)));
#define NEG ((vf){0} - 3.0e38f) /* "minus infinity", finite: the build assumes no infinities */
/* W floats read (written) at any float's address as one vector. A memcpy into a 16-float vector
 * became two 256-bit loads and stores to the stack and one 512-bit load back, which the store
 * buffer cannot forward: the values loop stalled on it for a fifth of the kernel's time. */
typedef float vf_unaligned __attribute__((vector_size(W * 4), aligned(4)));
INLINE vf loadv(const float *p) { return *(const vf_unaligned *)p; }
INLINE void storev(float *p, vf v) { *(vf_unaligned *)p = v; }
/* a in the lanes `take` marks (all ones), b in the others */
INLINE vf blend(vi take, vf a, vf b) { return (vf)(((vi)a & take) | ((vi)b & ~take)); }
INLINE vf vmax(vf a, vf b) { return blend(a > b, a, b); }
INLINE vf vmin(vf a, vf b) { return -vmax(-a, -b); }

/* Exponents at or below this are a masked key's (its weight is 0) or a row's first maximum's
 * correction, which scales zeros. */
#define EXP_FLOOR -80.f

/* e^x for x in [EXP_FLOOR, 0] (a softmax's exponents; clamped to it), W lanes inline: 2^n e^f,
 * n = x / ln 2 rounded, |f| <= ln 2 / 2, e^f by Cephes' expf polynomial (about 1 ulp). Libmvec's
 * vector expf is a call, around which every vector register the loop holds is saved. */
INLINE vf vexp(vf x) {
    x = vmin(vmax(x, (vf){0} + EXP_FLOOR), (vf){0});
    const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* toward zero: round(x / ln 2) */
    const vf nf = __builtin_convertvector(n, vf);
    const vf f = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    return (p * f * f + f + 1.f) * (vf)((n + 127) << 23);
}

typedef struct {
    int64_t num_heads, num_kv_heads, block_size, s_block, s_kv, s_tok, s_head;
    float scale;
} Shape;

typedef struct {
    int32_t seq, head, first; /* sequence, KV head, first query index in the sequence */
} Tile;

/* Scores of RB row vectors (rows v0 * W ..) against KB keys at a time, i < kmax, into
 * s[i * stride + r]: per d, RB loads of the transposed queries and KB broadcasts of a key's element
 * feed RB x KB FMAs, the key rows read as the cache holds them. Keys at or past kmax in the last
 * pass repeat key kmax - 1 and are not stored. */
INLINE void scores_pass(float *s, const float *qt, const float *k0, int64_t s_tok, int64_t kmax, int64_t stride,
                        int64_t v0, const int RB, const int64_t D) {
    for (int64_t i0 = 0; i0 < kmax; i0 += KB) {
        const float *key[KB];
        for (int j = 0; j < KB; ++j) key[j] = k0 + (i0 + j < kmax ? i0 + j : kmax - 1) * s_tok;
        vf a[2][KB];
        for (int v = 0; v < RB; ++v)
            for (int j = 0; j < KB; ++j) a[v][j] = (vf){0};
        for (int64_t d = 0; d < D; ++d) {
            vf q[2];
            for (int v = 0; v < RB; ++v) {
                q[v] = loadv(qt + d * stride + (v0 + v) * W);
                IN_REGISTER(q[v]); /* GCC otherwise folded the load into each of the KB FMAs */
            }
            for (int j = 0; j < KB; ++j) {
                const float kd = key[j][d];
                for (int v = 0; v < RB; ++v) a[v][j] += q[v] * kd;
            }
        }
        for (int j = 0; j < KB && i0 + j < kmax; ++j)
            for (int v = 0; v < RB; ++v) storev(s + (i0 + j) * stride + (v0 + v) * W, a[v][j]);
    }
}

#if HAS_BF16
/* scores_pass for bf16: per pair of elements d, RB loads of the transposed query pairs and KB
 * broadcasts of a key's pair (as the cache holds it) feed RB x KB dot products; the sums are
 * scaled as they are stored. */
INLINE void scores_pass_bf16(float *s, const uint32_t *qt, const uint16_t *k0, int64_t s_tok, int64_t kmax,
                             int64_t stride, int64_t v0, const int RB, const int64_t D, float scale) {
    for (int64_t i0 = 0; i0 < kmax; i0 += KB) {
        const uint16_t *key[KB];
        for (int j = 0; j < KB; ++j) key[j] = k0 + (i0 + j < kmax ? i0 + j : kmax - 1) * s_tok;
        __m512 a[2][KB];
        for (int v = 0; v < RB; ++v)
            for (int j = 0; j < KB; ++j) a[v][j] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; ++p) {
            __m512bh q[2];
            for (int v = 0; v < RB; ++v) {
                q[v] = (__m512bh)_mm512_loadu_si512(qt + p * stride + (v0 + v) * W);
                IN_REGISTER(q[v]);
            }
            for (int j = 0; j < KB; ++j) {
                int32_t pair;
                memcpy(&pair, key[j] + 2 * p, sizeof pair);
                const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
                for (int v = 0; v < RB; ++v) a[v][j] = _mm512_dpbf16_ps(a[v][j], q[v], kp);
            }
        }
        const __m512 sc = _mm512_set1_ps(scale);
        for (int j = 0; j < KB && i0 + j < kmax; ++j)
            for (int v = 0; v < RB; ++v) _mm512_storeu_ps(s + (i0 + j) * stride + (v0 + v) * W, a[v][j] * sc);
    }
}

/* A group of keys' values for the tile's rows in bf16 dot products: the keys go in pairs, each
 * pair's V rows interleaved once per group into [D] pairs (key i's element d, key i + 1's) and its
 * weights rounded to bf16 into [rows] pairs, so that one vdpbf16ps adds two keys' terms to W of a
 * row's outputs. An odd last key pairs with a zero key of weight 0. The interleave works within
 * 128-bit lanes, so `acc` holds each row's D outputs in that order (acc_position); its sums stay
 * fp32. Why: widening V and an FMA per key took half the bf16 kernel's time. */
INLINE void values_pass_bf16(float (*acc)[MAX_D], const float *sw, const uint16_t *v0, int64_t s_tok, int64_t kmax,
                             int64_t stride, int64_t nr, const int64_t D) {
    uint32_t vp[KEYS / 2][MAX_D] __attribute__((aligned(64)));
    uint32_t wp[KEYS / 2][TILE * MAX_REP] __attribute__((aligned(64)));
    const int64_t pairs = (kmax + 1) / 2;
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t i = 2 * p;
        const int two = i + 1 < kmax;
        for (int64_t c = 0; c < D / 32; ++c) {
            const __m512i a = _mm512_loadu_si512(v0 + i * s_tok + 32 * c);
            const __m512i b = two ? _mm512_loadu_si512(v0 + (i + 1) * s_tok + 32 * c) : _mm512_setzero_si512();
            _mm512_store_si512(vp[p] + 32 * c, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(vp[p] + 32 * c + 16, _mm512_unpackhi_epi16(a, b));
        }
        for (int64_t r = 0; r < stride; r += W) {
            const __m256i x = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sw + i * stride + r));
            const __m256i y = two ? (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sw + (i + 1) * stride + r))
                                  : _mm256_setzero_si256();
            const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
            _mm256_store_si256((__m256i *)(wp[p] + r), _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_store_si256((__m256i *)(wp[p] + r + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
    }
    for (int64_t r0 = 0; r0 < nr; r0 += RT) {
        __m512 a[RT][MAX_D / W];
        const int rows = nr - r0 < RT ? (int)(nr - r0) : RT;
        for (int k = 0; k < RT; ++k)
            for (int64_t j = 0; j < D / W; ++j) a[k][j] = _mm512_load_ps(&acc[r0 + k][W * j]);
        for (int64_t p = 0; p < pairs; ++p) {
            __m512bh v[MAX_D / W];
            for (int64_t j = 0; j < D / W; ++j) v[j] = (__m512bh)_mm512_load_si512(vp[p] + W * j);
            for (int k = 0; k < RT; ++k) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32(k < rows ? (int32_t)wp[p][r0 + k] : 0);
                for (int64_t j = 0; j < D / W; ++j) a[k][j] = _mm512_dpbf16_ps(a[k][j], v[j], w);
            }
        }
        for (int k = 0; k < rows; ++k)
            for (int64_t j = 0; j < D / W; ++j) _mm512_store_ps(&acc[r0 + k][W * j], a[k][j]);
    }
}
#else /* never called: the bf16 entry declines without AVX512-BF16 */
INLINE void values_pass_bf16(float (*acc)[MAX_D], const float *sw, const uint16_t *v0, int64_t s_tok, int64_t kmax,
                             int64_t stride, int64_t nr, const int64_t D) {
    (void)acc, (void)sw, (void)v0, (void)s_tok, (void)kmax, (void)stride, (void)nr, (void)D;
}
INLINE void scores_pass_bf16(float *s, const uint32_t *qt, const uint16_t *k0, int64_t s_tok, int64_t kmax,
                             int64_t stride, int64_t v0, const int RB, const int64_t D, float scale) {
    (void)s, (void)qt, (void)k0, (void)s_tok, (void)kmax, (void)stride, (void)v0, (void)RB, (void)D, (void)scale;
}
#endif

/* A pass of scores over keys k0.. of the cache's dtype (the queries `qt` as attend_tile holds them). */
INLINE void scores(float *s, const void *qt, const char *k0, const Shape *sh, int64_t kmax, int64_t stride, int64_t v0,
                   const int RB, const int64_t D, const int BF16) {
    if (BF16)
        scores_pass_bf16(s, (const uint32_t *)qt, (const uint16_t *)k0, sh->s_tok, kmax, stride, v0, RB, D, sh->scale);
    else
        scores_pass(s, (const float *)qt, (const float *)k0, sh->s_tok, kmax, stride, v0, RB, D);
}

/* Where values_pass_bf16 keeps output d of a row: 32 outputs make two vectors, the first holding
 * each 128-bit lane's first 4 (d = 8l .. 8l + 3 for lane l), the second their last 4. */
INLINE int64_t acc_position(int64_t d) {
    const int64_t within = d % 32, lane = within / 8, k = within % 8;
    return (d / 32) * 32 + (k / 4) * 16 + lane * 4 + k % 4;
}

/* One tile: rows r = p * rep + h for positions first + p (p < np) and query heads g * rep + h.
 * BF16: query, kv and out hold bf16 (else fp32). */
INLINE void attend_tile(void *out, const void *query, const void *kv, const int32_t *table, int64_t q_row0,
                        int64_t q_len, int64_t ctx_len, int64_t g, int64_t first, const Shape *sh, const int64_t D,
                        const int BF16) {
    const int64_t H = sh->num_heads, rep = H / sh->num_kv_heads, bs = sh->block_size, es = BF16 ? 2 : 4;
    const int64_t np = q_len - first < TILE ? q_len - first : TILE, nr = np * rep;
    const int64_t nv = (nr + W - 1) / W, stride = nv * W; /* row vectors; rows padded to whole ones */
    const int64_t base = ctx_len - q_len; /* position of query 0 */
    /* Queries transposed, [D][stride] (bf16: [D/2][stride] pairs), and a key group's scores, then
     * weights, [KEYS][stride]: a score vector holds W rows' scores for one key, so the running
     * softmax is W rows at a time. */
    union {
        float f[MAX_D * TILE * MAX_REP];
        uint32_t pairs[MAX_D / 2 * TILE * MAX_REP];
    } qt_buf __attribute__((aligned(64)));
    float *qt = qt_buf.f;
    uint32_t *qt_pairs = qt_buf.pairs;
    float sw[KEYS * TILE * MAX_REP] __attribute__((aligned(64)));
    float acc[TILE * MAX_REP][MAX_D] __attribute__((aligned(64)));
    vf mx[TILE * MAX_REP / W], sum[TILE * MAX_REP / W], pos[TILE * MAX_REP / W];
    for (int64_t r = 0; r < stride; ++r) {
        const int64_t p = r < nr ? r / rep : np - 1; /* a padding row: zeros at the last position */
        const int64_t at = ((q_row0 + first + p) * H + g * rep + r % rep) * D;
        for (int64_t d = 0; d < D; ++d) acc[r][d] = 0.f;
        if (BF16) {
            const uint16_t *qrow = (const uint16_t *)query + at;
            for (int64_t d = 0; d < D; d += 2)
                qt_pairs[d / 2 * stride + r] = r < nr ? qrow[d] | (uint32_t)qrow[d + 1] << 16 : 0;
        } else {
            const float *qrow = (const float *)query + at;
            for (int64_t d = 0; d < D; ++d) qt[d * stride + r] = r < nr ? qrow[d] * sh->scale : 0.f;
        }
        pos[r / W][r % W] = (float)(base + first + p);
    }
    for (int64_t v = 0; v < nv; ++v) mx[v] = NEG, sum[v] = (vf){0}; /* finite: see NEG */
    const int64_t last = base + first + np - 1, least = base + first; /* the tile's last and first positions */
    for (int64_t t0 = 0, b = 0; t0 <= last; t0 += bs, ++b) {
        const char *block = (const char *)kv + ((int64_t)table[b] * sh->s_block + g * sh->s_head) * es;
        for (int64_t i0 = 0; i0 < bs && t0 + i0 <= last; i0 += KEYS) {
            const int64_t m = last + 1 - (t0 + i0) < KEYS ? last + 1 - (t0 + i0) : KEYS;
            const int64_t kmax = bs - i0 < m ? bs - i0 : m; /* keys of these that exist */
            const char *k0 = block + i0 * sh->s_tok * es, *v0 = block + (sh->s_kv + i0 * sh->s_tok) * es;
            int64_t v = 0;
            for (; v + 2 <= nv; v += 2) scores(sw, &qt_buf, k0, sh, kmax, stride, v, 2, D, BF16);
            if (v < nv) scores(sw, &qt_buf, k0, sh, kmax, stride, v, 1, D, BF16);
            /* running softmax, W rows at a time; keys past a row's position score "minus infinity"
             * (only where the diagonal crosses this group) */
            const int masked = t0 + i0 + kmax - 1 > least;
            for (v = 0; v < nv; ++v) {
                vf bmax = mx[v];
                for (int64_t i = 0; i < kmax; ++i) {
                    vf s = loadv(sw + i * stride + v * W);
                    if (masked) {
                        const vi keep = pos[v] >= (float)(t0 + i0 + i);
                        s = blend(keep, s, NEG);
                        storev(sw + i * stride + v * W, s);
                    }
                    bmax = vmax(bmax, s);
                }
                const vi grew = bmax > mx[v];
                int any = 0;
                for (int l = 0; l < W; ++l) any |= grew[l];
                if (any) { /* earlier terms shrink by exp(old - new): 1 in lanes that did not grow */
                    const vf c = vexp(mx[v] - bmax);
                    sum[v] *= c;
                    for (int l = 0; l < W && v * W + l < nr; ++l)
                        if (grew[l])
                            for (int64_t d = 0; d < D; ++d) acc[v * W + l][d] *= c[l];
                    mx[v] = bmax;
                }
                vf add = {0};
                for (int64_t i = 0; i < kmax; ++i) {
                    const vf x = loadv(sw + i * stride + v * W) - bmax;
                    const vf e = (vf)((vi)vexp(x) & (x > EXP_FLOOR)); /* a masked key weighs 0 */
                    storev(sw + i * stride + v * W, e);
                    add += e;
                }
                sum[v] += add;
            }
            if (BF16) {
                values_pass_bf16(acc, sw, (const uint16_t *)v0, sh->s_tok, kmax, stride, nr, D);
                continue;
            }
#if defined(__AVX512F__)
            /* values (fp32): RT rows' accumulators in registers, each V row loaded once for them */
            for (int64_t r0 = 0; r0 < nr; r0 += RT) {
                vf a[RT][MAX_D / W];
                const int rows = nr - r0 < RT ? (int)(nr - r0) : RT;
                for (int k = 0; k < RT; ++k)
                    for (int64_t j = 0; j < D / W; ++j) a[k][j] = loadv(&acc[r0 + k][W * j]);
                for (int64_t i = 0; i < kmax; ++i) {
                    vf v[MAX_D / W];
                    for (int64_t j = 0; j < D / W; ++j) v[j] = loadv((const float *)v0 + i * sh->s_tok + W * j);
                    for (int k = 0; k < RT; ++k) {
                        const float w = k < rows ? sw[i * stride + r0 + k] : 0.f;
                        for (int64_t j = 0; j < D / W; ++j) a[k][j] += w * v[j];
                    }
                }
                for (int k = 0; k < rows; ++k)
                    for (int64_t j = 0; j < D / W; ++j) storev(&acc[r0 + k][W * j], a[k][j]);
            }
#else
            /* values (fp32): RTV rows' accumulators in registers (VJ vectors of each at a time), each
             * V row's piece loaded once for them */
            for (int64_t r0 = 0; r0 < nr; r0 += RTV) {
                const int rows = nr - r0 < RTV ? (int)(nr - r0) : RTV;
                for (int64_t j0 = 0; j0 < D / W; j0 += VJ(D)) {
                    vf a[RTV][VJ(D)];
                    for (int k = 0; k < RTV; ++k)
                        for (int64_t j = 0; j < VJ(D); ++j) a[k][j] = loadv(&acc[r0 + k][W * (j0 + j)]);
                    for (int64_t i = 0; i < kmax; ++i) {
                        vf v[VJ(D)];
                        for (int64_t j = 0; j < VJ(D); ++j)
                            v[j] = loadv((const float *)v0 + i * sh->s_tok + W * (j0 + j));
                        for (int k = 0; k < RTV; ++k) {
                            const float w = k < rows ? sw[i * stride + r0 + k] : 0.f;
                            for (int64_t j = 0; j < VJ(D); ++j) a[k][j] += w * v[j];
                        }
                    }
                    for (int k = 0; k < rows; ++k)
                        for (int64_t j = 0; j < VJ(D); ++j) storev(&acc[r0 + k][W * (j0 + j)], a[k][j]);
                }
            }
#endif
        }
    }
    for (int64_t p = 0; p < np; ++p)
        for (int64_t h = 0; h < rep; ++h) {
            const int64_t r = p * rep + h;
            const float inv = 1.f / sum[r / W][r % W];
            const int64_t at = ((q_row0 + first + p) * H + g * rep + h) * D;
            if (BF16)
                for (int64_t d = 0; d < D; ++d) ((uint16_t *)out)[at + d] = f32_to_bf16(acc[r][acc_position(d)] * inv);
            else
                for (int64_t d = 0; d < D; ++d) ((float *)out)[at + d] = acc[r][d] * inv;
        }
}

typedef void (*TileFn)(void *, const void *, const void *, const int32_t *, int64_t, int64_t, int64_t, int64_t,
                       int64_t, const Shape *);
#define TILE_FN(name, D, BF16)                                                                                      \
    static void name(void *o, const void *q, const void *kv, const int32_t *t, int64_t r0, int64_t ql, int64_t cl,  \
                     int64_t g, int64_t f, const Shape *sh) {                                                       \
        attend_tile(o, q, kv, t, r0, ql, cl, g, f, sh, D, BF16);                                                    \
    }
TILE_FN(tile_f32_d64, 64, 0)
TILE_FN(tile_f32_d128, 128, 0)
#if HAS_BF16
TILE_FN(tile_bf16_d64, 64, 1)
TILE_FN(tile_bf16_d128, 128, 1)
#endif

/* Returns 0, or -1 for shapes the kernel does not take (the caller checks them first) and for bf16
 * (query, cache and out all bf16) where the build has no AVX512-BF16. */
int paged_prefill_attention(void *out, const void *query, const void *kv, const int32_t *block_tables,
                            const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head,
                            float scale, int num_threads, int bf16) {
    const int64_t rep = num_heads / num_kv_heads;
    if ((head_dim != 64 && head_dim != 128) || rep > MAX_REP || rep * num_kv_heads != num_heads) return -1;
    TileFn tile = head_dim == 64 ? tile_f32_d64 : tile_f32_d128;
    if (bf16) {
#if HAS_BF16
        tile = head_dim == 64 ? tile_bf16_d64 : tile_bf16_d128;
#else
        return -1;
#endif
    }
    const Shape sh = {num_heads, num_kv_heads, block_size, s_block, s_kv, s_tok, s_head, scale};
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < num_seqs; ++s) num_tiles += num_kv_heads * ((q_len[s] + TILE - 1) / TILE);
    Tile *tiles = (Tile *)malloc(sizeof(Tile) * (num_tiles ? num_tiles : 1));
    int64_t n = 0;
    /* Each prompt's last tiles first: they cost the most, so the dynamic schedule ends evenly. */
    for (int64_t s = 0; s < num_seqs; ++s)
        for (int64_t f = (q_len[s] - 1) / TILE * TILE; f >= 0; f -= TILE)
            for (int64_t g = 0; g < num_kv_heads; ++g) tiles[n++] = (Tile){(int32_t)s, (int32_t)g, (int32_t)f};
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < num_tiles; ++i) {
        const Tile t = tiles[i];
        tile(out, query, kv, block_tables + (int64_t)t.seq * max_blocks, q_start[t.seq], q_len[t.seq], ctx_len[t.seq],
             t.head, t.first, &sh);
    }
    free(tiles);
    return 0;
}

/* Whether the bf16 path was built (the CPU has AVX512-BF16). */
int paged_prefill_attention_has_bf16(void) { return HAS_BF16; }
