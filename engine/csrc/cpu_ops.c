#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* The four lane sums of a0..a3 as one vector, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
   (l6 + l7)); hsum adds in the same order, so one output's value never depends on whether it
   was reduced alone or four at a time. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* the worker team (team.c; these declarations must match it) */
typedef void (*team_job)(void *ctx, int t, int T);
typedef struct { _Atomic int arrived; _Atomic int phase; } TeamBarrier;
void team_run(team_job job, void *ctx, int threads);
void team_barrier(TeamBarrier *b, int T);
void team_share(int64_t units, int t, int T, int64_t *a, int64_t *b);

static inline float hsum(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 t = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
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

/* y[M, N] = x[M, K] (float32) . w[N, K]^T (bfloat16) (+ residual[M, N] if not NULL), with
   K % 8 == 0. Up to DIRECT_ROWS rows, or up to 12 that fit in 24 KB of L1, each weight row
   streams once past all of them (prefetched ahead for 4+ rows). More rows: each thread takes
   tiles of TILE_ROWS weight rows in order and runs the activation rows over a tile a few at a
   time (they stay in L1, the tile in L2), two weight rows per pass.
   Every output is summed in the same order whatever M is, so a row's result never depends on
   the rows batched with it. */
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

void bf16_linear(const float *x, const uint16_t *w, float *y, const float *residual,
                 int64_t M, int64_t N, int64_t K, int threads) {
    LinearJob job = {x, w, y, M, N, K, 0, 0};
    if (M <= DIRECT_ROWS || (M <= 12 && 4 * M * K <= 24576))
        team_run(bf16_direct_job, &job, threads);
    else
        team_run(bf16_tiled_job, &job, threads);
    if (residual)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
}

/* ---- weights kept in their GGUF blocks: Q4_1 (20 bytes per 32 weights: fp16 d, fp16 m, then
   16 bytes where byte j holds weight j in its low nibble and weight j + 16 in its high one) and
   Q8_0 (34 bytes: fp16 d, then 32 int8). A weight is d * q + m (Q4_1) or d * q (Q8_0) in
   float32, computed as a product then a sum (built with -ffp-contract=off), optionally rounded
   to bfloat16 like torch's cast: exactly the values of the checkpoint that was dequantised from
   these blocks, at a third of the bytes to stream. */
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
DEFINE_PACKED_DOTS(q4_1, 20)
DEFINE_PACKED_DOTS(q8_0, 34)

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
    const int64_t row_bytes = j->K / 32 * (j->kind == 0 ? 20 : 34);
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
    const int64_t block_bytes = kind == 0 ? 20 : 34, row_bytes = K / 32 * block_bytes;
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
                if (kind == 0) q4_1_block(blk, rnd, v); else q8_0_block(blk, rnd, v);
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

/* exp(x) for 8 floats: range reduction to 2^n * e^r, |r| <= ln2/2, degree-6 polynomial
   (relative error ~2e-7); inputs below -87 flush to 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, for M rows of K (K % 8 == 0). */
void rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t K, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *yr = y + m * K;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)K + eps));
        for (int64_t k = 0; k < K; k += 8)
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), inv),
                                                   _mm256_loadu_ps(w + k)));
    }
}

/* y[i] = silu(gu[i]) * gu[I + i] for i = a .. b - 1 (a, b multiples of 8) of one row gu [2I]. */
static void silu_mul_range(const float *gu, float *y, int64_t I, int64_t a, int64_t b) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t i = a; i < b; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i);
        const __m256 u = _mm256_loadu_ps(gu + I + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
}

/* y[m, i] = silu(gu[m, i]) * gu[m, I + i] for gu [M, 2I] (I % 8 == 0). */
void silu_mul(const float *gu, float *y, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++)
        silu_mul_range(gu + m * 2 * I, y + m * I, I, 0, I);
}

/* ---- the KV cache holds float16 (IEEE half) keys and values: half the bytes attention
   streams; every path stores and reads them the same way, so results stay path-independent. */
