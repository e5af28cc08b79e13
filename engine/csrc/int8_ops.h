/* Integer matmuls against GGUF blocks interleaved by 8 rows (gguf.h), activations quantised to
   int8 per block of 32; the exact arithmetic is described in int8_ops.c. */
#ifndef AGENTRT_INT8_OPS_H
#define AGENTRT_INT8_OPS_H

#include <stdint.h>

/* x [M, K] (K % 32 == 0) -> codes q [M, K], scales d [M, K / 32], sx [M, K / 32]. */
void quantize_q8_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *sx);

void q8_blocks_linear(const int8_t *q, const float *d, const float *sx, const uint8_t *w,
                      int kind, float *y, const float *residual, int64_t M, int64_t N, int64_t K,
                      int threads);
void q8_blocks_rows(const int8_t *q, const float *d, const float *sx, const uint8_t *w, int kind,
                    float *y, const float *residual, int64_t N, int64_t K, int64_t n0, int64_t n1);
void int8_linear(const float *x, const uint8_t *w, int kind, float *y, const float *residual,
                 int64_t M, int64_t N, int64_t K, int threads);

/* Which group kernels run: 1 VNNI where the CPU has it, 0 AVX2, -1 asks (int8_ops.c). */
int int8_vnni(int mode);

#endif
