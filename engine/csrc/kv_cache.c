/* RoPE and the store of new keys and values in the paged cache (kv_cache.h). */
#include "kv_cache.h"

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
