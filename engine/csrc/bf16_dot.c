/* bf16 activations against bf16 weights with AVX512-BF16 (bf16_dot.h): ``precision="bf16"``'s
   many-row matmuls.

   Each activation row is rounded to bfloat16 (nearest, ties to even) once per call; then every
   output (m, n) is one float32 accumulator over the K / 2 pairs of k in order, each step one
   vdpbf16ps lane: acc += x[2p] * w[2p] + x[2p + 1] * w[2p + 1] (the products of two bf16 values
   are exact in float32; the instruction rounds the sums to nearest even and flushes denormals).
   One register holds 16 outputs of one activation row, so there is no horizontal sum; the
   order of the steps never depends on the rows batched together, so a row's result never
   depends on them either. Not the exact path's arithmetic (float32 activations, eight partial
   sums per output): the logits differ slightly, see docs/engine.md. Built with a per-function
   target, so the library itself still needs only AVX2. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_dot.h"
#include "matmul.h"
#include "team.h"

#define BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512bf16")))
#define TILE 32   /* weight rows (outputs) a thread repacks at a time: two registers' worth */
#define ROWS 12   /* activation rows per pass over a tile: 24 accumulators */

int bf16_dot_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

/* x [M, K] float32 -> bf16 (nearest, ties to even), 32 values at a time (K % 32 == 0). */
BF16 static void round_rows(const float *x, int64_t count, uint16_t *out) {
    for (int64_t i = 0; i < count; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512((void *)(out + i), (__m512i)v);
    }
}

/* Rows n0 .. n0 + nt - 1 of w as pairs: buf[p * TILE + r] = (w[n0 + r, 2p], w[n0 + r, 2p + 1]),
   rows past nt zero. */
static void repack_tile(const uint16_t *w, int64_t K, int64_t n0, int64_t nt, uint32_t *buf) {
    const int64_t pairs = K / 2;
    for (int64_t r = 0; r < TILE; r++) {
        if (r >= nt) {
            for (int64_t p = 0; p < pairs; p++) buf[p * TILE + r] = 0;
            continue;
        }
        uint32_t row[pairs];
        memcpy(row, w + (n0 + r) * K, (size_t)K * sizeof(uint16_t));
        for (int64_t p = 0; p < pairs; p++) buf[p * TILE + r] = row[p];
    }
}

/* out[i * N + 0 .. TILE - 1] (the first `valid` of them) for R bf16 activation rows xb (row
   stride K) against one repacked tile. */
#define DEFINE_PASS(R)                                                                          \
    BF16 static void pass##R(const uint32_t *buf, const uint16_t *xb, int64_t K, float *out,   \
                             int64_t N, int64_t valid) {                                       \
        __m512 acc[R][2];                                                                       \
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();               \
        const uint32_t *xp = (const uint32_t *)xb;                                             \
        for (int64_t p = 0; p < K / 2; p++, buf += TILE) {                                     \
            const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)buf);                \
            const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(buf + 16));         \
            for (int i = 0; i < R; i++) {                                                       \
                const __m512bh v = (__m512bh)_mm512_set1_epi32((int)xp[i * (K / 2) + p]);      \
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], v, w0);                                 \
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], v, w1);                                 \
            }                                                                                   \
        }                                                                                       \
        const __mmask16 m0 = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);           \
        const __mmask16 m1 = valid >= 32 ? 0xFFFF                                              \
                             : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);        \
        for (int i = 0; i < R; i++) {                                                           \
            _mm512_mask_storeu_ps(out + i * N, m0, acc[i][0]);                                  \
            _mm512_mask_storeu_ps(out + i * N + 16, m1, acc[i][1]);                             \
        }                                                                                       \
    }
DEFINE_PASS(1) DEFINE_PASS(2) DEFINE_PASS(3) DEFINE_PASS(4) DEFINE_PASS(5) DEFINE_PASS(6)
DEFINE_PASS(7) DEFINE_PASS(8) DEFINE_PASS(9) DEFINE_PASS(10) DEFINE_PASS(11) DEFINE_PASS(12)

typedef void (*pass_fn)(const uint32_t *, const uint16_t *, int64_t, float *, int64_t, int64_t);
static const pass_fn PASSES[ROWS + 1] = {0, pass1, pass2, pass3, pass4, pass5, pass6,
                                         pass7, pass8, pass9, pass10, pass11, pass12};

typedef struct {
    const uint16_t *xb;
    const uint16_t *w;
    float *y;
    int64_t M, N, K;
} Job;

/* Thread t repacks its share of the tiles one at a time and runs every activation row over
   each, ROWS at a time (spread evenly over the passes). */
static void tiles_job(void *ctx, int t, int T) {
    const Job *j = (const Job *)ctx;
    const int64_t M = j->M, N = j->N, K = j->K;
    const int64_t passes = (M + ROWS - 1) / ROWS, per = (M + passes - 1) / passes;
    int64_t a, b;
    team_share((N + TILE - 1) / TILE, t, T, &a, &b);
    if (a >= b) return;
    uint32_t *buf = (uint32_t *)aligned_alloc(64, (size_t)(TILE * K / 2) * sizeof(uint32_t));
    for (int64_t tile = a; tile < b; tile++) {
        const int64_t n0 = tile * TILE, nt = N - n0 < TILE ? N - n0 : TILE;
        repack_tile(j->w, K, n0, nt, buf);
        for (int64_t m0 = 0; m0 < M; m0 += per) {
            const int64_t rows = M - m0 < per ? M - m0 : per;
            PASSES[rows](buf, j->xb + m0 * K, K, j->y + m0 * N + n0, N, nt);
        }
    }
    free(buf);
}

void bf16_dot_linear(const float *x, const uint16_t *w, float *y, const float *residual,
                     int64_t M, int64_t N, int64_t K, int threads) {
    if (!bf16_dot_supported() || K % 32) {  /* callers check first; never an illegal instruction */
        bf16_linear(x, w, y, residual, M, N, K, threads);
        return;
    }
    uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)(M * K) * sizeof(uint16_t) + 64);
    round_rows(x, M * K, xb);
    Job job = {xb, w, y, M, N, K};
    team_run(tiles_job, &job, threads);
    free(xb);
    if (residual)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
}
