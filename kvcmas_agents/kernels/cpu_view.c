/* Decode-sized attention over a corrected view on CPU, fp32, one thread.
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
 *
 * Layouts: q [n, KVH*G, D]; caches [slots, KVH, D]; scores/probs [KVH, G*n, ctx] with row g*n + i for
 * query i of group head g; U transposed, [KVH, r, R]. One thread: a second OpenMP team beside torch's
 * would make every parallel region of the process sleep and wake.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* The key loop of vd_scores; inlined with d a constant for the usual head sizes, so that the products
 * unroll into whole vectors with no remainder handling. */
static inline __attribute__((always_inline)) void score_keys(int kvh, int gn, const int d, const float *kc,
                                                             int ctx, const int64_t *slots,
                                                             const int64_t *key_class, const float *qr,
                                                             float *scores) {
    for (int j = 0; j < ctx; j++) {
        const float *k = kc + (size_t)slots[j] * kvh * d;
        int c = key_class ? (int)key_class[j] : 0;
        for (int h = 0; h < kvh; h++)
            dots(scores + (size_t)h * gn * ctx + j, ctx, qr + ((size_t)c * kvh + h) * gn * d, k + (size_t)h * d, gn, d);
    }
}

/* qr [C, KVH, G*n, D] scratch; classes == 0 means no realignment (key_class and tables unused). */
void vd_scores(int n, int kvh, int g, int d, const float *q, const float *kc, int ctx, const int64_t *slots,
               const int64_t *key_class, int classes, const float *qcos, const float *qsin, float *qr,
               float *scores) {
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
    if (d == 64) score_keys(kvh, gn, 64, kc, ctx, slots, kcls, qr, scores);
    else if (d == 128) score_keys(kvh, gn, 128, kc, ctx, slots, kcls, qr, scores);
    else score_keys(kvh, gn, d, kc, ctx, slots, kcls, qr, scores);
}

/* A stack's U, stored transposed [KVH, r, R] so that the loops run along rows (no horizontal sums):
 * fp32, or int8 codes times an optional row scale [KVH, R] and optional channel scales (a table
 * [KVH, S, r] of the states' scales and each row's state [R] in it). */
typedef struct {
    const float *uf;
    const int8_t *u8;
    const float *scale, *chan;
    const int32_t *state;
    int nrows, r, states;
} coeffs_t;

#define BLOCK 64            /* rows per block: four vectors of 16 */

/* Sixteen floats as one value (GCC/Clang vector extensions: one AVX-512 register, two AVX ones), so
 * that a block's sums stay in registers; vload/vstore take unaligned addresses. */
