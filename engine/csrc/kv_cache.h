/* The paged KV cache: how keys and values are stored, and the sequences of a step over it.

   The cache holds float16 (IEEE half) keys and values: half the bytes attention streams; every
   path stores and reads them the same way, so results stay path-independent. The caches are
   pools of blocks [NB, KV, BS, D]: position t of a sequence lives at offset t % BS of block
   blocks[t / BS] of its block table. A step's rows are the sequences' rows one after another
   (Seq.row0 .. row0 + n - 1), each sequence at its own positions. Every row's result depends
   only on its own sequence's tokens up to it: not on the batch, the chunking or which blocks
   hold the keys, so a batched step gives the same bits as each sequence alone. */
#ifndef AGENTRT_KV_CACHE_H
#define AGENTRT_KV_CACHE_H

#include <immintrin.h>
#include <stdint.h>

typedef uint16_t kv_t;  /* CACHE_DTYPE in cpu_ops.py */

/* One sequence of a step (`_Seq` in cpu_ops.py). */
typedef struct {
    int64_t row0, n, start;   /* the step's rows row0 .. row0+n-1 sit at positions start .. */
    const int32_t *blocks;    /* block table */
} Seq;

/* One row of D floats into the cache as float16 (rounded to nearest even). */
static inline void store_kv_row(kv_t *dst, const float *src, int64_t D) {
    for (int64_t d = 0; d < D; d += 8)
        _mm_storeu_si128((__m128i *)(dst + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
}

/* 8 cached values back as float32. */
static inline __m256 load_kv(const kv_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

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
                      int64_t KV, int64_t D, kv_t *k_pool, kv_t *v_pool, int64_t BS);

#endif
