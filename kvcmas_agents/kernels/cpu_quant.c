/* Products of fp32 rows with weights kept in GGUF's blocks of 32 (Q4_1, Q8_0), read as they are stored.

   out[r, n] = sum_k x[r, k] * w[n, k], each weight expanded in registers exactly as the file defines it:
   Q4_1: w = d * q + m (q in 0..15, d and m the block's fp16 scale and minimum, kept as fp16 bits);
   Q8_0: w = d * q (q in -128..127). d * q is exact in fp32 (an 11-bit by an 8-bit mantissa), so each
   weight equals the fp32 weight a de-quantized checkpoint holds; only the order of the sum differs.
   A step reads 5 (Q4_1) or 8.5 (Q8_0) bits a weight instead of 32.

   Rows go through in passes of up to ROWS, whose accumulators stay in registers, so a few rows (a batch
   of decode steps) read each weight block once. Output features are split across the OpenMP team.
   Two steps of a layer ride along, to save the ops around the product: ``norm`` (RMS-normalize each row
   and scale it by ``norm`` first) and ``glu`` (the weight is gate then up, N = 2 I: out [M, I] is
   silu(gate) * up). With ``int8`` the rows are quantized to int8 a block first and the sums run in
   integers (cpu_quant_int8.c), as llama.cpp's do. */
#include "cpu_quant.h"

#if defined(__AVX512F__) && defined(__F16C__) && !defined(KVQ_PORTABLE)
#include <immintrin.h>

int kq_vectorized(void) { return 1; }

/* acc[r] += w . x[r]'s block b for the R rows: one block's weights, formed once, for every row. */
static inline __attribute__((always_inline)) void add_rows(const int R, int K, const float *x, int b, __m512 w0,
                                                           __m512 w1, __m512 acc[][2]) {
  for (int r = 0; r < R; r++) {
    const float *xr = x + (size_t)r * K + b * BLOCK;
    acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
  }
}

/* Per block of 32: (d * q) . x for Q4_1 and Q8_0, with the Q4_1 minimum's part as m . sx, sx the row's
   sums over each block: d * q once a block for every row, then one multiply-add per row and 16 lanes.
   Scales are widened sixteen blocks at a time. */
static inline __attribute__((always_inline)) void q4_1_feature(const int R, int K, const float *x,
    const float *sx, const uint8_t *q, const uint16_t *d, const uint16_t *mn, float *out) {
  __m512 acc[ROWS][2], macc[ROWS];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = macc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  const int nb = K / BLOCK;
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int nc = nb - b0 < 16 ? nb - b0 : 16;
    const __mmask16 live = (__mmask16)((1u << nc) - 1);
    float ds[16];
    _mm512_storeu_ps(ds, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, d + b0)));
    const __m512 ms = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mn + b0));
    for (int r = 0; r < R; r++)
      macc[r] = _mm512_fmadd_ps(ms, _mm512_maskz_loadu_ps(live, sx + (size_t)r * nb + b0), macc[r]);
    for (int c = 0; c < nc; c++) {
      const int b = b0 + c;
      const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 16)));
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(raw, low));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 4));
      const __m512 db = _mm512_set1_ps(ds[c]);
      add_rows(R, K, x, b, _mm512_mul_ps(db, q0), _mm512_mul_ps(db, q1), acc);   /* d * q: exact in fp32 */
    }
  }
  for (int r = 0; r < R; r++)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), macc[r]));
}

static inline __attribute__((always_inline)) void q8_0_feature(const int R, int K, const float *x,
    const int8_t *q, const uint16_t *d, float *out) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int nb = K / BLOCK;
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int nc = nb - b0 < 16 ? nb - b0 : 16;
    float ds[16];
    _mm512_storeu_ps(ds, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << nc) - 1), d + b0)));
    for (int c = 0; c < nc; c++) {
      const int b = b0 + c;
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * BLOCK))));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * BLOCK + 16))));
      const __m512 db = _mm512_set1_ps(ds[c]);
      add_rows(R, K, x, b, _mm512_mul_ps(db, q0), _mm512_mul_ps(db, q1), acc);   /* d * q: exact in fp32 */
    }
  }
  for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

