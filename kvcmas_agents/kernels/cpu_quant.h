/* What cpu_quant.c and cpu_quant_int8.c share: block sizes and the int8 rows' entry points. */
#ifndef KVCMAS_CPU_QUANT_H
#define KVCMAS_CPU_QUANT_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define ROWS 4

/* Rows of x quantized to int8 per block of 32, as llama.cpp quantizes activations (its Q8_0/Q8_1):
   code = round(x / d) with d = max |x| / 127 of the block. For Q4_1 weights (q4) each pair of blocks
   (b, b + 1) holds b's codes 0-15, b + 1's 0-15, b's 16-31, b + 1's 16-31, the order the weight's
   nibbles unpack in; for Q8_0 the codes keep their order and ``bias`` holds -128 times each group of
   four codes' sum (the vector path reads the weight's codes offset by 128, as unsigned bytes). ``s``
   is each block's exact fp32 sum of x, for the Q4_1 minimums. */
typedef struct {
  int K, q4;
  int8_t *q;       /* [M, K] */
  float *d, *s;    /* [M, K / 32] */
  int32_t *bias;   /* [M, K / 4], Q8_0 only */
} kq_rows;

/* IEEE binary16 bits to float, exactly (the portable loops' own; the vector ones convert in registers). */
static inline float kq_half(uint16_t h) {
  const uint32_t exp = (h >> 10) & 31, man = h & 1023;
  float v;
  if (exp == 0) v = ldexpf((float)man, -24);                         /* zero and subnormals */
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = ldexpf((float)(man | 1024), (int)exp - 25);
  return (h & 0x8000) ? -v : v;
}

/* Whether the int8 path runs on AVX-512 VNNI (1) or portable loops (0). */
int kq_int8_vectorized(void);
/* Quantize x [M, K] (K a multiple of 64) for weights of one format; kq_rows_free lets it go. */
void kq_rows_prepare(int M, int K, const float *x, int q4, kq_rows *p);
void kq_rows_free(kq_rows *p);
/* out[0..R) = rows r0..r0+R (R <= ROWS) of p . weight row n: Q4_1 (mn set) or Q8_0, as kq_matmul's. */
void kq_int8_feature(int R, const kq_rows *p, int r0, const void *qs, const uint16_t *d, const uint16_t *mn,
                     int n, float *out);
#endif
