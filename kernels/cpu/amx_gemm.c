/* bf16 x bf16 -> bf16 GEMM on Intel AMX (or AVX512-BF16, below): out[m, n] = bf16(sum_k x[m, k] w[n, k] (+ bias[n])),
 * summed in fp32 by the tile unit's TDPBF16PS (each product exact, subnormals flushed), rounded
 * to nearest even once at the end, as torch rounds a bf16 GEMM's result.
 *
 * The weight is packed once (`amx_pack_bf16`) into the tiles the kernel loads: for each block of
 * 16 output channels, its K in steps of 32, one 1 KB tile whose row r holds, for each channel j,
 * the pair w[j][2r], w[j][2r + 1] (the "VNNI" pairs TDPBF16PS multiplies). A block's tiles are
 * contiguous, so a thread streams its share of the weight front to back. N and K are padded
 * with zeros to 16 and 32.
 *
 * The micro-kernel holds 2 x 2 fp32 accumulator tiles (32 rows by 32 channels; tiles 0-3), two
 * tiles of x's rows (4, 5) and two of the weight (6, 7): each weight tile loaded serves 32 rows,
 * each row tile 32 channels. Threads split the channel blocks; rows go 32 at a time, in chunks
 * of ROW_CHUNK that stay in L2 while every channel block of a thread passes over them.
 *
 * Why: oneDNN's GEMM on its own packed weight, which torch calls, read SmolLM2's bf16 layers at
 * about half this CPU's memory rate at a decode step's rows (16 rows: ~11 ms for 212 MB, this
 * kernel 8), and it has no C entry point the bf16 layers' C could call. For many rows oneDNN's
 * stays faster (2,048 rows: 138 against 173 ms): keeping a pair's weight tiles in L1 across row
 * blocks (218 ms), copying the rows into contiguous tiles first (186) or prefetching the next
 * row tiles into L1 (197) did not close the gap, so pagedserve calls this kernel up to
 * kernels/cpu/amx_gemm.py's MAX_ROWS rows only.
 *
 * A CPU with AVX512-BF16 but no AMX (AMD Zen 4) runs the same packed weight on VDPBF16PS dot
 * products instead (below: a register tile of 12 rows by 32 channels), summed in fp32 and rounded
 * once as well. There, SmolLM2's 30 layers of projections, 2 threads, against oneDNN's packed
 * bf16 GEMM (best of 4 alternated passes): 1 row 5.8 against 11.7 ms, 4 rows 6.6 / 9.6, 16 rows
 * 11.6 / 15.1, 64 rows 36.4 / 42.9, 160 rows 88.0 / 92.2; 256 rows 144 / 141 and 2,048 rows
 * 1,137 / 1,076, where oneDNN's takes over as on AMX. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define ROW_CHUNK 256 /* rows whose x stays in L2 while a thread's channel blocks pass over it */

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

int64_t amx_packed_elements(int64_t n, int64_t k) { return round_up(n, 16) * round_up(k, 32); }

/* x [m, k] copied to kp columns, zeros past k, where k is not a multiple of 32 (NULL where it is):
 * the last K tile reads 32 columns, which must be NaN-free, unlike a neighbour's. Freed by the
 * caller. */
static inline uint16_t *padded_columns(const uint16_t *x, int64_t m, int64_t k, int64_t kp) {
    if (kp == k) return NULL;
    uint16_t *padded = (uint16_t *)calloc((size_t)(m * kp), sizeof(uint16_t));
    for (int64_t r = 0; r < m; ++r) memcpy(padded + r * kp, x + r * k, (size_t)k * sizeof(uint16_t));
    return padded;
}

