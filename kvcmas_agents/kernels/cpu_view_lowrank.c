/* The low-rank terms of attention over a corrected view (see cpu_view.c for the layouts): a stack's
 * basis products with the queries, its U rows' score terms, and its value terms. */
#include "cpu_view.h"

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
