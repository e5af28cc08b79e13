/* The float matmuls (matmul.h): bf16 weights widened in registers, and GGUF blocks widened
   the same way, with products summed in the same order by both. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "matmul512.h"
#include "gguf.h"
#include "simd.h"
#include "team.h"

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* y[i * ystride] = lane sum of acc[i], four outputs per reduction. */
static inline void store_sums(const __m256 *acc, int R, float *y, int64_t ystride) {
    int i = 0;
    for (; i + 4 <= R; i += 4) {
        float out[4];
        _mm_storeu_ps(out, hsum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
        for (int j = 0; j < 4; j++) y[(i + j) * ystride] = out[j];
    }
    for (; i < R; i++) y[i * ystride] = hsum(acc[i]);
}

/* y[i * ystride] = dot(w_row, x[i]) for R activation rows: the weight row is widened once per
   8 values and used for all R rows (R accumulators live in registers). */
#define DEFINE_DOT(R)                                                                   \
    static void dot##R(const uint16_t *wr, const float *x, int64_t K, float *y,         \
                       int64_t ystride) {                                               \
        __m256 acc[R];                                                                  \
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();                       \
        for (int64_t k = 0; k < K; k += 8) {                                            \
            if (R > 3 && (k & 31) == 0)                                                 \
                _mm_prefetch((const char *)(wr + 8 * K + k), _MM_HINT_T0);              \
            const __m256 c = load_bf16x8(wr + k);                                       \
            for (int i = 0; i < R; i++)                                                 \
                acc[i] = _mm256_fmadd_ps(c, _mm256_loadu_ps(x + i * K + k), acc[i]);    \
        }                                                                               \
        store_sums(acc, R, y, ystride);                                                 \
    }
DEFINE_DOT(1) DEFINE_DOT(2) DEFINE_DOT(3) DEFINE_DOT(4) DEFINE_DOT(5) DEFINE_DOT(6)
DEFINE_DOT(7) DEFINE_DOT(8) DEFINE_DOT(9) DEFINE_DOT(10) DEFINE_DOT(11) DEFINE_DOT(12)

typedef void (*dot_fn)(const uint16_t *, const float *, int64_t, float *, int64_t);
static const dot_fn DOTS[13] = {0, dot1, dot2, dot3, dot4, dot5, dot6,
                                dot7, dot8, dot9, dot10, dot11, dot12};

/* Two weight rows against R activation rows: 2R accumulators in registers, each activation
   vector loaded once for both weight rows (LOADW widens 8 weights to float32). Every output is
   accumulated in the same order as dot##R's, so the two give the same bits. */
#define DEFINE_DOT2(NAME, TYPE, LOADW, R)                                                   \
    static void NAME##R(const TYPE *w0, const float *x, int64_t K, float *y,               \
                        int64_t ystride) {                                                 \
        const TYPE *w1 = w0 + K;                                                           \
        __m256 a0[R], a1[R];                                                               \
        for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm256_setzero_ps();                   \
        for (int64_t k = 0; k < K; k += 8) {                                               \
            if ((k & 31) == 0) { /* the pair after next: memory keeps streaming meanwhile */ \
                _mm_prefetch((const char *)(w0 + 8 * K + k), _MM_HINT_T0);                 \
                _mm_prefetch((const char *)(w0 + 9 * K + k), _MM_HINT_T0);                 \
            }                                                                              \
            const __m256 c0 = LOADW(w0 + k), c1 = LOADW(w1 + k);                           \
            for (int i = 0; i < R; i++) {                                                  \
                const __m256 v = _mm256_loadu_ps(x + i * K + k);                           \
                a0[i] = _mm256_fmadd_ps(c0, v, a0[i]);                                     \
                a1[i] = _mm256_fmadd_ps(c1, v, a1[i]);                                     \
            }                                                                              \
        }                                                                                  \
        store_sums(a0, R, y, ystride);                                                     \
        store_sums(a1, R, y + 1, ystride);                                                 \
    }
