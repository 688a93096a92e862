/* bf16 x bf16 -> bf16 GEMM on Intel AMX: out[m, n] = bf16(sum_k x[m, k] w[n, k] (+ bias[n])),
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
 * kernels/cpu/amx_gemm.py's MAX_ROWS rows only. */
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
    uint16_t *padded = NULL;
    if (kp != k) { /* the last K tile reads 32 columns: zeros past k (NaN-free, unlike a neighbour's) */
        padded = (uint16_t *)calloc((size_t)(m * kp), sizeof(uint16_t));
        for (int64_t r = 0; r < m; ++r) memcpy(padded + r * kp, x + r * k, (size_t)k * sizeof(uint16_t));
        x = padded;
    }
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
#else
int amx_available(void) { return 0; }

void amx_linear_bf16(uint16_t *out, const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    (void)out; (void)x; (void)packed; (void)bias; (void)m; (void)n; (void)k; (void)num_threads;
}
#endif
