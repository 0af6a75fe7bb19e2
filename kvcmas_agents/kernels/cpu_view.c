/* Decode-sized attention over a corrected view on CPU, fp32, on torch's threads.
 *
 * The torch gather path spends most of a decode step over a corrected view in small ops (about 40 a
 * layer): gathering keys, rotating reused ones, and the low-rank terms of each group of corrections.
 * These loops do the same math reading the paged cache, the kept codes and the stored bases in place:
 *
 *   vd_scores          scores[h, x, j] = R(-delta_j) q[h, x] . k[slot_j, h]    (query-side realignment)
 *   vd_basis_queries   qb[i, h, x] = q[h, x] . B_k,i[h]^T                       (per stack of groups)
 *   vd_lowrank_scores  scores[h, x, row] += qb[group, h, x] . U_k[h, row]
 *   vd_softmax_pv      probs = softmax(scale * scores) (causal for n > 1); out = probs . v
 *   vd_lowrank_values  pu[group, h, x] += probs[h, x, row] * U_v[h, row]
 *   vd_basis_values    out[h, x] += pu[i, h, x] . B_v,i[h]
 *   vd_view_attention  all of the above for one layer in one call (a table of the view's stacks), so a
 *                      decode step pays one call a layer, not six per stack
 *
 * Layouts: q [n, KVH*G, D]; caches [slots, KVH, D]; scores/probs [KVH, G*n, ctx] with row g*n + i for
 * query i of group head g; U transposed, [KVH, r, R].
 *
 * Threads: built with -fopenmp only where the process's OpenMP runtime is the libgomp torch already
 * loaded (cpu_view.py checks), so these loops share torch's thread team; a second team beside it would
 * make every parallel region of the process sleep and wake. Work is split so that no two threads add
 * into one sum: results do not depend on scheduling (only, in the last bits, on the thread count).
 */
#include "cpu_view.h"

/* s[x * stride] = q[x] . k for the gn rows of q [gn, d]; three rows at a time, so each element of k is
 * loaded once for three products. */
static inline void dots(float *s, size_t stride, const float *q, const float *k, int gn, int d) {
    int x = 0;
    for (; x + 3 <= gn; x += 3) {
        const float *q0 = q + (size_t)x * d, *q1 = q0 + d, *q2 = q1 + d;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f;
#pragma omp simd reduction(+:a0, a1, a2)
        for (int t = 0; t < d; t++) {
            a0 += q0[t] * k[t];
            a1 += q1[t] * k[t];
            a2 += q2[t] * k[t];
        }
        s[x * stride] = a0;
        s[(x + 1) * stride] = a1;
        s[(x + 2) * stride] = a2;
    }
    for (; x < gn; x++) s[x * stride] = dot(q + (size_t)x * d, k, d);
}

/* Rotate-half RoPE of x [d] by (cos, sin) [d]: x * cos + rotate_half(x) * sin. */
static void rotate(float *out, const float *x, const float *cs, const float *sn, int d) {
    int half = d / 2;
    for (int t = 0; t < half; t++) out[t] = x[t] * cs[t] - x[t + half] * sn[t];
    for (int t = half; t < d; t++) out[t] = x[t] * cs[t] + x[t - half] * sn[t];
}

/* Paged KV is read slot by slot through a table, in runs of a block's slots: a slot a few ahead is
 * asked for early, since the hardware's prefetchers stop at each block's edge. */
#define PREFETCH 4
static inline void prefetch_row(const float *row, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(row + i);
}

/* The key loop of vd_scores; inlined with d a constant for the usual head sizes, so that the products
 * unroll into whole vectors with no remainder handling. */
static inline __attribute__((always_inline)) void score_keys(int kvh, int gn, const int d, const float *kc,
                                                             int ctx, int j0, int j1, const int64_t *slots,
                                                             const int64_t *key_class, const float *qr,
                                                             float *scores) {
    for (int j = j0; j < j1; j++) {
        const float *k = kc + (size_t)slots[j] * kvh * d;
        if (j + PREFETCH < j1) prefetch_row(kc + (size_t)slots[j + PREFETCH] * kvh * d, kvh * d);
        int c = key_class ? (int)key_class[j] : 0;
        for (int h = 0; h < kvh; h++)
            dots(scores + (size_t)h * gn * ctx + j, ctx, qr + ((size_t)c * kvh + h) * gn * d, k + (size_t)h * d, gn, d);
    }
}

#if defined(__AVX512F__) && !defined(KVQ_PORTABLE)
#include <immintrin.h>
#define WIDE_LOOPS 1

/* Sixteen vectors' lane sums as one vector (lane i: the sum of v[i]'s lanes), in 45 shuffles and adds
 * where sixteen separate horizontal sums take about 130. */
