/* A pipeline stage's decoder layers for one decode step, in one call: for every layer
 *
 *   x = rmsnorm(h) * norm1;  qkv = x Wqkv^T (+ b);  [rmsnorm each q, k head * q_norm, k_norm];
 *   rotate q, k (the layer's cos/sin table); write k, v to the pools;
 *   a = paged decode attention(q, the layer's window);  o = a Wo^T;  [o = rmsnorm(o) * post_attn_norm];
 *   h += o;  x = rmsnorm(h) * norm2;  [g u] = x Wgu^T;  m = act(g, u) Wdown^T   (or m = moe(x));
 *   [m = rmsnorm(m) * post_mlp_norm];  h += m
 *
 * act(g, u): SiLU(g) * u, GELU-tanh(g) * u, or gpt-oss's clamped SwiGLU; the bracketed steps
 * where the layer has them (Qwen3's and Gemma 3's q/k norms, Gemma's norms after attention
 * and MLP); Gemma 2's attention soft-capping and gpt-oss's sinks are the attention kernel's.
 * A mixture-of-experts layer (L->moe) routes each row to its top-k experts (worker_svc/layers/
 * moe.py): the rows are grouped by expert so that each active expert's weights are read once
 * a step for all its rows (gathered into a contiguous block), as the module path does.
 *
 * for T decode rows (one new token per sequence), so a small step pays no per-operation
 * Python or torch dispatch (at batch 1 that overhead was twice the arithmetic of the
 * 30-layer real model). The products, the rotation with the K/V write and the attention are
 * the other libraries' kernels (csrc/quant_matmul.c, csrc/paged_decode.c), called through
 * function pointers the Python side takes from those loaded libraries, so each kernel has
 * one implementation and one test; this file adds the norms, SiLU and residual sums.
 *
 * Layouts (row-major, float32 unless said):
 *   h        [T, hidden], updated in place (the residual stream)
 *   cos, sin [tables, T, head_dim]: each row's rotary factors, one table per kind of layer
 *   slots    [groups, T] int64: where each row's K/V goes (block * block_size + offset)
 *   tables   [groups, T, max_blocks] int64; ctx_lens [T] int64 (tokens in KV after this step)
 *            KV groups (services/kv_layout.py): layer L reads sub-group L->group's slots and
 *            table, `L->group * shape.group_slots` and `* shape.group_tables` elements on; a
 *            step of one group passes strides 0 (every layer reads the one table)
 *   layer    struct pagoda_layer per layer (weights as the Python side holds them)
 *   scratch  at least pagoda_decode_scratch_floats(...) floats, plus the quantized
 *            activations' scratch (qscratch, qscratch_bytes) for the packed products
 * Returns 0, or the first nonzero code of a kernel (see the kernels' files).
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

/* one linear layer: packed GGUF rows (qtype: ggml's type id, 8 Q8_0, 2 Q4_0, 3 Q4_1, 6 Q5_0,
   7 Q5_1, 10-14 Q2_K-Q6_K), bfloat16 (30) or float32 (0) weights [n, k]; `next`: the rows
   after these in another type (a Q4_K_M file's q/k in Q4_K, v in Q6_K), their outputs
   side by side with these in one [T, total n] product, or NULL */
struct pagoda_linear {
    int64_t qtype;
    const void *w;
    const float *bias; /* [n] or NULL */
    int64_t n, k;
    const struct pagoda_linear *next;
};

/* one gated MLP: [g u] = x Wgu^T (g and u the two halves, never interleaved), then down */
struct pagoda_expert {
    struct pagoda_linear gate_up, down;
};

/* a mixture-of-experts MLP. Router: softmax over all experts, the top k, renormalised to sum
   1 when `renormalize`; or (`softmax_after_topk`, gpt-oss) the top k of the raw logits, then a
   softmax over those k. out = sum of weight * expert(x) [+ sigmoid(shared_gate(x)) * shared(x)] */
