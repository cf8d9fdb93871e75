/* Matrix products y = x w^T on the CPU with GGUF block-quantized weights (Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, MXFP4; the K-quants Q2_K ... Q6_K in kquant_matmul.inc, included below) or
 * bfloat16 weights, float32 activations and outputs.
 *
 * Layouts (row-major, rows contiguous):
 *   x   float32 [T, x_stride]: token t's K inputs at x + t * x_stride
 *   w   quantized: N rows of K / 32 blocks each, row n at w + n * row_bytes, row_bytes =
 *       K / 32 * block bytes; blocks as GGUF stores them:
 *         Q8_0 (34 bytes): fp16 d, int8 q[32]           w[j] = d * q[j]
 *         Q4_0 (18 bytes): fp16 d, uint8 qs[16]         w[j] = d * ((qs[j] & 15) - 8),
 *                                                       w[j + 16] = d * ((qs[j] >> 4) - 8)
 *         Q4_1 (20 bytes): fp16 d, fp16 m, uint8 qs[16] w[j] = d * (qs[j] & 15) + m, ...
 *         Q5_0 (22 bytes): fp16 d, qh[4], qs[16]        Q4_0's with bit j of qh as bit 4, q - 16
 *         Q5_1 (24 bytes): fp16 d, fp16 m, qh[4], qs[16] Q4_1's with the fifth bit
 *         MXFP4 (17 bytes): E8M0 e, uint8 qs[16]        w[j] = d * KV[qs[j] & 15],
 *                                                       w[j + 16] = d * KV[qs[j] >> 4],
 *           KV = ggml's kvalues_mxfp4 (E2M1 doubled: 0 1 2 3 4 6 8 12, then negated),
 *           d = 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF)
 *       bfloat16: uint16 [N, K]
 *   y   float32 [T, y_stride]: y[t, n] at y + t * y_stride + n
 * Rows [n_begin, n_end) are computed per call, so callers can split N over threads.
 *
 * Quantized weights: the activations are quantized per 32-block to integers, then every
 * block adds d_w * d_x * dot(q_w, q_x), the dot in integers. Two activation precisions
 * (act_bits):
 *   8   as llama.cpp computes: int8, d_x = amax / 127, q_x = round(x / d_x) (bit-exact with
 *       gguf-py's Q8_0). vpdpbusd and vpmaddubsw multiply unsigned by signed bytes: Q4
 *       nibbles (Q5: with the fifth bit) go in unsigned as stored (their -8 / -16 becomes
 *       -8 / -16 * sum(q_x) of the block, Q4_1's and Q5_1's min m_w * d_x * sum(q_x)); MXFP4's
 *       nibbles are looked up (pshufb) as KV + 12, unsigned 0..24, and -12 * sum(q_x) added;
 *       Q8_0 weights are offset to unsigned for AVX-512 (w + 128,
 *       then -128 * sum(q_x)) and take the abs/sign trick for AVX2, whose 16-bit pair sums
 *       would saturate otherwise.
 *   16  int16, d_x = amax / 32767, q_x = round(x / d_x): 258x finer, so close decisions of a
 *       model follow its float32 products. The weights are widened to int16 (Q4 nibbles
 *       zero-extended, Q8_0 sign-extended) and multiplied by vpdpwssd (AVX-512 VNNI) or
 *       vpmaddwd (AVX2), int16 pairs summed into int32: exact (the bounds are at
 *       pack512_16 and w_words_256); Q4_0's -8 and Q4_1's min as for int8.
 *   pagoda_quant_prepare   quantizes x (a range of tokens) into a scratch buffer, in the
 *                          layout of the ISA path and act_bits (pagoda_quant_scratch_bytes);
 *   pagoda_quant_matmul    multiplies a range of rows with it (threads share one prepare);
 *   pagoda_quant_matmul_f32  both, for all rows: the one-call path of a single thread;
 *   pagoda_q8_quantize, pagoda_q16_quantize  the plain int8 / int16 quantization (q, d,
 *                          sum q, d * sum q).
 *
 * Register tiles of up to 4 rows x 4 tokens (AVX-512; 2 x 4 for AVX2) use each unpacked
 * weight group for every token of the tile, and a group of rows runs through a chunk of
 * tokens whose activations stay in L2, so a prefill of T tokens reads the weights
 * ceil(T / chunk) times, not T times. Below ROW_TILES_MIN_T tokens rows are taken one at a
 * time (with a software prefetch ahead), so the weights stream from memory in order: reading
 * 4 rows side by side ran at a third of the bandwidth for T = 1 (the bfloat16 AVX2 path keeps
 * its 4-row tiles).
 *
 * bfloat16 weights: widened to float32 (a shift) and multiplied with float32 x by FMA,
 * accumulating in float32 (pagoda_bf16_matmul); or, with AVX-512 BF16, vdpbf16ps on x
 * rounded to bfloat16 (pagoda_f32_to_bf16, then pagoda_bf16_matmul_dp): twice the
 * multiply-adds per instruction, at x's bfloat16 rounding (~2e-3 relative).
 *
 * isa: 0 portable C, 1 AVX2 (+FMA, F16C), 2 AVX-512 (F, BW, DQ, VL, VNNI), 3 AVX-512 BF16
 * (the _dp product only). Every path is compiled into the library (target attributes) and
 * chosen per call, so the narrower ones run on a wider CPU too; pagoda_isa_supported says
 * which this CPU runs. Entry points return 0, -1 for an unknown qtype, -2 for an ISA this
 * CPU (or build) lacks, -3 for act_bits other than 8 and 16, -4 for K not whole blocks (32
 * values; 256 for the K-quants).
 *
 * Built by worker_svc/cpu_kernels.py with the system C compiler; no Python or torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define PAGODA_X86 1
#include <immintrin.h>
#else
#define PAGODA_X86 0
#endif

#define QK 32
enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_MXFP4 = 39 };
enum { QT_Q2_K = 10, QT_Q3_K = 11, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14 }; /* kquant_matmul.inc */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };

#define ROW_TILES_MIN_T 12 /* tokens from which rows go 4 (AVX2: 2) side by side; see the top */

#define INL static inline __attribute__((always_inline))
/* the tiles' loops over rows and tokens are unrolled so that their accumulators stay in registers */
#define UNROLL _Pragma("GCC unroll 16")

/* quantized activations and the product's operands */
struct qmm {
    int64_t T, K, nb, row_bytes, y_stride;
    const int8_t *qx;     /* [T, K] */
    const float *dx;      /* [T, nb] */
    const int32_t *isum;  /* [T, nb] */
    const float *sx;      /* [T, nb] */
    const uint8_t *w;
    float *y;
    const int16_t *qx16;  /* [T, K]: the int16 activations (act_bits 16; qx unused then) */
};

static inline int block_bytes(int qtype)
{
    return qtype == QT_Q8_0 ? 34 : qtype == QT_Q4_1 ? 20 : qtype == QT_Q5_0 ? 22 : qtype == QT_Q5_1 ? 24
         : qtype == QT_MXFP4 ? 17 : 18;
}

/* the types with a min (w = d q + m) and those whose q is offset (Q4_0 q - 8, Q5_0 q - 16,
   MXFP4 KV + 12 - 12: its lookup table MX_U below) */
static inline int has_min(int qtype) { return qtype == QT_Q4_1 || qtype == QT_Q5_1; }
static inline int q_offset(int qtype) { return qtype == QT_Q4_0 ? 8 : qtype == QT_Q5_0 ? 16 : qtype == QT_MXFP4 ? 12 : 0; }
static inline int is_q5(int qtype) { return qtype == QT_Q5_0 || qtype == QT_Q5_1; }
static inline int is_mx(int qtype) { return qtype == QT_MXFP4; }
/* where a 32-block's nibbles (qs) start, and Q5's high bits (qh, a little-endian uint32) */
static inline int qs_offset(int qtype)
{
    return qtype == QT_Q4_1 ? 4 : qtype == QT_Q5_0 ? 6 : qtype == QT_Q5_1 ? 8 : qtype == QT_MXFP4 ? 1 : 2;
}
static inline int qh_offset(int qtype) { return qtype == QT_Q5_1 ? 4 : 2; }

static inline uint16_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline float f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        const float sub = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, exact */
        return sign ? -sub : sub;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* MXFP4: ggml's kvalues_mxfp4 (E2M1 values doubled) indexed by a nibble, and the same plus 12
   (unsigned, for vpdpbusd / vpmaddubsw: the 12 comes back as -12 * sum(q_x)) */
static const int8_t MX_KV[16] __attribute__((aligned(16))) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const uint8_t MX_U[16] __attribute__((aligned(16))) = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) exactly (e 0 and 1: float32 subnormals) */
static inline float e8m0_half(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* a 32-block's scale d: the fp16 at its start, MXFP4's E8M0 byte */
static inline float block_d(int qtype, const uint8_t *blk) { return qtype == QT_MXFP4 ? e8m0_half(blk[0]) : f16_to_f32(ld16(blk)); }

static inline float bf16_to_f32(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Token chunk: the tokens whose activations (bytes_per_token each) a row group runs through
   before the next row group, sized to stay in L2; a multiple of 4. */
static inline int64_t token_chunk(int64_t bytes_per_token)
{
    int64_t chunk = ((int64_t)256 * 1024 / (bytes_per_token > 0 ? bytes_per_token : 1)) & ~(int64_t)3;
    return chunk < 4 ? 4 : chunk;
}

/* ---- activation quantization -------------------------------------------------------- */

/* numpy's np_roundf of gguf-py: round half away from zero, as floor(a) + floor(2 * frac) */
static inline float round_away(float v)
{
    const float a = fabsf(v), f = floorf(a), r = f + floorf(2.0f * (a - f));
    return v < 0 ? -r : r;
}

static void quantize_scalar(const float *v, int8_t *q, float *d_out, int32_t *isum, float *sx)
{
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = fabsf(v[j]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < QK; j++) {
        const int qj = (int)round_away(v[j] * id);
        q[j] = (int8_t)qj;
        s += qj;
    }
    *d_out = d;
    *isum = s;
    *sx = d * (float)s;
}

/* The int16 activations (act_bits 16): d = amax / 32767, q = round(x / d) (half away from
   zero, like the int8 path), so |q| <= 32767 (the clamp only guards against inputs that
   are not finite). x / d, not x * (1 / d): 1 / d overflows for amax below ~4e-34 (d
   subnormal); d == 0 (amax 0, or below ~2e-41) gives q = 0. Every ISA computes the same q
   bit for bit (IEEE float32 division and rounding). */
static void quantize16_scalar(const float *v, int16_t *q, float *d_out, int32_t *isum, float *sx)
{
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = fabsf(v[j]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 32767.0f;
    int32_t s = 0;
    for (int j = 0; j < QK; j++) {
        const float r = d != 0.0f ? round_away(v[j] / d) : 0.0f;
        const int qj = r >= 32767.0f ? 32767 : r > -32767.0f ? (int)r : -32767;
        q[j] = (int16_t)qj;
        s += qj;
    }
    *d_out = d;
    *isum = s;
    *sx = d * (float)s;
}

#if PAGODA_X86
#define TGT2 __attribute__((target("avx2,fma,f16c")))
#define TGT512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define TGTBF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")))
#define TGT512F __attribute__((target("avx512f,avx2,fma,f16c"))) /* helpers inlined into both of the above */

INL TGT2 __m256 round_away8(__m256 v)
{
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(signbit, v);
    const __m256 f = _mm256_floor_ps(a);
    const __m256 r = _mm256_add_ps(f, _mm256_floor_ps(_mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_sub_ps(a, f))));
    return _mm256_or_ps(r, _mm256_and_ps(v, signbit));
}

static TGT2 void quantize_avx2(const float *v, int8_t *q, float *d_out, int32_t *isum, float *sx)
{
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    __m256 x[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, x[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4];
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        qi[i] = _mm256_cvtps_epi32(round_away8(_mm256_mul_ps(x[i], _mm256_set1_ps(id))));
        s = _mm256_add_epi32(s, qi[i]);
    }
    /* packs interleave 128-bit lanes; the permute restores element order */
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t total = _mm_cvtsi128_si32(s4);
    *d_out = d;
    *isum = total;
    *sx = d * (float)total;
}

INL TGT512 __m512 round_away16(__m512 v)
{
    const __m512 a = _mm512_abs_ps(v);
    const __m512 f = _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_add_ps(
        f, _mm512_roundscale_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), _mm512_sub_ps(a, f)),
                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(r), _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))));
}

