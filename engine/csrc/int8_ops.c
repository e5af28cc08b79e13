/* Integer matmul against GGUF weight blocks: activations quantised to int8 once per call.

   An activation row is cut into blocks of 32; block b gets a scale d = max|x| / 127 and codes
   q = round-half-even(x * (1 / d)), plus sx = d * sum(q) for the Q4_1 min term. A Q4_1 weight
   block (fp16 dw, fp16 mw, 32 nibbles w) against it gives dw * d * sum(w q) + mw * sx; a Q8_0
   block (fp16 dw, 32 int8 w) gives dw * d * sum(w q). sum(w q) is an exact integer; every float
   step is a separate product or sum (built with -ffp-contract=off) in a fixed order, so
   `tests/test_packed.py` rebuilds each output bit for bit in torch. Per output, from 0, over
   the blocks in order:

     Q4_1: acc = (acc + (dw_b * d_b) * float(sum_b)) + mw_b * sx_b
     Q8_0: acc = acc + (dw_b * d_b) * float(sum_b)
     y = acc [+ residual]

   A row's result never depends on the other rows of the call. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_ops.h"
#include "gguf.h"
#include "team.h"

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

/* ---- weights: 8 rows interleaved per block (`PackedMatrix.interleaved`), so one vector lane is
   one output row and a block's scales for 8 rows load as one vector. Q4_1, 160 bytes per block
   of a group of 8 rows: 8 fp16 dw, 8 fp16 mw, then for g = 0..3 and row j = 0..7 the 4 bytes
   4g .. 4g + 3 of row j's nibbles (low nibbles: weights 4g .. 4g + 3; high: 16 + 4g ..).
   Q8_0, 272 bytes: 8 fp16 dw, then for g = 0..7 and row j the 4 codes 4g .. 4g + 3 of row j. */

/* The integer sum of one block for 8 rows (one per int32 lane) against one activation row's
   codes a (32 bytes, read as 8 runs of 4): w[g] holds the 8 rows' codes for run g (Q4_1: the
   nibbles, unsigned; Q8_0: signed codes, multiplied as |w| times the code with w's sign). AVX2:
   maddubs, int16 adds, madd; AVX512-VNNI: one vpdpbusd per run (two sums, so each waits on
   half as many). The sums are exact either way: the same integers. */
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))

/* Activation codes 4g .. 4g + 3 of a, in every int32 lane (one broadcast load). */
static inline __m256i run_of_four(const int8_t *a, int g) {
    return _mm256_broadcastd_epi32(_mm_loadu_si32(a + 4 * g));
}

static inline __m256i q4_sum_avx2(const __m256i w[8], const int8_t *a) {
    /* 8 x (2 products of <= 15 * 127): the int16 sums cannot overflow */
    __m256i s16 = _mm256_maddubs_epi16(w[0], run_of_four(a, 0));
    for (int g = 1; g < 8; g++)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g], run_of_four(a, g)));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}

static inline __m256i q8_sum_avx2(const __m256i w[8], const int8_t *a) {
    __m256i s32 = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        const __m256i x = _mm256_sign_epi8(run_of_four(a, g), w[g]);
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w[g], w[g]), x),
                                                      _mm256_set1_epi16(1)));
    }
    return s32;
}

VNNI static inline __m256i q4_sum_vnni(const __m256i w[8], const int8_t *a) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int g = 0; g < 8; g += 2) {
        s0 = _mm256_dpbusd_epi32(s0, w[g], run_of_four(a, g));
        s1 = _mm256_dpbusd_epi32(s1, w[g + 1], run_of_four(a, g + 1));
    }
    return _mm256_add_epi32(s0, s1);
}

VNNI static inline __m256i q8_sum_vnni(const __m256i w[8], const int8_t *a) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int g = 0; g < 8; g += 2) {  /* |-128| is 0x80 = 128 unsigned */
        s0 = _mm256_dpbusd_epi32(s0, _mm256_abs_epi8(w[g]),
                                 _mm256_sign_epi8(run_of_four(a, g), w[g]));
        s1 = _mm256_dpbusd_epi32(s1, _mm256_abs_epi8(w[g + 1]),
                                 _mm256_sign_epi8(run_of_four(a, g + 1), w[g + 1]));
    }
    return _mm256_add_epi32(s0, s1);
}

