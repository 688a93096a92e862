/* Prefill attention straight from the paged KV cache, flash-style: for fp32 caches and head
 * sizes 64 and 128, every prompt chunk of a step (fresh, or over cached context) in one call,
 * with no gather copy, no mask tensor and no [rows, context] score matrix.
 *
 * Work is split into tiles: one KV head and up to TILE consecutive query positions of one
 * sequence, whose rows are those positions' `rep` query heads sharing that KV head (GQA), so a
 * K/V block read once serves TILE * rep rows. A tile walks its context block by block, KEYS keys
 * (a vector's width: 16, or 8 without AVX-512) at a time: the keys are transposed into [D][KEYS]
 * once, then every row's KEYS scores are one vector built by D broadcast FMAs (RT rows per pass
 * share each loaded key column); a running softmax per row (its maximum and sum so far, its
 * output rescaled when the maximum grows), then the block's V rows added into RTV rows'
 * accumulators at a time. Causality is a mask on the scores of the blocks the diagonal crosses;
 * blocks past a tile's last position are never read.
 * Tiles go to OpenMP threads dynamically: causal tiles late in a prompt cost more than early ones.
 *
 * Why: torch's SDPA ran these shapes (SmolLM2: 9 query / 3 KV heads of 64, prompts of 20-600
 * tokens) at 43-65 GFLOP/s on this machine's 2 cores against 176 for a GEMM, and chunks over
 * cached context first gathered their blocks and built a boolean mask.
 *
 * Layouts (strides in elements):
 *   query, out   [T, H, D] contiguous fp32 (the step's rows; sequence s's rows start at q_start[s])
 *   kv           one layer of the block-major cache: element (block, kv, token, head, d) at
 *                block * s_block + kv * s_kv + token * s_tok + head * s_head + d
 *   block_tables [S, max_blocks] int32; q_start, q_len, ctx_len [S] int32 (query i of sequence s
 *                sits at position ctx_len - q_len + i and attends to keys 0..that position)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define TILE 16     /* query positions per tile */
#define MAX_REP 8   /* query heads per KV head */
#define MAX_D 128

/* The vector width: a register's floats. With AVX-512, 16 keys per score vector, and the values
 * pass keeps 4 rows' whole output in registers (16 vectors at D = 64). Without it (AVX2: 16
 * registers of 8 floats) GCC lowered those 16-float vectors into pairs and spilled them to the
 * stack: the kernel ran at 9 GFLOP/s on an AMD EPYC's 2 cores (perf annotate: stack moves). There
 * a score vector holds 8 keys, the scores pass takes 8 rows (75 against 69 GFLOP/s with 4), and
 * the values pass 2 rows at a time, 32 of their output floats at a time (8 accumulators and 4 V
 * vectors in registers): 61-75 GFLOP/s. With AVX-512 the code compiles as it did before W. */
#if defined(__AVX512F__)
#define W 16
#define RT 4                  /* rows per scores pass (and values pass) */
#else
#define W 8
#define RT 8
#define RTV 2                 /* rows per values pass */
#define VJ(D) 4               /* output vectors per row in a values pass */
#endif
#define KEYS W                /* keys per score vector */

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
#define NEG ((vf){0} - 3.0e38f) /* "minus infinity", finite: the build assumes no infinities */
/* W floats read (written) at any float's address as one vector. A memcpy into a 16-float vector
 * became two 256-bit loads and stores to the stack and one 512-bit load back, which the store
 * buffer cannot forward: the values loop stalled on it for a fifth of the kernel's time. */
typedef float vf_unaligned __attribute__((vector_size(W * 4), aligned(4)));
INLINE vf loadv(const float *p) { return *(const vf_unaligned *)p; }
INLINE void storev(float *p, vf v) { *(vf_unaligned *)p = v; }

typedef struct {
    int64_t num_heads, num_kv_heads, block_size, s_block, s_kv, s_tok, s_head;
    float scale;
} Shape;

typedef struct {
    int32_t seq, head, first; /* sequence, KV head, first query index in the sequence */
} Tile;