typedef uint16_t kv_t;

static inline void store_kv_row(kv_t *dst, const float *src, int64_t D) {
    for (int64_t d = 0; d < D; d += 8)
        _mm_storeu_si128((__m128i *)(dst + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
}

static inline __m256 load_kv(const kv_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Attention of the G query heads that share one kv head (q [G, D], contiguous) over
   keys/values [len, D]: each key and value row is loaded once for all G heads. Scores go to
   s[g * ss + t]; KB keys at a time keep G * KB dot products in registers. A score is its own
   accumulator over d whatever G, KB and the key block are, so heads and keys can be grouped
   freely. */
#define DEFINE_SCORES(G, KB)                                                                \
    static void scores##G(const float *q, const kv_t *keys, int64_t D, int64_t len,         \
                          float scale, float *s, int64_t ss) {                              \
        int64_t t = 0;                                                                     \
        for (; t + KB <= len; t += KB) {                                                   \
            __m256 acc[G][KB];                                                             \
            for (int g = 0; g < G; g++)                                                    \
                for (int j = 0; j < KB; j++) acc[g][j] = _mm256_setzero_ps();              \
            for (int64_t d = 0; d < D; d += 8) {                                           \
                __m256 qv[G];                                                              \
                for (int g = 0; g < G; g++) qv[g] = _mm256_loadu_ps(q + g * D + d);        \
                for (int j = 0; j < KB; j++) {                                             \
                    const __m256 kv = load_kv(keys + (t + j) * D + d);                     \
                    for (int g = 0; g < G; g++) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]); \
                }                                                                          \
            }                                                                              \
            for (int g = 0; g < G; g++) {                                                  \
                if (KB == 4) {                                                             \
                    const __m128 v = _mm_mul_ps(hsum4(acc[g][0], acc[g][1 % KB], acc[g][2 % KB], \
                                                      acc[g][3 % KB]), _mm_set1_ps(scale)); \
                    _mm_storeu_ps(s + g * ss + t, v);                                      \
                } else {                                                                   \
                    for (int j = 0; j < KB; j++) s[g * ss + t + j] = hsum(acc[g][j]) * scale; \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (; t < len; t++) {                                                             \
            __m256 acc[G];                                                                 \
            for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();                      \
            for (int64_t d = 0; d < D; d += 8) {                                           \
                const __m256 kv = load_kv(keys + t * D + d);                               \
                for (int g = 0; g < G; g++)                                                \
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);  \
            }                                                                              \
            for (int g = 0; g < G; g++) s[g * ss + t] = hsum(acc[g]) * scale;              \
        }                                                                                  \
    }
DEFINE_SCORES(1, 4) DEFINE_SCORES(2, 4) DEFINE_SCORES(3, 4) DEFINE_SCORES(4, 4)

/* acc [G, D] += s[g * ss + t] * values [len, D] summed over t in order, CW vectors of D at a
   time (D % (8 CW) == 0); acc is loaded and stored around the block, which leaves every sum
   exactly as if it had stayed in registers. */
#define DEFINE_MIX(G, CW)                                                                   \
    static void mix##G##_##CW(const float *s, int64_t ss, int64_t len, const kv_t *vals,     \
                              int64_t D, float *acc_out) {                                  \
        for (int64_t d0 = 0; d0 < D; d0 += 8 * CW) {                                       \
            __m256 acc[G][CW];                                                             \
            for (int g = 0; g < G; g++)                                                    \
                for (int c = 0; c < CW; c++) acc[g][c] = _mm256_loadu_ps(acc_out + g * D + d0 + 8 * c); \
            for (int64_t t = 0; t < len; t++) {                                            \
                __m256 v[CW];                                                              \
                for (int c = 0; c < CW; c++) v[c] = load_kv(vals + t * D + d0 + 8 * c);     \
                for (int g = 0; g < G; g++) {                                              \
                    const __m256 p = _mm256_set1_ps(s[g * ss + t]);                        \
                    for (int c = 0; c < CW; c++) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]); \
                }                                                                          \
            }                                                                              \
            for (int g = 0; g < G; g++)                                                    \
                for (int c = 0; c < CW; c++)                                               \
                    _mm256_storeu_ps(acc_out + g * D + d0 + 8 * c, acc[g][c]);             \
        }                                                                                  \
    }