static TGT512 void quantize_avx512(const float *v, int8_t *q, float *d_out, int32_t *isum, float *sx)
{
    const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(round_away16(_mm512_mul_ps(x0, idv)));
    const __m512i q1 = _mm512_cvtps_epi32(round_away16(_mm512_mul_ps(x1, idv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    *d_out = d;
    *isum = total;
    *sx = d * (float)total;
}

static TGT2 void quantize16_avx2(const float *v, int16_t *q, float *d_out, int32_t *isum, float *sx)
{
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    __m256 x[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, x[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 32767.0f;
    if (d == 0.0f) {
        memset(q, 0, QK * sizeof *q);
        *d_out = d;
        *isum = 0;
        *sx = 0.0f;
        return;
    }
    const __m256i lim = _mm256_set1_epi32(32767), nlim = _mm256_set1_epi32(-32767);
    __m256i qi[4];
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        qi[i] = _mm256_cvtps_epi32(round_away8(_mm256_div_ps(x[i], _mm256_set1_ps(d))));
        qi[i] = _mm256_max_epi32(_mm256_min_epi32(qi[i], lim), nlim);
        s = _mm256_add_epi32(s, qi[i]);
    }
    /* packs interleave 128-bit lanes; the permute restores element order */
    _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t total = _mm_cvtsi128_si32(s4);
    *d_out = d;
    *isum = total;
    *sx = d * (float)total;
}

static TGT512 void quantize16_avx512(const float *v, int16_t *q, float *d_out, int32_t *isum, float *sx)
{
    const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 32767.0f;
    if (d == 0.0f) {
        memset(q, 0, QK * sizeof *q);
        *d_out = d;
        *isum = 0;
        *sx = 0.0f;
        return;
    }
    const __m512 dv = _mm512_set1_ps(d);
    const __m512i lim = _mm512_set1_epi32(32767), nlim = _mm512_set1_epi32(-32767);
    const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(round_away16(_mm512_div_ps(x0, dv))), lim), nlim);
    const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(round_away16(_mm512_div_ps(x1, dv))), lim), nlim);
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtepi32_epi16(q1));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    *d_out = d;
    *isum = total;
    *sx = d * (float)total;
}
#endif

int pagoda_isa_supported(int isa)
{
    if (isa == ISA_SCALAR) return 1;
#if PAGODA_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                       && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    if (isa == ISA_AVX2) return avx2;
    if (isa == ISA_AVX512) return avx512 && __builtin_cpu_supports("avx512vnni");
    if (isa == ISA_AVX512_BF16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
    return 0;
}

/* Quantizes tokens [t_begin, t_end) of x ([T, x_stride] float32, K % 32 == 0) per 32-block:
   qx [T, K] int8, dx [T, K / 32] scales, isum [T, K / 32] sums of q, sx = dx * isum. */
int pagoda_q8_quantize(int isa, const float *x, int64_t x_stride, int64_t K, int64_t t_begin, int64_t t_end,
                       int8_t *qx, float *dx, int32_t *isum, float *sx)
{
    if (!pagoda_isa_supported(isa)) return -2;
    const int64_t nb = K / QK;
    for (int64_t t = t_begin; t < t_end; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + t * x_stride + b * QK;
            int8_t *q = qx + t * K + b * QK;
            const int64_t i = t * nb + b;
#if PAGODA_X86
            if (isa == ISA_AVX512 || isa == ISA_AVX512_BF16) { quantize_avx512(v, q, dx + i, isum + i, sx + i); continue; }
            if (isa == ISA_AVX2) { quantize_avx2(v, q, dx + i, isum + i, sx + i); continue; }
#endif
            quantize_scalar(v, q, dx + i, isum + i, sx + i);
        }
    }
    return 0;
}

/* The same per 32-block into int16: qx [T, K] int16, dx (amax / 32767), isum, sx = dx * isum. */
int pagoda_q16_quantize(int isa, const float *x, int64_t x_stride, int64_t K, int64_t t_begin, int64_t t_end,
                        int16_t *qx, float *dx, int32_t *isum, float *sx)
{
    if (!pagoda_isa_supported(isa)) return -2;
    const int64_t nb = K / QK;
    for (int64_t t = t_begin; t < t_end; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + t * x_stride + b * QK;
            int16_t *q = qx + t * K + b * QK;
            const int64_t i = t * nb + b;
#if PAGODA_X86
            if (isa == ISA_AVX512 || isa == ISA_AVX512_BF16) { quantize16_avx512(v, q, dx + i, isum + i, sx + i); continue; }
            if (isa == ISA_AVX2) { quantize16_avx2(v, q, dx + i, isum + i, sx + i); continue; }
#endif
            quantize16_scalar(v, q, dx + i, isum + i, sx + i);
        }
    }
    return 0;
}

/* ---- quantized weights: portable C -------------------------------------------------- */

/* One block's contribution to y[t, n]: Q4 nibbles (Q5: plus a fifth bit from qh) unsigned,
   their offset (-8, -16) as offset * isum, the min as m * sx */
static inline float block_dot_scalar(int qtype, const uint8_t *blk, const int8_t *xq, float dx, int32_t isum,
                                     float sx)
{
    const float d = block_d(qtype, blk);
    int32_t dot = 0;
    if (qtype == QT_Q8_0) {
        const int8_t *wq = (const int8_t *)(blk + 2);
        for (int j = 0; j < QK; j++) dot += (int32_t)wq[j] * xq[j];
        return d * dx * (float)dot;
    }
    const uint8_t *qs = blk + qs_offset(qtype);
    if (is_mx(qtype)) {
        for (int j = 0; j < QK / 2; j++) dot += (int32_t)MX_KV[qs[j] & 15] * xq[j] + (int32_t)MX_KV[qs[j] >> 4] * xq[j + 16];
        return d * dx * (float)dot;
    }
    const uint32_t qh = is_q5(qtype) ? ld32(blk + qh_offset(qtype)) : 0;
    for (int j = 0; j < QK / 2; j++)
        dot += (int32_t)((qs[j] & 15) | ((qh >> j & 1) << 4)) * xq[j]
               + (int32_t)((qs[j] >> 4) | ((qh >> (j + 16) & 1) << 4)) * xq[j + 16];
    if (!has_min(qtype)) return d * dx * (float)(dot - q_offset(qtype) * isum);
    return d * dx * (float)dot + f16_to_f32(ld16(blk + 2)) * sx;
}

/* the same with int16 activations: |dot| <= 32 * 32767 * 128 < 2^27, exact in int32 */
static inline float block_dot16_scalar(int qtype, const uint8_t *blk, const int16_t *xq, float dx, int32_t isum,
                                       float sx)
{
    const float d = block_d(qtype, blk);
    int32_t dot = 0;
    if (qtype == QT_Q8_0) {
        const int8_t *wq = (const int8_t *)(blk + 2);
        for (int j = 0; j < QK; j++) dot += (int32_t)wq[j] * xq[j];
        return d * dx * (float)dot;
    }
    const uint8_t *qs = blk + qs_offset(qtype);
    if (is_mx(qtype)) {
        for (int j = 0; j < QK / 2; j++) dot += (int32_t)MX_KV[qs[j] & 15] * xq[j] + (int32_t)MX_KV[qs[j] >> 4] * xq[j + 16];
        return d * dx * (float)dot;
    }
    const uint32_t qh = is_q5(qtype) ? ld32(blk + qh_offset(qtype)) : 0;
    for (int j = 0; j < QK / 2; j++)
        dot += (int32_t)((qs[j] & 15) | ((qh >> j & 1) << 4)) * xq[j]
               + (int32_t)((qs[j] >> 4) | ((qh >> (j + 16) & 1) << 4)) * xq[j + 16];
    if (!has_min(qtype)) return d * dx * (float)(dot - q_offset(qtype) * isum);
    return d * dx * (float)dot + f16_to_f32(ld16(blk + 2)) * sx;
}

static void qmm_scalar(int qtype, const int x16, const struct qmm *a, int64_t n_begin, int64_t n_end)
{
    const int bb = block_bytes(qtype);
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = a->w + n * a->row_bytes;
        for (int64_t t = 0; t < a->T; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < a->nb; b++) {
                const int64_t i = t * a->nb + b;
                acc += x16 ? block_dot16_scalar(qtype, row + b * bb, a->qx16 + t * a->K + b * QK, a->dx[i],
                                                a->isum[i], a->sx[i])
                           : block_dot_scalar(qtype, row + b * bb, a->qx + t * a->K + b * QK, a->dx[i], a->isum[i],
                                              a->sx[i]);
            }
            a->y[t * a->y_stride + n] = acc;
        }
    }
}

