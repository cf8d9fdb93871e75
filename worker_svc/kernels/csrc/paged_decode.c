/* Paged attention on the CPU, float32 (K/V pools float32 or bfloat16: the _bf16kv entry points): the decode attention of single-token rows
 * (pagoda_paged_decode_f32) and, before it in every layer, the rotary embedding of the new
 * tokens' q and k with the write of their K/V into the pools (pagoda_rope_write_f32).
 *
 * Decode attention reads each sequence's K and V straight from the paged pools through its
 * block table: no gathered copy of the context is made (the torch path gathers it with
 * index_select every layer, which costs more than the attention itself). Per sequence, in
 * three passes over its context: every query head's score against each key (K read once, in
 * order), the softmax, the weighted sum of values (V read once, in order).
 *
 * Layouts (row-major):
 *   q            [num_rows, q_stride]: row r's heads at q + r * q_stride, [num_heads, head_dim]
 *   out          [num_rows, num_heads, head_dim], contiguous (rows[i]: sequence i's row)
 *   k_pool/v_pool [num_blocks, block_size, num_kv_heads, head_dim]
 *   tables       [num_seqs, max_blocks] block ids     ctx_lens [num_seqs] tokens in KV
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA). With window > 0 the
 * sequence attends to its last `window` tokens only (keys at positions > ctx - 1 - window).
 * With softcap > 0 each score s becomes softcap * tanh(s / softcap) before the softmax
 * (Gemma 2's attention logit soft-capping). With sinks (gpt-oss; NULL: none) head h's softmax
 * has one more logit, sinks[h], in its denominator only: the weights of the keys sum to less
 * than 1 (transformers' gpt_oss eager attention: softmax over [scores, sink], the sink's
 * column dropped).
 * Sequences [seq_begin, seq_end) are computed, so callers can split a batch over threads.
 * Returns 0, or -1 when the scratch space cannot be allocated.
 *
 * Built by worker_svc/cpu_kernels.py with the system C compiler (without FMA contraction,
 * so that the rotation rounds as torch does); no Python or torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* K/V element i of a pool: float32, or bfloat16 (widened exactly) when bf16 */
static inline __attribute__((always_inline)) float kv_at(const void *pool, int64_t i, const int bf16)
{
    if (bf16) {
        const uint32_t u = (uint32_t)((const uint16_t *)pool)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)pool)[i];
}