/* One tile: rows r = p * rep + h for positions first + p (p < np) and query heads g * rep + h. */
INLINE void attend_tile(float *out, const float *query, const float *kv, const int32_t *table, int64_t q_row0,
                        int64_t q_len, int64_t ctx_len, int64_t g, int64_t first, const Shape *sh, const int64_t D) {
    const int64_t H = sh->num_heads, rep = H / sh->num_kv_heads, bs = sh->block_size;
    const int64_t np = q_len - first < TILE ? q_len - first : TILE, nr = np * rep;
    const int64_t base = ctx_len - q_len; /* position of query 0 */
    float qs[TILE * MAX_REP][MAX_D] __attribute__((aligned(64)));
    float acc[TILE * MAX_REP][MAX_D] __attribute__((aligned(64)));
    float kt[MAX_D][KEYS] __attribute__((aligned(64)));
    vf sc[TILE * MAX_REP];
    float mx[TILE * MAX_REP], sum[TILE * MAX_REP];
    int32_t pos[TILE * MAX_REP];
    for (int64_t p = 0; p < np; ++p)
        for (int64_t h = 0; h < rep; ++h) {
            const int64_t r = p * rep + h;
            const float *qrow = query + ((q_row0 + first + p) * H + g * rep + h) * D;
            for (int64_t d = 0; d < D; ++d) qs[r][d] = qrow[d] * sh->scale, acc[r][d] = 0.f;
            mx[r] = -3.0e38f; /* finite: the build assumes no infinities (see kernels/cpu) */
            sum[r] = 0.f;
            pos[r] = (int32_t)(base + first + p);
        }
    for (int64_t r = nr; r < (nr + RT - 1) / RT * RT; ++r) /* a last partial pass reads zeros */
        for (int64_t d = 0; d < D; ++d) qs[r][d] = 0.f, acc[r][d] = 0.f;
    const int64_t last = base + first + np - 1; /* the tile's last position: no key beyond it */
    vf iota;
    for (int i = 0; i < KEYS; ++i) iota[i] = (float)i;
    for (int64_t t0 = 0, b = 0; t0 <= last; t0 += bs, ++b) {
        const float *block = kv + (int64_t)table[b] * sh->s_block + g * sh->s_head;
        for (int64_t i0 = 0; i0 < bs && t0 + i0 <= last; i0 += KEYS) {
            const int64_t m = last + 1 - (t0 + i0) < KEYS ? last + 1 - (t0 + i0) : KEYS;
            const int64_t kmax = bs - i0 < m ? bs - i0 : m; /* keys of these that exist */
            const float *k0 = block + i0 * sh->s_tok, *v0 = block + sh->s_kv + i0 * sh->s_tok;
            for (int64_t i = 0; i < KEYS; ++i)
                for (int64_t d = 0; d < D; ++d) kt[d][i] = i < kmax ? k0[i * sh->s_tok + d] : 0.f;
            /* scores: RT rows at a time, each key column loaded once for them */
            const float key0 = (float)(t0 + i0);
            for (int64_t r0 = 0; r0 < nr; r0 += RT) {
                vf s[RT] = {0};
                for (int64_t d = 0; d < D; ++d) {
                    vf col;
                    memcpy(&col, kt[d], sizeof col);
                    for (int k = 0; k < RT; ++k) s[k] += qs[r0 + k][d] * col;
                }
                for (int k = 0; k < RT && r0 + k < nr; ++k) {
                    const int64_t r = r0 + k;
                    const float lim = (float)(pos[r] < t0 + i0 + kmax - 1 ? pos[r] : t0 + i0 + kmax - 1);
                    /* keys past the row's position, or past the block, score "minus infinity" */
                    const vi keep = (iota + key0) <= lim;
                    const vi masked = ((vi)s[k] & keep) | ((vi)NEG & ~keep);
                    sc[r] = (vf)masked;
                }
            }
            /* running softmax per row */
            for (int64_t r = 0; r < nr; ++r) {
                float bmax = mx[r];
                for (int i = 0; i < KEYS; ++i) bmax = sc[r][i] > bmax ? sc[r][i] : bmax;
                if (bmax > mx[r]) { /* earlier terms shrink by exp(old - new) */
                    const float c = expf(mx[r] - bmax);
                    sum[r] *= c;
                    for (int64_t d = 0; d < D; ++d) acc[r][d] *= c;
                    mx[r] = bmax;
                }
                float e[KEYS], add = 0.f;
#pragma omp simd reduction(+ : add)
                for (int i = 0; i < KEYS; ++i) { e[i] = expf(sc[r][i] - bmax); add += e[i]; }
                sc[r] = loadv(e);
                sum[r] += add;
            }
#if defined(__AVX512F__)
            /* values: RT rows' accumulators in registers, each V row loaded once for them */
            for (int64_t r0 = 0; r0 < nr; r0 += RT) {
                vf a[RT][MAX_D / W];
                const int rows = nr - r0 < RT ? (int)(nr - r0) : RT;
                for (int k = 0; k < RT; ++k)
                    for (int64_t j = 0; j < D / W; ++j) a[k][j] = loadv(&acc[r0 + k][W * j]);
                for (int64_t i = 0; i < kmax; ++i) {
                    vf v[MAX_D / W];
                    for (int64_t j = 0; j < D / W; ++j) v[j] = loadv(v0 + i * sh->s_tok + W * j);
                    for (int k = 0; k < RT; ++k) {
                        const float w = k < rows ? sc[r0 + k][i] : 0.f;
                        for (int64_t j = 0; j < D / W; ++j) a[k][j] += w * v[j];
                    }
                }
                for (int k = 0; k < rows; ++k)
                    for (int64_t j = 0; j < D / W; ++j) storev(&acc[r0 + k][W * j], a[k][j]);
            }
#else
            /* values: RTV rows' accumulators in registers (VJ vectors of each at a time), each
             * V row's piece loaded once for them */
            for (int64_t r0 = 0; r0 < nr; r0 += RTV) {
                const int rows = nr - r0 < RTV ? (int)(nr - r0) : RTV;
                for (int64_t j0 = 0; j0 < D / W; j0 += VJ(D)) {
                    vf a[RTV][VJ(D)];
                    for (int k = 0; k < RTV; ++k)
                        for (int64_t j = 0; j < VJ(D); ++j) a[k][j] = loadv(&acc[r0 + k][W * (j0 + j)]);
                    for (int64_t i = 0; i < kmax; ++i) {
                        vf v[VJ(D)];
                        for (int64_t j = 0; j < VJ(D); ++j) v[j] = loadv(v0 + i * sh->s_tok + W * (j0 + j));
                        for (int k = 0; k < RTV; ++k) {
                            const float w = k < rows ? sc[r0 + k][i] : 0.f;
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
            const float inv = 1.f / sum[r];
            float *orow = out + ((q_row0 + first + p) * H + g * rep + h) * D;
            for (int64_t d = 0; d < D; ++d) orow[d] = acc[r][d] * inv;
        }
}

static void tile_d64(float *o, const float *q, const float *kv, const int32_t *t, int64_t r0, int64_t ql,
                     int64_t cl, int64_t g, int64_t f, const Shape *sh) {
    attend_tile(o, q, kv, t, r0, ql, cl, g, f, sh, 64);
}

static void tile_d128(float *o, const float *q, const float *kv, const int32_t *t, int64_t r0, int64_t ql,
                      int64_t cl, int64_t g, int64_t f, const Shape *sh) {
    attend_tile(o, q, kv, t, r0, ql, cl, g, f, sh, 128);
}

/* Returns 0, or -1 for shapes the kernel does not take (the caller checks them first). */
int paged_prefill_attention_f32(float *out, const float *query, const float *kv, const int32_t *block_tables,
                                const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t max_blocks, int64_t s_block, int64_t s_kv,
                                int64_t s_tok, int64_t s_head, float scale, int num_threads) {
    const int64_t rep = num_heads / num_kv_heads;
    if ((head_dim != 64 && head_dim != 128) || rep > MAX_REP || rep * num_kv_heads != num_heads) return -1;
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
        (head_dim == 64 ? tile_d64 : tile_d128)(out, query, kv, block_tables + (int64_t)t.seq * max_blocks,
                                                q_start[t.seq], q_len[t.seq], ctx_len[t.seq], t.head, t.first, &sh);
    }
    free(tiles);
    return 0;
}
