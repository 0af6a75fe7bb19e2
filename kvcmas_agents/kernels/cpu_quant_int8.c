/* Products of int8-quantized rows with Q4_1 / Q8_0 blocks: integer dot products a block, then one scale.

   w . x over a block is dw * dx * sum(q_w * q_x) (+ m * sum(x) for Q4_1), the sum exact in int32. This is
   how llama.cpp computes its decode products; x's rounding to 8 bits a block is the only difference from
   the fp32 rows of cpu_quant.c, and AVX-512 VNNI forms 64 of the products in one instruction. */
#include "cpu_quant.h"

void kq_rows_prepare(int M, int K, const float *x, int q4, kq_rows *p) {
  const int nb = K / BLOCK;
  p->K = K;
  p->q4 = q4;
  p->q = aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
  p->d = malloc((size_t)M * nb * sizeof(float));
  p->s = malloc((size_t)M * nb * sizeof(float));
  p->bias = q4 ? NULL : aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
  int8_t code[BLOCK];
  for (int r = 0; r < M; r++)
    for (int b = 0; b < nb; b++) {
      const float *xb = x + (size_t)r * K + b * BLOCK;
      float amax = 0.0f, s = 0.0f;
      for (int j = 0; j < BLOCK; j++) {
        amax = fmaxf(amax, fabsf(xb[j]));
        s += xb[j];
      }
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      p->d[(size_t)r * nb + b] = d;
      p->s[(size_t)r * nb + b] = s;
      for (int j = 0; j < BLOCK; j++) code[j] = (int8_t)lrintf(xb[j] * inv);
      int8_t *out = p->q + (size_t)r * K + (b & ~1) * BLOCK;
      if (q4) {
        const int odd = b & 1;
        memcpy(out + odd * 16, code, 16);
        memcpy(out + 32 + odd * 16, code + 16, 16);
      } else {
        memcpy(out + (b & 1) * BLOCK, code, BLOCK);
        for (int g = 0; g < BLOCK / 4; g++)
          p->bias[(size_t)r * (K / 4) + b * 8 + g] = -128 * (code[4 * g] + code[4 * g + 1] + code[4 * g + 2] + code[4 * g + 3]);
      }
    }
}

void kq_rows_free(kq_rows *p) {
  free(p->q);
  free(p->d);
  free(p->s);
  free(p->bias);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__) && !defined(KVQ_PORTABLE)
#include <immintrin.h>

int kq_int8_vectorized(void) { return 1; }

/* Two blocks a step: the 32 nibble bytes of blocks b and b + 1, low nibbles in the lower half of the
   register and high in the upper, against the rows' codes in the same order. Lane l of the int32 dot
   holds four products of block b + (l / 4) % 2; each lane is scaled by its block's dw * dx. */
static inline __attribute__((always_inline)) void q4_1_rows(const int R, const kq_rows *p, int r0,
    const uint8_t *q, const uint16_t *d, const uint16_t *mn, float *out) {
  const int K = p->K, nb = K / BLOCK;
  __m512 acc[ROWS], macc[ROWS], scale[ROWS];
  for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm512_setzero_ps();
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i low = _mm512_set1_epi8(15);
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int nc = nb - b0 < 16 ? nb - b0 : 16;
    const __mmask16 live = (__mmask16)((1u << nc) - 1);
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, d + b0));
    const __m512 ms = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mn + b0));
    for (int r = 0; r < R; r++) {
      const size_t at = (size_t)(r0 + r) * nb + b0;
      macc[r] = _mm512_fmadd_ps(ms, _mm512_maskz_loadu_ps(live, p->s + at), macc[r]);
      scale[r] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(live, p->d + at));
    }
    for (int c = 0; c < nc; c += 2) {
      const int b = b0 + c;
      const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + b * 16)));
      const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(raw, shifts), low);
      const __m512i lane = _mm512_set_epi32(c + 1, c + 1, c + 1, c + 1, c, c, c, c, c + 1, c + 1, c + 1, c + 1, c, c, c, c);
      for (int r = 0; r < R; r++) {
        const __m512i xq = _mm512_load_si512((const void *)(p->q + (size_t)(r0 + r) * K + b * BLOCK));
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane, scale[r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], macc[r]));
}

