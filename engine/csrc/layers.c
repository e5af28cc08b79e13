/* The fused layer step (layers.h): the matmuls, norms, RoPE + cache store and attention of
   every layer, called from C. */
#include <stdlib.h>

#include "layers.h"
#include "attention.h"
#include "bf16_dot.h"
#include "int8_ops.h"
#include "matmul.h"
#include "norms.h"
#include "team.h"

/* y = x . W^T (+ residual) as `kernel_linear` does it: the blocks with int8 activations when the
   matrix asks for them, else the blocks for up to packed_max rows, else the bf16 weights: from
   bf16_rows rows on (0: never) with bf16 activations (bf16_dot.c), else in float32. */
static void matrix_apply(const Matrix *m, const float *x, float *y, const float *residual,
                         int64_t M, int64_t N, int64_t K, int packed_max, int bf16_rows,
                         int threads) {
    if (m->int8)
        int8_linear(x, m->int8, m->kind, y, residual, M, N, K, threads);
    else if (bf16_rows && M >= bf16_rows)
        bf16_dot_linear(x, m->dense, y, residual, M, N, K, threads);
    else if (m->packed && M <= packed_max)
        packed_linear(x, m->packed, m->kind, 1, y, residual, M, N, K, threads);
    else
        bf16_linear(x, m->dense, y, residual, M, N, K, threads);
}

/* ---- one row of one sequence (plain decoding): every layer inside one parallel region ----
   Spawning a team per matmul and per attention costs two synchronisations each, five times a
   layer, and leaves the other threads spinning while one runs the norms, RoPE and the SiLU gate.
   Here the team lives for the whole step and meets at five barriers a layer; each thread
   computes its share of every matmul's outputs, the RoPE and cache store of the heads it
   computed, and the attention of its query heads, and repeats the small row-wide steps (RMSNorm,
   activation quantisation) itself. Every output uses the same kernel and order as the
   one-row path of decode_layers_paged (the *_rows matmuls of matmul.h and int8_ops.h, one
   attention task per query head), so the bits are the same. */

/* Outputs n0 .. n1 - 1 of x [1, K] . W^T (+ residual) on this thread, as matrix_apply computes
   them for one row (n0, n1: multiples of 8, or N); q, d: x quantised (int8 matrices only). */
static void matrix_rows(const Matrix *m, const float *x, const int8_t *q, const float *d,
                        float *y, const float *residual, int64_t N, int64_t K, int packed_max,
                        int64_t n0, int64_t n1) {
    if (m->int8)
        q8_blocks_rows(q, d, d + K / 32, m->int8, m->kind, y, residual, N, K, n0, n1);
    else if (m->packed && packed_max >= 1)
        packed_linear_rows(x, m->packed, m->kind, 1, y, residual, K, n0, n1);
    else
        bf16_linear_rows(x, m->dense, y, residual, K, n0, n1);
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

void decode_layers_paged(float *x, int64_t n, const Seq *seqs, int64_t S, const Layer *layers,
                         int64_t L, int64_t E, int64_t I, int64_t H, int64_t KV, int64_t D,
                         int64_t BS, const float *rope, float eps, float scale, int packed_max,
                         int bf16_rows, int threads) {
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
        matrix_apply(&w->qkv, h, qkv, NULL, n, Q, E, packed_max, bf16_rows, threads);
        if (w->bqkv)
            for (int64_t i = 0; i < n * Q; i++) qkv[i] += w->bqkv[i % Q];
        rope_store_paged(qkv, rope, seqs, S, H, KV, D, w->k_cache, w->v_cache, BS);
        attend_paged(qkv, Q, w->k_cache, w->v_cache, att, seqs, S, H, KV, D, BS, scale, threads);
        matrix_apply(&w->o, att, mid, x, n, E, H * D, packed_max, bf16_rows, threads);
        rms_norm(mid, w->mlp_norm, h, n, E, eps);
        matrix_apply(&w->gate_up, h, gu, NULL, n, 2 * I, E, packed_max, bf16_rows, threads);
        silu_mul(gu, act, n, I);
        matrix_apply(&w->down, act, x, mid, n, E, I, packed_max, bf16_rows, threads);
    }
    free(act); free(gu); free(att); free(qkv); free(mid); free(h);
}