#define DEFINE_DOT2S(NAME, TYPE, LOADW)                                                     \
    DEFINE_DOT2(NAME, TYPE, LOADW, 1) DEFINE_DOT2(NAME, TYPE, LOADW, 2)                     \
    DEFINE_DOT2(NAME, TYPE, LOADW, 3) DEFINE_DOT2(NAME, TYPE, LOADW, 4)                     \
    DEFINE_DOT2(NAME, TYPE, LOADW, 5) DEFINE_DOT2(NAME, TYPE, LOADW, 6)
DEFINE_DOT2S(bf16_dot2_, uint16_t, load_bf16x8)

typedef void (*dot2_fn)(const uint16_t *, const float *, int64_t, float *, int64_t);
static const dot2_fn BF16_DOT2[7] = {0, bf16_dot2_1, bf16_dot2_2, bf16_dot2_3, bf16_dot2_4,
                                     bf16_dot2_5, bf16_dot2_6};

#define TILE_ROWS 16        /* weight rows a thread keeps in L2 while activation rows pass */
#define DIRECT_ROWS 3       /* up to this many activation rows: one pass per weight row */

/* Activation rows per pass over a weight tile: at most 6 and as many as fit in 24 KB of L1,
   spread evenly over the passes M needs. */
static inline int64_t rows_per_pass(int64_t M, int64_t K) {
    int64_t r = 24576 / (4 * K);
    r = r < 2 ? 2 : (r > 6 ? 6 : r);
    const int64_t passes = (M + r - 1) / r;
    return (M + passes - 1) / passes;
}

/* One matmul handed to the team: y[M, N] = x[M, K] . w^T; packed weights: block kind, rnd. */
typedef struct {
    const float *x;
    const void *w;
    float *y;
    int64_t M, N, K;
    int kind, rnd;
} LinearJob;

static void bf16_direct_job(void *ctx, int t, int T) {
    const LinearJob *j = (const LinearJob *)ctx;
    const uint16_t *w = (const uint16_t *)j->w;
    int64_t a, b;
    team_share(j->N, t, T, &a, &b);
    for (int64_t n = a; n < b; n++)
        DOTS[j->M](w + n * j->K, j->x, j->K, j->y + n, j->N);
}

static void bf16_tiled_job(void *ctx, int t, int T) {
    const LinearJob *j = (const LinearJob *)ctx;
    const uint16_t *w = (const uint16_t *)j->w;
    const float *x = j->x;
    float *y = j->y;
    const int64_t M = j->M, N = j->N, K = j->K, R = rows_per_pass(M, K);
    int64_t a, b;
    team_share((N + TILE_ROWS - 1) / TILE_ROWS, t, T, &a, &b);
    for (int64_t tile = a; tile < b; tile++) {
        const int64_t n0 = tile * TILE_ROWS, nt = N - n0 < TILE_ROWS ? N - n0 : TILE_ROWS;
        for (int64_t m0 = 0; m0 < M; m0 += R) {
            const int64_t rows = M - m0 < R ? M - m0 : R;
            int64_t r = 0;
            for (; r + 2 <= nt; r += 2)
                BF16_DOT2[rows](w + (n0 + r) * K, x + m0 * K, K, y + m0 * N + n0 + r, N);
            if (r < nt)
                DOTS[rows](w + (n0 + r) * K, x + m0 * K, K, y + m0 * N + n0 + r, N);
        }
    }
}

static int avx512_rows = 0;  /* from this many rows on, the AVX512 tiles (0: never) */

int bf16_avx512(int min_rows) {
    if (min_rows >= 0)
        avx512_rows = min_rows > 0 && bf16_avx512_supported() ? min_rows : 0;
    return avx512_rows;
}

/* y[M, N] = x[M, K] (float32) . w[N, K]^T (bfloat16) (+ residual[M, N] if not NULL), with
   K % 8 == 0. Up to DIRECT_ROWS rows, or up to 12 that fit in 24 KB of L1, each weight row
   streams once past all of them (prefetched ahead for 4+ rows). More rows: each thread takes
   tiles of TILE_ROWS weight rows in order and runs the activation rows over a tile a few at a
   time (they stay in L1, the tile in L2), two weight rows per pass; from bf16_avx512's row
   count on (a CPU with AVX512F, N % 8 == 0) bf16_linear_avx512 does it, two outputs a register.
   Every output is summed in the same order whatever M is and on either path, so a row's result
   never depends on the rows batched with it nor on the instruction set. */