#else  /* portable C: the same sums, lane by lane; the compiler vectorizes what it can */

int kq_vectorized(void) { return 0; }

/* acc[r] += w * x[r]'s block b, lane by lane; then each row's lanes summed into out[r]. */
static inline void add_block(const int R, int K, const float *w, const float *x, int b, float acc[][BLOCK]) {
  for (int r = 0; r < R; r++)
    for (int j = 0; j < BLOCK; j++) acc[r][j] += w[j] * x[(size_t)r * K + b * BLOCK + j];
}

static inline void sum_rows(const int R, float acc[][BLOCK], float *out) {
  for (int r = 0; r < R; r++) {
    float s = 0.0f;
    for (int j = 0; j < BLOCK; j++) s += acc[r][j];
    out[r] = s;
  }
}

static inline void q4_1_feature(const int R, int K, const float *x, const float *sx, const uint8_t *q,
                                const uint16_t *d, const uint16_t *mn, float *out) {
  (void)sx;
  float acc[ROWS][BLOCK];
  memset(acc, 0, sizeof(acc));
  for (int b = 0; b < K / BLOCK; b++) {
    float w[BLOCK];
    const float db = kq_half(d[b]), mb = kq_half(mn[b]);
    for (int j = 0; j < 16; j++) {
      w[j] = db * (float)(q[b * 16 + j] & 15) + mb;
      w[j + 16] = db * (float)(q[b * 16 + j] >> 4) + mb;
    }
    add_block(R, K, w, x, b, acc);
  }
  sum_rows(R, acc, out);
}

static inline void q8_0_feature(const int R, int K, const float *x, const int8_t *q, const uint16_t *d,
                                float *out) {
  float acc[ROWS][BLOCK];
  memset(acc, 0, sizeof(acc));
  for (int b = 0; b < K / BLOCK; b++) {
    float w[BLOCK];
    const float db = kq_half(d[b]);
    for (int j = 0; j < BLOCK; j++) w[j] = db * (float)q[b * BLOCK + j];
    add_block(R, K, w, x, b, acc);
  }
  sum_rows(R, acc, out);
}
#endif

/* One output feature n of R rows: the weight's row n in either format, sums into out[0..R). */
static inline void feature(const int R, int K, const float *x, const float *sx, const void *qs,
                           const uint16_t *d, const uint16_t *mn, int n, float *out) {
  const int nb = K / BLOCK;
  if (mn) {
    const uint8_t *q = (const uint8_t *)qs + (size_t)n * (K / 2);
    switch (R) {                    /* a constant R each, so the accumulators stay in registers */
      case 1: q4_1_feature(1, K, x, sx, q, d + (size_t)n * nb, mn + (size_t)n * nb, out); break;
      case 2: q4_1_feature(2, K, x, sx, q, d + (size_t)n * nb, mn + (size_t)n * nb, out); break;
      case 3: q4_1_feature(3, K, x, sx, q, d + (size_t)n * nb, mn + (size_t)n * nb, out); break;
      default: q4_1_feature(4, K, x, sx, q, d + (size_t)n * nb, mn + (size_t)n * nb, out); break;
    }
  } else {
    const int8_t *q = (const int8_t *)qs + (size_t)n * K;
    switch (R) {
      case 1: q8_0_feature(1, K, x, q, d + (size_t)n * nb, out); break;
      case 2: q8_0_feature(2, K, x, q, d + (size_t)n * nb, out); break;
      case 3: q8_0_feature(3, K, x, q, d + (size_t)n * nb, out); break;
      default: q8_0_feature(4, K, x, q, d + (size_t)n * nb, out); break;
    }
  }
}

/* x [M, K] row-major; qs: Q4_1 [N, K/2] nibbles (element j of a block in the low nibble of byte j,
   element j + 16 in its high nibble) with d and mn [N, K/32] fp16 bits, or Q8_0 [N, K] int8 with d and
   mn NULL. K is a multiple of 32. norm: NULL, or [K] (rows are RMS-normalized with eps and scaled by it
   first). glu: out [M, N/2] = silu(row n) * row(n + N/2), else out [M, N]. residual: NULL, or [M, out's
   width] added to the result (it may be out itself). */