struct pagoda_moe {
    int64_t num_experts, top_k, renormalize, softmax_after_topk;
    struct pagoda_linear router; /* [num_experts, hidden] (+ bias) */
    const struct pagoda_expert *experts; /* [num_experts] */
    int64_t intermediate; /* each expert's */
    int64_t act; /* 0 SiLU, 1 GELU-tanh, 2 clamped SwiGLU (alpha, limit) */
    float alpha, limit;
    const struct pagoda_expert *shared; /* or NULL */
    int64_t shared_intermediate, shared_act;
    struct pagoda_linear shared_gate; /* [1, hidden], when shared */
};

struct pagoda_layer {
    const float *norm1, *norm2; /* [hidden] */
    struct pagoda_linear qkv, o, gate_up, down; /* gate_up, down unused when moe */
    float *k_pool, *v_pool; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const float *q_norm, *k_norm; /* [head_dim] or NULL */
    const float *post_attn_norm, *post_mlp_norm; /* [hidden] or NULL */
    int64_t window; /* sliding window in tokens, 0: the whole context */
    float softcap; /* attention scores -> softcap * tanh(score / softcap); 0: none */
    int64_t rope; /* which cos/sin table */
    int64_t act; /* 0 SiLU, 1 GELU-tanh, 2 clamped SwiGLU (act_alpha, act_limit) */
    int64_t group; /* its KV sub-group: which slots and table it reads */
    float act_alpha, act_limit;
    const float *sinks; /* [num_heads] attention sinks (gpt-oss), or NULL */
    const struct pagoda_moe *moe; /* NULL: the dense gate_up / down MLP */
};

typedef int (*qmm_fn)(int isa, int qtype, int act_bits, const float *x, int64_t x_stride, int64_t T,
                      int64_t K, const uint8_t *w, int64_t N, float *y, int64_t y_stride, uint8_t *scratch);
typedef int (*bf16mm_fn)(int isa, const float *x, int64_t x_stride, int64_t T, int64_t K,
                         const uint16_t *w, int64_t n_begin, int64_t n_end, float *y, int64_t y_stride);
typedef void (*rope_fn)(float *qkv, const float *cos, const float *sin, const int64_t *slots,
                        float *k_pool, float *v_pool, int64_t num_tokens, int64_t row_stride,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots);
typedef int (*attn_fn)(const float *q, const float *k_pool, const float *v_pool, float *out,
                       const int64_t *rows, const int64_t *tables, const int64_t *ctx_lens,
                       int64_t q_stride, int64_t seq_begin, int64_t seq_end, int64_t max_blocks,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t num_blocks, float scale, int64_t window, float softcap, const float *sinks);

struct pagoda_kernels {
    qmm_fn qmm;
    bf16mm_fn bf16mm;
    rope_fn rope;
    attn_fn attn;
    int64_t isa, act_bits;
    uint8_t *qscratch; /* for qmm: its scratch for [T, max K] activations */
};

struct pagoda_shape {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, num_blocks, max_blocks;
    float eps, scale;
    int64_t group_slots, group_tables; /* elements between sub-groups' slots, tables (0: one group) */
};

int64_t pagoda_decode_scratch_floats(int64_t T, int64_t hidden, int64_t qkv, int64_t q, int64_t intermediate)
{
    /* x, qkv rows, attention out, the o / down output, gate_up, silu(g) * u */
    return T * (hidden + qkv + q + hidden + 2 * intermediate + intermediate) + 64;
}

/* A mixture-of-experts layer's scratch, after pagoda_decode_scratch_floats' (intermediate: the
   largest of the experts' and the shared expert's) */
int64_t pagoda_moe_scratch_floats(int64_t T, int64_t hidden, int64_t num_experts, int64_t top_k,
                                  int64_t intermediate)
{
    /* router logits; each row's picks (expert ids, weights); the picks grouped by expert (rows,
       weights) with each expert's start; an expert's gathered rows, its gate_up, act(g, u), its
       output; the shared expert's gate */
    return T * num_experts + 4 * T * top_k + (num_experts + 1) + T * (2 * hidden + 3 * intermediate) + T + 64;
}

static void rms_norm(const float *h, const float *weight, float *x, int64_t T, int64_t n, float eps)
{
    for (int64_t t = 0; t < T; t++) {
        const float *row = h + t * n;
        float *out = x + t * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += row[i] * row[i];
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (row[i] * r);
    }
}