/* acc[i] (8 rows) gets activation row i's blocks, in order, with the ISA's block sums. */
#define DEFINE_GROUPS(ISA, ATTR, R)                                                           \
    ATTR static void q4_1_##ISA##_##R(const uint8_t *p, int64_t nb, const int8_t *q, const float *d, \
                                   const float *sx, int64_t K, __m256 *out) {                  \
        const __m256i low4 = _mm256_set1_epi8(0x0F);                                          \
        __m256 acc[R];                                                                        \
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();                             \
        for (int64_t b = 0; b < nb; b++, p += Q4_1_GROUP_BYTES) {                             \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));           \
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));    \
            __m256i w[8];                                                                     \
            for (int g = 0; g < 4; g++) {                                                     \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * g));     \
                w[g] = _mm256_and_si256(v, low4);                                             \
                w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);                   \
            }                                                                                 \
            for (int i = 0; i < R; i++) {                                                     \
                const __m256 f = _mm256_cvtepi32_ps(q4_sum_##ISA(w, q + i * K + 32 * b));     \
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(d[i * nb + b]));        \
                acc[i] = _mm256_add_ps(_mm256_add_ps(acc[i], _mm256_mul_ps(scale, f)),        \
                                       _mm256_mul_ps(mw, _mm256_set1_ps(sx[i * nb + b])));    \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < R; i++) out[i] = acc[i];                                          \
    }                                                                                         \
    ATTR static void q8_0_##ISA##_##R(const uint8_t *p, int64_t nb, const int8_t *q, const float *d, \
                                   const float *sx, int64_t K, __m256 *out) {                  \
        (void)sx;                                                                             \
        __m256 acc[R];                                                                        \
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();                             \
        for (int64_t b = 0; b < nb; b++, p += Q8_0_GROUP_BYTES) {                             \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));           \
            __m256i w[8];                                                                     \
            for (int g = 0; g < 8; g++)                                                       \
                w[g] = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * g));                \
            for (int i = 0; i < R; i++) {                                                     \
                const __m256 f = _mm256_cvtepi32_ps(q8_sum_##ISA(w, q + i * K + 32 * b));     \
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(d[i * nb + b]));        \
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(scale, f));                      \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < R; i++) out[i] = acc[i];                                          \
    }
DEFINE_GROUPS(avx2, , 1) DEFINE_GROUPS(avx2, , 2) DEFINE_GROUPS(avx2, , 3) DEFINE_GROUPS(avx2, , 4)
DEFINE_GROUPS(vnni, VNNI, 1) DEFINE_GROUPS(vnni, VNNI, 2) DEFINE_GROUPS(vnni, VNNI, 3)
DEFINE_GROUPS(vnni, VNNI, 4) DEFINE_GROUPS(vnni, VNNI, 5) DEFINE_GROUPS(vnni, VNNI, 6)
DEFINE_GROUPS(vnni, VNNI, 7) DEFINE_GROUPS(vnni, VNNI, 8)

typedef void (*group_fn)(const uint8_t *, int64_t, const int8_t *, const float *, const float *,
                         int64_t, __m256 *);
static const group_fn AVX2_GROUPS[2][9] = {
    {0, q4_1_avx2_1, q4_1_avx2_2, q4_1_avx2_3, q4_1_avx2_4},
    {0, q8_0_avx2_1, q8_0_avx2_2, q8_0_avx2_3, q8_0_avx2_4},
};
static const group_fn VNNI_GROUPS[2][9] = {
    {0, q4_1_vnni_1, q4_1_vnni_2, q4_1_vnni_3, q4_1_vnni_4, q4_1_vnni_5, q4_1_vnni_6, q4_1_vnni_7, q4_1_vnni_8},
    {0, q8_0_vnni_1, q8_0_vnni_2, q8_0_vnni_3, q8_0_vnni_4, q8_0_vnni_5, q8_0_vnni_6, q8_0_vnni_7, q8_0_vnni_8},
};
static const group_fn (*GROUPS)[9] = AVX2_GROUPS;