#if PAGODA_X86
/* ---- quantized weights: AVX-512 VNNI ------------------------------------------------ */
/* The activations are packed per token in groups of 4 blocks (pack512), 256 bytes a group:
     xa int8 [64]   elements 0-15 of blocks 4g .. 4g+3, 16 per block, block after block
     xb int8 [64]   elements 16-31, the same way
     dx f32 [16]    lane 4j+i: d_x of block 4g+j
     aux [16]       lane 4j: Q8_0 int32 -128 * isum_j, Q4_0 / Q5_0 -8 / -16 * isum_j, Q4_1 / Q5_1
                    float sx_j; else 0
   Blocks past K are zeros throughout. A group's weights are unpacked likewise: low (Q4: the
   low nibbles = elements 0-15; Q8_0: bytes 0-15 + 128) and high halves of 4 blocks, so one
   vpdpbusd with xa and one with xb give each block's dot in 4 lanes, and the float work
   (convert, scale, accumulate) is one instruction each per 4 blocks. */
#define GROUP_BYTES 256
#define PF_ROWS 4 /* weights prefetched this many rows ahead */

static inline int64_t num_groups(int64_t nb) { return (nb + 3) / 4; }

static TGT512 void pack512(int qt, const float *x, int64_t K, uint8_t *out)
{
    const int64_t nb = K / QK;
    for (int64_t g = 0; g < num_groups(nb); g++) {
        uint8_t *p = out + g * GROUP_BYTES;
        float dx[16];
        int32_t aux[16];
        memset(aux, 0, sizeof aux);
        for (int j = 0; j < 4; j++) {
            const int64_t b = 4 * g + j;
            int8_t q[QK];
            float d = 0.0f, sx = 0.0f;
            int32_t s = 0;
            if (b < nb) quantize_avx512(x + b * QK, q, &d, &s, &sx);
            else memset(q, 0, sizeof q);
            memcpy(p + 16 * j, q, 16);
            memcpy(p + 64 + 16 * j, q + 16, 16);
            for (int i = 0; i < 4; i++) dx[4 * j + i] = d;
            if (has_min(qt)) memcpy(&aux[4 * j], &sx, 4);
            else aux[4 * j] = -(qt == QT_Q8_0 ? 128 : q_offset(qt)) * s;
        }
        memcpy(p + 128, dx, sizeof dx);
        memcpy(p + 192, aux, sizeof aux);
    }
}

/* A group of 4 Q4 blocks (72 or 80 bytes from b0) is read with two loads inside the group
   (bytes 0-63, and 56-71 / 64-79) and a word permute (vpermt2w: every field of a block
   starts at an even offset) in place of four 16-byte loads and inserts, its scales with one
   more (vpermw, d and Q4_1's m four times over for lanes 4j..4j+3) in place of four 2-byte
   loads, shifts and ors: 7-13% faster decode steps (rows streamed one by one; measured on
   Zen 4). A last group of fewer blocks keeps those (masked loads measured no faster), and so
   do the 4-row tiles, where the permutes measured ~10% slower for Q4_0, and Q8_0's 136-byte
   groups (two vpermt2w and the scale permute measured slower). Indices in words of the
   group, the second source at 32 + its word. */
static const uint16_t PERM_Q4_0_QS[32] __attribute__((aligned(64))) = {
    1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 24, 25, 26, 28, 29, 30, 31, 36, 37, 38, 39};
static const uint16_t PERM_Q4_0_D[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 9, 9, 9, 9, 18, 18, 18, 18, 27, 27, 27, 27};
static const uint16_t PERM_Q4_1_QS[32] __attribute__((aligned(64))) = {
    2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19, 22, 23, 24, 25, 26, 27, 28, 29, 32, 33, 34, 35, 36, 37, 38, 39};
static const uint16_t PERM_Q4_1_D[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 10, 10, 10, 10, 20, 20, 20, 20, 30, 30, 30, 30};
static const uint16_t PERM_Q4_1_M[32] __attribute__((aligned(64))) = {1, 1, 1, 1, 11, 11, 11, 11, 21, 21, 21, 21, 31, 31, 31, 31};
/* Q5_0 / Q5_1 groups (88 / 96 bytes) the same way: bytes 0-63 and a 32-byte load ending at the
   group's end (from byte 56 / 64: Q5_0's word w >= 32 is the second source's w + 4), permuted
   into the qs bytes (block j in lane j), the qh words (words 0-3: bits 0-15 of block j's qh,
   words 4-7: bits 16-31, so a 64-bit mask each of the elements 0-15 and 16-31 of the group),
   d (and Q5_1's m) as for Q4. In place of the 4-block loads and the fifth bits gathered in
   scalar code: SmolLM2's gate/up (3072 x 576 Q5_0, int16, T = 1) 96 -> 87 us, int8 85 -> 73
   (Zen 4, one thread, warm caches); the 4-row tiles keep the scalar gathering (the permute
   measured slower there), and so does a row's last group of fewer blocks (masked loads
   measured slower) */
static const uint16_t PERM_Q5_0_QS[32] __attribute__((aligned(64))) = {
    3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 16, 17, 18, 19, 20, 21, 25, 26, 27, 28, 29, 30, 31, 36, 40, 41, 42, 43, 44, 45, 46, 47};
static const uint16_t PERM_Q5_0_QH[32] __attribute__((aligned(64))) = {1, 12, 23, 38, 2, 13, 24, 39};
static const uint16_t PERM_Q5_0_D[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 11, 11, 11, 11, 22, 22, 22, 22, 37, 37, 37, 37};
static const uint16_t PERM_Q5_1_QS[32] __attribute__((aligned(64))) = {
    4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23, 28, 29, 30, 31, 32, 33, 34, 35, 40, 41, 42, 43, 44, 45, 46, 47};
static const uint16_t PERM_Q5_1_QH[32] __attribute__((aligned(64))) = {2, 14, 26, 38, 3, 15, 27, 39};
static const uint16_t PERM_Q5_1_D[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 12, 12, 12, 12, 24, 24, 24, 24, 36, 36, 36, 36};
static const uint16_t PERM_Q5_1_M[32] __attribute__((aligned(64))) = {1, 1, 1, 1, 13, 13, 13, 13, 25, 25, 25, 25, 37, 37, 37, 37};

#define LD512(p) _mm512_loadu_si512((const void *)(p))
#define PERM(table) _mm512_load_si512((const void *)(table))

/* the two sources of a wide Q5 group's permutes: its bytes 0-63, and 56-87 (Q5_0) or 64-95 (Q5_1) */
INL TGT512 void q5_group512(const int qt, const uint8_t *b0, __m512i *head, __m512i *tail)
{
    *head = LD512(b0);
    *tail = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + (qt == QT_Q5_0 ? 56 : 64))));
}

/* n (1-4) blocks of a row from b0, their weight bytes as stored, 16 per block in lane j:
   Q4 the qs bytes (*l; *h unused), Q8_0 bytes 0-15 (*l) and 16-31 (*h); lanes of missing
   blocks are zero */
INL TGT512 void wraw512(const int qt, const int n, const int wide, const uint8_t *b0, const int bb, __m512i *l,
                        __m512i *h)
{
#define LD128(p) _mm_loadu_si128((const __m128i *)(p))
    if (qt != QT_Q8_0) {
        *h = _mm512_setzero_si512();
        if (wide && is_q5(qt)) {
            __m512i head, tail;
            q5_group512(qt, b0, &head, &tail);
            *l = _mm512_permutex2var_epi16(head, PERM(qt == QT_Q5_0 ? PERM_Q5_0_QS : PERM_Q5_1_QS), tail);
            return;
        }
        if (wide) {
            *l = _mm512_permutex2var_epi16(LD512(b0), PERM(qt == QT_Q4_0 ? PERM_Q4_0_QS : PERM_Q4_1_QS),
                                           _mm512_castsi128_si512(LD128(b0 + (qt == QT_Q4_0 ? 56 : 64))));
            return;
        }
        const int off = qs_offset(qt);
        __m512i q = _mm512_zextsi128_si512(LD128(b0 + off));
        if (n > 1) q = _mm512_inserti32x4(q, LD128(b0 + bb + off), 1);
        if (n > 2) q = _mm512_inserti32x4(q, LD128(b0 + 2 * bb + off), 2);
        if (n > 3) q = _mm512_inserti32x4(q, LD128(b0 + 3 * bb + off), 3);
        *l = q;
        return;
    }
    {
        __m512i lo = _mm512_zextsi128_si512(LD128(b0 + 2)), hi = _mm512_zextsi128_si512(LD128(b0 + 18));
        if (n > 1) { lo = _mm512_inserti32x4(lo, LD128(b0 + bb + 2), 1); hi = _mm512_inserti32x4(hi, LD128(b0 + bb + 18), 1); }
        if (n > 2) { lo = _mm512_inserti32x4(lo, LD128(b0 + 2 * bb + 2), 2); hi = _mm512_inserti32x4(hi, LD128(b0 + 2 * bb + 18), 2); }
        if (n > 3) { lo = _mm512_inserti32x4(lo, LD128(b0 + 3 * bb + 2), 3); hi = _mm512_inserti32x4(hi, LD128(b0 + 3 * bb + 18), 3); }
        *l = lo;
        *h = hi;
    }
#undef LD128
}

/* Q5_0/Q5_1: bit 4 of each element of n (1-4) blocks from b0 (qh: bit k for element k), set
   where lo (elements 0-15 of block j in lane j) and hi (16-31) hold the low nibbles; a 64-bit
   mask of qh's halves, one byte-masked add each. wide (n == 4): the masks from one word
   permute of the group (PERM_Q5_*_QH), else gathered in scalar code. */
INL TGT512 void fifth_bit512(const int qt, const int n, const int wide, const uint8_t *b0, const int bb,
                             __m512i *lo, __m512i *hi)
{
    uint64_t ml = 0, mh = 0;
    if (wide) {
        __m512i head, tail;
        q5_group512(qt, b0, &head, &tail);
        const __m128i qh = _mm512_castsi512_si128(
            _mm512_permutex2var_epi16(head, PERM(qt == QT_Q5_0 ? PERM_Q5_0_QH : PERM_Q5_1_QH), tail));
        ml = (uint64_t)_mm_cvtsi128_si64(qh);
        mh = (uint64_t)_mm_extract_epi64(qh, 1);
    } else {
        for (int j = 0; j < n; j++) {
            const uint32_t qh = ld32(b0 + j * bb + qh_offset(qt));
            ml |= (uint64_t)(qh & 0xFFFF) << (16 * j);
            mh |= (uint64_t)(qh >> 16) << (16 * j);
        }
    }
    const __m512i bit = _mm512_set1_epi8(0x10);
    *lo = _mm512_mask_add_epi8(*lo, (__mmask64)ml, *lo, bit);
    *hi = _mm512_mask_add_epi8(*hi, (__mmask64)mh, *hi, bit);
}

