/* bf16_linear's many-row path on AVX512F (matmul512.h): the same arithmetic, twice the lanes.

   bf16_linear sums output (m, n) in eight float32 lanes, lane l taking the products of k = l,
   l + 8, l + 16, ... in order (one fused multiply-add each, from zero), then adds the lanes as
   ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (hsum4). Here one 512-bit register holds
   those eight lanes for two outputs, (m, n) and (m, n + 1): the weight rows n and n + 1 are
   widened once per tile into a buffer that interleaves them by 8 values, the 8 activation
   values are broadcast to both halves, and the lanes are added by the same hsum4. Every fused
   multiply-add and every sum is the one bf16_linear performs, in the same order, so the
   outputs are the same bits; only the number of instructions (and registers: 24 accumulators,
   4 x 2 weight rows by 6 activation rows) changes. Built with a per-function target, so the
   library itself still needs only AVX2. */
#include <immintrin.h>
#include <stdlib.h>

#include "matmul512.h"
#include "simd.h"
#include "team.h"

#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512dq")))
#define TILE 32   /* weight rows a thread widens into its buffer at a time: 4 groups of 8 */
#define ROWS 6    /* activation rows per pass over a group of 8 weight rows */

/* Rows n0 .. n0 + nt - 1 (nt % 8 == 0) of w widened into buf: for each group u of 8 rows,
   each chunk c of 8 values and each pair p, 16 floats: row 8u + 2p's values 8c .. 8c + 7,
   then row 8u + 2p + 1's. */
AVX512 static void widen_tile(const uint16_t *w, int64_t K, int64_t n0, int64_t nt, float *buf) {
    const int64_t chunks = K / 8;
    for (int64_t r = 0; r < nt; r++) {
        const uint16_t *row = w + (n0 + r) * K;
        float *dst = buf + ((r / 8) * chunks * 4 + (r % 8) / 2) * 16 + (r % 2) * 8;
        for (int64_t c = 0; c < chunks; c++) {
            const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 8 * c)));
            _mm256_store_ps(dst + c * 64, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
    }
}

/* y[i * N + 0 .. 7] for R activation rows x (row stride K) against one widened group of 8
   weight rows g (K / 8 chunks of 4 pairs): 4R accumulators, two outputs each. */
#define DEFINE_GROUP(R)                                                                        \
    AVX512 static void group##R(const float *g, const float *x, int64_t K, float *y, int64_t N) { \
        __m512 acc[R][4];                                                                      \
        for (int i = 0; i < R; i++)                                                            \
            for (int p = 0; p < 4; p++) acc[i][p] = _mm512_setzero_ps();                       \
        for (int64_t k = 0; k < K; k += 8, g += 64) {                                          \
            const __m512 w0 = _mm512_load_ps(g), w1 = _mm512_load_ps(g + 16);                  \
            const __m512 w2 = _mm512_load_ps(g + 32), w3 = _mm512_load_ps(g + 48);             \
            for (int i = 0; i < R; i++) {                                                      \
                const __m512 v = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * K + k));       \
                acc[i][0] = _mm512_fmadd_ps(w0, v, acc[i][0]);                                 \
                acc[i][1] = _mm512_fmadd_ps(w1, v, acc[i][1]);                                 \
                acc[i][2] = _mm512_fmadd_ps(w2, v, acc[i][2]);                                 \
                acc[i][3] = _mm512_fmadd_ps(w3, v, acc[i][3]);                                 \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) {                                                          \
            __m256 h[8];                                                                       \
            for (int p = 0; p < 4; p++) {                                                      \
                h[2 * p] = _mm512_castps512_ps256(acc[i][p]);                                  \
                h[2 * p + 1] = _mm512_extractf32x8_ps(acc[i][p], 1);                           \
            }                                                                                  \
            _mm_storeu_ps(y + i * N, hsum4(h[0], h[1], h[2], h[3]));                           \
            _mm_storeu_ps(y + i * N + 4, hsum4(h[4], h[5], h[6], h[7]));                       \
        }                                                                                      \
    }
DEFINE_GROUP(1) DEFINE_GROUP(2) DEFINE_GROUP(3) DEFINE_GROUP(4) DEFINE_GROUP(5) DEFINE_GROUP(6)

typedef void (*group_fn)(const float *, const float *, int64_t, float *, int64_t);
static const group_fn GROUPS[ROWS + 1] = {0, group1, group2, group3, group4, group5, group6};

typedef struct {
    const float *x;
    const uint16_t *w;
    float *y;
    int64_t M, N, K;
} Job;

/* Thread t widens its share of the tiles one at a time and runs every activation row over
   each, ROWS at a time (spread evenly over the passes), group after group. */
AVX512 static void tiles_job(void *ctx, int t, int T) {
    const Job *j = (const Job *)ctx;
    const int64_t M = j->M, N = j->N, K = j->K, chunks = K / 8;
    const int64_t passes = (M + ROWS - 1) / ROWS, per = (M + passes - 1) / passes;
    int64_t a, b;
    team_share((N + TILE - 1) / TILE, t, T, &a, &b);
    if (a >= b) return;
    float *buf = (float *)aligned_alloc(64, (size_t)(TILE * K) * sizeof(float));
    for (int64_t tile = a; tile < b; tile++) {
        const int64_t n0 = tile * TILE, nt = N - n0 < TILE ? N - n0 : TILE;
        widen_tile(j->w, K, n0, nt, buf);
        for (int64_t m0 = 0; m0 < M; m0 += per) {
            const int64_t rows = M - m0 < per ? M - m0 : per;
            for (int64_t u = 0; u < nt / 8; u++)
                GROUPS[rows](buf + u * chunks * 64, j->x + m0 * K, K, j->y + m0 * N + n0 + 8 * u, N);
        }
    }
    free(buf);
}

int bf16_avx512_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

void bf16_linear_avx512(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                        int64_t K, int threads) {
    Job job = {x, w, y, M, N, K};
    team_run(tiles_job, &job, threads);
}
