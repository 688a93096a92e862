/* fp32 GEMM on a weight packed once: out[m, n] = sum_k x[m, k] * w[n, k], for a step's rows
 * against a linear layer's [n_out, k_in] weight.
 *
 * Layout (pack_f32_panels): the weight in panels of NR output channels; panel p holds, for each k,
 * the NR channels p*NR .. p*NR+NR-1 side by side (the last panel's missing channels zero), so a
 * k-range of a panel is one contiguous run. The microkernel keeps an MR x NR tile of the output in
 * registers (8-float vectors, the default: 6 rows x 16 channels, 12 of AVX2's 16 vector registers;
 * 16-float ones, PACKED_GEMM_W=16: 12 x 32, 24 of AVX-512's 32) and, per k, loads NR weights,
 * broadcasts MR activations and issues MR x NR / W FMAs.
 *
 * Blocking: a KC-long slice of a panel (16 KiB on AVX2) stays in L1 while every MR-row block of
 * an MC-row chunk of the activations (held in L2) runs against it. Threads split the panels, a
 * thread that finishes early taking the others' last ones (see `claim`).
 *
 * Why: on an AMD EPYC (Zen 3, AVX2, 2 cores) oneDNN's packed GEMM ran SmolLM2's decoder
 * projections at 100-120 GFLOP/s at a decode batch's 24-64 rows, against ~178 for its own
 * large GEMMs, and MKL's slower still; these loops are what both do at large sizes, without
 * their per-call costs at small ones. */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* 8-float (256-bit) vectors, AVX-512 or not: on the one AVX-512 CPU this kernel has run on, an AMD
 * Zen 4 (whose 512-bit instructions take its 256-bit units twice), they were the faster at every
 * row count, SmolLM2's 30 layers of projections, 2 threads, alternated, ms at 16-float / 8-float:
 * 1 row 16.2 / 14.7, 8 rows 25.1 / 22.0, 12 rows 29.3 / 21.9, 32 rows 47.9 / 41.4, 256 rows 307 /
 * 293, 2,048 rows 2,336 / 2,142 (where oneDNN's took 26.2, 28.8, 27.0, 41.3, 269 and 2,070). A
 * CPU with two 512-bit units may differ: `-DPACKED_GEMM_W=16` builds the 16-float tiles
 * (tests/test_packed_gemm.py checks them). */
#if !defined(PACKED_GEMM_W)
#define PACKED_GEMM_W 8
#endif
#define W PACKED_GEMM_W
#define NR (2 * W)
/* Rows per register tile: 2 * MR accumulators, 2 weight vectors and a broadcast fit the register
 * file (16 vectors on AVX2, 32 on AVX-512). */
#define MR (W == 16 ? 12 : 6)
/* k per L1 block: NR * KC floats of the weight (16 KiB at W = 8, 32 KiB at W = 16). */
#define KC 256
/* Activation rows per L2 chunk: MC * KC floats (144 KiB at W = 8). */
#define MC (MR * 24)
/* Up to this many bytes of activations (a chunk's rows x k_in), each thread takes its panels one
 * whole panel at a time (the weight read in order, all the activations cycled from L2 per panel);
 * beyond, one KC block of every panel at a time (the activations' block cycled instead). SmolLM2's
 * layers, 2 threads: 32 rows 48.4 against 51.0 ms, 96 rows 127.5 / 136.9; 256 rows even. */
#define PANEL_OUTER_BYTES (384 << 10)
/* The first row tile of a block prefetches the weight this far ahead of its reads (4 KiB): in the
 * whole-panel order, the weight the next blocks read arrives while this one computes (8 rows 17-20 against 20-22 ms,
 * 16 rows 26-28 against 30-31; 256 to 2,048 floats ahead measured alike). */
#define PREFETCH_FLOATS 1024
/* A block of fewer rows than a tile prefetches so too from this many rows: 3-5 rows (a few
 * decodes, a speculative verify step of 5) are bound by the weight's stream as one row is, and
 * went from 18.2-20.5 to 18.0-18.6 ms (medians, SmolLM2's layers, Zen 3); one row, whose loop
 * the hardware prefetcher keeps fed, did not gain. */
#define PREFETCH_MIN_ROWS 3
/* In the whole-panel order a thread's next block is the weight right after this one's (the same
 * panel's next k range, or the next panel's first): the block's second row tile prefetches it
 * into L2, a line per k, while the tiles after the first compute from L1. Before, the first tile
 * of every block waited on memory for a block's worth of weight (8-64 rows); SmolLM2's layers, 2
 * threads, Zen 4, best of 9 alternated, ms: 8 rows 16.6 -> 15.0, 12 rows 19.4 -> 16.2, 16 rows
 * 25.5 -> 21.9, 39 rows 47.8 -> 43.6, 64 rows 72.9 -> 70.4; 1-4 rows and 512 alike (into L1
 * instead, about half the gain). 0 leaves it out (benchmarks compare the two). */
#ifndef NEXT_BLOCK_PREFETCH
#define NEXT_BLOCK_PREFETCH 1
#endif

typedef float vec __attribute__((vector_size(W * 4)));
typedef float vec_unaligned __attribute__((vector_size(W * 4), aligned(4)));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }

static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }

/* The floats `pack_f32_panels` writes for an [n_out, k_in] weight. */
int64_t packed_f32_size(int64_t n_out, int64_t k_in) { return (n_out + NR - 1) / NR * NR * k_in; }

/* The panel width the layout uses (NR: 16 channels on AVX2, 32 on AVX-512). */
int64_t packed_f32_panel_width(void) { return NR; }

void pack_f32_panels(float *packed, const float *w, int64_t n_out, int64_t k_in) {
    const int64_t panels = (n_out + NR - 1) / NR;
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * NR * k_in;
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t n = p * NR + j;
            if (n < n_out)
                for (int64_t k = 0; k < k_in; ++k) dst[k * NR + j] = w[n * k_in + k];
            else
                for (int64_t k = 0; k < k_in; ++k) dst[k * NR + j] = 0.f;
        }
    }
}

/* out[r, 0..NR) (+)= sum over kc of x[r, k] * b[k, 0..NR) for the tile's `rows` rows (a constant
 * once inlined: the accumulators are registers). `first`: the k-range starts at 0, so the tile is
 * written rather than added to. `cols`: the valid channels (NR but in the last panel). */
static inline __attribute__((always_inline)) void tile(const int rows, const float *x, int64_t ldx,
                                                       const float *b, int64_t kc, float *out, int64_t ldo,
                                                       int first, int64_t cols, const int prefetch) {
    vec acc[MR][2];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = (vec){0};
    for (int64_t k = 0; k < kc; ++k) {
        if (prefetch == 1) __builtin_prefetch(b + k * NR + PREFETCH_FLOATS);
        if (prefetch == 2) __builtin_prefetch(b + (kc + k) * NR, 0, 2);
        const vec b0 = load(b + k * NR), b1 = load(b + k * NR + W);
        for (int r = 0; r < rows; ++r) {
            const vec a = (vec){0} + x[r * ldx + k];
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
        }
    }
    if (cols == NR) {
        for (int r = 0; r < rows; ++r) {
            float *o = out + r * ldo;
            if (first) {
                store(o, acc[r][0]);
                store(o + W, acc[r][1]);
            } else {
                store(o, load(o) + acc[r][0]);
                store(o + W, load(o + W) + acc[r][1]);
            }
        }
        return;
    }
    for (int r = 0; r < rows; ++r) {  /* the last panel: only its real channels */
        float part[NR];
        store(part, acc[r][0]);
        store(part + W, acc[r][1]);
        float *o = out + r * ldo;
        for (int64_t j = 0; j < cols; ++j) o[j] = first ? part[j] : o[j] + part[j];
    }
}

static void tile_any(int64_t rows, const float *x, int64_t ldx, const float *b, int64_t kc, float *out,
                     int64_t ldo, int first, int64_t cols, int prefetch) {
    switch (rows) {
#define TILE_ROWS(n) case n: \
        if (prefetch == 1) tile(n, x, ldx, b, kc, out, ldo, first, cols, 1); \
        else if (prefetch == 2) tile(n, x, ldx, b, kc, out, ldo, first, cols, 2); \
        else tile(n, x, ldx, b, kc, out, ldo, first, cols, 0); \
        break;
        TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6)
#if MR > 6
        TILE_ROWS(7) TILE_ROWS(8) TILE_ROWS(9) TILE_ROWS(10) TILE_ROWS(11) TILE_ROWS(12)
#endif
#undef TILE_ROWS
    }
}