/* float32 -> bfloat16, round to nearest even (NaN kept a NaN), as torch's .to(bfloat16) */
static inline __attribute__((always_inline)) uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)((u >> 16) | ((u & 0xFFFFu) ? 0x40u : 0u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __attribute__((always_inline)) int paged_decode(
    const float *q, const void *k_pool, const void *v_pool, float *out,
    const int64_t *rows, const int64_t *tables, const int64_t *ctx_lens,
    int64_t q_stride, int64_t seq_begin, int64_t seq_end, int64_t max_blocks,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, float scale, int64_t window, float softcap, const float *sinks, const int bf16)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t kv_row = num_kv_heads * head_dim; /* floats between consecutive tokens */
    const int64_t q_row_len = num_heads * head_dim;
    int64_t longest = 0;
    for (int64_t i = seq_begin; i < seq_end; i++)
        if (ctx_lens[i] > longest) longest = ctx_lens[i];
    /* scores[h * longest + t]; acc[h * head_dim + d] */
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * (longest > 0 ? longest : 1)));
    float *acc = malloc(sizeof(float) * (size_t)q_row_len);
    float *maxes = malloc(sizeof(float) * (size_t)num_heads);
    if (!scores || !acc || !maxes) {
        free(scores); free(acc); free(maxes);
        return -1;
    }
    for (int64_t i = seq_begin; i < seq_end; i++) {
        const int64_t ctx = ctx_lens[i];
        const int64_t first = (window > 0 && ctx > window) ? ctx - window : 0;
        const int64_t n = ctx - first;
        const int64_t *table = tables + i * max_blocks;
        const float *q_row = q + rows[i] * q_stride;
        for (int64_t h = 0; h < num_heads; h++) maxes[h] = -INFINITY;
        /* pass 1: every head's score against each key; a token's keys (all KV heads) are
           contiguous, so K is read once, in order, block by block */
        for (int64_t b = first / block_size, t = first; t < ctx; b++) {
            int64_t block = table[b];
            if (block < 0 || block >= num_blocks) block = 0; /* validated upstream */
            const int64_t end = (b + 1) * block_size < ctx ? (b + 1) * block_size : ctx;
            int64_t k = (block * block_size + t - b * block_size) * kv_row;
            for (; t < end; t++, k += kv_row) {
                for (int64_t h = 0; h < num_heads; h++) {
                    const float *qh = q_row + h * head_dim;
                    const int64_t kh = k + (h / group) * head_dim;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < head_dim; d++) s += qh[d] * kv_at(k_pool, kh + d, bf16);
                    s *= scale;
                    if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
                    scores[h * longest + (t - first)] = s;
                    if (s > maxes[h]) maxes[h] = s;
                }
            }
        }
        /* pass 2: softmax over each head's scores (and its sink) */
        for (int64_t h = 0; h < num_heads; h++) {
            float *sh = scores + h * longest;
            const float m = (sinks && sinks[h] > maxes[h]) ? sinks[h] : maxes[h];
            float sum = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                const float e = expf(sh[t] - m);
                sh[t] = e;
                sum += e;
            }
            if (sinks) sum += expf(sinks[h] - m);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma omp simd
            for (int64_t t = 0; t < n; t++) sh[t] *= inv;
        }
        /* pass 3: the weighted sum of values, V read once, in order */
        memset(acc, 0, sizeof(float) * (size_t)q_row_len);
        for (int64_t b = first / block_size, t = first; t < ctx; b++) {
            int64_t block = table[b];
            if (block < 0 || block >= num_blocks) block = 0;
            const int64_t end = (b + 1) * block_size < ctx ? (b + 1) * block_size : ctx;
            int64_t v = (block * block_size + t - b * block_size) * kv_row;
            for (; t < end; t++, v += kv_row) {
                for (int64_t h = 0; h < num_heads; h++) {
                    const float p = scores[h * longest + (t - first)];
                    const int64_t vh = v + (h / group) * head_dim;
                    float *a = acc + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * kv_at(v_pool, vh + d, bf16);
                }
            }
        }
        memcpy(out + rows[i] * q_row_len, acc, sizeof(float) * (size_t)q_row_len);
    }
    free(scores); free(acc); free(maxes);
    return 0;
}

int pagoda_paged_decode_f32(
    const float *q, const float *k_pool, const float *v_pool, float *out,
    const int64_t *rows, const int64_t *tables, const int64_t *ctx_lens,
    int64_t q_stride, int64_t seq_begin, int64_t seq_end, int64_t max_blocks,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, float scale, int64_t window, float softcap, const float *sinks)
{
    return paged_decode(q, k_pool, v_pool, out, rows, tables, ctx_lens, q_stride, seq_begin, seq_end, max_blocks,
                        num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, window, softcap, sinks, 0);
}

/* The same over bfloat16 pools (each K/V element widened to float32 as it is read) */
int pagoda_paged_decode_bf16kv(
    const float *q, const uint16_t *k_pool, const uint16_t *v_pool, float *out,
    const int64_t *rows, const int64_t *tables, const int64_t *ctx_lens,
    int64_t q_stride, int64_t seq_begin, int64_t seq_end, int64_t max_blocks,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, float scale, int64_t window, float softcap, const float *sinks)
{
    return paged_decode(q, k_pool, v_pool, out, rows, tables, ctx_lens, q_stride, seq_begin, seq_end, max_blocks,
                        num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, window, softcap, sinks, 1);
}

/* The rotary embedding of a step's new tokens and the write of their K/V into the pools.
 *   qkv      [num_tokens, row_stride]: per token its q heads, k heads and v heads side by
 *            side ([num_heads + 2 * num_kv_heads, head_dim]); q and k are rotated in place
 *   cos/sin  [num_tokens, head_dim]: each token's rotation (x * cos + rotate_half(x) * sin,
 *            every product and sum rounded as torch rounds them)
 *   slots    [num_tokens]: the pool row of each token's K/V (block * block_size + offset);
 *            rows outside [0, num_slots) are skipped (validated upstream)
 */