DEFINE_MIX(1, 8) DEFINE_MIX(1, 4) DEFINE_MIX(2, 4) DEFINE_MIX(3, 4) DEFINE_MIX(4, 2)

typedef void (*scores_fn)(const float *, const kv_t *, int64_t, int64_t, float, float *, int64_t);
typedef void (*mix_fn)(const float *, int64_t, int64_t, const kv_t *, int64_t, float *);
static const scores_fn SCORES[5] = {0, scores1, scores2, scores3, scores4};
static const mix_fn MIXES[5] = {0, mix1_4, mix2_4, mix3_4, mix4_2};

/* Scores of a row -> exp(score - max) in place; returns 1 / sum. */
static float softmax_row(float *s, int64_t len) {
    __m256 best8 = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) best8 = _mm256_max_ps(best8, _mm256_loadu_ps(s + t));
    __m128 best4 = _mm_max_ps(_mm256_castps256_ps128(best8), _mm256_extractf128_ps(best8, 1));
    best4 = _mm_max_ps(best4, _mm_movehl_ps(best4, best4));
    float best = _mm_cvtss_f32(_mm_max_ss(best4, _mm_shuffle_ps(best4, best4, 1)));
    for (; t < len; t++) best = s[t] > best ? s[t] : best;
    __m256 total8 = _mm256_setzero_ps();
    t = 0;
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(best)));
        _mm256_storeu_ps(s + t, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = hsum(total8);
    for (; t < len; t++) {
        s[t] = expf(s[t] - best);
        total += s[t];
    }
    return 1.0f / total;
}

/* ---- a whole step's layers in one call: no per-op trip through Python ---- */

typedef struct {
    const uint16_t *dense;  /* bf16 [N, K] */
    const uint8_t *packed;  /* GGUF blocks of the same matrix, or NULL */
    int kind;               /* of the blocks: 0 Q4_1, 1 Q8_0 */
    const uint8_t *int8;    /* the blocks interleaved by 8 rows: multiply them with int8
                               activations at every row count; or NULL */
} Matrix;

/* engine/csrc/int8_ops.c */
void int8_linear(const float *x, const uint8_t *w, int kind, float *y, const float *residual,
                 int64_t M, int64_t N, int64_t K, int threads);

typedef struct {
    const float *attn_norm, *mlp_norm, *bqkv;  /* bqkv may be NULL */
    Matrix qkv, o, gate_up, down;
    kv_t *k_cache, *v_cache;                   /* block pools [NB, KV, BS, D], float16 */
} Layer;

/* y = x . W^T (+ residual) as `kernel_linear` does it: the blocks with int8 activations when the
   matrix asks for them, else the blocks for up to packed_max rows, else the bf16 weights. */
static void matrix_apply(const Matrix *m, const float *x, float *y, const float *residual,
                         int64_t M, int64_t N, int64_t K, int packed_max, int threads) {
    if (m->int8)
        int8_linear(x, m->int8, m->kind, y, residual, M, N, K, threads);
    else if (m->packed && M <= packed_max)
        packed_linear(x, m->packed, m->kind, 1, y, residual, M, N, K, threads);
    else
        bf16_linear(x, m->dense, y, residual, M, N, K, threads);
}

/* ---- a ragged batch over a paged KV cache: several sequences in one step ----
   The caches are pools of blocks [NB, KV, BS, D]: position t of a sequence lives at offset
   t % BS of block blocks[t / BS] of its block table. A step's rows are the sequences' rows one
   after another (Seq.row0 .. row0 + n - 1), each sequence at its own positions. Every row's
   result depends only on its own sequence's tokens up to it: not on the batch, the chunking or
   which blocks hold the keys, so a batched step gives the same bits as each sequence alone. */