static inline __m512 sum16(const __m512 *v) {
    __m512 r[8], s[4];
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int m = 0; m < 4; m++)
        s[m] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * m], r[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(r[2 * m], r[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512 dot64(const float *q, const float *k) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(k + 16), a);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 32), _mm512_loadu_ps(k + 32), a);
    return _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), _mm512_loadu_ps(k + 48), a);
}

/* score_keys for d = 64, sixteen keys at a time: each key's products stay a vector until one sum16
 * turns the sixteen into their scores, stored as one vector. The keys' rows are read from L1 once per
 * query row; the next sixteen are asked for while these are scored. */
static void score_keys64(int kvh, int gn, const float *kc, int ctx, int j0, int j1, const int64_t *slots,
                         const int64_t *key_class, const float *qr, float *scores) {
    const int d = 64;
    int j = j0;
    for (; j + 16 <= j1; j += 16) {
        const float *k[16];
        for (int i = 0; i < 16; i++) k[i] = kc + (size_t)slots[j + i] * kvh * d;
        for (int i = 0; j + 16 + i < j1 && i < 16; i++) prefetch_row(kc + (size_t)slots[j + 16 + i] * kvh * d, kvh * d);
        /* sixteen keys of one rotation class (the usual case: a piece's keys share one) score against
         * one query row held in registers; else each key reads its class's row */
        int c0 = key_class ? (int)key_class[j] : 0, one = 1;
        for (int i = 1; key_class && i < 16; i++) one &= key_class[j + i] == c0;
        for (int h = 0; h < kvh; h++)
            for (int x = 0; x < gn; x++) {
                __m512 p[16];
                if (one) {
                    const float *qx = qr + (((size_t)c0 * kvh + h) * gn + x) * d;
                    __m512 q0 = _mm512_loadu_ps(qx), q1 = _mm512_loadu_ps(qx + 16), q2 = _mm512_loadu_ps(qx + 32),
                           q3 = _mm512_loadu_ps(qx + 48);
                    for (int i = 0; i < 16; i++) {
                        const float *kh = k[i] + (size_t)h * d;
                        __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(kh));
                        a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kh + 16), a);
                        a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kh + 32), a);
                        p[i] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kh + 48), a);
                    }
                } else {
                    for (int i = 0; i < 16; i++) {
                        int c = (int)key_class[j + i];
                        p[i] = dot64(qr + (((size_t)c * kvh + h) * gn + x) * d, k[i] + (size_t)h * d);
                    }
                }
                _mm512_storeu_ps(scores + ((size_t)h * gn + x) * ctx + j, sum16(p));
            }
    }
    for (; j < j1; j++) {
        const float *k = kc + (size_t)slots[j] * kvh * d;
        int c = key_class ? (int)key_class[j] : 0;
        for (int h = 0; h < kvh; h++)
            dots(scores + (size_t)h * gn * ctx + j, ctx, qr + ((size_t)c * kvh + h) * gn * d, k + (size_t)h * d, gn, d);
    }
}

/* out rows [x0, x0 + R) of head h, d = 64: sum over keys [j0, j1) of probs * v, the R rows' sums held in
 * registers across the keys (each key's value row loaded once for them). */
static inline __attribute__((always_inline)) void pv_rows64(const int R, int kvh, int gn, int ctx, int h, int x0,
                                                            int j0, int j1, const float *probs, const float *vc,
                                                            const int64_t *slots, float *o) {
    const int d = 64;
    __m512 acc[4][4];
    for (int x = 0; x < R; x++)
        for (int t = 0; t < 4; t++) acc[x][t] = _mm512_setzero_ps();
    const float *pr = probs + ((size_t)h * gn + x0) * ctx;
    for (int j = j0; j < j1; j++) {
        const float *v = vc + (size_t)slots[j] * kvh * d + (size_t)h * d;
        if (j + PREFETCH < j1) prefetch_row(vc + (size_t)slots[j + PREFETCH] * kvh * d + (size_t)h * d, d);
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        for (int x = 0; x < R; x++) {
            const __m512 w = _mm512_set1_ps(pr[(size_t)x * ctx + j]);
            acc[x][0] = _mm512_fmadd_ps(w, v0, acc[x][0]);
            acc[x][1] = _mm512_fmadd_ps(w, v1, acc[x][1]);
            acc[x][2] = _mm512_fmadd_ps(w, v2, acc[x][2]);
            acc[x][3] = _mm512_fmadd_ps(w, v3, acc[x][3]);
        }
    }
    for (int x = 0; x < R; x++)
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(o + ((size_t)h * gn + x0 + x) * d + t * 16, acc[x][t]);
}

