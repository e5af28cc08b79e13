/* A whole step's layers in one call (`CpuOps.decode_layers_paged`): no per-op trip through
   Python. Matrix and Layer are the layer plan that cpu_ops.py builds (`_Matrix`, `_Layer`). */
#ifndef AGENTRT_LAYERS_H
#define AGENTRT_LAYERS_H

#include <stdint.h>

#include "kv_cache.h"

/* One weight matrix [N, K] of a layer, in the forms it is kept in. */
typedef struct {
    const uint16_t *dense;  /* bf16 [N, K] */
    const uint8_t *packed;  /* GGUF blocks of the same matrix, or NULL */
    int kind;               /* of the blocks: GGUF_Q4_1 or GGUF_Q8_0 */
    const uint8_t *int8;    /* the blocks interleaved by 8 rows: multiply them with int8
                               activations at every row count; or NULL */
} Matrix;

/* One layer's weights and its k / v block pools. */
typedef struct {
    const float *attn_norm, *mlp_norm, *bqkv;  /* bqkv may be NULL */
    Matrix qkv, o, gate_up, down;
    kv_t *k_cache, *v_cache;                   /* block pools [NB, KV, BS, D], float16 */
} Layer;

/* Rows x [n, E] (in place) of S sequences, each with its own positions and block table, through
   L layers whose k_cache / v_cache are block pools: RMSNorm, qkv (+ bias), RoPE + cache store,
   attention, output projection, RMSNorm, SiLU-gated MLP, both residuals.
   The matmuls see all n rows at once (the weights stream once for the whole batch); RoPE and
   attention go per sequence. The same kernels in the same order as the per-op path. With
   bf16_rows > 0, a step of at least that many rows multiplies its dense matrices with bf16
   activations (bf16_dot.h; the caller checks that the CPU has AVX512-BF16). */
void decode_layers_paged(float *x, int64_t n, const Seq *seqs, int64_t S, const Layer *layers,
                         int64_t L, int64_t E, int64_t I, int64_t H, int64_t KV, int64_t D,
                         int64_t BS, const float *rope, float eps, float scale, int packed_max,
                         int bf16_rows, int threads);

#endif