typedef struct {
    int64_t row0, n, start;   /* the step's rows row0 .. row0+n-1 sit at positions start .. */
    const int32_t *blocks;    /* block table */
} Seq;

/* Rotate one head x [D] in place by its position's D/2 (cos, sin) pairs cs (adjacent pairs). */
static inline void rope_head(float *x, const float *cs, int64_t D) {
    for (int64_t i = 0; i < D; i += 2) {
        const float a = x[i], b = x[i + 1], c = cs[i], s = cs[i + 1];
        x[i] = a * c - b * s;
        x[i + 1] = a * s + b * c;
    }
}

/* Rotate the q and k heads of each row (adjacent pairs, rope[pos] holds D/2 (cos, sin) pairs)
   in place and store its k, v rows in the pools. */
void rope_store_paged(float *qkv, const float *rope, const Seq *seqs, int64_t S, int64_t H,
                      int64_t KV, int64_t D, kv_t *k_pool, kv_t *v_pool, int64_t BS) {
    const int64_t row = (H + 2 * KV) * D;
    for (int64_t q = 0; q < S; q++) {
        const Seq *sq = seqs + q;
        for (int64_t r = 0; r < sq->n; r++) {
            float *v = qkv + (sq->row0 + r) * row;
            const int64_t pos = sq->start + r;
            for (int64_t head = 0; head < H + KV; head++)
                rope_head(v + head * D, rope + pos * D, D);
            const int64_t block = sq->blocks[pos / BS], off = pos % BS;
            for (int64_t j = 0; j < KV; j++) {
                store_kv_row(k_pool + ((block * KV + j) * BS + off) * D, v + (H + j) * D, D);
                store_kv_row(v_pool + ((block * KV + j) * BS + off) * D, v + (H + KV + j) * D, D);
            }
        }
    }
}

typedef struct {
    int64_t seq, kv, r0, rows, g0;
    int G;
} AttendTask;

/* Ask for the first `positions` rows (D halves each) of a KV block at p, which can sit
   anywhere in the pool (the hardware cannot guess it), while the current block is worked on. */
/* Positions of the block starting at t that rows ending before `end` read: a single-block
   cache is as long as the whole context, and only what is used is worth prefetching. */
static inline int64_t used_from(int64_t t, int64_t end, int64_t BS) {
    return end - t < BS ? end - t : BS;
}

static inline void prefetch_block(const kv_t *p, int64_t positions, int64_t D) {
    const int64_t bytes = positions * D * (int64_t)sizeof(kv_t);
    for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch((const char *)p + off, _MM_HINT_T1);
}

/* One task of attend_paged: kv head `kv` of sequence sq for rows r0 .. r0+rows-1 and query
   heads g0 .. g0+G-1 of that kv head, keys and values walked one block (BS rows) at a time. */
