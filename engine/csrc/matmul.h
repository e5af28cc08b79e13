/* Float matmuls: float32 activations against bf16 weights, or against weights kept in their
   GGUF blocks (gguf.h) and widened in registers. Every output is summed in the same order
   whatever the row count, so a row's result never depends on the rows batched with it. */
#ifndef AGENTRT_MATMUL_H
#define AGENTRT_MATMUL_H

#include <stdint.h>

void bf16_linear(const float *x, const uint16_t *w, float *y, const float *residual,
                 int64_t M, int64_t N, int64_t K, int threads);
void packed_linear(const float *x, const uint8_t *w, int kind, int rnd, float *y,
                   const float *residual, int64_t M, int64_t N, int64_t K, int threads);

/* From min_rows activation rows on, bf16_linear's tiles run on AVX512F where the CPU has it (the
   same bits; 0: never); -1 asks. Returns the row count in use (0: the AVX2 tiles only). Not to
   be called while a matmul runs. */
int bf16_avx512(int min_rows);

/* Outputs n0 .. n1 - 1 of one activation row x [K] (+ residual), as bf16_linear and
   packed_linear compute them for M = 1, on the calling thread alone. */
void bf16_linear_rows(const float *x, const uint16_t *w, float *y, const float *residual,
                      int64_t K, int64_t n0, int64_t n1);
void packed_linear_rows(const float *x, const uint8_t *w, int kind, int rnd, float *y,
                        const float *residual, int64_t K, int64_t n0, int64_t n1);

#endif
