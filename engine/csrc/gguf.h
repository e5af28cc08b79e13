/* GGUF weight blocks as the kernels read them: 32 weights a block.
   Q4_1: fp16 d, fp16 m, then 16 bytes where byte j holds weight j in its low nibble and weight
   j + 16 in its high one. Q8_0: fp16 d, then 32 int8. Interleaved (int8_ops.c): the blocks of 8
   rows in one group. */
#ifndef AGENTRT_GGUF_H
#define AGENTRT_GGUF_H

/* Block kinds, as `_PACKED_KINDS` in cpu_ops.py numbers them. */
#define GGUF_Q4_1 0
#define GGUF_Q8_0 1

/* Bytes of one block of 32 weights, and of one interleaved group of 8 such blocks. */
#define Q4_1_BLOCK_BYTES 20
#define Q8_0_BLOCK_BYTES 34
#define Q4_1_GROUP_BYTES 160
#define Q8_0_GROUP_BYTES 272
#define GGUF_BLOCK_BYTES(kind) ((kind) == GGUF_Q4_1 ? Q4_1_BLOCK_BYTES : Q8_0_BLOCK_BYTES)
#define GGUF_GROUP_BYTES(kind) ((kind) == GGUF_Q4_1 ? Q4_1_GROUP_BYTES : Q8_0_GROUP_BYTES)

#endif