/* n (1-4) blocks of a row from b0: each block's elements 0-15 (lo) and 16-31 (hi) as unsigned
   bytes, 16 per block; lanes of missing blocks are zero. wide: the wide loads (n == 4) */
INL TGT512 void wgroup512(const int qt, const int n, const int wide, const uint8_t *b0, const int bb, __m512i *lo,
                          __m512i *hi)
{
    __m512i l, h;
    wraw512(qt, n, wide, b0, bb, &l, &h);
    if (qt == QT_Q8_0) {
        *lo = _mm512_xor_si512(l, _mm512_set1_epi8((char)0x80));
        *hi = _mm512_xor_si512(h, _mm512_set1_epi8((char)0x80));
        return;
    }
    *lo = _mm512_and_si512(l, _mm512_set1_epi8(0x0F));
    *hi = _mm512_and_si512(_mm512_srli_epi16(l, 4), _mm512_set1_epi8(0x0F));
    if (is_q5(qt)) fifth_bit512(qt, n, wide, b0, bb, lo, hi);
    if (is_mx(qt)) { /* nibble -> KV + 12 by vpshufb, the table in every 128-bit lane */
        const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)MX_U));
        *lo = _mm512_shuffle_epi8(table, *lo);
        *hi = _mm512_shuffle_epi8(table, *hi);
    }
}

/* d of the n (1-4) blocks from b0 in lanes 4j..4j+3 for block j; Q4_1's m in lane 4j (other lanes 0) */
INL TGT512 __m512 wscale512(const int qt, const int n, const int wide, const uint8_t *b0, const int bb, __m512 *mins)
{
    if ((qt == QT_Q4_0 || qt == QT_Q4_1) && wide) { /* the d (and m) of 4 Q4 blocks lie in the group's first 64 bytes */
        const __m512i g = LD512(b0);
        if (qt == QT_Q4_1) {
            *mins = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_permutexvar_epi16(0x1111, PERM(PERM_Q4_1_M), g)));
            return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(PERM(PERM_Q4_1_D), g)));
        }
        *mins = _mm512_setzero_ps();
        return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(PERM(PERM_Q4_0_D), g)));
    }
    if (is_q5(qt) && wide) {
        __m512i g, t;
        q5_group512(qt, b0, &g, &t);
        *mins = qt == QT_Q5_1 ? _mm512_cvtph_ps(_mm512_castsi512_si256(
                                    _mm512_maskz_permutex2var_epi16(0x1111, g, PERM(PERM_Q5_1_M), t)))
                              : _mm512_setzero_ps();
        return _mm512_cvtph_ps(_mm512_castsi512_si256(
            _mm512_permutex2var_epi16(g, PERM(qt == QT_Q5_0 ? PERM_Q5_0_D : PERM_Q5_1_D), t)));
    }
    if (has_min(qt)) { /* d, m adjacent: 4 bytes a block */
        const uint64_t lo = ld32(b0) | (n > 1 ? (uint64_t)ld32(b0 + bb) << 32 : 0);
        const uint64_t hi = (n > 2 ? ld32(b0 + 2 * bb) : 0) | (n > 3 ? (uint64_t)ld32(b0 + 3 * bb) << 32 : 0);
        const __m512 f = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo)));
        *mins = _mm512_maskz_permutexvar_ps(0x1111, _mm512_setr_epi32(1, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0), f);
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), f);
    }
    if (is_mx(qt)) { /* 2^(e - 128) of each block, exact; missing blocks 0 */
        *mins = _mm512_setzero_ps();
        const __m128 d4 = _mm_setr_ps(e8m0_half(b0[0]), n > 1 ? e8m0_half(b0[bb]) : 0.0f,
                                      n > 2 ? e8m0_half(b0[2 * bb]) : 0.0f, n > 3 ? e8m0_half(b0[3 * bb]) : 0.0f);
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                     _mm512_castps128_ps512(d4));
    }
    const uint64_t h = ld16(b0) | (n > 1 ? (uint64_t)ld16(b0 + bb) << 16 : 0)
                       | (n > 2 ? (uint64_t)ld16(b0 + 2 * bb) << 32 : 0) | (n > 3 ? (uint64_t)ld16(b0 + 3 * bb) << 48 : 0);
    *mins = _mm512_setzero_ps();
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)h))));
}

#undef LD512
#undef PERM

struct qmm512 {
    int64_t T, nb, ng, row_bytes, y_stride;
    const uint8_t *xp; /* [T, ng] groups of GROUP_BYTES */
    const uint8_t *w;
    float *y;
};

/* group g (n blocks in it) of the tile's R rows x C tokens */
INL TGT512 void gstep512(const int qt, const int n, const int R, const int C, __m512 acc[4][4],
                         const struct qmm512 *a, const uint8_t *w, int64_t t, int64_t g)
{
    /* wide loads: Q4 and Q5 rows streamed one by one */
    const int bb = block_bytes(qt), wide = R == 1 && n == 4 && qt != QT_Q8_0 && !is_mx(qt);
    UNROLL
    for (int r = 0; r < R; r++) {
        const uint8_t *b0 = w + r * a->row_bytes + 4 * g * bb;
        __m512i lo, hi;
        __m512 mg;
        _mm_prefetch((const char *)(b0 + PF_ROWS * a->row_bytes), _MM_HINT_T0);
        _mm_prefetch((const char *)(b0 + PF_ROWS * a->row_bytes + 64), _MM_HINT_T0);
        if (qt == QT_Q8_0) _mm_prefetch((const char *)(b0 + PF_ROWS * a->row_bytes + 128), _MM_HINT_T0);
        wgroup512(qt, n, wide, b0, bb, &lo, &hi);
        const __m512 dg = wscale512(qt, n, wide, b0, bb, &mg);
        UNROLL
        for (int c = 0; c < C; c++) {
            const uint8_t *p = a->xp + ((t + c) * a->ng + g) * GROUP_BYTES;
            const uint8_t *aux = p + 192;
            __m512i dot = has_min(qt) ? _mm512_setzero_si512() : _mm512_load_si512(aux);
            dot = _mm512_dpbusd_epi32(dot, lo, _mm512_load_si512(p));
            dot = _mm512_dpbusd_epi32(dot, hi, _mm512_load_si512(p + 64));
            acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dg, _mm512_load_ps(p + 128)), acc[r][c]);
            if (has_min(qt)) acc[r][c] = _mm512_fmadd_ps(mg, _mm512_load_ps(aux), acc[r][c]);
        }
    }
}

/* ---- quantized weights x int16 activations: AVX-512 VNNI vpdpwssd ------------------- */
/* The int16 activations are packed per token in groups of 4 blocks (pack512_16), 384 bytes:
     xw int16 [4][32]  vector i, 128-bit lane j: 8 activations of block 4g+j, element
                       E(i, k) at position k (k = 0..7): E(0, k) = 2k, E(1, k) = 2k + 16,
                       E(2, k) = 2k + 1, E(3, k) = 2k + 17
     dx f32 [16]       lane 4j+i: d_x of block 4g+j
     aux [16]          lane 4j: Q4_0 / Q5_0 int32 -8 / -16 * isum_j, Q4_1 / Q5_1 float sx_j; else 0
   Blocks past K are zeros throughout. That order is the one a group's weights widen to int16
   in without a shuffle (wgroup512_16): Q4's qs bytes as int16 words hold the nibbles of
   elements 2k, 2k + 16 (low byte), 2k + 1, 2k + 17 (high byte), taken apart by a shift and
   a mask each (zero-extended); Q8_0's bytes 0-15 / 16-31 of a block as words hold elements
   2k, 2k + 1 (+ 16), sign-extended by shifts. Four vpdpwssd (signed int16 pairs into int32)
   then give each block's dot in 4 lanes, as in the int8 path.
   int32 range: a lane adds 4 x 2 products |q_x| <= 32767 times |q_w| <= 15 (Q4) or <= 128
   (Q8_0): at most 8 * 32767 * 128 < 2^25, plus Q4_0's |8 * isum| <= 8 * 32 * 32767 < 2^23; the
   pair sums inside vpdpwssd (|a b + c d| <= 2 * 32767 * 128) never wrap, so every dot is
   exact. (A block's whole dot, 32 products, is below 2^28.) */
#define GROUP16_BYTES 384

static TGT512 void pack512_16(int qt, const float *x, int64_t K, uint8_t *out)
{
    const int64_t nb = K / QK;
    for (int64_t g = 0; g < num_groups(nb); g++) {
        uint8_t *p = out + g * GROUP16_BYTES;
        int16_t xw[4][32];
        float dx[16];
        int32_t aux[16];
        memset(aux, 0, sizeof aux);
        for (int j = 0; j < 4; j++) {
            const int64_t b = 4 * g + j;
            int16_t q[QK];
            float d = 0.0f, sx = 0.0f;
            int32_t s = 0;
            if (b < nb) quantize16_avx512(x + b * QK, q, &d, &s, &sx);
            else memset(q, 0, sizeof q);
            for (int k = 0; k < 8; k++) {
                xw[0][8 * j + k] = q[2 * k];
                xw[1][8 * j + k] = q[2 * k + 16];
                xw[2][8 * j + k] = q[2 * k + 1];
                xw[3][8 * j + k] = q[2 * k + 17];
            }
            for (int i = 0; i < 4; i++) dx[4 * j + i] = d;
            if (has_min(qt)) memcpy(&aux[4 * j], &sx, 4);
            else aux[4 * j] = -q_offset(qt) * s;
        }
        memcpy(p, xw, sizeof xw);
        memcpy(p + 256, dx, sizeof dx);
        memcpy(p + 320, aux, sizeof aux);
    }
}

/* n (1-4) blocks of a row from b0 widened to int16 in the order of pack512_16: w[i], lane j
   = elements E(i, 0..7) of block j; lanes of missing blocks are zero */
INL TGT512 void wgroup512_16(const int qt, const int n, const int wide, const uint8_t *b0, const int bb,
                             __m512i w[4])
{
    if (is_q5(qt) || is_mx(qt)) { /* whole 5-bit (MXFP4: looked-up) bytes first; a word of lo holds elements 2k, 2k + 1 */
        __m512i lo, hi;
        wgroup512(qt, n, wide, b0, bb, &lo, &hi);
        const __m512i m8 = _mm512_set1_epi16(0x00FF);
        w[0] = _mm512_and_si512(lo, m8);
        w[1] = _mm512_and_si512(hi, m8);
        w[2] = _mm512_srli_epi16(lo, 8);
        w[3] = _mm512_srli_epi16(hi, 8);
        return;
    }
    __m512i l, h;
    wraw512(qt, n, wide, b0, bb, &l, &h);
    if (qt == QT_Q8_0) {
        w[0] = _mm512_srai_epi16(_mm512_slli_epi16(l, 8), 8);
        w[1] = _mm512_srai_epi16(_mm512_slli_epi16(h, 8), 8);
        w[2] = _mm512_srai_epi16(l, 8);
        w[3] = _mm512_srai_epi16(h, 8);
        return;
    }
    const __m512i q = l, m4 = _mm512_set1_epi16(0x000F);
    w[0] = _mm512_and_si512(q, m4);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(q, 8), m4);
    w[3] = _mm512_srli_epi16(q, 12);
}