static void matmul(int M, int N, int K, const float *x, const float *norm, float eps, const void *qs,
                   const uint16_t *d, const uint16_t *mn, int glu, int int8, const float *residual, float *out,
                   int threads) {
  float *xn = NULL;
  if (norm) {
    xn = malloc((size_t)M * K * sizeof(float));
    for (int r = 0; r < M; r++) {
      const float *xr = x + (size_t)r * K;
      float ss = 0.0f;
      for (int k = 0; k < K; k++) ss += xr[k] * xr[k];
      const float inv = 1.0f / sqrtf(ss / (float)K + eps);
      for (int k = 0; k < K; k++) xn[(size_t)r * K + k] = norm[k] * (xr[k] * inv);
    }
    x = xn;
  }
  const int features = glu ? N / 2 : N, nb = K / BLOCK;
  int8 = int8 && K % 64 == 0;         /* the int8 loops take blocks in pairs */
  kq_rows rows;
  if (int8) kq_rows_prepare(M, K, x, mn != NULL, &rows);
  float *sx = NULL;                   /* each row's sum over each block, for the Q4_1 minimums */
  if (mn && !int8) {
    sx = malloc((size_t)M * nb * sizeof(float));
    for (int r = 0; r < M; r++)
      for (int b = 0; b < nb; b++) {
        float s = 0.0f;
        for (int j = 0; j < BLOCK; j++) s += x[(size_t)r * K + b * BLOCK + j];
        sx[(size_t)r * nb + b] = s;
      }
  }
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int n = 0; n < features; n++) {
    for (int r0 = 0; r0 < M; r0 += ROWS) {
      const int R = M - r0 < ROWS ? M - r0 : ROWS;
      const float *xr = x + (size_t)r0 * K;
      float a[ROWS];
      const float *sr = sx ? sx + (size_t)r0 * nb : NULL;
      if (int8) kq_int8_feature(R, &rows, r0, qs, d, mn, n, a);
      else feature(R, K, xr, sr, qs, d, mn, n, a);
      if (glu) {
        float b[ROWS];
        if (int8) kq_int8_feature(R, &rows, r0, qs, d, mn, n + features, b);
        else feature(R, K, xr, sr, qs, d, mn, n + features, b);
        for (int r = 0; r < R; r++) a[r] = a[r] / (1.0f + expf(-a[r])) * b[r];
      }
      for (int r = 0; r < R; r++) {
        const size_t at = (size_t)(r0 + r) * features + n;
        out[at] = residual ? residual[at] + a[r] : a[r];
      }
    }
  }
  if (int8) kq_rows_free(&rows);
  free(xn);
  free(sx);
}

void kq_matmul(int M, int N, int K, const float *x, const float *norm, float eps, const void *qs,
               const uint16_t *d, const uint16_t *mn, int glu, int int8, float *out, int threads) {
  matmul(M, N, K, x, norm, eps, qs, d, mn, glu, int8, NULL, out, threads);
}

/* A layer after its attention, in one call: out [M, K] = h + o . attn; then out += down . (silu(gate) *
   up) of RMS-normalized out (norm, eps). attn [M, A]; the gate/up weight is [2 I, K], down [K, I]. Each
   weight is (qs, d, mn) as for kq_matmul, and int8 as there. */
void kq_layer_tail(int M, int K, int A, int I, const float *h, const float *attn, const float *norm, float eps,
                   const void *o_qs, const uint16_t *o_d, const uint16_t *o_mn,
                   const void *gu_qs, const uint16_t *gu_d, const uint16_t *gu_mn,
                   const void *dn_qs, const uint16_t *dn_d, const uint16_t *dn_mn, int int8, float *out,
                   int threads) {
  float *act = malloc((size_t)M * I * sizeof(float));
  matmul(M, K, A, attn, NULL, 0.0f, o_qs, o_d, o_mn, 0, int8, h, out, threads);
  matmul(M, 2 * I, K, out, norm, eps, gu_qs, gu_d, gu_mn, 1, int8, NULL, act, threads);
  matmul(M, K, I, act, NULL, 0.0f, dn_qs, dn_d, dn_mn, 0, int8, out, out, threads);
  free(act);
}