/* each of `heads` head_dim-wide pieces of every row (row stride `stride`) normalised in place */
static void head_norm(float *x, const float *weight, int64_t T, int64_t stride, int64_t heads, int64_t head_dim,
                      float eps)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t hh = 0; hh < heads; hh++) {
            float *row = x + t * stride + hh * head_dim;
            rms_norm(row, weight, row, 1, head_dim, eps);
        }
}

static void gated(const float *gu, float *act, int64_t T, int64_t inter, int64_t kind, float alpha,
                  float limit)
{
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float *a = act + t * inter;
        if (kind == 1) {
            for (int64_t i = 0; i < inter; i++) {
                const float v = g[i];
                a[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))) * u[i];
            }
        } else if (kind == 2) { /* gpt-oss: (clamp(u) + 1) * g * sigmoid(alpha * g), g = min(g, limit) */
            for (int64_t i = 0; i < inter; i++) {
                const float v = g[i] < limit ? g[i] : limit;
                const float w = u[i] < -limit ? -limit : (u[i] > limit ? limit : u[i]);
                a[i] = (w + 1.0f) * v * (1.0f / (1.0f + expf(-(v * alpha))));
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < inter; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
    }
}

/* one part's rows into y [T, y_stride] */
static int linear_part(const struct pagoda_kernels *k, const struct pagoda_linear *l, const float *x,
                       int64_t T, float *y, int64_t y_stride)
{
    int rc = 0;
    if (l->qtype == 30) {
        rc = k->bf16mm((int)k->isa, x, l->k, T, l->k, (const uint16_t *)l->w, 0, l->n, y, y_stride);
    } else if (l->qtype == 0) {
        const float *w = (const float *)l->w;
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < l->n; n++) {
                const float *row = w + n * l->k, *xt = x + t * l->k;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < l->k; i++) acc += row[i] * xt[i];
                y[t * y_stride + n] = acc;
            }
    } else {
        rc = k->qmm((int)k->isa, (int)l->qtype, (int)k->act_bits, x, l->k, T, l->k, (const uint8_t *)l->w,
                    l->n, y, y_stride, k->qscratch);
    }
    if (rc == 0 && l->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < l->n; n++) y[t * y_stride + n] += l->bias[n];
    return rc;
}

/* y [T, sum of the parts' n] = x times every part of the chain from l */
static int linear(const struct pagoda_kernels *k, const struct pagoda_linear *l, const float *x,
                  int64_t T, float *y)
{
    int64_t total = 0, at = 0;
    for (const struct pagoda_linear *p = l; p; p = p->next) total += p->n;
    for (const struct pagoda_linear *p = l; p; p = p->next) {
        const int rc = linear_part(k, p, x, T, y + at, total);
        if (rc != 0) return rc;
        at += p->n;
    }
    return 0;
}

/* A mixture-of-experts MLP's scratch (pagoda_moe_scratch_floats' layout) */
struct moe_scratch {
    float *logits, *pick_w, *group_w, *xe, *gu, *act, *ye, *gate;
    int32_t *pick_ids, *group_rows, *starts;
};

static struct moe_scratch moe_scratch(float *at, int64_t T, int64_t hidden, int64_t E, int64_t K, int64_t inter)
{
    struct moe_scratch m;
    m.logits = at; at += T * E;
    m.pick_w = at; at += T * K;
    m.pick_ids = (int32_t *)at; at += T * K;
    m.group_w = at; at += T * K;
    m.group_rows = (int32_t *)at; at += T * K;
    m.starts = (int32_t *)at; at += E + 1;
    m.xe = at; at += T * hidden;
    m.gu = at; at += T * 2 * inter;
    m.act = at; at += T * inter;
    m.ye = at; at += T * hidden;
    m.gate = at;
    return m;
}

/* each row's top k experts (ids [T, K], the largest logit first, the lower index first on
   ties) and their weights (w [T, K]) from the router's logits [T, E] */