/* group g (n blocks in it) of the tile's R rows x C tokens, int16 activations */
INL TGT512 void gstep512_16(const int qt, const int n, const int R, const int C, __m512 acc[4][4],
                            const struct qmm512 *a, const uint8_t *w, int64_t t, int64_t g)
{
    /* wide loads: Q4 and Q5 rows streamed one by one */
    const int bb = block_bytes(qt), wide = R == 1 && n == 4 && qt != QT_Q8_0 && !is_mx(qt);
    UNROLL
    for (int r = 0; r < R; r++) {
        const uint8_t *b0 = w + r * a->row_bytes + 4 * g * bb;
        __m512i wv[4];
        __m512 mg;
        _mm_prefetch((const char *)(b0 + PF_ROWS * a->row_bytes), _MM_HINT_T0);
        _mm_prefetch((const char *)(b0 + PF_ROWS * a->row_bytes + 64), _MM_HINT_T0);
        if (qt == QT_Q8_0) _mm_prefetch((const char *)(b0 + PF_ROWS * a->row_bytes + 128), _MM_HINT_T0);
        wgroup512_16(qt, n, wide, b0, bb, wv);
        const __m512 dg = wscale512(qt, n, wide, b0, bb, &mg);
        UNROLL
        for (int c = 0; c < C; c++) {
            const uint8_t *p = a->xp + ((t + c) * a->ng + g) * GROUP16_BYTES;
            const uint8_t *aux = p + 320;
            __m512i dot = q_offset(qt) ? _mm512_load_si512(aux) : _mm512_setzero_si512();
            dot = _mm512_dpwssd_epi32(dot, wv[0], _mm512_load_si512(p));
            dot = _mm512_dpwssd_epi32(dot, wv[1], _mm512_load_si512(p + 64));
            dot = _mm512_dpwssd_epi32(dot, wv[2], _mm512_load_si512(p + 128));
            dot = _mm512_dpwssd_epi32(dot, wv[3], _mm512_load_si512(p + 192));
            acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dg, _mm512_load_ps(p + 256)), acc[r][c]);
            if (has_min(qt)) acc[r][c] = _mm512_fmadd_ps(mg, _mm512_load_ps(aux), acc[r][c]);
        }
    }
}

/* the sums of four vectors, in order */
INL TGT512F __m128 hsum4_512(__m512 v0, __m512 v1, __m512 v2, __m512 v3)
{
#define HALF256(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    const __m256 a = _mm256_hadd_ps(HALF256(v0), HALF256(v1)), b = _mm256_hadd_ps(HALF256(v2), HALF256(v3));
#undef HALF256
    const __m256 s = _mm256_hadd_ps(a, b);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* y[t + c, n + r] for the tile's R rows x C tokens (x16: int16 activations) */
INL TGT512 void tile512(const int qt, const int x16, const int R, const int C, const struct qmm512 *a, int64_t n,
                        int64_t t)
{
    __m512 acc[4][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const uint8_t *w = a->w + n * a->row_bytes;
    const int64_t full = a->nb / 4;
    if (x16) {
        for (int64_t g = 0; g < full; g++) gstep512_16(qt, 4, R, C, acc, a, w, t, g);
        if (full < a->ng) gstep512_16(qt, (int)(a->nb - 4 * full), R, C, acc, a, w, t, full);
    } else {
        for (int64_t g = 0; g < full; g++) gstep512(qt, 4, R, C, acc, a, w, t, g);
        if (full < a->ng) gstep512(qt, (int)(a->nb - 4 * full), R, C, acc, a, w, t, full);
    }
    UNROLL
    for (int c = 0; c < C; c++) {
        float *y = a->y + (t + c) * a->y_stride + n;
        if (R == 4) _mm_storeu_ps(y, hsum4_512(acc[0][c], acc[1][c], acc[2][c], acc[3][c]));
        else
            UNROLL
            for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r][c]);
    }
}


INL TGT512 void rows512(const int qt, const int x16, const int R, const struct qmm512 *a, int64_t n, int64_t t0,
                        int64_t t1)
{
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) tile512(qt, x16, R, 4, a, n, t);
    switch (t1 - t) {
    case 3: tile512(qt, x16, R, 3, a, n, t); break;
    case 2: tile512(qt, x16, R, 2, a, n, t); break;
    case 1: tile512(qt, x16, R, 1, a, n, t); break;
    default: break;
    }
}

INL TGT512 void qmm512(const int qt, const int x16, const struct qmm512 *a, int64_t n_begin, int64_t n_end)
{
    const int64_t chunk = token_chunk(a->ng * (x16 ? GROUP16_BYTES : GROUP_BYTES));
    for (int64_t t0 = 0; t0 < a->T; t0 += chunk) {
        const int64_t t1 = t0 + chunk < a->T ? t0 + chunk : a->T;
        int64_t n = n_begin;
        if (a->T >= ROW_TILES_MIN_T)
            for (; n + 4 <= n_end; n += 4) rows512(qt, x16, 4, a, n, t0, t1);
        for (; n < n_end; n++) rows512(qt, x16, 1, a, n, t0, t1);
    }
}

static TGT512 void qmm512_q8_0(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q8_0, 0, a, n0, n1); }
static TGT512 void qmm512_q4_0(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q4_0, 0, a, n0, n1); }
static TGT512 void qmm512_q4_1(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q4_1, 0, a, n0, n1); }
static TGT512 void qmm512_16_q8_0(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q8_0, 1, a, n0, n1); }
static TGT512 void qmm512_16_q4_0(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q4_0, 1, a, n0, n1); }
static TGT512 void qmm512_16_q4_1(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q4_1, 1, a, n0, n1); }
static TGT512 void qmm512_q5_0(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q5_0, 0, a, n0, n1); }
static TGT512 void qmm512_q5_1(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q5_1, 0, a, n0, n1); }
static TGT512 void qmm512_16_q5_0(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q5_0, 1, a, n0, n1); }
static TGT512 void qmm512_16_q5_1(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_Q5_1, 1, a, n0, n1); }
static TGT512 void qmm512_mxfp4(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_MXFP4, 0, a, n0, n1); }
static TGT512 void qmm512_16_mxfp4(const struct qmm512 *a, int64_t n0, int64_t n1) { qmm512(QT_MXFP4, 1, a, n0, n1); }

/* ---- quantized weights: AVX2 -------------------------------------------------------- */
/* A ymm holds one block; tiles of up to 2 rows x 4 tokens (16 ymm registers). */

/* 0x10 in byte k where bit k of the 32 bits at p is set (llama.cpp's bytes_from_bits_32) */
INL TGT2 __m256i fifth_bit256(const uint8_t *p)
{
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)ld32(p)), shuf),
                                          _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

/* the block's weights as 32 bytes in element order: Q4/Q5 unsigned; Q8_0 signed */
INL TGT2 __m256i w_bytes_256(const int qt, const uint8_t *blk)
{
    if (qt == QT_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + qs_offset(qt)));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
    const __m256i nib = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    if (is_mx(qt)) return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)MX_U)), nib);
    return is_q5(qt) ? _mm256_or_si256(nib, fifth_bit256(blk + qh_offset(qt))) : nib;
}

INL TGT2 void step256(const int qt, const int R, const int C, __m256 acc[2][4], const struct qmm *a,
                      const uint8_t *w, int64_t t, int64_t b)
{
    const int bb = block_bytes(qt);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i wq[2], wabs[2];
    __m256 wd[2], wm[2];
    UNROLL
    for (int r = 0; r < R; r++) {
        const uint8_t *blk = w + r * a->row_bytes + b * bb;
        wq[r] = w_bytes_256(qt, blk);
        wabs[r] = qt == QT_Q8_0 ? _mm256_abs_epi8(wq[r]) : wq[r];
        wd[r] = _mm256_set1_ps(is_mx(qt) ? e8m0_half(blk[0]) : _cvtsh_ss(ld16(blk)));
        wm[r] = has_min(qt) ? _mm256_setr_ps(_cvtsh_ss(ld16(blk + 2)), 0, 0, 0, 0, 0, 0, 0) : _mm256_setzero_ps();
    }
    UNROLL
    for (int c = 0; c < C; c++) {
        const int64_t i = (t + c) * a->nb + b;
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->qx + (t + c) * a->K + b * QK));
        const __m256 xd = _mm256_set1_ps(a->dx[i]);
        const __m256 xs = _mm256_set1_ps(a->sx[i]);
        const __m256i bias = _mm256_setr_epi32(-q_offset(qt) * a->isum[i], 0, 0, 0, 0, 0, 0, 0);
        UNROLL
        for (int r = 0; r < R; r++) {
            const __m256i xr = qt == QT_Q8_0 ? _mm256_sign_epi8(xv, wq[r]) : xv;
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[r], xr), ones);
            if (q_offset(qt)) dot = _mm256_add_epi32(dot, bias);
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(wd[r], xd), acc[r][c]);
            if (has_min(qt)) acc[r][c] = _mm256_fmadd_ps(wm[r], xs, acc[r][c]);
        }
    }
}

/* The same with int16 activations (qx16, element order): a block's weights widen to two
   ymm of int16 (Q4 nibbles zero-extended, Q8_0 sign-extended; elements 0-15, 16-31) and two
   vpmaddwd give its dot in 8 int32 lanes, 4 products each (|sum| < 4 * 32767 * 128 < 2^24;
   vpmaddwd's pair sums never wrap: no weight is -32768). */
INL TGT2 void w_words_256(const int qt, const uint8_t *blk, __m256i *lo, __m256i *hi)
{
    if (qt == QT_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return;
    }
    if (is_q5(qt) || is_mx(qt)) {
        const __m256i v = w_bytes_256(qt, blk);
        *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
        *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
        return;
    }
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + qs_offset(qt))));
    *lo = _mm256_and_si256(v, _mm256_set1_epi16(0x000F));
    *hi = _mm256_srli_epi16(v, 4);
}