/* o [KVH, gn, 64] = probs . v over keys [j0, j1), head by head, rows four at a time. */
static void pv64(int kvh, int gn, int ctx, int j0, int j1, const float *probs, const float *vc,
                 const int64_t *slots, float *o) {
    for (int h = 0; h < kvh; h++)
        for (int x0 = 0; x0 < gn; x0 += 4) {
            switch (gn - x0 < 4 ? gn - x0 : 4) {
                case 1: pv_rows64(1, kvh, gn, ctx, h, x0, j0, j1, probs, vc, slots, o); break;
                case 2: pv_rows64(2, kvh, gn, ctx, h, x0, j0, j1, probs, vc, slots, o); break;
                case 3: pv_rows64(3, kvh, gn, ctx, h, x0, j0, j1, probs, vc, slots, o); break;
                default: pv_rows64(4, kvh, gn, ctx, h, x0, j0, j1, probs, vc, slots, o); break;
            }
        }
}
#else
#define WIDE_LOOPS 0
#endif

int vd_wide_loops(void) { return WIDE_LOOPS; }

#define KEYS 256            /* keys per share of the scores among threads */

/* qr [C, KVH, G*n, D] scratch; classes == 0 means no realignment (key_class and tables unused). */
void vd_scores(int n, int kvh, int g, int d, const float *q, const float *kc, int ctx, const int64_t *slots,
               const int64_t *key_class, int classes, const float *qcos, const float *qsin, float *qr,
               float *scores, int threads) {
    int gn = g * n, c_count = classes > 0 ? classes : 1;
    for (int c = 0; c < c_count; c++)
        for (int h = 0; h < kvh; h++)
            for (int gg = 0; gg < g; gg++)
                for (int i = 0; i < n; i++) {
                    const float *src = q + ((size_t)i * kvh * g + h * g + gg) * d;
                    float *dst = qr + (((size_t)c * kvh + h) * gn + gg * n + i) * d;
                    if (classes > 0) rotate(dst, src, qcos + (size_t)c * d, qsin + (size_t)c * d, d);
                    else memcpy(dst, src, sizeof(float) * d);
                }
    const int64_t *kcls = classes > 0 ? key_class : NULL;
    int blocks = (ctx + KEYS - 1) / KEYS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 1)
    for (int b = 0; b < blocks; b++) {
        int j0 = b * KEYS, j1 = j0 + KEYS < ctx ? j0 + KEYS : ctx;
#if WIDE_LOOPS
        if (d == 64) score_keys64(kvh, gn, kc, ctx, j0, j1, slots, kcls, qr, scores);
#else
        if (d == 64) score_keys(kvh, gn, 64, kc, ctx, j0, j1, slots, kcls, qr, scores);
#endif
        else if (d == 128) score_keys(kvh, gn, 128, kc, ctx, j0, j1, slots, kcls, qr, scores);
        else score_keys(kvh, gn, d, kc, ctx, j0, j1, slots, kcls, qr, scores);
    }
}

/* o [KVH, gn, d] = probs . v over keys [j0, j1), key by key. */
static void pv(int kvh, int gn, int d, int ctx, int j0, int j1, const float *probs, const float *vc,
               const int64_t *slots, float *o) {
    memset(o, 0, sizeof(float) * (size_t)kvh * gn * d);
    for (int j = j0; j < j1; j++) {
        const float *v = vc + (size_t)slots[j] * kvh * d;
        if (j + PREFETCH < j1) prefetch_row(vc + (size_t)slots[j + PREFETCH] * kvh * d, kvh * d);
        for (int h = 0; h < kvh; h++) {
            const float *vh = v + (size_t)h * d;
            for (int x = 0; x < gn; x++) {
                float w = probs[((size_t)h * gn + x) * ctx + j];
                float *ox = o + ((size_t)h * gn + x) * d;
#pragma omp simd
                for (int t = 0; t < d; t++) ox[t] += w * vh[t];
            }
        }
    }
}

/* probs in place of scores; out [KVH, G*n, D]. Query i of n sees keys j <= ctx - n + i. Threads take
 * rows of the softmax, then shares of the keys into their own partial outputs, summed in thread order. */
void vd_softmax_pv(int n, int kvh, int gn, int d, int ctx, float scale, float *scores, const float *vc,
                   const int64_t *slots, float *out, int threads) {
    size_t size = (size_t)kvh * gn * d;
    float *parts = threads > 1 ? malloc(sizeof(float) * size * (threads - 1)) : NULL;
    int used = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int row = 0; row < kvh * gn; row++) {
            float *p = scores + (size_t)row * ctx;
            int seen = ctx - n + (row % gn % n) + 1;
            float top = -INFINITY;
#pragma omp simd reduction(max:top)
            for (int j = 0; j < seen; j++) top = p[j] * scale > top ? p[j] * scale : top;
            float sum = 0.0f;
#pragma omp simd reduction(+:sum)
            for (int j = 0; j < seen; j++) {
                float e = vexp(p[j] * scale - top);
                p[j] = e;
                sum += e;
            }
            float inv = 1.0f / sum;
#pragma omp simd
            for (int j = 0; j < seen; j++) p[j] *= inv;
            for (int j = seen; j < ctx; j++) p[j] = 0.0f;
        }
        int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        if (tid == 0) used = nt;
        float *o = tid == 0 ? out : parts + size * (tid - 1);
        int j0 = (int)((long)ctx * tid / nt), j1 = (int)((long)ctx * (tid + 1) / nt);
