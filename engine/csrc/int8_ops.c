/* Integer matmul against GGUF weight blocks: activations quantised to int8 once per call.

   An activation row is cut into blocks of 32; block b gets a scale d = max|x| / 127 and codes
   q = round-half-even(x / d) (computed as x * (1 / d)), plus sx = d * sum(q) for the Q4_1 min
   term. A Q4_1 weight block (fp16 dw, fp16 mw, 32 unsigned nibbles w) against it gives
   dw * d * sum(w q) + mw * sx; a Q8_0 block (fp16 dw, 32 int8 w) gives dw * d * sum(w q). The
   code products are summed in integers (exact), 4 at a time into 8 lanes (lane j holds the
   products of codes 4j .. 4j + 3); every float step is a separate product or sum (built with
   -ffp-contract=off) in a fixed order, so `tests/test_packed.py` can rebuild each output bit for
   bit in torch:

     acc[j] = 0; for b: acc[j] = acc[j] + (dw_b * d_b) * float(lane_j,b)
     min = 0;    for b: min = min + mw_b * sx_b                     (Q4_1 only)
     y = (((acc0 + acc1) + (acc2 + acc3)) + ((acc4 + acc5) + (acc6 + acc7))) [+ min] [+ residual]

   A row's result never depends on the other rows of the call. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float half_value(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float lane_sum(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 t = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* x [M, K] (K % 32 == 0) -> codes q [M, K], scales d [M, K / 32], sx [M, K / 32]. */
void quantize_q8_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < M * K / 32; i++) {
        const float *v = x + i * 32;
        __m256 f[4];
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            f[j] = _mm256_loadu_ps(v + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        const float scale = top / 127.0f;
        const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        __m256i n[4];
        for (int j = 0; j < 4; j++)
            n[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f[j], inv),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* |n| <= 127: the packs never saturate; packs interleave 128-bit lanes, undone by order */
        const __m256i p01 = _mm256_packs_epi32(n[0], n[1]), p23 = _mm256_packs_epi32(n[2], n[3]);
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
        _mm256_storeu_si256((__m256i *)(q + i * 32), bytes);
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
        d[i] = scale;
        sx[i] = scale * (float)_mm_cvtsi128_si32(t);
    }
}

/* The 32 Q4_1 nibbles of a block as bytes in weight order (low nibbles are weights 0..15). */
static inline __m256i q4_1_codes(const uint8_t *b) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 4));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* y[i * ystride] for R activation rows against one weight row; see the header for the order. */
#define DEFINE_INT8_DOT(R)                                                                    \
    static void q4_1_int8_dot##R(const uint8_t *row, const int8_t *q, const float *d,          \
                                 const float *sx, int64_t K, float *y, int64_t ystride) {      \
        const int64_t nb = K / 32;                                                            \
        const __m256i ones = _mm256_set1_epi16(1);                                            \
        __m256 acc[R];                                                                        \
        float low[R];                                                                         \
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps(), low[i] = 0.0f;              \
        for (int64_t b = 0; b < nb; b++, row += 20) {                                         \
            const float dw = half_value(row), mw = half_value(row + 2);                       \
            const __m256i w = q4_1_codes(row);                                                \
            for (int i = 0; i < R; i++) {                                                     \
                const __m256i a = _mm256_loadu_si256((const __m256i *)(q + i * K + 32 * b));  \
                const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);    \
                const __m256 s = _mm256_set1_ps(dw * d[i * nb + b]);                          \
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(s, _mm256_cvtepi32_ps(lanes)));  \
                low[i] = low[i] + mw * sx[i * nb + b];                                        \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < R; i++) y[i * ystride] = lane_sum(acc[i]) + low[i];               \
    }                                                                                         \
    static void q8_0_int8_dot##R(const uint8_t *row, const int8_t *q, const float *d,          \
                                 const float *sx, int64_t K, float *y, int64_t ystride) {      \
        const int64_t nb = K / 32;                                                            \
        const __m256i ones = _mm256_set1_epi16(1);                                            \
        (void)sx;                                                                             \
        __m256 acc[R];                                                                        \
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();                             \
        for (int64_t b = 0; b < nb; b++, row += 34) {                                         \
            const float dw = half_value(row);                                                 \
            const __m256i w = _mm256_loadu_si256((const __m256i *)(row + 2));                 \
            const __m256i wabs = _mm256_sign_epi8(w, w);                                      \
            for (int i = 0; i < R; i++) {                                                     \
                const __m256i a = _mm256_loadu_si256((const __m256i *)(q + i * K + 32 * b));  \
                const __m256i prod = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(a, w));      \
                const __m256i lanes = _mm256_madd_epi16(prod, ones);                          \
                const __m256 s = _mm256_set1_ps(dw * d[i * nb + b]);                          \
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(s, _mm256_cvtepi32_ps(lanes)));  \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < R; i++) y[i * ystride] = lane_sum(acc[i]);                        \
    }
DEFINE_INT8_DOT(1) DEFINE_INT8_DOT(2) DEFINE_INT8_DOT(3) DEFINE_INT8_DOT(4)
DEFINE_INT8_DOT(5) DEFINE_INT8_DOT(6) DEFINE_INT8_DOT(7) DEFINE_INT8_DOT(8)

typedef void (*int8_dot_fn)(const uint8_t *, const int8_t *, const float *, const float *,
                            int64_t, float *, int64_t);
static const int8_dot_fn INT8_DOTS[2][9] = {
    {0, q4_1_int8_dot1, q4_1_int8_dot2, q4_1_int8_dot3, q4_1_int8_dot4, q4_1_int8_dot5,
     q4_1_int8_dot6, q4_1_int8_dot7, q4_1_int8_dot8},
    {0, q8_0_int8_dot1, q8_0_int8_dot2, q8_0_int8_dot3, q8_0_int8_dot4, q8_0_int8_dot5,
     q8_0_int8_dot6, q8_0_int8_dot7, q8_0_int8_dot8},
};

/* y[M, N] = quantised x . W^T (+ residual) for activations already quantised by
   quantize_q8_rows and W [N, K] in blocks of kind 0 (Q4_1) or 1 (Q8_0). Weight rows stream once
   (one sequential stream per thread); activation rows go in chunks of <= 8. */
void q8_blocks_linear(const int8_t *q, const float *d, const float *sx, const uint8_t *w,
                      int kind, float *y, const float *residual, int64_t M, int64_t N, int64_t K,
                      int threads) {
    const int64_t row_bytes = K / 32 * (kind == 0 ? 20 : 34), nb = K / 32;
    const int64_t chunks = (M + 7) / 8, chunk = (M + chunks - 1) / chunks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
            INT8_DOTS[kind][rows](w + n * row_bytes, q + m0 * K, d + m0 * nb, sx + m0 * nb, K,
                                  y + m0 * N + n, N);
        }
    if (residual)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
}

/* quantize_q8_rows, then q8_blocks_linear: x [M, K] float32 (K % 32 == 0). */
void int8_linear(const float *x, const uint8_t *w, int kind, float *y, const float *residual,
                 int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t nb = K / 32;
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    float *d = (float *)malloc((size_t)(2 * M * nb) * sizeof(float));
    quantize_q8_rows(x, M, K, q, d, d + M * nb);
    q8_blocks_linear(q, d, d + M * nb, w, kind, y, residual, M, N, K, threads);
    free(d);
    free(q);
}