INL TGT2 void step256_16(const int qt, const int R, const int C, __m256 acc[2][4], const struct qmm *a,
                         const uint8_t *w, int64_t t, int64_t b)
{
    const int bb = block_bytes(qt);
    __m256i wl[2], wh[2];
    __m256 wd[2], wm[2];
    UNROLL
    for (int r = 0; r < R; r++) {
        const uint8_t *blk = w + r * a->row_bytes + b * bb;
        w_words_256(qt, blk, &wl[r], &wh[r]);
        wd[r] = _mm256_set1_ps(is_mx(qt) ? e8m0_half(blk[0]) : _cvtsh_ss(ld16(blk)));
        wm[r] = has_min(qt) ? _mm256_setr_ps(_cvtsh_ss(ld16(blk + 2)), 0, 0, 0, 0, 0, 0, 0) : _mm256_setzero_ps();
    }
    UNROLL
    for (int c = 0; c < C; c++) {
        const int64_t i = (t + c) * a->nb + b;
        const int16_t *xq = a->qx16 + (t + c) * a->K + b * QK;
        const __m256i xl = _mm256_loadu_si256((const __m256i *)xq), xh = _mm256_loadu_si256((const __m256i *)(xq + 16));
        const __m256 xd = _mm256_set1_ps(a->dx[i]);
        const __m256 xs = _mm256_set1_ps(a->sx[i]);
        const __m256i bias = _mm256_setr_epi32(-q_offset(qt) * a->isum[i], 0, 0, 0, 0, 0, 0, 0);
        UNROLL
        for (int r = 0; r < R; r++) {
            __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(wl[r], xl), _mm256_madd_epi16(wh[r], xh));
            if (q_offset(qt)) dot = _mm256_add_epi32(dot, bias);
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(wd[r], xd), acc[r][c]);
            if (has_min(qt)) acc[r][c] = _mm256_fmadd_ps(wm[r], xs, acc[r][c]);
        }
    }
}

INL TGT2 float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INL TGT2 void tile256(const int qt, const int x16, const int R, const int C, const struct qmm *a, int64_t n,
                      int64_t t)
{
    __m256 acc[2][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const uint8_t *w = a->w + n * a->row_bytes;
    if (x16)
        for (int64_t b = 0; b < a->nb; b++) step256_16(qt, R, C, acc, a, w, t, b);
    else
        for (int64_t b = 0; b < a->nb; b++) step256(qt, R, C, acc, a, w, t, b);
    UNROLL
    for (int c = 0; c < C; c++)
        UNROLL
        for (int r = 0; r < R; r++) a->y[(t + c) * a->y_stride + n + r] = hsum_256(acc[r][c]);
}

INL TGT2 void rows256(const int qt, const int x16, const int R, const struct qmm *a, int64_t n, int64_t t0,
                      int64_t t1)
{
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) tile256(qt, x16, R, 4, a, n, t);
    switch (t1 - t) {
    case 3: tile256(qt, x16, R, 3, a, n, t); break;
    case 2: tile256(qt, x16, R, 2, a, n, t); break;
    case 1: tile256(qt, x16, R, 1, a, n, t); break;
    default: break;
    }
}

INL TGT2 void qmm256(const int qt, const int x16, const struct qmm *a, int64_t n_begin, int64_t n_end)
{
    const int64_t chunk = token_chunk(x16 ? 2 * a->K : a->K);
    for (int64_t t0 = 0; t0 < a->T; t0 += chunk) {
        const int64_t t1 = t0 + chunk < a->T ? t0 + chunk : a->T;
        int64_t n = n_begin;
        if (a->T >= ROW_TILES_MIN_T)
            for (; n + 2 <= n_end; n += 2) rows256(qt, x16, 2, a, n, t0, t1);
        for (; n < n_end; n++) rows256(qt, x16, 1, a, n, t0, t1);
    }
}

static TGT2 void qmm256_q8_0(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q8_0, 0, a, n0, n1); }
static TGT2 void qmm256_q4_0(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q4_0, 0, a, n0, n1); }
static TGT2 void qmm256_q4_1(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q4_1, 0, a, n0, n1); }
static TGT2 void qmm256_16_q8_0(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q8_0, 1, a, n0, n1); }
static TGT2 void qmm256_16_q4_0(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q4_0, 1, a, n0, n1); }
static TGT2 void qmm256_16_q4_1(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q4_1, 1, a, n0, n1); }
static TGT2 void qmm256_q5_0(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q5_0, 0, a, n0, n1); }
static TGT2 void qmm256_q5_1(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q5_1, 0, a, n0, n1); }
static TGT2 void qmm256_16_q5_0(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q5_0, 1, a, n0, n1); }
static TGT2 void qmm256_16_q5_1(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_Q5_1, 1, a, n0, n1); }
static TGT2 void qmm256_mxfp4(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_MXFP4, 0, a, n0, n1); }
static TGT2 void qmm256_16_mxfp4(const struct qmm *a, int64_t n0, int64_t n1) { qmm256(QT_MXFP4, 1, a, n0, n1); }
#endif /* PAGODA_X86 */

#include "kquant_matmul.inc" /* the K-quants (Q2_K ... Q6_K): their own activation records and kernels */

/* ---- entry points of the quantized product ------------------------------------------ */
/* act_bits: 8 (int8 activations, llama.cpp's products) or 16 (int16 activations). The
   scratch space of quantized activations: for AVX-512 the packed groups (pack512,
   pack512_16), else qx [T, K] int8 (int16 with act_bits 16), then dx, isum, sx [T, K / 32]
   each, at 64-byte aligned offsets. */

static inline int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* the scratch of the 32-block types' layout (qtype 0: the most over all types, so one
   buffer serves every type of a model, as csrc/decode_layers.c uses it) */
static int64_t scratch_bytes_32(int isa, int act_bits, int64_t T, int64_t K)
{
    const int64_t elem = act_bits == 16 ? 2 : 1;
#if PAGODA_X86
    if (isa == ISA_AVX512) return T * num_groups(K / QK) * (act_bits == 16 ? GROUP16_BYTES : GROUP_BYTES);
#endif
    (void)isa;
    return align64(T * K * elem) + 3 * align64(T * (K / QK) * 4);
}

/* bytes of the prepared activations for T tokens of K inputs: the most any qtype needs (the
   K-quants' records per 256-block, the 32-block types' layouts) */
int64_t pagoda_quant_scratch_bytes(int isa, int act_bits, int64_t T, int64_t K)
{
    const int64_t b32 = scratch_bytes_32(isa, act_bits, T, K), bk = T * (K / QKK) * kq_rec_bytes(act_bits);
    return b32 > bk ? b32 : bk;
}

struct plain { int8_t *qx; float *dx; int32_t *isum; float *sx; };

static struct plain plain_layout(uint8_t *scratch, int act_bits, int64_t T, int64_t K)
{
    const int64_t q = align64(T * K * (act_bits == 16 ? 2 : 1)), f = align64(T * (K / QK) * 4);
    const struct plain p = {(int8_t *)scratch, (float *)(scratch + q), (int32_t *)(scratch + q + f),
                            (float *)(scratch + q + 2 * f)};
    return p;
}

/* the 32-block types (the K-quants: kquant_matmul.inc) */
static int valid_qtype(int qtype)
{
    return qtype == QT_Q8_0 || qtype == QT_Q4_0 || qtype == QT_Q4_1 || qtype == QT_Q5_0 || qtype == QT_Q5_1
           || qtype == QT_MXFP4;
}

/* Quantizes tokens [t_begin, t_end) of x ([T, x_stride] float32, K % 32 == 0) into `scratch`
   (pagoda_quant_scratch_bytes(isa, act_bits, T, K) bytes, 64-byte aligned) for
   pagoda_quant_matmul. Returns -3 for act_bits other than 8 and 16. */
int pagoda_quant_prepare(int isa, int qtype, int act_bits, const float *x, int64_t x_stride, int64_t T, int64_t K,
                         int64_t t_begin, int64_t t_end, uint8_t *scratch)
{
    if (!valid_qtype(qtype) && !is_kquant(qtype)) return -1;
    if (isa == ISA_AVX512_BF16 || !pagoda_isa_supported(isa)) return -2;
    if (act_bits != 8 && act_bits != 16) return -3;
    if (K % (is_kquant(qtype) ? QKK : QK)) return -4;
    if (is_kquant(qtype)) {
        kq_prepare(act_bits, x, x_stride, K, t_begin, t_end, scratch);
        return 0;
    }
#if PAGODA_X86
    if (isa == ISA_AVX512) {
        const int64_t token_bytes = num_groups(K / QK) * (act_bits == 16 ? GROUP16_BYTES : GROUP_BYTES);
        for (int64_t t = t_begin; t < t_end; t++) {
            if (act_bits == 16) pack512_16(qtype, x + t * x_stride, K, scratch + t * token_bytes);
            else pack512(qtype, x + t * x_stride, K, scratch + t * token_bytes);
        }
        return 0;
    }
#endif
    const struct plain p = plain_layout(scratch, act_bits, T, K);
    if (act_bits == 16)
        return pagoda_q16_quantize(isa, x, x_stride, K, t_begin, t_end, (int16_t *)p.qx, p.dx, p.isum, p.sx);
    return pagoda_q8_quantize(isa, x, x_stride, K, t_begin, t_end, p.qx, p.dx, p.isum, p.sx);
}

/* y[t, n] for t < T, n in [n_begin, n_end): the product of the prepared activations with the
   qtype weights w ([N, K / 32 blocks]) */
