/* What cpu_view.c, cpu_view_lowrank.c and cpu_decode.c share: includes, sizes, small math, entry points. */
#ifndef KVCMAS_CPU_VIEW_H
#define KVCMAS_CPU_VIEW_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

#define MAX_RANK 256        /* the caller checks r <= MAX_RANK and G * n <= MAX_ROWS */
#define MAX_ROWS 64

/* exp(x) for x <= 0 to a few ulp, in a form the compiler vectorizes: x = k ln2 + f, |f| <= ln2/2,
 * exp(f) by its degree-7 Taylor polynomial, 2^k built in the exponent bits (k rounded by adding and
 * taking away 1.5 * 2^23). */
static inline float vexp(float x) {
    if (x < -87.0f) x = -87.0f;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float f = x - k * 0.693145751953125f - k * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } two = { .i = ((int32_t)k + 127) << 23 };
    return p * two.f;
}

static inline float dot(const float *a, const float *b, int d) {
    float acc = 0.0f;
#pragma omp simd reduction(+:acc)
    for (int t = 0; t < d; t++) acc += a[t] * b[t];
    return acc;
}

/* Shared by the sources (cpu_view.c: scores, softmax, the one-call view attention; cpu_decode.c: a decode
   step's RoPE, KV write and attention in one call;
   cpu_view_lowrank.c: the low-rank terms and bases). */
void vd_scores(int n, int kvh, int g, int d, const float *q, const float *kc, int ctx, const int64_t *slots,
               const int64_t *key_class, int classes, const float *qcos, const float *qsin, float *qr,
               float *scores, int threads);
void vd_softmax_pv(int n, int kvh, int gn, int d, int ctx, float scale, float *scores, const float *vc,
                   const int64_t *slots, float *out, int threads);
void vd_lowrank_scores(int kvh, int gn, int ctx, float *scores, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *qb, const float *uf, const int8_t *u8,
                       const float *scale, const float *chan, const int32_t *state, int states, int threads);
void vd_lowrank_values(int kvh, int gn, int ctx, const float *probs, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *uf, const int8_t *u8, const float *scale,
                       const float *chan, const int32_t *state, int states, float *pu, int threads);
void vd_basis_queries(int nb, int kvh, int gn, int r, int d, const float *qg, int kind, const int64_t *b,
                      const int64_t *scale, const int64_t *cos, const int64_t *sin, float *qb);
void vd_view_attention(int n, int kvh, int g, int d, const float *q, const float *kc, const float *vc, int ctx,
                       const int64_t *slots, const int64_t *key_class, int classes, const float *qcos,
                       const float *qsin, float scale, int nst, const int64_t *table, float *out, int threads);
void vd_basis_values(int nb, int kvh, int gn, int r, int d, const float *pu, int kind, const int64_t *b,
                     const int64_t *scale, float *out);

#endif
