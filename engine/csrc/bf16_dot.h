/* bf16 activations against bf16 weights on AVX512-BF16 (bf16_dot.c): float32 sums of bf16
   products, 16 outputs a register; not the exact path's arithmetic. */
#ifndef AGENTRT_BF16_DOT_H
#define AGENTRT_BF16_DOT_H

#include <stdint.h>

/* Whether this CPU runs it (AVX512F, AVX512BW and AVX512-BF16). */
int bf16_dot_supported(void);

/* y[M, N] = bf16(x[M, K]) . w[N, K]^T (+ residual); on a CPU without AVX512-BF16, or unless
   K % 32 == 0, bf16_linear's float32 product instead. */
void bf16_dot_linear(const float *x, const uint16_t *w, float *y, const float *residual,
                     int64_t M, int64_t N, int64_t K, int threads);

#endif
