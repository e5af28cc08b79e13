/* The row-wise steps of a layer: RMSNorm and the SiLU gate (float32). */
#ifndef AGENTRT_NORMS_H
#define AGENTRT_NORMS_H

#include <stdint.h>

void rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t K, float eps);
void silu_mul(const float *gu, float *y, int64_t M, int64_t I);
void silu_mul_range(const float *gu, float *y, int64_t I, int64_t a, int64_t b);

#endif