static void attend_paged_task(const float *q, int64_t q_stride, const kv_t *k_pool,
                              const kv_t *v_pool, float *out, const Seq *sq, const AttendTask *tk,
                              int64_t H, int64_t KV, int64_t D, int64_t BS, float scale) {
    const int64_t groups = H / KV, kv = tk->kv, r0 = tk->r0, rows = tk->rows;
    const int G = tk->G;
    const int64_t h0 = kv * groups + tk->g0, start = sq->start;
    const int64_t ss = start + r0 + rows + 8;
    float *s = (float *)malloc((size_t)(rows * G * ss) * sizeof(float));
    float *acc = (float *)calloc((size_t)(rows * G * D), sizeof(float));
    const int64_t end = start + r0 + rows;
    for (int64_t t0 = 0; t0 < end; t0 += BS) {
        const kv_t *keys = k_pool + (sq->blocks[t0 / BS] * KV + kv) * BS * D;
        if (t0 + BS < end)
            prefetch_block(k_pool + (sq->blocks[t0 / BS + 1] * KV + kv) * BS * D,
                           used_from(t0 + BS, end, BS), D);
        else  /* the values come next */
            prefetch_block(v_pool + (sq->blocks[0] * KV + kv) * BS * D, used_from(0, end, BS), D);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t len = start + r0 + r + 1 - t0;
            if (len > 0)
                SCORES[G](q + (sq->row0 + r0 + r) * q_stride + h0 * D, keys, D,
                          len < BS ? len : BS, scale, s + r * G * ss + t0, ss);
        }
    }
    float inv[rows * G];
    for (int64_t j = 0; j < rows * G; j++)
        inv[j] = softmax_row(s + j * ss, start + r0 + j / G + 1);
    const mix_fn mix = G == 1 && D % 64 == 0 ? mix1_8 : MIXES[G];
    for (int64_t t0 = 0; t0 < end; t0 += BS) {
        const kv_t *vals = v_pool + (sq->blocks[t0 / BS] * KV + kv) * BS * D;
        if (t0 + BS < end)
            prefetch_block(v_pool + (sq->blocks[t0 / BS + 1] * KV + kv) * BS * D,
                           used_from(t0 + BS, end, BS), D);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t len = start + r0 + r + 1 - t0;
            if (len > 0)
                mix(s + r * G * ss + t0, ss, len < BS ? len : BS, vals, D, acc + r * G * D);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int g = 0; g < G; g++) {
            const __m256 f = _mm256_set1_ps(inv[r * G + g]);
            const float *a = acc + (r * G + g) * D;
            float *o = out + (sq->row0 + r0 + r) * H * D + (h0 + g) * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), f));
        }
    free(acc);
    free(s);
}

/* attend_paged's tasks handed to the team: each thread takes the next task left. */
typedef struct {
    const float *q;
    int64_t q_stride;
    const kv_t *k_pool, *v_pool;
    float *out;
    const Seq *seqs;
    const AttendTask *tasks;
    int64_t count, H, KV, D, BS;
    float scale;
    _Atomic int64_t next;
} AttendJob;

static void attend_job(void *ctx, int t, int T) {
    (void)t; (void)T;
    AttendJob *j = (AttendJob *)ctx;
    for (int64_t i = j->next++; i < j->count; i = j->next++)
        attend_paged_task(j->q, j->q_stride, j->k_pool, j->v_pool, j->out,
                          j->seqs + j->tasks[i].seq, j->tasks + i, j->H, j->KV, j->D, j->BS,
                          j->scale);
}

/* Causal attention of every sequence's rows over its own paged keys and values (row r of a
   sequence sees its positions 0 .. start + r; q row i, head h at q[i * q_stride + h * D]);
   out [rows, H * D]; query heads h = kv * G .. kv * G + G - 1 (G = H / KV) read kv head kv;
   D % 32 == 0. A task is one kv head of one sequence for a chunk of its rows (and, when rows
   are too few to keep the threads busy, a chunk of its query heads); it walks the keys, then
   the values, a block at a time, and every row of the chunk uses a block while it is in L1,
   so a verify step reads the cache about once per thread instead of once per row. All
   sequences' tasks run in one parallel loop. A row's result depends only on its own
   position, never on the rows beside it or on the chunking. */