static void route(const struct pagoda_moe *m, const float *logits, int64_t T, int32_t *ids, float *w)
{
    const int64_t E = m->num_experts, K = m->top_k;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        int32_t *id = ids + t * K;
        float *wt = w + t * K;
        int64_t n = 0; /* insertion into the descending list of the best so far */
        for (int64_t e = 0; e < E; e++) {
            if (n == K && !(l[e] > wt[K - 1])) continue;
            int64_t j = n < K ? n++ : K - 1;
            for (; j > 0 && l[e] > wt[j - 1]; j--) {
                wt[j] = wt[j - 1];
                id[j] = id[j - 1];
            }
            wt[j] = l[e];
            id[j] = (int32_t)e;
        }
        /* softmax over all E (its top k), or over the k picked logits alone */
        const float top = wt[0];
        float sum = 0.0f, picked = 0.0f;
        if (m->softmax_after_topk) {
            for (int64_t j = 0; j < K; j++) sum += expf(wt[j] - top);
        } else {
            for (int64_t e = 0; e < E; e++) sum += expf(l[e] - top);
        }
        for (int64_t j = 0; j < K; j++) {
            wt[j] = expf(wt[j] - top) / sum;
            picked += wt[j];
        }
        if (m->renormalize && !m->softmax_after_topk)
            for (int64_t j = 0; j < K; j++) wt[j] /= picked;
    }
}

/* the picks grouped by expert, each expert's in row order: expert e's rows and weights at
   [starts[e], starts[e + 1]) of rows, w */
