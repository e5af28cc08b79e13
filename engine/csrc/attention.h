/* Causal attention over the paged KV cache (kv_cache.h), float32 queries and outputs. */
#ifndef AGENTRT_ATTENTION_H
#define AGENTRT_ATTENTION_H

#include <stdint.h>

#include "kv_cache.h"

/* One task of attend_paged (see attend_paged_task); seq indexes the step's sequences. */
typedef struct {
    int64_t seq, kv, r0, rows, g0;
    int G;
} AttendTask;

/* One task of attend_paged: kv head `kv` of sequence sq for rows r0 .. r0+rows-1 and query
   heads g0 .. g0+G-1 of that kv head, keys and values walked one block (BS rows) at a time. */
void attend_paged_task(const float *q, int64_t q_stride, const kv_t *k_pool, const kv_t *v_pool,
                       float *out, const Seq *sq, const AttendTask *tk, int64_t H, int64_t KV,
                       int64_t D, int64_t BS, float scale);

/* Causal attention of every sequence's rows over its own paged keys and values (row r of a
   sequence sees its positions 0 .. start + r; q row i, head h at q[i * q_stride + h * D]);
   out [rows, H * D]; query heads h = kv * G .. kv * G + G - 1 (G = H / KV) read kv head kv;
   D % 32 == 0. A row's result depends only on its own position, never on the rows beside it
   or on how the work is split (attention.c). */
void attend_paged(const float *q, int64_t q_stride, const kv_t *k_pool, const kv_t *v_pool,
                  float *out, const Seq *seqs, int64_t S, int64_t H, int64_t KV, int64_t D,
                  int64_t BS, float scale, int threads);

#endif
