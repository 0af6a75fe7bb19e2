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
                                                             int ctx, int j0, int j1, const int64_t *slots,
                                                             const int64_t *key_class, const float *qr,
                                                             float *scores) {
    for (int j = j0; j < j1; j++) {
        const float *k = kc + (size_t)slots[j] * kvh * d;
        int c = key_class ? (int)key_class[j] : 0;
        for (int h = 0; h < kvh; h++)
            dots(scores + (size_t)h * gn * ctx + j, ctx, qr + ((size_t)c * kvh + h) * gn * d, k + (size_t)h * d, gn, d);
    }
}

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
        if (d == 64) score_keys(kvh, gn, 64, kc, ctx, j0, j1, slots, kcls, qr, scores);
        else if (d == 128) score_keys(kvh, gn, 128, kc, ctx, j0, j1, slots, kcls, qr, scores);
        else score_keys(kvh, gn, d, kc, ctx, j0, j1, slots, kcls, qr, scores);
    }
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
            /* the next blocks of this component's row: one stream per component, r of them, too many
             * for the hardware prefetcher to follow */
            __builtin_prefetch(src + 2 * BLOCK);
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

/* The runs of rows (``run_end``) as [start, end) pairs in runs [2 * count]; returns count. */
static int runs_of(const coeffs_t *c, const int32_t *group, int *runs) {
    int count = 0;
    for (int a = 0; a < c->nrows; a = runs[2 * count - 1]) {
        runs[2 * count] = a;
        runs[2 * count + 1] = run_end(c, group, a);
        count++;
    }
    return count;
}

/* One stack: rows [R] of the view, their group [R], U_k, qb [groups, KVH, G*n, r]:
 * scores[h, x, rows[j]] += qb[group[j], h, x] . U_k[h, j]. Each (head, run) is one thread's, its terms
 * written by position in rows, then added into the scores in order (a row corrected by a chain of
 * groups appears in several runs). */
void vd_lowrank_scores(int kvh, int gn, int ctx, float *scores, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *qb, const float *uf, const int8_t *u8,
                       const float *scale, const float *chan, const int32_t *state, int states, int threads) {
    coeffs_t c = {uf, u8, scale, chan, state, nrows, r, states};
    int *runs = malloc(sizeof(int) * 2 * (nrows + 1));
    int count = runs_of(&c, group, runs);
    float *terms = malloc(sizeof(float) * (size_t)kvh * gn * nrows);
#pragma omp parallel num_threads(threads) if (threads > 1 && kvh * count > 1)
    {
        /* sized to need: small blocks come back from the thread's arena, large ones would be mapped anew */
        float *qc = malloc(sizeof(float) * (size_t)(gn + BLOCK) * r), *u = qc + (size_t)gn * r;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kvh * count; item++) {
            int h = item / count, a = runs[2 * (item % count)], e = runs[2 * (item % count) + 1];
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
                    float *o = terms + ((size_t)h * gn + x) * nrows + j;
                    for (int y = 0; y < len; y++) o[y] = sc ? ax[y] * sc[y] : ax[y];
                }
            }
        }
        free(qc);
#pragma omp for schedule(static)
        for (int hx = 0; hx < kvh * gn; hx++) {     /* after every run's terms (the loop above's barrier) */
            float *s = scores + (size_t)hx * ctx;
            const float *o = terms + (size_t)hx * nrows;
            for (int j = 0; j < nrows; j++) s[rows[j]] += o[j];
        }
    }
    free(terms);
    free(runs);
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
        memset(o, 0, sizeof(float) * size);
        int j0 = (int)((long)ctx * tid / nt), j1 = (int)((long)ctx * (tid + 1) / nt);
        for (int j = j0; j < j1; j++) {
            const float *v = vc + (size_t)slots[j] * kvh * d;
            for (int h = 0; h < kvh; h++) {
                const float *vh = v + (size_t)h * d;
                for (int x = 0; x < gn; x++) {
                    float w = scores[((size_t)h * gn + x) * ctx + j];
                    float *ox = o + ((size_t)h * gn + x) * d;
#pragma omp simd
                    for (int t = 0; t < d; t++) ox[t] += w * vh[t];
                }
            }
        }
    }
    for (int k = 1; k < used; k++)
        for (size_t i = 0; i < size; i++) out[i] += parts[size * (k - 1) + i];
    free(parts);
}

/* pu [groups, KVH, G*n, r] (zeroed by the caller) += probs of each row times its U_v row. Partial sums
 * are kept LANES wide over a run's rows and summed across at its end. Each (head, run) is one thread's,
 * into its own slot; the slots are added into pu in order. */
#define LANES 16
void vd_lowrank_values(int kvh, int gn, int ctx, const float *probs, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *uf, const int8_t *u8, const float *scale,
                       const float *chan, const int32_t *state, int states, float *pu, int threads) {
    coeffs_t c = {uf, u8, scale, chan, state, nrows, r, states};
    int *runs = malloc(sizeof(int) * 2 * (nrows + 1));
    int count = runs_of(&c, group, runs);
    float *slots = malloc(sizeof(float) * (size_t)kvh * count * gn * r);
#pragma omp parallel num_threads(threads) if (threads > 1 && kvh * count > 1)
    {
        float *acc = malloc(sizeof(float) * (size_t)(gn * LANES + BLOCK) * r), *u = acc + (size_t)gn * r * LANES;
        float pr[BLOCK];
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kvh * count; item++) {
            int h = item / count, a = runs[2 * (item % count)], e = runs[2 * (item % count) + 1];
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
            float *out = slots + (size_t)item * gn * r;
            const float *ch = chan ? chan + ((size_t)h * states + state[a]) * r : NULL;
            for (int x = 0; x < gn; x++)
                for (int t = 0; t < r; t++) {
                    const float *av = acc + ((size_t)x * r + t) * LANES;
                    float sum = 0.0f;
                    for (int l = 0; l < LANES; l++) sum += av[l];
                    out[x * r + t] = ch ? sum * ch[t] : sum;
                }
        }
        free(acc);
    }
    for (int item = 0; item < kvh * count; item++) {
        int h = item / count, a = runs[2 * (item % count)];
        float *out = pu + ((size_t)group[a] * kvh + h) * gn * r;
        const float *in = slots + (size_t)item * gn * r;
        for (int i = 0; i < gn * r; i++) out[i] += in[i];
    }
    free(slots);
    free(runs);
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