/* w [n, k] contiguous bf16 into dst (amx_packed_elements(n, k) bf16, zero padding included). */
void amx_pack_bf16(uint16_t *dst, const uint16_t *w, int64_t n, int64_t k) {
    const int64_t kp = round_up(k, 32), blocks = round_up(n, 16) / 16;
    for (int64_t nb = 0; nb < blocks; ++nb)
        for (int64_t kb = 0; kb < kp / 32; ++kb) {
            uint16_t *tile = dst + (nb * (kp / 32) + kb) * 512;
            for (int64_t r = 0; r < 16; ++r)
                for (int64_t j = 0; j < 16; ++j)
                    for (int64_t e = 0; e < 2; ++e) {
                        const int64_t row = nb * 16 + j, col = kb * 32 + 2 * r + e;
                        tile[r * 32 + j * 2 + e] = row < n && col < k ? w[row * k + col] : 0;
                    }
        }
}

#if HAVE_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the tile unit: Linux hands out its 8 KB of state per process on
 * request (a tile instruction without it is SIGILL). oneDNN asks too; asking twice is harmless. */
int amx_available(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

int amx_kernel_isa(void) { return 2; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles for a block of `r0` + `r1` rows (r1 = 0: one row tile): accumulators 0-3, rows 4-5,
 * weights 6-7. */
static void configure(int r0, int r1) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[4] = {r0, r0, r1 ? r1 : r0, r1 ? r1 : r0};
    for (int t = 0; t < 4; ++t) c.rows[t] = (uint8_t)rows[t], c.colsb[t] = 64;
    c.rows[4] = (uint8_t)r0, c.colsb[4] = 64;
    c.rows[5] = (uint8_t)(r1 ? r1 : r0), c.colsb[5] = 64;
    c.rows[6] = c.rows[7] = 16, c.colsb[6] = c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

/* One accumulator tile's rows (fp32, 16 to a row) plus the bias, rounded into out. */
static void store_rows(uint16_t *out, int64_t ldo, const float *acc, const uint16_t *bias, int rows, int cols) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
    for (int r = 0; r < rows; ++r) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc + 16 * r), b));
        _mm256_mask_storeu_epi16(out + r * ldo, mask, (__m256i)v);
    }
}

