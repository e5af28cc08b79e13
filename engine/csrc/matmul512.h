/* bf16_linear's many-row path on AVX512F: the same bits as the AVX2 path (matmul512.c). */
#ifndef AGENTRT_MATMUL512_H
#define AGENTRT_MATMUL512_H

#include <stdint.h>

/* Whether this CPU runs it (AVX512F and AVX512DQ). */
int bf16_avx512_supported(void);

/* y[M, N] = x[M, K] . w[N, K]^T as bf16_linear computes it, for N % 8 == 0 and K % 8 == 0. */
void bf16_linear_avx512(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                        int64_t K, int threads);

#endif
