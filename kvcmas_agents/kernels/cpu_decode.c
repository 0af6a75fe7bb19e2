/* The start of a decode step's attention in one call: RoPE of the step's q and k rows as the fused q/k/v
   product left them, k and v written to their cache slots, and then the attention of the loops in
   cpu_view.c: plain (given the context's slots) or over a corrected view.

   A decode layer made six small torch ops and two loop calls here, each a few microseconds against a
   few of real work. The rotation is bitwise torch's ``rotate_``: x * cos + roll(x, D/2) * signed sin,
   each product and the sum rounded on its own (so this file is built without contracting them into
   fused multiply-adds). */
#pragma GCC optimize("fp-contract=off")
#include "cpu_view.h"

/* x[t] = x[t] * c[t] + x[(t + d/2) % d] * s[t], in place, for one head row (d <= MAX_RANK). */
static void rope_row(float *x, const float *c, const float *s, int d) {
    float src[MAX_RANK];
    memcpy(src, x, sizeof(float) * d);
    const int half = d / 2;
    for (int t = 0; t < d; t++) {
        const float a = src[t] * c[t];
        const float b = src[t < half ? t + half : t - half] * s[t];
        x[t] = a + b;
    }
}

/* qkv [n, (H + 2 KVH) * D], row i: q heads, k heads, v heads; cos and ssin [n, D] (ssin: the sin table
   with its first half negated). Rotates q and k in place, writes k and v rows to kc/vc [slots, KVH, D]
   at wslots[i]. With ctx > 0 also attends: out [KVH, G*n, D] over kc/vc[slots] (cpu_view.c's loops;
   query i sees the keys up to ctx - n + i); q_out [n, H, D] scratch for the rotated queries. */
void vd_rope_write_attend(int n, int heads, int kvh, int d, float *qkv, const float *cos, const float *ssin,
                          float *kc, float *vc, const int64_t *wslots, int ctx, const int64_t *slots,
                          float scale, float *q_out, float *out, int threads) {
    const size_t width = (size_t)(heads + 2 * kvh) * d;
    for (int i = 0; i < n; i++) {
        float *row = qkv + (size_t)i * width;
        const float *c = cos + (size_t)i * d, *s = ssin + (size_t)i * d;
        for (int h = 0; h < heads + kvh; h++) rope_row(row + (size_t)h * d, c, s, d);
        memcpy(kc + (size_t)wslots[i] * kvh * d, row + (size_t)heads * d, sizeof(float) * kvh * d);
        memcpy(vc + (size_t)wslots[i] * kvh * d, row + (size_t)(heads + kvh) * d, sizeof(float) * kvh * d);
        if (q_out) memcpy(q_out + (size_t)i * heads * d, row, sizeof(float) * heads * d);
    }
    if (ctx <= 0) return;
    const int g = heads / kvh, gn = g * n;
    float *qr = malloc(sizeof(float) * (size_t)kvh * gn * d);
    float *scores = malloc(sizeof(float) * (size_t)kvh * gn * ctx);
    vd_scores(n, kvh, g, d, q_out, kc, ctx, slots, NULL, 0, NULL, NULL, qr, scores, threads);
    vd_softmax_pv(n, kvh, gn, d, ctx, scale, scores, vc, slots, out, threads);
    free(scores);
    free(qr);
}

/* The same start, then a decode step's attention over a corrected view (``vd_view_attention``: keys
   realigned by class, each stack's low-rank terms from ``table``) instead of plain attention. */
void vd_rope_write_view(int n, int heads, int kvh, int d, float *qkv, const float *cos, const float *ssin,
                        float *kc, float *vc, const int64_t *wslots, int ctx, const int64_t *slots,
                        const int64_t *key_class, int classes, const float *qcos, const float *qsin, float scale,
                        int nst, const int64_t *table, float *q_out, float *out, int threads) {
    vd_rope_write_attend(n, heads, kvh, d, qkv, cos, ssin, kc, vc, wslots, 0, NULL, scale, q_out, NULL, threads);
    vd_view_attention(n, kvh, heads / kvh, d, q_out, kc, vc, ctx, slots, key_class, classes, qcos, qsin, scale,
                      nst, table, out, threads);
}