void attend_paged(const float *q, int64_t q_stride, const kv_t *k_pool, const kv_t *v_pool,
                  float *out, const Seq *seqs, int64_t S, int64_t H, int64_t KV, int64_t D,
                  int64_t BS, float scale, int threads) {
    const int64_t groups = H / KV;
    const int64_t wanted = (2 * threads + KV - 1) / KV;
    /* query heads go 4 at a time (each key row loaded once for them) when the sequences'
       kv heads and row chunks alone give every thread work; else one at a time */
    int64_t coarse = 0, work = 0;
    for (int64_t q = 0; q < S; q++)
        if (seqs[q].n > 0) {
            coarse += KV * (seqs[q].n < wanted ? seqs[q].n : wanted);
            work += seqs[q].n * H * (seqs[q].start + seqs[q].n) * D;
        }
    const int64_t per_task = coarse >= 2 * threads ? 4 : 1;
    const int64_t head_chunks = (groups + per_task - 1) / per_task;
    int64_t count = 0;
    for (int pass = 0; pass < 2; pass++) {
        AttendTask *tasks = pass ? (AttendTask *)malloc((size_t)count * sizeof(AttendTask)) : NULL;
        int64_t i = 0;
        for (int64_t q = 0; q < S; q++) {
            const int64_t n = seqs[q].n;
            if (n <= 0) continue;
            const int64_t row_chunks = n < wanted ? n : wanted;
            const int64_t rows_per = (n + row_chunks - 1) / row_chunks;
            for (int64_t kv = 0; kv < KV; kv++)
                for (int64_t rc = 0; rc < row_chunks; rc++)
                    for (int64_t hc = 0; hc < head_chunks; hc++) {
                        const int64_t r0 = rc * rows_per;
                        const int64_t rows = n - r0 < rows_per ? n - r0 : rows_per;
                        const int64_t g0 = hc * per_task;
                        if (rows <= 0) continue;
                        if (pass)
                            tasks[i] = (AttendTask){q, kv, r0, rows, g0,
                                                    groups - g0 < per_task ? (int)(groups - g0) : (int)per_task};
                        i++;
                    }
        }
        if (!pass) { count = i; continue; }
        AttendJob job = {q, q_stride, k_pool, v_pool, out, seqs, tasks, count, H, KV, D, BS,
                         scale, 0};
        team_run(attend_job, &job, work >= (1 << 17) ? threads : 1);
        free(tasks);
    }
}

/* ---- one row of one sequence (plain decoding): every layer inside one parallel region ----
   Spawning a team per matmul and per attention costs two synchronisations each, five times a
   layer, and leaves the other threads spinning while one runs the norms, RoPE and the SiLU gate.
   Here the team lives for the whole step and meets at five barriers a layer; each thread
   computes its share of every matmul's outputs, the RoPE and cache store of the heads it
   computed, and the attention of its query heads, and repeats the small row-wide steps (RMSNorm,
   activation quantisation) itself. Every output uses the same kernel and order as the
   one-row path of decode_layers_paged (dot1 / q4_1_dot1 / q8_0_dot1, the int8 group kernel,
   one attention task per query head), so the bits are the same. */

void q8_blocks_rows(const int8_t *q, const float *d, const float *sx, const uint8_t *w, int kind,
                    float *y, const float *residual, int64_t N, int64_t K, int64_t n0, int64_t n1);
void quantize_q8_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *sx);

/* Outputs n0 .. n1 - 1 of x [1, K] . W^T (+ residual) on this thread, as matrix_apply computes
   them for one row (n0, n1: multiples of 8, or N); q, d: x quantised (int8 matrices only). */
static void matrix_rows(const Matrix *m, const float *x, const int8_t *q, const float *d,
                        float *y, const float *residual, int64_t N, int64_t K, int packed_max,
                        int64_t n0, int64_t n1) {
    if (m->int8) {
        q8_blocks_rows(q, d, d + K / 32, m->int8, m->kind, y, residual, N, K, n0, n1);
        return;
    }
    if (m->packed && packed_max >= 1) {
        const int64_t row_bytes = K / 32 * (m->kind == 0 ? 20 : 34);
        for (int64_t n = n0; n < n1; n++)
            PACKED_DOTS[m->kind][1](m->packed + n * row_bytes, 1, x, K, y + n, N);
    } else {
        for (int64_t n = n0; n < n1; n++)
            DOTS[1](m->dense + n * K, x, K, y + n, N);
    }
    if (residual)
        for (int64_t i = n0; i < n1; i++) y[i] += residual[i];
}