static void group(const int32_t *ids, const float *pick_w, int64_t T, int64_t E, int64_t K, int32_t *starts,
                  int32_t *rows, float *w)
{
    for (int64_t e = 0; e <= E; e++) starts[e] = 0;
    for (int64_t i = 0; i < T * K; i++) starts[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
    for (int64_t i = 0; i < T * K; i++) { /* starts[e] moves to expert e's end ... */
        const int32_t at = starts[ids[i]]++;
        rows[at] = (int32_t)(i / K);
        w[at] = pick_w[i];
    }
    for (int64_t e = E; e > 0; e--) starts[e] = starts[e - 1]; /* ... and back */
    starts[0] = 0;
}

/* out[rows[j]] += w[j] * expert(x[rows[j]]) for the n rows routed to one expert, gathered into one
   block so that its weights are read once (rows NULL: the first n rows in place, the shared expert) */
static int run_expert(const struct pagoda_kernels *k, const struct pagoda_expert *ex, int64_t inter,
                      int64_t kind, float alpha, float limit, const float *x, int64_t hidden,
                      const int32_t *rows, const float *w, int64_t n, struct moe_scratch *m, float *out)
{
    int rc;
    const float *xe = x;
    if (rows) {
        for (int64_t j = 0; j < n; j++) memcpy(m->xe + j * hidden, x + rows[j] * hidden, sizeof(float) * hidden);
        xe = m->xe;
    }
    if ((rc = linear(k, &ex->gate_up, xe, n, m->gu)) != 0) return rc;
    gated(m->gu, m->act, n, inter, kind, alpha, limit);
    if ((rc = linear(k, &ex->down, m->act, n, m->ye)) != 0) return rc;
    for (int64_t j = 0; j < n; j++) {
        float *o = out + (rows ? rows[j] : j) * hidden;
        const float *y = m->ye + j * hidden, wj = w[j];
        for (int64_t i = 0; i < hidden; i++) o[i] += wj * y[i];
    }
    return 0;
}

/* out [T, hidden] = the mixture of experts of x [T, hidden] */
static int moe_ffn(const struct pagoda_kernels *k, const struct pagoda_moe *mo, const float *x, int64_t T,
                   int64_t hidden, float *out, float *scratch)
{
    const int64_t E = mo->num_experts, K = mo->top_k;
    const int64_t inter = mo->intermediate > mo->shared_intermediate ? mo->intermediate : mo->shared_intermediate;
    struct moe_scratch m = moe_scratch(scratch, T, hidden, E, K, inter);
    int rc;
    if ((rc = linear(k, &mo->router, x, T, m.logits)) != 0) return rc;
    route(mo, m.logits, T, m.pick_ids, m.pick_w);
    group(m.pick_ids, m.pick_w, T, E, K, m.starts, m.group_rows, m.group_w);
    memset(out, 0, sizeof(float) * (size_t)(T * hidden));
    for (int64_t e = 0; e < E; e++) {
        const int64_t begin = m.starts[e], n = m.starts[e + 1] - begin;
        if (n && (rc = run_expert(k, mo->experts + e, mo->intermediate, mo->act, mo->alpha, mo->limit, x, hidden,
                                  m.group_rows + begin, m.group_w + begin, n, &m, out)) != 0)
            return rc;
    }
    if (!mo->shared) return 0;
    /* the shared expert: every row, scaled by sigmoid(shared_gate(x)) */
    if ((rc = linear(k, &mo->shared_gate, x, T, m.gate)) != 0) return rc;
    for (int64_t t = 0; t < T; t++) m.gate[t] = 1.0f / (1.0f + expf(-m.gate[t]));
    return run_expert(k, mo->shared, mo->shared_intermediate, mo->shared_act, mo->alpha, mo->limit, x, hidden,
                      NULL, m.gate, T, &m, out);
}

/* the MLP of one layer: out [T, hidden] from x [T, hidden] (dense: gu, act scratch; MoE: moe) */
static int ffn(const struct pagoda_kernels *k, const struct pagoda_layer *L, const float *x, int64_t T,
               int64_t hidden, int64_t inter, float *gu, float *act, float *out, float *moe)
{
    if (L->moe) return moe_ffn(k, L->moe, x, T, hidden, out, moe);
    int rc;
    if ((rc = linear(k, &L->gate_up, x, T, gu)) != 0) return rc;
    gated(gu, act, T, inter, L->act, L->act_alpha, L->act_limit);
    return linear(k, &L->down, act, T, out);
}

int pagoda_decode_layers(const struct pagoda_kernels *k, const struct pagoda_shape *s,
                         const struct pagoda_layer *layers, int64_t num_layers, float *h, int64_t T,
                         const float *cos, const float *sin, const int64_t *slots, const int64_t *rows,
                         const int64_t *tables, const int64_t *ctx_lens, float *scratch)
{
    const int64_t hidden = s->hidden, inter = s->intermediate;
    const int64_t q_size = s->num_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * s->num_kv_heads * s->head_dim;
    float *x = scratch, *qkv = x + T * hidden, *att = qkv + T * qkv_size, *out = att + T * q_size;
    float *gu = out + T * hidden, *act = gu + T * 2 * inter, *moe = act + T * inter;
    for (int64_t li = 0; li < num_layers; li++) {
        const struct pagoda_layer *L = layers + li;
        int rc;
        rms_norm(h, L->norm1, x, T, hidden, s->eps);
        if ((rc = linear(k, &L->qkv, x, T, qkv)) != 0) return rc;
        if (L->q_norm) head_norm(qkv, L->q_norm, T, qkv_size, s->num_heads, s->head_dim, s->eps);
        if (L->k_norm) head_norm(qkv + q_size, L->k_norm, T, qkv_size, s->num_kv_heads, s->head_dim, s->eps);
        const float *lcos = cos + L->rope * T * s->head_dim, *lsin = sin + L->rope * T * s->head_dim;
        const int64_t *lslots = slots + L->group * s->group_slots, *ltables = tables + L->group * s->group_tables;
        k->rope(qkv, lcos, lsin, lslots, L->k_pool, L->v_pool, T, qkv_size, s->num_heads, s->num_kv_heads,
                s->head_dim, s->num_blocks * s->block_size);
        if ((rc = k->attn(qkv, L->k_pool, L->v_pool, att, rows, ltables, ctx_lens, qkv_size, 0, T,
                          s->max_blocks, s->num_heads, s->num_kv_heads, s->head_dim, s->block_size,
                          s->num_blocks, s->scale, L->window, L->softcap, L->sinks)) != 0)
            return rc;
        if ((rc = linear(k, &L->o, att, T, out)) != 0) return rc;
        if (L->post_attn_norm) rms_norm(out, L->post_attn_norm, out, T, hidden, s->eps);
        for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];
        rms_norm(h, L->norm2, x, T, hidden, s->eps);
        if ((rc = ffn(k, L, x, T, hidden, inter, gu, act, out, moe)) != 0) return rc;
        if (L->post_mlp_norm) rms_norm(out, L->post_mlp_norm, out, T, hidden, s->eps);
        for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];
    }
    return 0;
}