/* Two blocks a step: 64 weight codes, offset by 128 to unsigned bytes; the rows' bias takes the offset's
   part (128 * sum of the row's codes) back out of each lane. */
static inline __attribute__((always_inline)) void q8_0_rows(const int R, const kq_rows *p, int r0,
    const int8_t *q, const uint16_t *d, float *out) {
  const int K = p->K, nb = K / BLOCK;
  __m512 acc[ROWS], scale[ROWS];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int nc = nb - b0 < 16 ? nb - b0 : 16;
    const __mmask16 live = (__mmask16)((1u << nc) - 1);
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, d + b0));
    for (int r = 0; r < R; r++)
      scale[r] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(live, p->d + (size_t)(r0 + r) * nb + b0));
    for (int c = 0; c < nc; c += 2) {
      const int b = b0 + c;
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + b * BLOCK)), flip);
      const __m512i lane = _mm512_set_epi32(c + 1, c + 1, c + 1, c + 1, c + 1, c + 1, c + 1, c + 1, c, c, c, c, c, c, c, c);
      for (int r = 0; r < R; r++) {
        const size_t row = (size_t)(r0 + r) * K + b * BLOCK;
        const __m512i xq = _mm512_load_si512((const void *)(p->q + row));
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_load_si512((const void *)(p->bias + row / 4)), w, xq);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane, scale[r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#else  /* portable C: the same integer sums a block, then the same scales */

int kq_int8_vectorized(void) { return 0; }

static inline void q4_1_rows(const int R, const kq_rows *p, int r0, const uint8_t *q, const uint16_t *d,
                             const uint16_t *mn, float *out) {
  const int K = p->K, nb = K / BLOCK;
  for (int r = 0; r < R; r++) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
      const int8_t *xq = p->q + (size_t)(r0 + r) * K + (b & ~1) * BLOCK + (b & 1) * 16;
      int32_t dot = 0;
      for (int j = 0; j < 16; j++) dot += (q[b * 16 + j] & 15) * xq[j] + (q[b * 16 + j] >> 4) * xq[32 + j];
      const size_t at = (size_t)(r0 + r) * nb + b;
      acc += kq_half(d[b]) * p->d[at] * (float)dot + kq_half(mn[b]) * p->s[at];
    }
    out[r] = acc;
  }
}

static inline void q8_0_rows(const int R, const kq_rows *p, int r0, const int8_t *q, const uint16_t *d,
                             float *out) {
  const int K = p->K, nb = K / BLOCK;
  for (int r = 0; r < R; r++) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
      const int8_t *xq = p->q + (size_t)(r0 + r) * K + b * BLOCK;
      int32_t dot = 0;
      for (int j = 0; j < BLOCK; j++) dot += q[b * BLOCK + j] * xq[j];
      acc += kq_half(d[b]) * p->d[(size_t)(r0 + r) * nb + b] * (float)dot;
    }
    out[r] = acc;
  }
}
#endif

void kq_int8_feature(int R, const kq_rows *p, int r0, const void *qs, const uint16_t *d, const uint16_t *mn,
                     int n, float *out) {
  const int K = p->K, nb = K / BLOCK;
  d += (size_t)n * nb;
  if (mn) {
    const uint8_t *q = (const uint8_t *)qs + (size_t)n * (K / 2);
    mn += (size_t)n * nb;
    switch (R) {                    /* a constant R each, so the accumulators stay in registers */
      case 1: q4_1_rows(1, p, r0, q, d, mn, out); break;
      case 2: q4_1_rows(2, p, r0, q, d, mn, out); break;
      case 3: q4_1_rows(3, p, r0, q, d, mn, out); break;
      default: q4_1_rows(4, p, r0, q, d, mn, out); break;
    }
  } else {
    const int8_t *q = (const int8_t *)qs + (size_t)n * K;
    switch (R) {
      case 1: q8_0_rows(1, p, r0, q, d, out); break;
      case 2: q8_0_rows(2, p, r0, q, d, out); break;
      case 3: q8_0_rows(3, p, r0, q, d, out); break;
      default: q8_0_rows(4, p, r0, q, d, out); break;
    }
  }
}