/* x quantised into q, d (d [K/32 scales, K/32 sums]) when m multiplies int8 activations. */
static inline void quantize_for(const Matrix *m, const float *x, int64_t K, int8_t *q, float *d) {
    if (m->int8)
        quantize_q8_rows(x, 1, K, q, d, d + K / 32);
}

/* decode_one_row's step handed to the team: the row, the weights and the shared buffers. */
typedef struct {
    float *x, *qkv, *att, *mid, *gu, *act;
    const Seq *sq;
    const Layer *layers;
    int64_t L, E, I, H, KV, D, BS;
    const float *rope;
    float eps, scale;
    int packed_max;
    TeamBarrier barrier;
} RowJob;

static void decode_one_row_job(void *ctx, int t, int T) {
    RowJob *j = (RowJob *)ctx;
    const int64_t E = j->E, I = j->I, H = j->H, KV = j->KV, D = j->D, BS = j->BS;
    const int64_t Q = (H + 2 * KV) * D, groups = H / KV, pos = j->sq->start;
    const int64_t widest = E > I ? (E > H * D ? E : H * D) : (I > H * D ? I : H * D);
    float *x = j->x, *qkv = j->qkv, *att = j->att, *mid = j->mid, *gu = j->gu, *act = j->act;
    const int packed_max = j->packed_max;
    float *h = (float *)malloc((size_t)E * sizeof(float));
    int8_t *q = (int8_t *)malloc((size_t)widest);
    float *d = (float *)malloc((size_t)(2 * (widest / 32)) * sizeof(float));
    int64_t a, b;
    for (int64_t l = 0; l < j->L; l++) {
        const Layer *w = j->layers + l;
        const int64_t block = j->sq->blocks[pos / BS], off = pos % BS;
        /* qkv by whole heads, each rotated and its k / v stored by the thread that made it */
        rms_norm(x, w->attn_norm, h, 1, E, j->eps);
        quantize_for(&w->qkv, h, E, q, d);
        team_share(H + 2 * KV, t, T, &a, &b);
        matrix_rows(&w->qkv, h, q, d, qkv, NULL, Q, E, packed_max, a * D, b * D);
        for (int64_t head = a; head < b; head++) {
            float *v = qkv + head * D;
            if (w->bqkv)
                for (int64_t i = 0; i < D; i++) v[i] += w->bqkv[head * D + i];
            if (head < H + KV)
                rope_head(v, j->rope + pos * D, D);
            if (head >= H && head < H + KV)
                store_kv_row(w->k_cache + ((block * KV + head - H) * BS + off) * D, v, D);
            else if (head >= H + KV)
                store_kv_row(w->v_cache + ((block * KV + head - H - KV) * BS + off) * D, v, D);
        }
        team_barrier(&j->barrier, T);
        team_share(H, t, T, &a, &b);
        for (int64_t head = a; head < b; head++) {
            const AttendTask task = {0, head / groups, 0, 1, head % groups, 1};
            attend_paged_task(qkv, Q, w->k_cache, w->v_cache, att, j->sq, &task, H, KV, D, BS,
                              j->scale);
        }
        team_barrier(&j->barrier, T);
        quantize_for(&w->o, att, H * D, q, d);
        team_share(E / 8, t, T, &a, &b);
        matrix_rows(&w->o, att, q, d, mid, x, E, H * D, packed_max, a * 8, b * 8);
        team_barrier(&j->barrier, T);
        /* gate and up rows of the same slice, then its SiLU gate */
        rms_norm(mid, w->mlp_norm, h, 1, E, j->eps);
        quantize_for(&w->gate_up, h, E, q, d);
        team_share(I / 8, t, T, &a, &b);
        matrix_rows(&w->gate_up, h, q, d, gu, NULL, 2 * I, E, packed_max, a * 8, b * 8);
        matrix_rows(&w->gate_up, h, q, d, gu, NULL, 2 * I, E, packed_max, I + a * 8, I + b * 8);
        silu_mul_range(gu, act, I, a * 8, b * 8);
        team_barrier(&j->barrier, T);
        quantize_for(&w->down, act, I, q, d);
        team_share(E / 8, t, T, &a, &b);
        matrix_rows(&w->down, act, q, d, x, mid, E, I, packed_max, a * 8, b * 8);
        team_barrier(&j->barrier, T);
    }
    free(d); free(q); free(h);
}

