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
#define CHUNK 128           /* rows per share of the work among threads (at most; a run's last is less) */
#define TILE 4              /* query rows whose sums a block keeps in registers at once */

/* Sixteen floats as one value (GCC/Clang vector extensions: one AVX-512 register, two AVX ones), so
 * that a block's sums stay in registers; vload/vstore take unaligned addresses. */
typedef float v16 __attribute__((vector_size(64)));
static inline v16 vload(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }
/* Sixteen int8 codes as floats: GCC lowers the generic conversion lane by lane, so AVX-512 names it. */
#if defined(__AVX512F__) && !defined(KVQ_PORTABLE)
#include <immintrin.h>
static inline v16 cload(const int8_t *p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
static inline v16 cload(const int8_t *p) {
    float f[16];
    for (int k = 0; k < 16; k++) f[k] = (float)p[k];
    return vload(f);
}
#endif

/* Head h's U for rows [j, j + len) into out [r, BLOCK], without the row scales, zero past len: a run's
 * last block, whose rows past len must not be read. */
static inline void block_of(const coeffs_t *c, int h, int j, int len, float *restrict out) {
    int whole = len / 16 * 16;
    for (int t = 0; t < c->r; t++) {
        size_t at = ((size_t)h * c->r + t) * c->nrows + j;
        float *o = out + (size_t)t * BLOCK;
        if (c->uf) {
            memcpy(o, c->uf + at, sizeof(float) * len);
        } else {
            for (int x = 0; x < whole; x += 16) vstore(o + x, cload(c->u8 + at + x));
            for (int x = whole; x < len; x++) o[x] = (float)c->u8[at + x];
        }
        memset(o + len, 0, sizeof(float) * (BLOCK - len));
    }
}

/* Where a block's U lies: fp32 (its own rows, or the copy block_of made) or int8 codes, component t
 * at base + t * stride. */
typedef struct {
    const float *f;
    const int8_t *i8;
    size_t stride;
} ublock_t;

static inline ublock_t ublock(const coeffs_t *c, const float *copy, int h, int j) {
    size_t at = (size_t)h * c->r * c->nrows + j;
    if (copy) return (ublock_t){copy, NULL, BLOCK};
    if (c->uf) return (ublock_t){c->uf + at, NULL, (size_t)c->nrows};
    return (ublock_t){NULL, c->u8 + at, (size_t)c->nrows};
}

/* Component t of a block's U as four vectors, codes converted once for all the block's query rows. */
static inline __attribute__((always_inline)) void u_of(ublock_t b, int t, v16 *u) {
    if (b.f) {
        for (int k = 0; k < 4; k++) u[k] = vload(b.f + t * b.stride + 16 * k);
    } else {
        /* one stream per component, r of them, too many for the hardware prefetcher to follow */
        __builtin_prefetch(b.i8 + t * b.stride + 2 * BLOCK);
        for (int k = 0; k < 4; k++) u[k] = cload(b.i8 + t * b.stride + 16 * k);
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

/* The work's shares: runs of rows (``run_end``) cut into pieces of at most CHUNK rows, as [start, end)
 * pairs in shares [2 * count]; returns count. Fixed by the rows alone, so that the sums do not depend
 * on the thread count. */
static int shares_of(const coeffs_t *c, const int32_t *group, int *shares) {
    int count = 0;
    for (int a = 0; a < c->nrows;) {
        int e = run_end(c, group, a);
        for (int b = a; b < e; b += CHUNK, count++) {
            shares[2 * count] = b;
            shares[2 * count + 1] = b + CHUNK < e ? b + CHUNK : e;
        }
        a = e;
    }
    return count;
}

/* Whether each share's rows are consecutive positions (a view laid out for the loops puts its
 * corrected rows first, ``layout.KeyOrder``): the terms then go in and the probabilities come out as
 * whole vectors. */
static int consecutive(const int64_t *rows, const int *shares, int count) {
    for (int i = 0; i < count; i++) {
        int a = shares[2 * i], e = shares[2 * i + 1];
        for (int j = a + 1; j < e; j++)
            if (rows[j] != rows[a] + (j - a)) return 0;
    }
    return 1;
}

/* Whether no position appears twice among rows (a chain's rows appear once per group): then each share
 * adds its terms into the scores itself. Increasing rows (a KeyOrder's) are, with no marks to make. */
static int disjoint(const int64_t *rows, int nrows, int ctx) {
    int increasing = nrows == 0 || (rows[0] >= 0 && rows[nrows - 1] < ctx);
    for (int j = 1; j < nrows && increasing; j++) increasing = rows[j] > rows[j - 1];
    if (increasing) return 1;
    unsigned char *seen = calloc((size_t)ctx, 1);
    int ok = 1;
    for (int j = 0; j < nrows && ok; j++) {
        ok = rows[j] >= 0 && rows[j] < ctx && !seen[rows[j]];
        if (ok) seen[rows[j]] = 1;
    }
    free(seen);
    return ok;
}

/* One block's score terms for TN query rows from w [TN, r] (TN a constant where inlined, so that the
 * sums stay in registers): ax [TN, BLOCK]. */
static inline __attribute__((always_inline)) void block_scores_n(ublock_t b, int r, const float *w, const int TN,
                                                                 float *ax) {
    v16 acc[TILE][4] = {{{0}}};
    for (int t = 0; t < r; t++) {
        v16 u[4];
        u_of(b, t, u);
        for (int x = 0; x < TN; x++)
            for (int k = 0; k < 4; k++) acc[x][k] += w[x * r + t] * u[k];
    }
    for (int x = 0; x < TN; x++)
        for (int k = 0; k < 4; k++) vstore(ax + (size_t)x * BLOCK + 16 * k, acc[x][k]);
}

static void block_scores(ublock_t b, int r, const float *w, int tn, float *ax) {
    switch (tn) {
    case 1: block_scores_n(b, r, w, 1, ax); break;
    case 2: block_scores_n(b, r, w, 2, ax); break;
    case 3: block_scores_n(b, r, w, 3, ax); break;
    default: block_scores_n(b, r, w, 4, ax); break;
    }
}

/* One block's value terms for TN query rows of probabilities p [TN][4]: acc [TN, r, LANES] +=. */
#define LANES 16
static inline __attribute__((always_inline)) void block_values_n(ublock_t b, int r, v16 (*p)[4], const int TN,
                                                                 float *acc) {
    for (int t = 0; t < r; t++) {
        v16 u[4];
        u_of(b, t, u);
        for (int x = 0; x < TN; x++) {
            float *av = acc + ((size_t)x * r + t) * LANES;
            vstore(av, vload(av) + p[x][0] * u[0] + p[x][1] * u[1] + p[x][2] * u[2] + p[x][3] * u[3]);
        }
    }
}

static void block_values(ublock_t b, int r, v16 (*p)[4], int tn, float *acc) {
    switch (tn) {
    case 1: block_values_n(b, r, p, 1, acc); break;
    case 2: block_values_n(b, r, p, 2, acc); break;
    case 3: block_values_n(b, r, p, 3, acc); break;
    default: block_values_n(b, r, p, 4, acc); break;
    }
}

/* One stack: rows [R] of the view, their group [R], U_k, qb [groups, KVH, G*n, r]:
 * scores[h, x, rows[j]] += qb[group[j], h, x] . U_k[h, j]. Each (head, share) is one thread's. Where the
 * rows are disjoint it adds its terms into the scores; else they are written by position in rows and
 * then added in order (a row corrected by a chain of groups appears in several runs). */
void vd_lowrank_scores(int kvh, int gn, int ctx, float *scores, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *qb, const float *uf, const int8_t *u8,
                       const float *scale, const float *chan, const int32_t *state, int states, int threads) {
    coeffs_t c = {uf, u8, scale, chan, state, nrows, r, states};
    int *shares = malloc(sizeof(int) * 2 * (nrows + 1));
    int count = shares_of(&c, group, shares), direct = disjoint(rows, nrows, ctx);
    int dense = direct && consecutive(rows, shares, count);
    float *terms = direct ? NULL : malloc(sizeof(float) * (size_t)kvh * gn * nrows);
#pragma omp parallel num_threads(threads) if (threads > 1 && kvh * count > 1)
    {
        /* sized to need: small blocks come back from the thread's arena, large ones would be mapped anew */
        float *qc = malloc(sizeof(float) * ((size_t)(gn + BLOCK) * r + TILE * BLOCK)), *tail = qc + (size_t)gn * r;
        float *ax = tail + (size_t)BLOCK * r;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kvh * count; item++) {
            int h = item / count, a = shares[2 * (item % count)], e = shares[2 * (item % count) + 1];
            run_queries(&c, qb + ((size_t)group[a] * kvh + h) * gn * r, h, a, gn, qc);
            for (int j = a; j < e; j += BLOCK) {
                int len = e - j < BLOCK ? e - j : BLOCK;
                /* a block reads whole vectors of a component's codes: past the last row only in a copy */
                int copy = len < BLOCK || j + BLOCK > nrows;
                if (copy) block_of(&c, h, j, len, tail);
                const float *sc = scale ? scale + (size_t)h * nrows + j : NULL;
                for (int x0 = 0; x0 < gn; x0 += TILE) {
                    int tn = gn - x0 < TILE ? gn - x0 : TILE;
                    block_scores(ublock(&c, copy ? tail : NULL, h, j), r, qc + (size_t)x0 * r, tn, ax);
                    for (int x = 0; x < tn; x++) {
                        const float *v = ax + (size_t)x * BLOCK;
                        if (dense) {
                            float *s = scores + ((size_t)h * gn + x0 + x) * ctx + rows[j];
#pragma omp simd
                            for (int y = 0; y < len; y++) s[y] += sc ? v[y] * sc[y] : v[y];
                        } else if (direct) {
                            float *s = scores + ((size_t)h * gn + x0 + x) * ctx;
                            for (int y = 0; y < len; y++) s[rows[j + y]] += sc ? v[y] * sc[y] : v[y];
                        } else {
                            float *o = terms + ((size_t)h * gn + x0 + x) * nrows + j;
                            for (int y = 0; y < len; y++) o[y] = sc ? v[y] * sc[y] : v[y];
                        }
                    }
                }
            }
        }
        free(qc);
        if (!direct) {
#pragma omp for schedule(static)
            for (int hx = 0; hx < kvh * gn; hx++) {     /* after every share's terms (the loop above's barrier) */
                float *s = scores + (size_t)hx * ctx;
                const float *o = terms + (size_t)hx * nrows;
                for (int j = 0; j < nrows; j++) s[rows[j]] += o[j];
            }
        }
    }
    free(terms);
    free(shares);
}

/* pu [groups, KVH, G*n, r] (zeroed by the caller) += probs of each row times its U_v row. Partial sums
 * are kept LANES wide over a share's rows and summed across at its end. Each (head, share) is one
 * thread's, into its own slot; the slots are added into pu in order. */
void vd_lowrank_values(int kvh, int gn, int ctx, const float *probs, int nrows, const int64_t *rows,
                       const int32_t *group, int r, const float *uf, const int8_t *u8, const float *scale,
                       const float *chan, const int32_t *state, int states, float *pu, int threads) {
    coeffs_t c = {uf, u8, scale, chan, state, nrows, r, states};
    int *shares = malloc(sizeof(int) * 2 * (nrows + 1));
    int count = shares_of(&c, group, shares), dense = consecutive(rows, shares, count);
    float *slots = malloc(sizeof(float) * (size_t)kvh * count * gn * r);
#pragma omp parallel num_threads(threads) if (threads > 1 && kvh * count > 1)
    {
        float *acc = malloc(sizeof(float) * ((size_t)gn * LANES + BLOCK) * r), *tail = acc + (size_t)gn * r * LANES;
        float pr[TILE][BLOCK];
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kvh * count; item++) {
            int h = item / count, a = shares[2 * (item % count)], e = shares[2 * (item % count) + 1];
            memset(acc, 0, sizeof(float) * gn * r * LANES);
            for (int j = a; j < e; j += BLOCK) {
                int len = e - j < BLOCK ? e - j : BLOCK;
                int copy = len < BLOCK || j + BLOCK > nrows;
                if (copy) block_of(&c, h, j, len, tail);
                const float *sc = scale ? scale + (size_t)h * nrows + j : NULL;
                for (int x0 = 0; x0 < gn; x0 += TILE) {
                    int tn = gn - x0 < TILE ? gn - x0 : TILE;
                    v16 p[TILE][4];
                    for (int x = 0; x < tn; x++) {
                        const float *px = probs + ((size_t)h * gn + x0 + x) * ctx;
                        if (dense) {
                            const float *pj = px + rows[j];
#pragma omp simd
                            for (int y = 0; y < len; y++) pr[x][y] = sc ? pj[y] * sc[y] : pj[y];
                        } else {
                            for (int y = 0; y < len; y++) pr[x][y] = sc ? px[rows[j + y]] * sc[y] : px[rows[j + y]];
                        }
                        for (int y = len; y < BLOCK; y++) pr[x][y] = 0.0f;
                        for (int k = 0; k < 4; k++) p[x][k] = vload(pr[x] + 16 * k);
                    }
                    block_values(ublock(&c, copy ? tail : NULL, h, j), r, p, tn, acc + (size_t)x0 * r * LANES);
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
        int h = item / count, a = shares[2 * (item % count)];
        float *out = pu + ((size_t)group[a] * kvh + h) * gn * r;
        const float *in = slots + (size_t)item * gn * r;
        for (int i = 0; i < gn * r; i++) out[i] += in[i];
    }
    free(slots);
    free(shares);
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
                if (kind == B_I8) {       /* the usual basis: converted sixteen at a time */
                    for (int e = 0; e + 16 <= d; e += 16) vstore(row + e, cload((const int8_t *)b[i] + at + e));
                    for (int e = d / 16 * 16; e < d; e++) row[e] = (float)((const int8_t *)b[i])[at + e];
                } else {
                    for (int e = 0; e < d; e++) row[e] = basis_at(kind, (const void *)b[i], at + e);
                }
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
                if (kind == B_I8) {
                    for (int e = 0; e + 16 <= d; e += 16) vstore(row + e, s * cload((const int8_t *)b[i] + at + e));
                    for (int e = d / 16 * 16; e < d; e++) row[e] = (float)((const int8_t *)b[i])[at + e] * s;
                } else {
                    for (int e = 0; e < d; e++) row[e] = basis_at(kind, (const void *)b[i], at + e) * s;
                }
                for (int x = 0; x < gn; x++) {
                    float w = p[(size_t)x * r + t], *ox = o + (size_t)x * d;
#pragma omp simd
                    for (int e = 0; e < d; e++) ox[e] += w * row[e];
                }
            }
        }
}