/* Panel p's channels, k in [k0, k0 + kc), for rows [m0, m0 + mc). */
static inline void block(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed, int64_t n_out,
                         int64_t k_in, int64_t p, int64_t k0, int64_t kc, int64_t m0, int64_t mc, int in_order) {
    const float *b = packed + p * NR * k_in + k0 * NR;
    const int64_t cols = n_out - p * NR < NR ? n_out - p * NR : NR;
    float *o = out + m0 * ldo + p * NR;
    const float *a = x + m0 * ldx + k0;
    int64_t r = 0;
    if (mc >= MR) {
        tile(MR, a, ldx, b, kc, o, ldo, k0 == 0, cols, 1);
        r = MR;
    }
    const int next = NEXT_BLOCK_PREFETCH && in_order; /* the tile at row MR fetches the next block */
    for (; r + MR <= mc; r += MR) {
        if (next && r == MR)
            tile(MR, a + r * ldx, ldx, b, kc, o + r * ldo, ldo, k0 == 0, cols, 2);
        else
            tile(MR, a + r * ldx, ldx, b, kc, o + r * ldo, ldo, k0 == 0, cols, 0);
    }
    if (r < mc)
        tile_any(mc - r, a + r * ldx, ldx, b, kc, o + r * ldo, ldo, k0 == 0, cols,
                 r == 0 ? mc >= PREFETCH_MIN_ROWS : next && r == MR ? 2 : 0);
}

/* Which panels a thread computes: each starts on an equal contiguous share of a pass's panels,
 * claims them one at a time from the front, and once its own are done takes the other threads'
 * from their backs. A share is one word (lo | hi << 32: a weight has far fewer than 2^32 panels)
 * on a cache line of its own, so a claim is an uncontended compare-and-swap until another thread
 * comes to take from the back.
 *
 * Why: with a fixed split the step waits for the slower core. On a shared 2-core VM one core often
 * ran slower than the other for a while: SmolLM2's 120 projections, 2 threads, summed over a pass,
 * one thread finished 1-17 ms before the other at 32 rows (75-95 ms a pass) and 70-570 ms at 2,048
 * rows (2.9-4.8 s). The same passes alternated against the fixed split, 9 each, median ms: 8 rows
 * 31.2 -> 26.1, 32 rows 89.6 -> 79.5, 64 rows 173.4 -> 137.6; in moments when the cores ran
 * evenly the two were alike (best of 15: 8 rows 18.8 / 18.7, 32 rows 46.3 / 44.3). The offline
 * benchmark's workload in one engine, the two builds alternated: 66.7, 79.1, 76.0, 80.4 s against
 * 60.5, 61.3, 62.3, 63.3 s, the same tokens. */
typedef struct {
    _Alignas(64) uint64_t range;
    char pad[64 - sizeof(uint64_t)];
} Share;

static inline uint64_t share_range(int64_t lo, int64_t hi) { return (uint64_t)hi << 32 | (uint64_t)lo; }