void bf16_linear(const float *x, const uint16_t *w, float *y, const float *residual,
                 int64_t M, int64_t N, int64_t K, int threads) {
    LinearJob job = {x, w, y, M, N, K, 0, 0};
    if (M <= DIRECT_ROWS || (M <= 12 && 4 * M * K <= 24576))
        team_run(bf16_direct_job, &job, threads);
    else if (avx512_rows && M >= avx512_rows && N % 8 == 0)
        bf16_linear_avx512(x, w, y, M, N, K, threads);
    else
        team_run(bf16_tiled_job, &job, threads);
    if (residual)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
}

void bf16_linear_rows(const float *x, const uint16_t *w, float *y, const float *residual,
                      int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        DOTS[1](w + n * K, x, K, y + n, 1);
    if (residual)
        for (int64_t i = n0; i < n1; i++) y[i] += residual[i];
}

/* ---- weights kept in their GGUF blocks (gguf.h): a weight is d * q + m (Q4_1) or d * q
   (Q8_0) in float32, computed as a product then a sum (built with -ffp-contract=off), optionally
   rounded to bfloat16 like torch's cast: exactly the values of the checkpoint that was
   dequantised from these blocks, at a third of the bytes to stream. */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Round 8 floats to bfloat16 precision (nearest, ties to even), kept as floats. */
static inline __m256 round_bf16x8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void q4_1_block(const uint8_t *b, int rnd, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 4)), low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(d, q), m);
        w[i] = rnd ? round_bf16x8(v) : v;
    }
}

static inline void q8_0_block(const uint8_t *b, int rnd, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int i = 0; i < 4; i++) {
        const __m128i raw = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
        const __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
        w[i] = rnd ? round_bf16x8(v) : v;
    }
}

/* Like dot##R, for one packed weight row: each block is widened once for all R rows, and every
   output is accumulated in the same order as bf16_linear's, so results match it bit for bit. */
#define DEFINE_PACKED_DOT(KIND, BYTES, R)                                                   \
    static void KIND##_dot##R(const uint8_t *row, int rnd, const float *x, int64_t K,       \
                              float *y, int64_t ystride) {                                  \
        __m256 acc[R];                                                                     \
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();                          \
        for (int64_t k = 0; k < K; k += 32, row += BYTES) {                                \
            __m256 w[4];                                                                   \
            KIND##_block(row, rnd, w);                                                     \
            for (int j = 0; j < 4; j++)                                                    \
                for (int i = 0; i < R; i++)                                                \
                    acc[i] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + i * K + k + 8 * j), acc[i]); \
        }                                                                                  \
        store_sums(acc, R, y, ystride);                                                    \
    }
#define DEFINE_PACKED_DOTS(KIND, BYTES)                                                     \
    DEFINE_PACKED_DOT(KIND, BYTES, 1) DEFINE_PACKED_DOT(KIND, BYTES, 2)                     \
    DEFINE_PACKED_DOT(KIND, BYTES, 3)
DEFINE_PACKED_DOTS(q4_1, Q4_1_BLOCK_BYTES)
DEFINE_PACKED_DOTS(q8_0, Q8_0_BLOCK_BYTES)

typedef void (*packed_dot_fn)(const uint8_t *, int, const float *, int64_t, float *, int64_t);
static const packed_dot_fn PACKED_DOTS[2][4] = {
    {0, q4_1_dot1, q4_1_dot2, q4_1_dot3},
    {0, q8_0_dot1, q8_0_dot2, q8_0_dot3},
};

static inline __m256 load_f32x8(const float *p) { return _mm256_load_ps(p); }
DEFINE_DOT2S(wide_dot2_, float, load_f32x8)
typedef void (*wide_fn)(const float *, const float *, int64_t, float *, int64_t);
static const wide_fn WIDE_DOT2[7] = {0, wide_dot2_1, wide_dot2_2, wide_dot2_3, wide_dot2_4,
                                       wide_dot2_5, wide_dot2_6};