int pagoda_quant_matmul(int isa, int qtype, int act_bits, const uint8_t *scratch, int64_t T, int64_t K,
                        const uint8_t *w, int64_t n_begin, int64_t n_end, float *y, int64_t y_stride)
{
    if (!valid_qtype(qtype) && !is_kquant(qtype)) return -1;
    if (isa == ISA_AVX512_BF16 || !pagoda_isa_supported(isa)) return -2;
    if (act_bits != 8 && act_bits != 16) return -3;
    if (K % (is_kquant(qtype) ? QKK : QK)) return -4;
    if (is_kquant(qtype)) {
        kq_matmul(isa, qtype, act_bits, scratch, T, K, w, n_begin, n_end, y, y_stride);
        return 0;
    }
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(qtype);
    const int x16 = act_bits == 16;
#if PAGODA_X86
    if (isa == ISA_AVX512) {
        const struct qmm512 a = {T, nb, num_groups(nb), row_bytes, y_stride, scratch, w, y};
        if (qtype == QT_Q8_0) (x16 ? qmm512_16_q8_0 : qmm512_q8_0)(&a, n_begin, n_end);
        else if (qtype == QT_Q4_0) (x16 ? qmm512_16_q4_0 : qmm512_q4_0)(&a, n_begin, n_end);
        else if (qtype == QT_Q4_1) (x16 ? qmm512_16_q4_1 : qmm512_q4_1)(&a, n_begin, n_end);
        else if (qtype == QT_Q5_0) (x16 ? qmm512_16_q5_0 : qmm512_q5_0)(&a, n_begin, n_end);
        else if (qtype == QT_MXFP4) (x16 ? qmm512_16_mxfp4 : qmm512_mxfp4)(&a, n_begin, n_end);
        else (x16 ? qmm512_16_q5_1 : qmm512_q5_1)(&a, n_begin, n_end);
        return 0;
    }
#endif
    const struct plain p = plain_layout((uint8_t *)scratch, act_bits, T, K);
    const struct qmm a = {T, K, nb, row_bytes, y_stride, p.qx, p.dx, p.isum, p.sx, w, y,
                          x16 ? (const int16_t *)p.qx : NULL};
#if PAGODA_X86
    if (isa == ISA_AVX2) {
        if (qtype == QT_Q8_0) (x16 ? qmm256_16_q8_0 : qmm256_q8_0)(&a, n_begin, n_end);
        else if (qtype == QT_Q4_0) (x16 ? qmm256_16_q4_0 : qmm256_q4_0)(&a, n_begin, n_end);
        else if (qtype == QT_Q4_1) (x16 ? qmm256_16_q4_1 : qmm256_q4_1)(&a, n_begin, n_end);
        else if (qtype == QT_Q5_0) (x16 ? qmm256_16_q5_0 : qmm256_q5_0)(&a, n_begin, n_end);
        else if (qtype == QT_MXFP4) (x16 ? qmm256_16_mxfp4 : qmm256_mxfp4)(&a, n_begin, n_end);
        else (x16 ? qmm256_16_q5_1 : qmm256_q5_1)(&a, n_begin, n_end);
        return 0;
    }
#endif
    qmm_scalar(qtype, x16, &a, n_begin, n_end);
    return 0;
}

/* prepare + matmul of all rows [0, N) in one call: the path of a single thread */
int pagoda_quant_matmul_f32(int isa, int qtype, int act_bits, const float *x, int64_t x_stride, int64_t T,
                            int64_t K, const uint8_t *w, int64_t N, float *y, int64_t y_stride, uint8_t *scratch)
{
    const int rc = pagoda_quant_prepare(isa, qtype, act_bits, x, x_stride, T, K, 0, T, scratch);
    return rc != 0 ? rc : pagoda_quant_matmul(isa, qtype, act_bits, scratch, T, K, w, 0, N, y, y_stride);
}

/* ---- bfloat16 weights --------------------------------------------------------------- */

static void bf16_scalar(const float *x, int64_t x_stride, int64_t T, int64_t K, const uint16_t *w,
                        int64_t n_begin, int64_t n_end, float *y, int64_t y_stride)
{
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint16_t *row = w + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * x_stride;
            float part[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* independent sums: the compiler may vectorize them */
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int j = 0; j < 8; j++) part[j] += bf16_to_f32(row[k + j]) * xt[k + j];
            float acc = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
            for (; k < K; k++) acc += bf16_to_f32(row[k]) * xt[k];
            y[t * y_stride + n] = acc;
        }
    }
}

#if PAGODA_X86
struct bmm {
    const float *x;
    int64_t x_stride, T, K, y_stride;
    const uint16_t *w; /* [N, K] */
    float *y;
};

/* weights k..k+15 of a row as float32; `m` masks a tail */
INL TGT512 __m512 bf16x16_512(const uint16_t *p, const __mmask16 m, const int tail)
{
    const __m256i v = tail ? _mm256_maskz_loadu_epi16(m, p) : _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

INL TGT512 void bstep512(const int R, const int C, const int tail, __m512 (*acc)[4], const struct bmm *a,
                         int64_t n, int64_t t, int64_t k, const __mmask16 m)
{
    __m512 wv[4];
    UNROLL
    for (int r = 0; r < R; r++) wv[r] = bf16x16_512(a->w + (n + r) * a->K + k, m, tail);
    UNROLL
    for (int c = 0; c < C; c++) {
        const float *xp = a->x + (t + c) * a->x_stride + k;
        const __m512 xv = tail ? _mm512_maskz_loadu_ps(m, xp) : _mm512_loadu_ps(xp);
        UNROLL
        for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
}

INL TGT512 void btile512(const int R, const int C, const struct bmm *a, int64_t n, int64_t t)
{
    __m512 acc[4][4];
    UNROLL
    for (int r = 0; r < 4; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t k = 0;
    if (R == 1) { /* one row: a second accumulator per token (acc[1]) hides the FMA latency */
        for (; k + 32 <= a->K; k += 32) {
            bstep512(1, C, 0, acc, a, n, t, k, 0xFFFF);
            bstep512(1, C, 0, acc + 1, a, n, t, k + 16, 0xFFFF);
        }
    }
    for (; k + 16 <= a->K; k += 16) bstep512(R, C, 0, acc, a, n, t, k, 0xFFFF);
    if (k < a->K) bstep512(R, C, 1, acc, a, n, t, k, (__mmask16)((1u << (a->K - k)) - 1));
    if (R == 1)
        UNROLL
        for (int c = 0; c < C; c++) acc[0][c] = _mm512_add_ps(acc[0][c], acc[1][c]);
    UNROLL
    for (int c = 0; c < C; c++) {
        float *y = a->y + (t + c) * a->y_stride + n;
        if (R == 4) _mm_storeu_ps(y, hsum4_512(acc[0][c], acc[1][c], acc[2][c], acc[3][c]));
        else
            UNROLL
            for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r][c]);
    }
}

INL TGT512 void brows512(const int R, const struct bmm *a, int64_t n, int64_t t0, int64_t t1)
{
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) btile512(R, 4, a, n, t);
    switch (t1 - t) {
    case 3: btile512(R, 3, a, n, t); break;
    case 2: btile512(R, 2, a, n, t); break;
    case 1: btile512(R, 1, a, n, t); break;
    default: break;
    }
}

static TGT512 void bmm512(const struct bmm *a, int64_t n_begin, int64_t n_end)
{
    const int64_t chunk = token_chunk(4 * a->K);
    for (int64_t t0 = 0; t0 < a->T; t0 += chunk) {
        const int64_t t1 = t0 + chunk < a->T ? t0 + chunk : a->T;
        int64_t n = n_begin;
        if (a->T >= ROW_TILES_MIN_T)
            for (; n + 4 <= n_end; n += 4) brows512(4, a, n, t0, t1);
        for (; n < n_end; n++) brows512(1, a, n, t0, t1);
    }
}

/* AVX2: tiles of up to 4 rows x 2 tokens; the K % 8 tail in scalar */
INL TGT2 void btile256(const int R, const int C, const struct bmm *a, int64_t n, int64_t t)
{
    __m256 acc[4][2];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= a->K; k += 8) {
        __m256 wv[4];
        UNROLL
        for (int r = 0; r < R; r++)
            wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a->w + (n + r) * a->K + k))), 16));
        UNROLL
        for (int c = 0; c < C; c++) {
            const __m256 xv = _mm256_loadu_ps(a->x + (t + c) * a->x_stride + k);
            UNROLL
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
        }
    }
    UNROLL
    for (int c = 0; c < C; c++) {
        const float *xt = a->x + (t + c) * a->x_stride;
        UNROLL
        for (int r = 0; r < R; r++) {
            const uint16_t *row = a->w + (n + r) * a->K;
            float s = hsum_256(acc[r][c]);
            for (int64_t j = k; j < a->K; j++) s += bf16_to_f32(row[j]) * xt[j];
            a->y[(t + c) * a->y_stride + n + r] = s;
        }
    }
}

INL TGT2 void brows256(const int R, const struct bmm *a, int64_t n, int64_t t0, int64_t t1)
{
    int64_t t = t0;
    for (; t + 2 <= t1; t += 2) btile256(R, 2, a, n, t);
    if (t < t1) btile256(R, 1, a, n, t);
}

static TGT2 void bmm256(const struct bmm *a, int64_t n_begin, int64_t n_end)
{
    const int64_t chunk = token_chunk(4 * a->K);
    for (int64_t t0 = 0; t0 < a->T; t0 += chunk) {
        const int64_t t1 = t0 + chunk < a->T ? t0 + chunk : a->T;
        int64_t n = n_begin;
        for (; n + 4 <= n_end; n += 4) brows256(4, a, n, t0, t1);
        for (; n < n_end; n++) brows256(1, a, n, t0, t1);
    }
}

/* ---- bfloat16 weights, AVX-512 BF16: vdpbf16ps on x rounded to bfloat16 -------------- */

static TGTBF16 void f32_to_bf16_512(const float *x, int64_t K, uint16_t *out)
{
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
        _mm512_storeu_si512(out + k, (__m512i)v);
    }
    for (; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k));
        _mm256_mask_storeu_epi16(out + k, m, (__m256i)v);
    }
}

struct bdp {
    const uint16_t *x; /* [T, K] bf16 */
    int64_t T, K, y_stride;
    const uint16_t *w;
    float *y;
};

/* k .. k+31 of the tile; `m` masks a tail */
INL TGTBF16 void dpstep512(const int R, const int C, const int tail, __m512 (*acc)[4], const struct bdp *a,
                           int64_t n, int64_t t, int64_t k, const __mmask32 m)
{
    __m512i wv[4];
    UNROLL
    for (int r = 0; r < R; r++) {
        const uint16_t *p = a->w + (n + r) * a->K + k;
        wv[r] = tail ? _mm512_maskz_loadu_epi16(m, p) : _mm512_loadu_si512(p);
    }
    UNROLL
    for (int c = 0; c < C; c++) {
        const uint16_t *p = a->x + (t + c) * a->K + k;
        const __m512i xv = tail ? _mm512_maskz_loadu_epi16(m, p) : _mm512_loadu_si512(p);
        UNROLL
        for (int r = 0; r < R; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[r], (__m512bh)xv);
    }
}

INL TGTBF16 void dptile512(const int R, const int C, const struct bdp *a, int64_t n, int64_t t)
{
    __m512 acc[4][4];
    UNROLL
    for (int r = 0; r < 4; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t k = 0;
    if (R == 1) { /* one row: a second accumulator per token (acc[1]) hides the latency */
        for (; k + 64 <= a->K; k += 64) {
            dpstep512(1, C, 0, acc, a, n, t, k, 0xFFFFFFFFu);
            dpstep512(1, C, 0, acc + 1, a, n, t, k + 32, 0xFFFFFFFFu);
        }
    }
    for (; k + 32 <= a->K; k += 32) dpstep512(R, C, 0, acc, a, n, t, k, 0xFFFFFFFFu);
    if (k < a->K) dpstep512(R, C, 1, acc, a, n, t, k, (__mmask32)((1u << (a->K - k)) - 1));
    if (R == 1)
        UNROLL
        for (int c = 0; c < C; c++) acc[0][c] = _mm512_add_ps(acc[0][c], acc[1][c]);
    UNROLL
    for (int c = 0; c < C; c++) {
        float *y = a->y + (t + c) * a->y_stride + n;
        if (R == 4) _mm_storeu_ps(y, hsum4_512(acc[0][c], acc[1][c], acc[2][c], acc[3][c]));
        else
            UNROLL
            for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r][c]);
    }
}