/* Rows [m0, m0 + r0 + r1) by channel blocks nb (and nb + 1 where two): x padded to kp columns. */
static void block(uint16_t *out, const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                  int64_t m0, int r0, int r1, int64_t nb, int two, int64_t n, int64_t kp) {
    const int64_t tiles = kp / 32;
    const uint16_t *w0 = packed + nb * tiles * 512, *w1 = w0 + tiles * 512;
    const uint16_t *x0 = x + m0 * ldx, *x1 = x0 + 16 * ldx;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < tiles; ++kb) {
        _tile_loadd(4, x0 + kb * 32, ldx * 2);
        _tile_loadd(6, w0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, w1 + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (r1) {
            _tile_loadd(5, x1 + kb * 32, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float acc[16 * 16];
    for (int t = 0; t < 4; ++t) {
        const int second_rows = t >= 2, second_cols = t & 1;
        if ((second_rows && !r1) || (second_cols && !two)) continue;
        switch (t) {
        case 0: _tile_stored(0, acc, 64); break;
        case 1: _tile_stored(1, acc, 64); break;
        case 2: _tile_stored(2, acc, 64); break;
        default: _tile_stored(3, acc, 64); break;
        }
        const int64_t c0 = (nb + second_cols) * 16;
        const int cols = n - c0 < 16 ? (int)(n - c0) : 16;
        store_rows(out + (m0 + 16 * second_rows) * n + c0, n, acc, bias ? bias + c0 : NULL,
                   second_rows ? r1 : r0, cols);
    }
}

/* out [m, n] = x [m, k] (contiguous bf16) times the packed weight, plus bias [n] (may be NULL). */
void amx_linear_bf16(uint16_t *out, const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    const int64_t kp = round_up(k, 32), pairs = (round_up(n, 16) / 16 + 1) / 2;
    uint16_t *padded = padded_columns(x, m, k, kp);
    if (padded) x = padded;
    const int64_t blocks16 = round_up(n, 16) / 16;
    #pragma omp parallel num_threads(num_threads)
    {
        int configured = -1;
        for (int64_t c0 = 0; c0 < m; c0 += ROW_CHUNK) {
            const int64_t c1 = c0 + ROW_CHUNK < m ? c0 + ROW_CHUNK : m;
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; ++p) {
                const int64_t nb = 2 * p;
                const int two = nb + 1 < blocks16;
                for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                    const int rows = c1 - m0 < 32 ? (int)(c1 - m0) : 32;
                    const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
                    if (configured != rows) configure(r0, r1), configured = rows;
                    block(out, x, kp, packed, bias, m0, r0, r1, nb, two, n, kp);
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
    free(padded);
}
#elif defined(__AVX512BF16__)
#include <immintrin.h>

/* Without AMX, on AVX512-BF16 (AMD Zen 4, Intel Cooper Lake): the same packed weight, read as
 * vectors. A tile's row r, for its 16 channels, holds the pair of k the dot product VDPBF16PS
 * takes: one 64-byte vector per pair of k, a block's vectors contiguous over k. The register
 * tile: DP_ROWS rows by two blocks (32 channels) of fp32 accumulators, 2 x 12 of the 32 vector
 * registers; per pair of k, two weight vectors loaded and each row's pair broadcast. Rows go
 * DP_ROWS at a time over a pair of blocks, whose weight (2 x 16 channels x k) stays in L2 while
 * the step's rows pass over it: at a decode step's rows the weight is streamed once.
 * From 8 rows a tile prefetches its weight DP_PREFETCH pairs of k ahead: SmolLM2's 30 layers of
 * projections (Zen 4, 2 threads, best of 7 alternated) 12 rows 9.7 -> 9.2 ms, 16 rows 11.6 -> 10.8,
 * 24 rows 15.9 -> 15.1; at 1-4 rows (bound by memory) it measured no faster, or slower. */
#define DP_ROWS 12
#define DP_PREFETCH 16
/* The first row tile of a pair of blocks (the only one, up to DP_ROWS rows) prefetches the next
 * pair's weight into L2, 128 bytes per pair of k, as it reads its own 128: with `omp for`'s static
 * schedule a thread's next pair is the weight right after this one's. A decode step then streams
 * its weight a whole pair of blocks ahead. SmolLM2's 30 layers of projections (Zen 4, 2 threads,
 * best of 9 alternated, ms): 3 rows 6.8 -> 6.2, 6 rows 7.1-7.4 -> 5.9-6.2, 8 rows 7.6-8.5 -> 6.1-7.2,
 * 12 rows 8.7-9.0 -> 7.8-8.1, 16 rows 10.4-10.7 -> 9.7-10.1, 64 rows 35.3 -> 34.7; at 1-2 rows it
 * measured a few percent slower, so from DP_NEXT_MIN_ROWS. Those tiles leave out the DP_PREFETCH
 * one into L1 (their weight is in L2 by then). 0 builds the kernel without it (benchmarks). */
#ifndef DP_NEXT_GROUP
#define DP_NEXT_GROUP 1
#endif
#define DP_NEXT_MIN_ROWS 3

int amx_available(void) { return 1; }

int amx_kernel_isa(void) { return 1; }

typedef int32_t __attribute__((may_alias, aligned(2))) pair_t;

/* Rows [m0, m0 + rows) by blocks nb and, where `two`, nb + 1 (constants once inlined: the
 * accumulators stay in registers); x padded to kp columns. `next`: the pair's first row tile. */
static inline __attribute__((always_inline)) void dp_tile(const int rows, const int two, uint16_t *out,
                                                          const uint16_t *x, int64_t ldx, const uint16_t *packed,
                                                          const uint16_t *bias, int64_t m0, int64_t nb, int64_t n,
                                                          int64_t kp, const int next) {
    const int64_t pairs = kp / 2;
    const uint16_t *w0 = packed + nb * kp * 16, *w1 = w0 + kp * 16;
    const pair_t *xr = (const pair_t *)(x + m0 * ldx);
    const int64_t ldp = ldx / 2;
    __m512 acc[DP_ROWS][2];
    const int next_pair = DP_NEXT_GROUP && next && rows >= DP_NEXT_MIN_ROWS;
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        if (rows >= 8 && !next_pair) { /* past a block's end: the next block's */
            _mm_prefetch((const char *)(w0 + 32 * (p + DP_PREFETCH)), _MM_HINT_T0);
            if (two) _mm_prefetch((const char *)(w1 + 32 * (p + DP_PREFETCH)), _MM_HINT_T0);
        }
        if (next_pair) {  /* the next pair of blocks starts where w1 ends: w0 + 2 * 16 * kp */
            _mm_prefetch((const char *)(w0 + 32 * kp + 64 * p), _MM_HINT_T1);
            _mm_prefetch((const char *)(w0 + 32 * kp + 64 * p + 32), _MM_HINT_T1);
        }
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + 32 * p);
        const __m512bh b1 = two ? (__m512bh)_mm512_loadu_si512(w1 + 32 * p) : b0;
        for (int r = 0; r < rows; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r * ldp + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            if (two) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    for (int c = 0; c < 1 + two; ++c) {
        const int64_t c0 = (nb + c) * 16;
        const int cols = n - c0 < 16 ? (int)(n - c0) : 16;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c0)),
                                                      16));
        for (int r = 0; r < rows; ++r) {
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], b));
            _mm256_mask_storeu_epi16(out + (m0 + r) * n + c0, mask, (__m256i)v);
        }
    }
}