/* y[M, N] = x[M, K] . W^T (+ residual) for W [N, K] in blocks of kind 0 (Q4_1) or 1 (Q8_0),
   rounded to bfloat16 when rnd != 0. K % 32 == 0. Up to DIRECT_ROWS rows each block is widened
   in registers for the rows at hand. More rows: each thread widens a tile of TILE_ROWS weight
   rows into a buffer once and passes the activation rows over it as bf16_linear does (an odd
   last weight row goes with a zero row: its own outputs are unaffected). */
static void packed_direct_job(void *ctx, int t, int T) {
    const LinearJob *j = (const LinearJob *)ctx;
    const uint8_t *w = (const uint8_t *)j->w;
    const int64_t row_bytes = j->K / 32 * GGUF_BLOCK_BYTES(j->kind);
    int64_t a, b;
    team_share(j->N, t, T, &a, &b);
    for (int64_t n = a; n < b; n++)
        PACKED_DOTS[j->kind][j->M](w + n * row_bytes, j->rnd, j->x, j->K, j->y + n, j->N);
}

static void packed_tiled_job(void *ctx, int t, int T) {
    const LinearJob *j = (const LinearJob *)ctx;
    const uint8_t *w = (const uint8_t *)j->w;
    const float *x = j->x;
    float *y = j->y;
    const int kind = j->kind, rnd = j->rnd;
    const int64_t M = j->M, N = j->N, K = j->K, R = rows_per_pass(M, K);
    const int64_t block_bytes = GGUF_BLOCK_BYTES(kind), row_bytes = K / 32 * block_bytes;
    int64_t a, b;
    team_share((N + TILE_ROWS - 1) / TILE_ROWS, t, T, &a, &b);
    if (a >= b) return;
    float *buf = (float *)aligned_alloc(64, (size_t)((TILE_ROWS + 1) * K) * sizeof(float));
    for (int64_t tile = a; tile < b; tile++) {
        const int64_t n0 = tile * TILE_ROWS, nt = N - n0 < TILE_ROWS ? N - n0 : TILE_ROWS;
        for (int64_t r = 0; r < nt; r++) {
            const uint8_t *blk = w + (n0 + r) * row_bytes;
            for (int64_t k = 0; k < K; k += 32, blk += block_bytes) {
                __m256 v[4];
                if (kind == GGUF_Q4_1) q4_1_block(blk, rnd, v); else q8_0_block(blk, rnd, v);
                for (int i = 0; i < 4; i++) _mm256_store_ps(buf + r * K + k + 8 * i, v[i]);
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += R) {
            const int64_t rows = M - m0 < R ? M - m0 : R;
            for (int64_t r = 0; r < nt; r += 2) {
                if (r + 1 < nt) {
                    WIDE_DOT2[rows](buf + r * K, x + m0 * K, K, y + m0 * N + n0 + r, N);
                } else {  /* an odd last row goes with a zero row; its outputs only */
                    float out[6 * 2];
                    memset(buf + (r + 1) * K, 0, (size_t)K * sizeof(float));
                    WIDE_DOT2[rows](buf + r * K, x + m0 * K, K, out, 2);
                    for (int64_t i = 0; i < rows; i++)
                        y[(m0 + i) * N + n0 + r] = out[2 * i];
                }
            }
        }
    }
    free(buf);
}

void packed_linear(const float *x, const uint8_t *w, int kind, int rnd, float *y,
                   const float *residual, int64_t M, int64_t N, int64_t K, int threads) {
    LinearJob job = {x, w, y, M, N, K, kind, rnd};
    team_run(M <= DIRECT_ROWS ? packed_direct_job : packed_tiled_job, &job, threads);
    if (residual)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
}

void packed_linear_rows(const float *x, const uint8_t *w, int kind, int rnd, float *y,
                        const float *residual, int64_t K, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / 32 * GGUF_BLOCK_BYTES(kind);
    for (int64_t n = n0; n < n1; n++)
        PACKED_DOTS[kind][1](w + n * row_bytes, rnd, x, K, y + n, 1);
    if (residual)
        for (int64_t i = n0; i < n1; i++) y[i] += residual[i];
}