static void decode_one_row(float *x, const Seq *sq, const Layer *layers, int64_t L, int64_t E,
                           int64_t I, int64_t H, int64_t KV, int64_t D, int64_t BS,
                           const float *rope, float eps, float scale, int packed_max, int threads) {
    const int64_t Q = (H + 2 * KV) * D;
    RowJob job = {x, (float *)malloc((size_t)Q * sizeof(float)),
                  (float *)malloc((size_t)(H * D) * sizeof(float)),
                  (float *)malloc((size_t)E * sizeof(float)),
                  (float *)malloc((size_t)(2 * I) * sizeof(float)),
                  (float *)malloc((size_t)I * sizeof(float)),
                  sq, layers, L, E, I, H, KV, D, BS, rope, eps, scale, packed_max, {0, 0}};
    team_run(decode_one_row_job, &job, threads);
    free(job.act); free(job.gu); free(job.mid); free(job.att); free(job.qkv);
}

/* Rows x [n, E] (in place) of S sequences, each with its own positions and block table, through
   L layers whose k_cache / v_cache are block pools: RMSNorm, qkv (+ bias), RoPE + cache store,
   attention, output projection, RMSNorm, SiLU-gated MLP, both residuals.
   The matmuls see all n rows at once (the weights stream once for the whole batch); RoPE and
   attention go per sequence. The same kernels in the same order as the per-op path. */
void decode_layers_paged(float *x, int64_t n, const Seq *seqs, int64_t S, const Layer *layers,
                         int64_t L, int64_t E, int64_t I, int64_t H, int64_t KV, int64_t D,
                         int64_t BS, const float *rope, float eps, float scale, int packed_max,
                         int threads) {
    if (n == 1 && S == 1) {
        decode_one_row(x, seqs, layers, L, E, I, H, KV, D, BS, rope, eps, scale, packed_max,
                       threads);
        return;
    }
    const int64_t Q = (H + 2 * KV) * D;
    float *h = (float *)malloc((size_t)(n * E) * sizeof(float));
    float *mid = (float *)malloc((size_t)(n * E) * sizeof(float));
    float *qkv = (float *)malloc((size_t)(n * Q) * sizeof(float));
    float *att = (float *)malloc((size_t)(n * H * D) * sizeof(float));
    float *gu = (float *)malloc((size_t)(n * 2 * I) * sizeof(float));
    float *act = (float *)malloc((size_t)(n * I) * sizeof(float));
    for (int64_t l = 0; l < L; l++) {
        const Layer *w = layers + l;
        rms_norm(x, w->attn_norm, h, n, E, eps);
        matrix_apply(&w->qkv, h, qkv, NULL, n, Q, E, packed_max, threads);
        if (w->bqkv)
            for (int64_t i = 0; i < n * Q; i++) qkv[i] += w->bqkv[i % Q];
        rope_store_paged(qkv, rope, seqs, S, H, KV, D, w->k_cache, w->v_cache, BS);
        attend_paged(qkv, Q, w->k_cache, w->v_cache, att, seqs, S, H, KV, D, BS, scale, threads);
        matrix_apply(&w->o, att, mid, x, n, E, H * D, packed_max, threads);
        rms_norm(mid, w->mlp_norm, h, n, E, eps);
        matrix_apply(&w->gate_up, h, gu, NULL, n, 2 * I, E, packed_max, threads);
        silu_mul(gu, act, n, I);
        matrix_apply(&w->down, act, x, mid, n, E, I, packed_max, threads);
    }
    free(act); free(gu); free(att); free(qkv); free(mid); free(h);
}