/* Claims the front (back = 0) or the back panel of `share`; 0 once it is empty. */
static inline int claim(Share *share, int back, int64_t *panel) {
    uint64_t r = __atomic_load_n(&share->range, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t lo = (uint32_t)r, hi = (uint32_t)(r >> 32);
        if (lo >= hi) return 0;
        const uint64_t next = back ? share_range(lo, hi - 1) : share_range(lo + 1, hi);
        if (__atomic_compare_exchange_n(&share->range, &r, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *panel = back ? hi - 1 : lo;
            return 1;
        }
    }
}

/* 0: each thread computes its own share only, the fixed split the schedule replaced, which
 * benchmarks/gemm_imbalance.py builds to compare (it needs the whole team asked for). */
#if !defined(PACKED_GEMM_STEAL)
#define PACKED_GEMM_STEAL 1
#endif

/* One pass over every panel: rows [m0, m0 + mc), k in [k0, k0 + kc) (the whole k_in when
 * `kc` is 0, each panel's KC blocks in turn), its shares[0 .. n) set up by the caller. */
static void pass(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed, int64_t n_out,
                 int64_t k_in, int64_t m0, int64_t mc, int64_t k0, int64_t kc, Share *shares, int t, int n) {
    int64_t p;
    for (int v = 0; v < (PACKED_GEMM_STEAL ? n : 1); ++v) {
        Share *share = &shares[(t + v) % n];
        while (claim(share, v != 0, &p)) {
            if (kc)
                block(out, ldo, x, ldx, packed, n_out, k_in, p, k0, kc, m0, mc, 0);
            else
                for (int64_t k = 0; k < k_in; k += KC)
                    block(out, ldo, x, ldx, packed, n_out, k_in, p, k, k_in - k < KC ? k_in - k : KC, m0, mc, 1);
        }
    }
}

/* Shares on one call's stack: a group of passes' worth (passes x threads); more passes run in
 * further groups. (A test builds it small to run many groups.) */
#if !defined(PACKED_GEMM_MAX_SHARES)
#define PACKED_GEMM_MAX_SHARES 256
#endif
#define MAX_SHARES PACKED_GEMM_MAX_SHARES

static void gemm(float *out, int64_t ldo, const float *x, int64_t ldx, const float *packed, int64_t rows,
                 int64_t n_out, int64_t k_in, int num_threads) {
    const int64_t panels = (n_out + NR - 1) / NR;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > panels) num_threads = (int)panels;
    if (num_threads > MAX_SHARES) num_threads = MAX_SHARES;
    /* Activation chunks of MC rows. Up to PANEL_OUTER_BYTES a chunk is one pass, each panel
     * whole; beyond, one pass per KC block of k, the chunk's block cycled from L2 across panels. */
    const int panel_outer = (rows < MC ? rows : MC) * k_in * (int64_t)sizeof(float) <= PANEL_OUTER_BYTES;
    const int64_t per_chunk = panel_outer ? 1 : (k_in + KC - 1) / KC;
    const int64_t passes = (rows + MC - 1) / MC * per_chunk, group = MAX_SHARES / num_threads;
    Share shares[MAX_SHARES];
    for (int64_t first = 0; first < passes; first += group) {
        const int64_t last = first + group < passes ? first + group : passes;
        for (int64_t i = 0; i < (last - first) * num_threads; ++i) {
            const int t = (int)(i % num_threads);
            shares[i].range = share_range(panels * t / num_threads, panels * (t + 1) / num_threads);
        }
#pragma omp parallel num_threads(num_threads)
        {
            int t = 0;
#ifdef _OPENMP
            t = omp_get_thread_num();
#endif
            /* A smaller team than asked for still covers every share: each thread ends by taking
             * from the back of all of them. */
            for (int64_t i = first; i < last; ++i) {
                const int64_t m0 = i / per_chunk * MC, kb = i % per_chunk;
                const int64_t kc = panel_outer ? 0 : (k_in - kb * KC < KC ? k_in - kb * KC : KC);
                pass(out, ldo, x, ldx, packed, n_out, k_in, m0, rows - m0 < MC ? rows - m0 : MC, kb * KC, kc,
                     &shares[(i - first) * num_threads], t, num_threads);
                if (kb + 1 < per_chunk) {
#pragma omp barrier
                }  /* the chunk's next k block adds to this one's output */
            }
        }
    }
}

/* out [rows, n_out] = x [rows, k_in] @ w^T, both contiguous, w packed by pack_f32_panels; the
 * panels split over up to num_threads OpenMP threads. */
void packed_gemm_f32(float *out, const float *x, const float *packed, int64_t rows, int64_t n_out, int64_t k_in,
                     int num_threads) {
    gemm(out, n_out, x, k_in, packed, rows, n_out, k_in, num_threads);
}

/* cblas_sgemm_compute's signature, for kernels/cpu/decoder_layer.c, which calls a packed GEMM
 * through that type: its callers' form only (row-major, a not transposed, b packed here, beta 0);
 * threads: OpenMP's default for the calling thread (torch's intra-op count). */
void packed_gemm_f32_cblas(int layout, int transa, int transb, int m, int n, int k, const float *a, int lda,
                           const void *b, int ldb, float beta, float *c, int ldc) {
    (void)layout, (void)transa, (void)transb, (void)ldb, (void)beta;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    gemm(c, ldc, a, lda, (const float *)b, m, n, k, threads);
}
