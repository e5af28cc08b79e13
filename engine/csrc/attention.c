/* Paged attention (attention.h): scores and value mixes per group of query heads sharing a
   kv head, one cache block at a time. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "attention.h"
#include "simd.h"
#include "team.h"

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

/* Positions of the block starting at t that rows ending before `end` read: a single-block
   cache is as long as the whole context, and only what is used is worth prefetching. */
static inline int64_t used_from(int64_t t, int64_t end, int64_t BS) {
    return end - t < BS ? end - t : BS;
}

/* Ask for the first `positions` rows (D halves each) of a KV block at p, which can sit
   anywhere in the pool (the hardware cannot guess it), while the current block is worked on. */
static inline void prefetch_block(const kv_t *p, int64_t positions, int64_t D) {
    const int64_t bytes = positions * D * (int64_t)sizeof(kv_t);
    for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch((const char *)p + off, _MM_HINT_T1);
}

#define EARLY_VALUES_BYTES (256 << 10)

/* Keys and values walked one block (BS rows) at a time; every row of the task uses a block
   while it is in L1. */
void attend_paged_task(const float *q, int64_t q_stride, const kv_t *k_pool, const kv_t *v_pool,
                       float *out, const Seq *sq, const AttendTask *tk, int64_t H, int64_t KV,
                       int64_t D, int64_t BS, float scale) {
    const int64_t groups = H / KV, kv = tk->kv, r0 = tk->r0, rows = tk->rows;
    const int G = tk->G;
    const int64_t h0 = kv * groups + tk->g0, start = sq->start;
    const int64_t ss = start + r0 + rows + 8;
    float *s = (float *)malloc((size_t)(rows * G * ss) * sizeof(float));
    float *acc = (float *)calloc((size_t)(rows * G * D), sizeof(float));
    const int64_t end = start + r0 + rows;
    /* values that fit in L2 (EARLY_VALUES_BYTES) are asked for block by block while the keys
       are worked on, so that the values pass computes from L2 instead of waiting for memory a
       second time; longer ones would be evicted before use, and only the first block is */
    const int early = end * D * (int64_t)sizeof(kv_t) <= EARLY_VALUES_BYTES;
    for (int64_t t0 = 0; t0 < end; t0 += BS) {
        const kv_t *keys = k_pool + (sq->blocks[t0 / BS] * KV + kv) * BS * D;
        if (early)
            prefetch_block(v_pool + (sq->blocks[t0 / BS] * KV + kv) * BS * D,
                           used_from(t0, end, BS), D);
        if (t0 + BS < end)
            prefetch_block(k_pool + (sq->blocks[t0 / BS + 1] * KV + kv) * BS * D,
                           used_from(t0 + BS, end, BS), D);
        else if (!early)  /* the values come next */
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

/* A task of attend_paged is one kv head of one sequence for a chunk of its rows (and, when rows
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