static void dp_tile_any(int rows, int two, uint16_t *out, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                        const uint16_t *bias, int64_t m0, int64_t nb, int64_t n, int64_t kp, int next) {
    switch (rows) {
#define DP_TILE(r) case r: \
        if (two && next) dp_tile(r, 1, out, x, ldx, packed, bias, m0, nb, n, kp, 1); \
        else if (two) dp_tile(r, 1, out, x, ldx, packed, bias, m0, nb, n, kp, 0); \
        else dp_tile(r, 0, out, x, ldx, packed, bias, m0, nb, n, kp, 0); \
        break;
        DP_TILE(1) DP_TILE(2) DP_TILE(3) DP_TILE(4) DP_TILE(5) DP_TILE(6)
        DP_TILE(7) DP_TILE(8) DP_TILE(9) DP_TILE(10) DP_TILE(11) DP_TILE(12)
#undef DP_TILE
    }
}

void amx_linear_bf16(uint16_t *out, const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    const int64_t kp = round_up(k, 32), blocks16 = round_up(n, 16) / 16, groups = (blocks16 + 1) / 2;
    uint16_t *padded = padded_columns(x, m, k, kp);
    if (padded) x = padded;
    #pragma omp parallel num_threads(num_threads)
    for (int64_t c0 = 0; c0 < m; c0 += ROW_CHUNK) {
        const int64_t c1 = c0 + ROW_CHUNK < m ? c0 + ROW_CHUNK : m;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t nb = 2 * g;
            const int two = nb + 1 < blocks16;
            for (int64_t m0 = c0; m0 < c1; m0 += DP_ROWS) {
                const int rows = c1 - m0 < DP_ROWS ? (int)(c1 - m0) : DP_ROWS;
                dp_tile_any(rows, two, out, x, kp, packed, bias, m0, nb, n, kp, m0 == c0);
            }
        }
    }
    free(padded);
}
#else
int amx_available(void) { return 0; }

int amx_kernel_isa(void) { return 0; }

void amx_linear_bf16(uint16_t *out, const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    (void)out; (void)x; (void)packed; (void)bias; (void)m; (void)n; (void)k; (void)num_threads;
}
#endif