INL TGTBF16 void dprows512(const int R, const struct bdp *a, int64_t n, int64_t t0, int64_t t1)
{
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) dptile512(R, 4, a, n, t);
    switch (t1 - t) {
    case 3: dptile512(R, 3, a, n, t); break;
    case 2: dptile512(R, 2, a, n, t); break;
    case 1: dptile512(R, 1, a, n, t); break;
    default: break;
    }
}

static TGTBF16 void dpmm512(const struct bdp *a, int64_t n_begin, int64_t n_end)
{
    const int64_t chunk = token_chunk(2 * a->K);
    for (int64_t t0 = 0; t0 < a->T; t0 += chunk) {
        const int64_t t1 = t0 + chunk < a->T ? t0 + chunk : a->T;
        int64_t n = n_begin;
        if (a->T >= ROW_TILES_MIN_T)
            for (; n + 4 <= n_end; n += 4) dprows512(4, a, n, t0, t1);
        for (; n < n_end; n++) dprows512(1, a, n, t0, t1);
    }
}
#endif /* PAGODA_X86 */

/* y[t, n] = sum_k x[t, k] * w[n, k] for w bfloat16 [N, K], accumulated in float32 */
int pagoda_bf16_matmul(int isa, const float *x, int64_t x_stride, int64_t T, int64_t K, const uint16_t *w,
                       int64_t n_begin, int64_t n_end, float *y, int64_t y_stride)
{
    if (isa == ISA_AVX512_BF16 || !pagoda_isa_supported(isa)) return -2;
#if PAGODA_X86
    const struct bmm a = {x, x_stride, T, K, y_stride, w, y};
    if (isa == ISA_AVX512) { bmm512(&a, n_begin, n_end); return 0; }
    if (isa == ISA_AVX2) { bmm256(&a, n_begin, n_end); return 0; }
#endif
    bf16_scalar(x, x_stride, T, K, w, n_begin, n_end, y, y_stride);
    return 0;
}

/* x ([T, x_stride] float32) rounded to bfloat16 (nearest even) into out [T, K], tokens
   [t_begin, t_end); for pagoda_bf16_matmul_dp */
int pagoda_f32_to_bf16(const float *x, int64_t x_stride, int64_t K, int64_t t_begin, int64_t t_end, uint16_t *out)
{
    if (!pagoda_isa_supported(ISA_AVX512_BF16)) return -2;
#if PAGODA_X86
    for (int64_t t = t_begin; t < t_end; t++) f32_to_bf16_512(x + t * x_stride, K, out + t * K);
#endif
    (void)x; (void)x_stride; (void)K; (void)t_begin; (void)t_end; (void)out;
    return 0;
}

/* y[t, n] = sum_k xb[t, k] * w[n, k], both bfloat16 ([T, K], [N, K]), by vdpbf16ps */
int pagoda_bf16_matmul_dp(const uint16_t *xb, int64_t T, int64_t K, const uint16_t *w, int64_t n_begin,
                          int64_t n_end, float *y, int64_t y_stride)
{
    if (!pagoda_isa_supported(ISA_AVX512_BF16)) return -2;
#if PAGODA_X86
    const struct bdp a = {xb, T, K, y_stride, w, y};
    dpmm512(&a, n_begin, n_end);
#endif
    (void)xb; (void)T; (void)K; (void)w; (void)n_begin; (void)n_end; (void)y; (void)y_stride;
    return 0;
}

/* ---- dequantization to bfloat16 (a prefill's products on oneDNN's bfloat16 GEMM) ------- */

static inline uint16_t f32_to_bf16_rne(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)((u >> 16) | ((u & 0xFFFFu) ? 0x40u : 0u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One GGUF block of qtype as 32 float32 weights, as dequantize() computes them (Q8_0 d * q,
   Q4_0 d * (q - 8), Q4_1 d * q + m, MXFP4 d * KV[q]). */
static inline void dequant_block(int qtype, const uint8_t *blk, float *v)
{
    const float d = block_d(qtype, blk);
    if (qtype == QT_MXFP4) {
        for (int i = 0; i < QK / 2; i++) {
            v[i] = d * (float)MX_KV[blk[1 + i] & 0x0F];
            v[i + QK / 2] = d * (float)MX_KV[blk[1 + i] >> 4];
        }
    } else if (qtype == QT_Q8_0) {
        for (int i = 0; i < QK; i++) v[i] = d * (float)(int8_t)blk[2 + i];
    } else if (qtype == QT_Q4_0) {
        for (int i = 0; i < QK / 2; i++) {
            v[i] = d * (float)((int)(blk[2 + i] & 0x0F) - 8);
            v[i + QK / 2] = d * (float)((int)(blk[2 + i] >> 4) - 8);
        }
    } else if (is_q5(qtype)) { /* Q5_0 d * (q - 16); Q5_1 d * q + m */
        const uint8_t *qs = blk + qs_offset(qtype);
        const uint32_t qh = ld32(blk + qh_offset(qtype));
        const float m = qtype == QT_Q5_1 ? f16_to_f32(ld16(blk + 2)) : 0.0f;
        for (int i = 0; i < QK / 2; i++) {
            const int lo = (qs[i] & 0x0F) | (int)((qh >> i & 1) << 4), hi = (qs[i] >> 4) | (int)((qh >> (i + 16) & 1) << 4);
            if (qtype == QT_Q5_0) {
                v[i] = d * (float)(lo - 16);
                v[i + QK / 2] = d * (float)(hi - 16);
            } else {
                v[i] = d * (float)lo + m;
                v[i + QK / 2] = d * (float)hi + m;
            }
        }
    } else {
        const float m = f16_to_f32(ld16(blk + 2));
        for (int i = 0; i < QK / 2; i++) {
            v[i] = d * (float)(blk[4 + i] & 0x0F) + m;
            v[i + QK / 2] = d * (float)(blk[4 + i] >> 4) + m;
        }
    }
}

/* Row n of w as float32 [K] in out, as dequantize() computes it: block by block (32 or a
   K-quant's 256 values) */
static void dequant_row(int qtype, const uint8_t *w, int64_t K, int64_t n, float *out)
{
    const int kq = is_kquant(qtype);
    const int64_t block = kq ? QKK : QK, nb = K / block, bb = kq ? kq_block_bytes(qtype) : block_bytes(qtype);
    const uint8_t *row = w + n * nb * bb;
    for (int64_t b = 0; b < nb; b++) {
        if (kq) kq_dequant_block(qtype, row + b * bb, out + b * block);
        else dequant_block(qtype, row + b * bb, out + b * block);
    }
}

static int dequant_args(int qtype, int64_t K)
{
    if (!valid_qtype(qtype) && !is_kquant(qtype)) return -1;
    return K % (is_kquant(qtype) ? QKK : QK) ? -4 : 0;
}

/* Rows [n_begin, n_end) of w (uint8 [N, row_bytes], GGUF blocks of any type above) as
   bfloat16 [N, K] in out: each weight computed in float32 (dequant_row), then rounded to
   nearest even. Returns 0, -1 for a bad type, -4 for K not whole blocks. */
int pagoda_dequant_bf16(int qtype, const uint8_t *w, int64_t K, int64_t n_begin, int64_t n_end, uint16_t *out)
{
    const int rc = dequant_args(qtype, K);
    if (rc != 0) return rc;
    float v[QKK];
    const int64_t block = is_kquant(qtype) ? QKK : QK;
    for (int64_t n = n_begin; n < n_end; n++) {
        uint16_t *o = out + n * K;
        for (int64_t k0 = 0; k0 < K; k0 += QKK) { /* a row in pieces of 256 (whole blocks of either size) */
            const int64_t len = K - k0 < QKK ? K - k0 : QKK;
            const int64_t bb = is_kquant(qtype) ? kq_block_bytes(qtype) : block_bytes(qtype);
            const uint8_t *row = w + n * (K / block) * bb + k0 / block * bb;
            for (int64_t b = 0; b < len / block; b++) {
                if (is_kquant(qtype)) kq_dequant_block(qtype, row + b * bb, v + b * block);
                else dequant_block(qtype, row + b * bb, v + b * block);
            }
            for (int64_t i = 0; i < len; i++) o[k0 + i] = f32_to_bf16_rne(v[i]);
        }
    }
    return 0;
}

/* The same as float32 [N, K], exactly dequantize()'s values: a prefill's products on the
   float32 GEMM where the CPU has no BF16 units. */
int pagoda_dequant_f32(int qtype, const uint8_t *w, int64_t K, int64_t n_begin, int64_t n_end, float *out)
{
    const int rc = dequant_args(qtype, K);
    if (rc != 0) return rc;
    for (int64_t n = n_begin; n < n_end; n++) dequant_row(qtype, w, K, n, out + n * K);
    return 0;
}

/* ---- silu(g) * u of a gate/up product (the MLP's activation on packed stages) ---------- */

#if PAGODA_X86
/* exp(x) for x in [-87.3, 88.7]: n = round(x log2 e), r = x - n ln 2 (two parts), e^r by a
   degree-6 polynomial on [-ln2/2, ln2/2] (relative error < 2e-7), times 2^n by scalef */
static TGT512F __m512 exp512(__m512 x)
{
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.37f)), _mm512_set1_ps(-87.33f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static TGT512F void silu_mul_row512(const float *g, const float *u, int64_t I, float *out)
{
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    if (i < I) {
        const __mmask16 m = (__mmask16)((1u << (I - i)) - 1u);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}
#endif

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] for rows [t_begin, t_end) of gu ([T, gu_stride]
   float32, gate then up) into out ([T, I] float32). isa 2 (AVX-512): a polynomial exp within
   ~3e-7 of expf's result relative; otherwise expf. Returns 0 or -2 (ISA not run here). */
int pagoda_silu_mul(int isa, const float *gu, int64_t gu_stride, int64_t I, int64_t t_begin, int64_t t_end,
                    float *out)
{
    if (!pagoda_isa_supported(isa)) return -2;
    for (int64_t t = t_begin; t < t_end; t++) {
        const float *g = gu + t * gu_stride, *u = g + I;
        float *o = out + t * I;
#if PAGODA_X86
        if (isa >= ISA_AVX512) {
            silu_mul_row512(g, u, I, o);
            continue;
        }
#endif
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}