#if WIDE_LOOPS
        if (d == 64) pv64(kvh, gn, ctx, j0, j1, scores, vc, slots, o);
        else
#endif
            pv(kvh, gn, d, ctx, j0, j1, scores, vc, slots, o);
    }
    for (int k = 1; k < used; k++)
        for (size_t i = 0; i < size; i++) out[i] += parts[size * (k - 1) + i];
    free(parts);
}

/* One stack of a layer's view as the Python side packs it (``cpu_view.stack_table``): int64 fields,
 * addresses for pointers (0 for none). */
enum {
    S_NROWS, S_ROWS, S_GROUP, S_GROUPS,
    S_KR, S_KUF, S_KU8, S_KSCALE, S_KCHAN, S_KSTATE, S_KSTATES, S_KBKIND, S_KB, S_KBSCALE, S_KBCOS, S_KBSIN,
    S_VR, S_VUF, S_VU8, S_VSCALE, S_VCHAN, S_VSTATE, S_VSTATES, S_VBKIND, S_VB, S_VBSCALE,
    S_FIELDS
};
#define AT(st, f, T) ((T)(intptr_t)(st)[f])

/* A decode step's whole attention over a view for one layer in one call: scores with realignment, each
 * stack's basis products and low-rank score terms, softmax and values, each stack's value terms.
 * out [KVH, G*n, D]; table [nst, S_FIELDS]. */
void vd_view_attention(int n, int kvh, int g, int d, const float *q, const float *kc, const float *vc, int ctx,
                       const int64_t *slots, const int64_t *key_class, int classes, const float *qcos,
                       const float *qsin, float scale, int nst, const int64_t *table, float *out, int threads) {
    int gn = g * n;
    float *qr = malloc(sizeof(float) * (size_t)(classes > 0 ? classes : 1) * kvh * gn * d);
    float *scores = malloc(sizeof(float) * (size_t)kvh * gn * ctx);
    vd_scores(n, kvh, g, d, q, kc, ctx, slots, key_class, classes, qcos, qsin, qr, scores, threads);
    /* qr's first class is the grouped queries themselves (class 0 is not rotated) */
    for (int i = 0; i < nst; i++) {
        const int64_t *st = table + (size_t)i * S_FIELDS;
        int nb = (int)st[S_GROUPS], r = (int)st[S_KR];
        float *qb = malloc(sizeof(float) * (size_t)nb * kvh * gn * r);
        vd_basis_queries(nb, kvh, gn, r, d, qr, (int)st[S_KBKIND], AT(st, S_KB, const int64_t *),
                         AT(st, S_KBSCALE, const int64_t *), AT(st, S_KBCOS, const int64_t *),
                         AT(st, S_KBSIN, const int64_t *), qb);
        vd_lowrank_scores(kvh, gn, ctx, scores, (int)st[S_NROWS], AT(st, S_ROWS, const int64_t *),
                          AT(st, S_GROUP, const int32_t *), r, qb, AT(st, S_KUF, const float *),
                          AT(st, S_KU8, const int8_t *), AT(st, S_KSCALE, const float *),
                          AT(st, S_KCHAN, const float *), AT(st, S_KSTATE, const int32_t *), (int)st[S_KSTATES],
                          threads);
        free(qb);
    }
    vd_softmax_pv(n, kvh, gn, d, ctx, scale, scores, vc, slots, out, threads);
    for (int i = 0; i < nst; i++) {
        const int64_t *st = table + (size_t)i * S_FIELDS;
        int nb = (int)st[S_GROUPS], r = (int)st[S_VR];
        float *pu = calloc((size_t)nb * kvh * gn * r, sizeof(float));
        vd_lowrank_values(kvh, gn, ctx, scores, (int)st[S_NROWS], AT(st, S_ROWS, const int64_t *),
                          AT(st, S_GROUP, const int32_t *), r, AT(st, S_VUF, const float *),
                          AT(st, S_VU8, const int8_t *), AT(st, S_VSCALE, const float *),
                          AT(st, S_VCHAN, const float *), AT(st, S_VSTATE, const int32_t *), (int)st[S_VSTATES],
                          pu, threads);
        vd_basis_values(nb, kvh, gn, r, d, pu, (int)st[S_VBKIND], AT(st, S_VB, const int64_t *),
                        AT(st, S_VBSCALE, const int64_t *), out);
        free(pu);
    }
    free(scores);
    free(qr);
}