static inline __attribute__((always_inline)) void rope_write(
    float *qkv, const float *cos, const float *sin, const int64_t *slots,
    void *k_pool, void *v_pool, int64_t num_tokens, int64_t row_stride,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, const int bf16)
{
    const int64_t half = head_dim / 2, kv_row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            float *x = row + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                const float lo = a * c[i] + (-b) * s[i];
                const float hi = b * c[i + half] + a * s[i + half];
                x[i] = lo;
                x[i + half] = hi;
            }
        }
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) continue;
        const float *k = row + num_heads * head_dim, *v = row + (num_heads + num_kv_heads) * head_dim;
        if (bf16) {
            uint16_t *kd = (uint16_t *)k_pool + slot * kv_row, *vd = (uint16_t *)v_pool + slot * kv_row;
            for (int64_t i = 0; i < kv_row; i++) {
                kd[i] = to_bf16(k[i]);
                vd[i] = to_bf16(v[i]);
            }
        } else {
            memcpy((float *)k_pool + slot * kv_row, k, sizeof(float) * (size_t)kv_row);
            memcpy((float *)v_pool + slot * kv_row, v, sizeof(float) * (size_t)kv_row);
        }
    }
}

void pagoda_rope_write_f32(
    float *qkv, const float *cos, const float *sin, const int64_t *slots,
    float *k_pool, float *v_pool, int64_t num_tokens, int64_t row_stride,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots)
{
    rope_write(qkv, cos, sin, slots, k_pool, v_pool, num_tokens, row_stride, num_heads, num_kv_heads, head_dim,
               num_slots, 0);
}

/* The same writing bfloat16 pools (K/V rounded to nearest even) */
void pagoda_rope_write_bf16kv(
    float *qkv, const float *cos, const float *sin, const int64_t *slots,
    uint16_t *k_pool, uint16_t *v_pool, int64_t num_tokens, int64_t row_stride,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots)
{
    rope_write(qkv, cos, sin, slots, k_pool, v_pool, num_tokens, row_stride, num_heads, num_kv_heads, head_dim,
               num_slots, 1);
}

/* Row-wise argmax of x [rows, cols] (row r at x + r * stride), as torch.argmax gives it: the
 * first index of the largest value, or of the first NaN when a row has one (NaN counts as
 * largest). A vectorised pass finds the maximum (and whether a NaN is there), then 32-wide chunks
 * are compared to it until the first that holds it. */
/* Structured output: x[r][i] = -inf wherever bit i % 32 of mask[r * words + i / 32] is 0
   (a grammar's token bitmask, llguidance's layout). */
void pagoda_mask_f32(float *x, int64_t rows, int64_t cols, int64_t stride, const int32_t *mask,
                     int64_t words)
{
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * stride;
        const uint32_t *m = (const uint32_t *)(mask + r * words);
        for (int64_t w = 0; w < words; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t end = (w + 1) * 32 < cols ? (w + 1) * 32 : cols;
            for (int64_t i = w * 32; i < end; i++)
                if (!((bits >> (i - w * 32)) & 1u)) row[i] = -INFINITY;
        }
    }
}

void pagoda_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < cols; i++) {
            const float v = row[i];
            m = v > m ? v : m;
            nan |= v != v;
        }
        int64_t found = 0;
        if (nan) {
            while (row[found] == row[found]) found++;
        } else {  /* 32-wide chunks compared at once, then the chunk that holds it */
            int64_t b = 0;
            for (; b + 32 <= cols; b += 32) {
                int hit = 0;
#pragma omp simd reduction(| : hit)
                for (int64_t i = b; i < b + 32; i++) hit |= row[i] == m;
                if (hit) break;
            }
            found = b;
            while (found < cols - 1 && row[found] != m) found++;
        }
        out[r] = found;
    }
}