/* Which group kernels run: mode 1 the VNNI ones where the CPU has AVX512-VNNI (else AVX2), 0
   the AVX2 ones, -1 asks. Returns 1 when the VNNI kernels are in use. The AVX2 ones run until
   this is called; not to be called while a matmul runs. */
int int8_vnni(int mode) {
    if (mode >= 0)
        GROUPS = mode && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
                     ? VNNI_GROUPS : AVX2_GROUPS;
    return GROUPS == VNNI_GROUPS;
}

/* q8_blocks_linear handed to the team: thread t takes its even share of the groups. */
typedef struct {
    const int8_t *q;
    const float *d, *sx;
    const uint8_t *w;
    int kind;
    float *y;
    int64_t M, N, K;
} Q8Job;

static void q8_blocks_job(void *ctx, int t, int T) {
    const Q8Job *j = (const Q8Job *)ctx;
    const int64_t M = j->M, N = j->N, K = j->K, nb = K / 32;
    const int64_t group_bytes = nb * GGUF_GROUP_BYTES(j->kind), groups = (N + 7) / 8;
    const int rows = GROUPS == VNNI_GROUPS ? 8 : 4;  /* activation rows a pass: the kernels' most */
    int64_t g0, g1;
    team_share(groups, t, T, &g0, &g1);
    for (int64_t G = g0; G < g1; G++) {
        const int64_t n0 = G * 8, valid = N - n0 < 8 ? N - n0 : 8;
        for (int64_t m0 = 0; m0 < M; m0 += rows) {
            const int R = M - m0 < rows ? (int)(M - m0) : rows;
            __m256 acc[8];
            GROUPS[j->kind][R](j->w + G * group_bytes, nb, j->q + m0 * K, j->d + m0 * nb,
                               j->sx + m0 * nb, K, acc);
            for (int i = 0; i < R; i++) {
                float *out = j->y + (m0 + i) * N + n0;
                if (valid == 8) {
                    _mm256_storeu_ps(out, acc[i]);
                } else {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, acc[i]);
                    memcpy(out, tmp, (size_t)valid * sizeof(float));
                }
            }
        }
    }
}

/* y[M, N] = quantised x . W^T (+ residual) for activations already quantised by
   quantize_q8_rows and W [N, K] interleaved by groups of 8 rows (kind 0: Q4_1, 1: Q8_0; the
   last group padded). Each thread streams whole groups in order; activation rows go 4 at a
   time over a group (its blocks stay in L1 for the next 4). Per output, over blocks b in
   order: acc = acc + (dw_b * d_b) * float(sum_b) [then + mw_b * sx_b for Q4_1], from 0. */
void q8_blocks_linear(const int8_t *q, const float *d, const float *sx, const uint8_t *w,
                      int kind, float *y, const float *residual, int64_t M, int64_t N, int64_t K,
                      int threads) {
    Q8Job job = {q, d, sx, w, kind, y, M, N, K};
    team_run(q8_blocks_job, &job, threads);
    if (residual)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
}

/* Outputs n0 .. n1 - 1 of one activation row (quantised by quantize_q8_rows) as
   q8_blocks_linear computes them for M = 1, on the calling thread alone: the groups of 8 rows
   holding them (n0 % 8 == 0, and n1 % 8 == 0 or n1 == N), then + residual. A worker's share of
   one matmul inside a parallel region that the caller already runs. */
void q8_blocks_rows(const int8_t *q, const float *d, const float *sx, const uint8_t *w, int kind,
                    float *y, const float *residual, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, group_bytes = nb * GGUF_GROUP_BYTES(kind);
    for (int64_t G = n0 / 8; G * 8 < n1; G++) {
        const int64_t first = G * 8, valid = N - first < 8 ? N - first : 8;
        __m256 acc;
        GROUPS[kind][1](w + G * group_bytes, nb, q, d, sx, K, &acc);
        if (valid == 8) {
            _mm256_storeu_ps(y + first, acc);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc);
            memcpy(y + first, tmp, (size_t)valid * sizeof(float));
        }
    }
    if (residual)
        for (int64_t i = n0; i < n1; i++) y[i] += residual[i];
}

/* quantize_q8_rows, then q8_blocks_linear: x [M, K] float32 (K % 32 == 0), W interleaved. */
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
