/* RMSNorm and the SiLU gate (norms.h). */
#include <immintrin.h>
#include <math.h>

#include "norms.h"
#include "simd.h"

/* y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, for M rows of K (K % 8 == 0). */
void rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t K, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *yr = y + m * K;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)K + eps));
        for (int64_t k = 0; k < K; k += 8)
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), inv),
                                                   _mm256_loadu_ps(w + k)));
    }
}

/* y[i] = silu(gu[i]) * gu[I + i] for i = a .. b - 1 (a, b multiples of 8) of one row gu [2I]. */
void silu_mul_range(const float *gu, float *y, int64_t I, int64_t a, int64_t b) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t i = a; i < b; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i);
        const __m256 u = _mm256_loadu_ps(gu + I + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
}

/* y[m, i] = silu(gu[m, i]) * gu[m, I + i] for gu [M, 2I] (I % 8 == 0). */
void silu_mul(const float *gu, float *y, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++)
        silu_mul_range(gu + m * 2 * I, y + m * I, I, 0, I);
}