typedef float v16 __attribute__((vector_size(64)));
static inline v16 vload(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Head h's U for rows [j, j + len) into out [r, BLOCK], without the row scales, zero past len: the
 * loops over a block then have a constant trip count and no remainder. */
static inline void block_of(const coeffs_t *c, int h, int j, int len, float *restrict out) {
    for (int t = 0; t < c->r; t++) {
        size_t at = ((size_t)h * c->r + t) * c->nrows + j;
        float *o = out + (size_t)t * BLOCK;
        if (c->uf) {
            memcpy(o, c->uf + at, sizeof(float) * len);
        } else {
            const int8_t *src = c->u8 + at;
#pragma omp simd
            for (int x = 0; x < len; x++) o[x] = (float)src[x];
        }
        if (len < BLOCK) memset(o + len, 0, sizeof(float) * (BLOCK - len));
    }
}

/* The end of the run of rows from j that share one group and one channel state. */
static inline int run_end(const coeffs_t *c, const int32_t *group, int j) {
    int e = j + 1;
    while (e < c->nrows && group[e] == group[j] && (!c->chan || c->state[e] == c->state[j])) e++;
    return e;
}

/* The query rows' products with a run's basis, times its channel scales where it has them. */
static void run_queries(const coeffs_t *c, const float *qb, int h, int j, int gn, float *out) {
    for (int x = 0; x < gn; x++)
        for (int t = 0; t < c->r; t++)
            out[x * c->r + t] = qb[(size_t)x * c->r + t] *
                                (c->chan ? c->chan[((size_t)h * c->states + c->state[j]) * c->r + t] : 1.0f);
}

/* One stack: rows [R] of the view, their group [R], U_k, qb [groups, KVH, G*n, r]:
 * scores[h, x, rows[j]] += qb[group[j], h, x] . U_k[h, j]. */
void vd_lowrank_scores(int kvh, int gn, int ctx, float *scores, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *qb, const float *uf, const int8_t *u8,
                       const float *scale, const float *chan, const int32_t *state, int states) {
    coeffs_t c = {uf, u8, scale, chan, state, nrows, r, states};
    float qc[MAX_ROWS * MAX_RANK], u[MAX_RANK * BLOCK];
    for (int h = 0; h < kvh; h++)
        for (int a = 0; a < nrows;) {
            int e = run_end(&c, group, a);
            run_queries(&c, qb + ((size_t)group[a] * kvh + h) * gn * r, h, a, gn, qc);
            for (int j = a; j < e; j += BLOCK) {
                int len = e - j < BLOCK ? e - j : BLOCK;
                block_of(&c, h, j, len, u);
                const float *sc = scale ? scale + (size_t)h * nrows + j : NULL;
                for (int x = 0; x < gn; x++) {
                    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (int t = 0; t < r; t++) {
                        float w = qc[x * r + t];
                        const float *ut = u + (size_t)t * BLOCK;
                        a0 += w * vload(ut);
                        a1 += w * vload(ut + 16);
                        a2 += w * vload(ut + 32);
                        a3 += w * vload(ut + 48);
                    }
                    float ax[BLOCK];
                    vstore(ax, a0), vstore(ax + 16, a1), vstore(ax + 32, a2), vstore(ax + 48, a3);
                    float *s = scores + ((size_t)h * gn + x) * ctx;
                    for (int y = 0; y < len; y++) s[rows[j + y]] += sc ? ax[y] * sc[y] : ax[y];
                }
            }
            a = e;
        }
}

/* probs in place of scores; out [KVH, G*n, D]. Query i of n sees keys j <= ctx - n + i. */
void vd_softmax_pv(int n, int kvh, int gn, int d, int ctx, float scale, float *scores, const float *vc,
                   const int64_t *slots, float *out) {
    for (int h = 0; h < kvh; h++)
        for (int x = 0; x < gn; x++) {
            float *p = scores + ((size_t)h * gn + x) * ctx;
            int seen = ctx - n + (x % n) + 1;
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
    memset(out, 0, sizeof(float) * (size_t)kvh * gn * d);
    for (int j = 0; j < ctx; j++) {
        const float *v = vc + (size_t)slots[j] * kvh * d;
        for (int h = 0; h < kvh; h++) {
            const float *vh = v + (size_t)h * d;
            for (int x = 0; x < gn; x++) {
                float w = scores[((size_t)h * gn + x) * ctx + j];
                float *o = out + ((size_t)h * gn + x) * d;
#pragma omp simd
                for (int t = 0; t < d; t++) o[t] += w * vh[t];
            }
        }
    }
}

/* pu [groups, KVH, G*n, r] (zeroed by the caller) += probs of each row times its U_v row. Partial sums
 * are kept LANES wide over a run's rows and summed across at its end. */
#define LANES 16
void vd_lowrank_values(int kvh, int gn, int ctx, const float *probs, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *uf, const int8_t *u8, const float *scale,
                       const float *chan, const int32_t *state, int states, float *pu) {
    coeffs_t c = {uf, u8, scale, chan, state, nrows, r, states};
    float pr[BLOCK], u[MAX_RANK * BLOCK], acc[MAX_ROWS * MAX_RANK * LANES];
    for (int h = 0; h < kvh; h++)
        for (int a = 0; a < nrows;) {
            int e = run_end(&c, group, a);
            memset(acc, 0, sizeof(float) * gn * r * LANES);
            for (int j = a; j < e; j += BLOCK) {
                int len = e - j < BLOCK ? e - j : BLOCK;
                const float *sc = scale ? scale + (size_t)h * nrows + j : NULL;
                block_of(&c, h, j, len, u);
                for (int x = 0; x < gn; x++) {
                    const float *p = probs + ((size_t)h * gn + x) * ctx;
                    for (int y = 0; y < len; y++) pr[y] = sc ? p[rows[j + y]] * sc[y] : p[rows[j + y]];
                    if (len < BLOCK) memset(pr + len, 0, sizeof(float) * (BLOCK - len));
                    v16 p0 = vload(pr), p1 = vload(pr + 16), p2 = vload(pr + 32), p3 = vload(pr + 48);
                    for (int t = 0; t < r; t++) {
                        float *av = acc + ((size_t)x * r + t) * LANES;
                        const float *ut = u + (size_t)t * BLOCK;
                        vstore(av, vload(av) + p0 * vload(ut) + p1 * vload(ut + 16) + p2 * vload(ut + 32)
                                   + p3 * vload(ut + 48));
                    }
                }
            }
            float *out = pu + ((size_t)group[a] * kvh + h) * gn * r;
            const float *ch = chan ? chan + ((size_t)h * states + state[a]) * r : NULL;
            for (int x = 0; x < gn; x++)
                for (int t = 0; t < r; t++) {
                    const float *av = acc + ((size_t)x * r + t) * LANES;
                    float sum = 0.0f;
                    for (int l = 0; l < LANES; l++) sum += av[l];
                    out[x * r + t] += ch ? sum * ch[t] : sum;
                }
            a = e;
        }
}

/* A stack's bases of one layer: per group, B [KVH, r, D] stored as fp32, int8 or bf16 (``kind``) at the
 * address b[i], an optional fp32 scale [KVH, r] per component (scale[i], 0 for none) and an optional
 * rotation of its D axis by rotate-half tables cos[i], sin[i] [D] (0 for none). kind 3: B is the
 * identity (r == D), rotated or not. */
enum { B_F32 = 0, B_I8 = 1, B_BF16 = 2, B_EYE = 3 };

static inline float basis_at(int kind, const void *b, size_t at) {
    if (kind == B_I8) return (float)((const int8_t *)b)[at];
    if (kind == B_BF16) {
        union { uint32_t i; float f; } v = { .i = (uint32_t)((const uint16_t *)b)[at] << 16 };
        return v.f;
    }
    return ((const float *)b)[at];
}

/* qb [NB, KVH, G*n, r]: qb[i, h, x, t] = q[h, x] . B_i[h, t]. A rotated basis is applied as the query
 * rotated back: q . rotate(b) == rotate^T(q) . b. */
void vd_basis_queries(int nb, int kvh, int gn, int r, int d, const float *qg, int kind, const int64_t *b,
                      const int64_t *scale, const int64_t *cos, const int64_t *sin, float *qb) {
    float qt[MAX_ROWS * 256], row[256];
    int half = d / 2;
    for (int i = 0; i < nb; i++)
        for (int h = 0; h < kvh; h++) {
            const float *q = qg + (size_t)h * gn * d;
            for (int x = 0; x < gn; x++) {
                const float *qx = q + (size_t)x * d;
                float *o = qt + (size_t)x * d;
                if (cos[i]) {
                    const float *c = (const float *)cos[i], *s = (const float *)sin[i];
                    for (int t = 0; t < half; t++) o[t] = qx[t] * c[t] + qx[t + half] * s[t + half];
                    for (int t = half; t < d; t++) o[t] = qx[t] * c[t] - qx[t - half] * s[t - half];
                } else {
                    memcpy(o, qx, sizeof(float) * d);
                }
            }
            float *out = qb + ((size_t)i * kvh + h) * gn * r;
            if (kind == B_EYE) {
                for (int x = 0; x < gn; x++) memcpy(out + (size_t)x * r, qt + (size_t)x * d, sizeof(float) * d);
                continue;
            }
            const float *sc = scale[i] ? (const float *)scale[i] + (size_t)h * r : NULL;
            for (int t = 0; t < r; t++) {
                size_t at = ((size_t)h * r + t) * d;
                for (int e = 0; e < d; e++) row[e] = basis_at(kind, (const void *)b[i], at + e);
                for (int x = 0; x < gn; x++) {
                    float v = dot(qt + (size_t)x * d, row, d);
                    out[(size_t)x * r + t] = sc ? v * sc[t] : v;
                }
            }
        }
}

/* out [KVH, G*n, D] += sum over groups i and components t of pu[i, h, x, t] * B_i[h, t] (value bases:
 * not rotated). */
void vd_basis_values(int nb, int kvh, int gn, int r, int d, const float *pu, int kind, const int64_t *b,
                     const int64_t *scale, float *out) {
    float row[256];
    for (int i = 0; i < nb; i++)
        for (int h = 0; h < kvh; h++) {
            const float *p = pu + ((size_t)i * kvh + h) * gn * r;
            float *o = out + (size_t)h * gn * d;
            if (kind == B_EYE) {
                for (int x = 0; x < gn; x++)
                    for (int e = 0; e < d; e++) o[(size_t)x * d + e] += p[(size_t)x * r + e];
                continue;
            }
            const float *sc = scale[i] ? (const float *)scale[i] + (size_t)h * r : NULL;
            for (int t = 0; t < r; t++) {
                size_t at = ((size_t)h * r + t) * d;
                float s = sc ? sc[t] : 1.0f;
                for (int e = 0; e < d; e++) row[e] = basis_at(kind, (const void *)b[i], at + e) * s;
                for (int x = 0; x < gn; x++) {
                    float w = p[(size_t)x * r + t], *ox = o + (size_t)x * d;
#pragma omp simd
                    for (int e = 0; e < d; e++) ox[e] += w * row[e];
                }
            }
        }
}
