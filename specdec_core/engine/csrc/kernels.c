/* Causal attention over paged keys and values for many sequences in one call (specdec_core/cpu_attention.py).

   Every query row is computed on its own, by the same instructions in the same order whatever else
   is in the call: row r of item i (position first_pos[i] + r) attends to that item's keys
   0..first_pos[i] + r, read from the pools at slots[slot_offset[i] + j]. So a position's output does
   not depend on the other sessions of a batch, on how many rows its pass verifies, or on the
   number of threads: decoding a token alone, verifying it in a block of six and prefilling it give
   the same bits (SDPA's CPU kernels take other paths for one query row and for a masked block, and
   differed by 3e-5 in the logits).

   Per row and head: s_j = (q . k_j) * scale; m = max s; e_j = exp(s_j - m); out = (sum e_j v_j) / sum e_j,
   sums in key order. Layouts (float32, last dimension contiguous):
     q      [T, heads, d]           element (t, h, i) at q[t * q_token_stride + h * q_head_stride + i]
     pools  [kv_heads, slots, d]    element (g, s, i) at pool[g * pool_head_stride + s * d + i]
     out    [T, heads, d]           contiguous
   Query head h reads kv head h / (heads / kv_heads) (grouped-query attention). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef SPECDEC_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp). Lane-wise:
   a lane's result depends on that lane's input only. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365448f);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* q . k over d elements (d a multiple of 8 on the AVX2 path). */
static inline float dot(const float* q, const float* k, int64_t d) {
#ifdef SPECDEC_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    return hsum8(acc);
#else
    float acc = 0.0f;
    for (int64_t i = 0; i < d; i++) acc += q[i] * k[i];
    return acc;
#endif
}

/* One query row of one head against L keys; `e` is scratch for L floats. */
static void attend_row(const float* q, const float* k_head, const float* v_head, const int64_t* slots, int64_t L,
                       int64_t d, float scale, float* out, float* e) {
    float m = -INFINITY;
    for (int64_t j = 0; j < L; j++) {
        float s = dot(q, k_head + slots[j] * d, d) * scale;
        e[j] = s;
        m = s > m ? s : m;
    }
    float sum = 0.0f;
#ifdef SPECDEC_AVX2
    __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) {
        __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), vm));
        _mm256_storeu_ps(e + j, x);
        vsum = _mm256_add_ps(vsum, x);
    }
    if (j < L) {  /* the tail: its lanes past L add zeros */
        float tail[8] = {0};
        for (int64_t t = j; t < L; t++) tail[t - j] = e[t] - m;
        __m256 x = exp8(_mm256_loadu_ps(tail));
        __m256 keep = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)(L - j)), _CMP_LT_OQ);
        x = _mm256_and_ps(x, keep);
        _mm256_storeu_ps(tail, x);
        for (int64_t t = j; t < L; t++) e[t] = tail[t - j];
        vsum = _mm256_add_ps(vsum, x);
    }
    sum = hsum8(vsum);
    __m256 inv = _mm256_set1_ps(1.0f / sum);
    /* out_i = sum_t e_t v_t,i: one FMA chain per element in key order, so both loops give the same bits */
    if (d == 64) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t t = 0; t < L; t++) {
            const float* v = v_head + slots[t] * 64;
            __m256 w = _mm256_set1_ps(e[t]);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4);
            a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
            a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6);
            a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
        }
        _mm256_storeu_ps(out, _mm256_mul_ps(a0, inv));
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(a1, inv));
        _mm256_storeu_ps(out + 16, _mm256_mul_ps(a2, inv));
        _mm256_storeu_ps(out + 24, _mm256_mul_ps(a3, inv));
        _mm256_storeu_ps(out + 32, _mm256_mul_ps(a4, inv));
        _mm256_storeu_ps(out + 40, _mm256_mul_ps(a5, inv));
        _mm256_storeu_ps(out + 48, _mm256_mul_ps(a6, inv));
        _mm256_storeu_ps(out + 56, _mm256_mul_ps(a7, inv));
        return;
    }
    for (int64_t i = 0; i < d; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = 0; t < L; t++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(e[t]), _mm256_loadu_ps(v_head + slots[t] * d + i), acc);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(acc, inv));
    }
#else
    for (int64_t j = 0; j < L; j++) {
        e[j] = expf(e[j] - m);
        sum += e[j];
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; i++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < L; t++) acc += e[t] * v_head[slots[t] * d + i];
        out[i] = acc * inv;
    }
#endif
}

/* 0 on success; 1 when d does not suit this build (the caller uses another kernel). */
int specdec_attention(const float* q, int64_t q_token_stride, int64_t q_head_stride,
                      const float* k_pool, const float* v_pool, int64_t pool_head_stride, float* out,
                      int64_t heads, int64_t kv_heads, int64_t d, float scale, int64_t n_items,
                      const int64_t* q_start, const int64_t* n_rows, const int64_t* first_pos,
                      const int64_t* slot_offset, const int64_t* slots) {
#ifdef SPECDEC_AVX2
    if (d % 8) return 1;
#endif
    int64_t group = heads / kv_heads, units = 0, max_len = 1;
    int64_t* first_unit = malloc(sizeof(int64_t) * (n_items + 1));
    if (!first_unit) return 2;
    for (int64_t i = 0; i < n_items; i++) {
        first_unit[i] = units;
        units += n_rows[i] * heads;
        if (first_pos[i] + n_rows[i] > max_len) max_len = first_pos[i] + n_rows[i];
    }
    first_unit[n_items] = units;
    int failed = 0;
#pragma omp parallel
    {
        float* e = malloc(sizeof(float) * (max_len + 8));
        int64_t item = 0;
        if (!e) failed = 2;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!e) continue;
            while (u >= first_unit[item + 1]) item++;
            while (u < first_unit[item]) item--;
            int64_t r = (u - first_unit[item]) / heads, h = (u - first_unit[item]) % heads;
            int64_t row = q_start[item] + r, g = h / group;
            attend_row(q + row * q_token_stride + h * q_head_stride, k_pool + g * pool_head_stride,
                       v_pool + g * pool_head_stride, slots + slot_offset[item], first_pos[item] + r + 1, d, scale,
                       out + (row * heads + h) * d, e);
        }
        free(e);
    }
    free(first_unit);
    return failed;
}

/* RMS normalization of rows of n floats: y = w * (x * (1 / sqrt(mean(x^2) + eps))). The sum of squares
   runs over the row in 8 lanes (or in order) and is then reduced in a fixed order: a row's result
   depends on that row alone. */
void specdec_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        float* yr = y + r * n;
        float sum = 0.0f;
#ifdef SPECDEC_AVX2
        int64_t i = 0;
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        sum = hsum8(acc);
        for (; i < n; i++) sum += xr[i] * xr[i];
#else
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
#endif
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* The rotary embedding of a layer's fused q/k/v rows, in place, and their keys and values written
   to the pools. qkv [T, heads + 2 kv_heads, d] contiguous; cos, sin [T, d] with sin's first half
   negated: x_i cos_i + x_{(i + d/2) mod d} sin_i, each product rounded, then the sum (PyTorch's
   x * cos + rotate_half(x) * sin, bit for bit). Key head g of token t goes to pool slot slots[t]. */
void specdec_rope_write(float* qkv, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                        int64_t kv_heads, int64_t d, float* k_pool, float* v_pool, int64_t pool_head_stride,
                        const int64_t* slots) {
    int64_t width = heads + 2 * kv_heads, half = d / 2;
#pragma omp parallel for schedule(static) if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++) {
        float x[512];
        const float* c = cos + t * d;
        const float* s = sin + t * d;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float* row = qkv + (t * width + h) * d;
            for (int64_t i = 0; i < d; i++) x[i] = row[i];
            for (int64_t i = 0; i < half; i++) {
                float a = x[i] * c[i], b = x[i + half] * s[i];
                row[i] = a + b;
            }
            for (int64_t i = half; i < d; i++) {
                float a = x[i] * c[i], b = x[i - half] * s[i];
                row[i] = a + b;
            }
        }
        for (int64_t g = 0; g < kv_heads; g++) {
            const float* k = qkv + (t * width + heads + g) * d;
            const float* v = qkv + (t * width + heads + kv_heads + g) * d;
            float* kd = k_pool + g * pool_head_stride + slots[t] * d;
            float* vd = v_pool + g * pool_head_stride + slots[t] * d;
            for (int64_t i = 0; i < d; i++) {
                kd[i] = k[i];
                vd[i] = v[i];
            }
        }
    }
}


/* Linear layers whose weights are block-quantized (specdec_core/cpu_quantized.py): y = x W^T (+ bias)
   (+ add), W [n, k], each block of 32 weights along k exactly
     Q4_1: fl(d * q + m), q in 0..15, d and m per block and output column;
     Q8_0: fl(d * q), q in -128..127.
   These are the float32 values GGUF's dequantization gives (d * q is exact, so an FMA rounds as the
   product-then-sum does): the layer computes with exactly the model's float32 weights while reading
   4-8 bits of memory per weight instead of 32, where memory is what bounds a decode step.

   Every output element is one FMA chain over k in order, from 0: acc = fma(x_k, w_k, acc) for
   k = 0 .. k - 1; then + bias, then + add. So a row's result depends on that row alone: not on the
   other rows of the call, their number, the threads or the tiling (few rows dequantize each weight
   into registers as they go; many rows first dequantize a panel of columns, then run over it).

   Layouts, per group of 16 output columns g and block b of 32 inputs (n a multiple of 16, k of 32):
     Q4_1 codes [n / 16, k / 32, 16, 16] bytes: byte (i, c) holds q for input 32 b + 2 i of column
          16 g + c in its low 4 bits and for input 32 b + 2 i + 1 in its high 4 bits;
     Q8_0 codes [n / 16, k / 32, 32, 16] int8: (j, c) is q for input 32 b + j of column 16 g + c;
     d, m [n / 16, k / 32, 16] float16 (m: Q4_1 only), GGUF's own precision.
   x [rows, k] with row stride ldx; y and add [rows, n]. Needs AVX-512 (F, BW, DQ):
   specdec_quantized_available() says whether this CPU has it. */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,fma")))
#define SPECDEC_INLINE __attribute__((always_inline)) static inline

int specdec_quantized_available(void) {
    static int available = -1;  /* asked once: every layer's call checks it */
    if (available < 0) {
        __builtin_cpu_init();
        available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
    }
    return available;
}

/* 16 fp16 scales (d or m) as float32: exact. */
SPECDEC_AVX512 SPECDEC_INLINE __m512 load_half(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

/* The weights of inputs 32 b + 2 i and 32 b + 2 i + 1 for a group's 16 columns; `block` at the group's block b. */
SPECDEC_AVX512 SPECDEC_INLINE void pair_weights(int bits, const uint8_t* block, int i, __m512 dv, __m512 mv,
                                                __m512* wa, __m512* wb) {
    if (bits == 4) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(block + 16 * i)));
        *wa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), dv, mv);
        *wb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dv, mv);
    } else {
        const __m128i* q = (const __m128i*)(block + 32 * i);
        *wa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), dv);
        *wb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), dv);
    }
}

typedef struct {
    int bits;
    int64_t k, n, blocks, block_bytes;
    const uint8_t* codes;
    const uint16_t *d, *m;  /* fp16, as GGUF stores them */
} qweight;

static inline const uint8_t* group_block(const qweight* w, int64_t g, int64_t b) {
    return w->codes + (g * w->blocks + b) * w->block_bytes;
}

/* R rows by C groups, dequantizing in registers: for few rows. */
SPECDEC_AVX512 SPECDEC_INLINE void direct_tile(const qweight* w, int R, int C, const float* x, int64_t ldx,
                                               int64_t g0, __m512* out) {
    __m512 acc[8][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->blocks; b++) {
        __m512 dv[2], mv[2];
        const uint8_t* blk[2];
        for (int c = 0; c < C; c++) {
            int64_t at = ((g0 + c) * w->blocks + b) * 16;
            dv[c] = load_half(w->d + at);
            mv[c] = w->bits == 4 ? load_half(w->m + at) : _mm512_setzero_ps();
            blk[c] = group_block(w, g0 + c, b);
        }
        for (int i = 0; i < 16; i++) {
            __m512 wa[2], wb[2];
            for (int c = 0; c < C; c++) pair_weights(w->bits, blk[c], i, dv[c], mv[c], &wa[c], &wb[c]);
            const int64_t j = 32 * b + 2 * i;
            for (int r = 0; r < R; r++) {
                __m512 xa = _mm512_set1_ps(x[r * ldx + j]), xb = _mm512_set1_ps(x[r * ldx + j + 1]);
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xa, wa[c], acc[r][c]);
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xb, wb[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r * 2 + c] = acc[r][c];
}

/* R rows by 2 groups over a dequantized panel [k][32]: for many rows. */
SPECDEC_AVX512 SPECDEC_INLINE void panel_tile(int R, int64_t k, const float* panel, const float* x, int64_t ldx,
                                              __m512* out) {
    __m512 acc[6][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        __m512 w0 = _mm512_loadu_ps(panel + 32 * j), w1 = _mm512_loadu_ps(panel + 32 * j + 16);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(x[r * ldx + j]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        out[r * 2] = acc[r][0];
        out[r * 2 + 1] = acc[r][1];
    }
}

#define SPECDEC_DIRECT(R, C) \
    case R * 4 + C: direct_tile(w, R, C, x, ldx, g0, out); break;
SPECDEC_AVX512 static void direct(const qweight* w, int R, int C, const float* x, int64_t ldx, int64_t g0,
                                  __m512* out) {
    switch (R * 4 + C) {
        SPECDEC_DIRECT(1, 1) SPECDEC_DIRECT(1, 2) SPECDEC_DIRECT(2, 1) SPECDEC_DIRECT(2, 2)
        SPECDEC_DIRECT(3, 1) SPECDEC_DIRECT(3, 2) SPECDEC_DIRECT(4, 1) SPECDEC_DIRECT(4, 2)
        SPECDEC_DIRECT(5, 1) SPECDEC_DIRECT(5, 2) SPECDEC_DIRECT(6, 1) SPECDEC_DIRECT(6, 2)
        SPECDEC_DIRECT(7, 1) SPECDEC_DIRECT(7, 2) SPECDEC_DIRECT(8, 1) SPECDEC_DIRECT(8, 2)
    }
}

SPECDEC_AVX512 static void panel(int R, int64_t k, const float* p, const float* x, int64_t ldx, __m512* out) {
    switch (R) {
        case 1: panel_tile(1, k, p, x, ldx, out); break;
        case 2: panel_tile(2, k, p, x, ldx, out); break;
        case 3: panel_tile(3, k, p, x, ldx, out); break;
        case 4: panel_tile(4, k, p, x, ldx, out); break;
        case 5: panel_tile(5, k, p, x, ldx, out); break;
        default: panel_tile(6, k, p, x, ldx, out); break;
    }
}

SPECDEC_AVX512 static void store(const __m512* out, int R, int C, int64_t r0, int64_t col, int64_t n,
                                 const float* bias, const float* add, float* y) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            __m512 v = out[r * 2 + c];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col + 16 * c));
            if (add) v = _mm512_add_ps(v, _mm512_loadu_ps(add + (r0 + r) * n + col + 16 * c));
            _mm512_storeu_ps(y + (r0 + r) * n + col + 16 * c, v);
        }
}

#define SPECDEC_PANEL_ROWS 16  /* from this many rows, dequantize a panel first */

/* 0 on success; 1 when this CPU or shape does not suit (k a multiple of 32, n of 16, bits 4 or 8). */
SPECDEC_AVX512 static int quantized_linear(int bits, const float* x, int64_t ldx, int64_t rows, int64_t k,
                                           const uint8_t* codes, const uint16_t* d, const uint16_t* m, int64_t n,
                                           const float* bias, const float* add, float* y, int threads) {
    qweight w = {bits, k, n, k / 32, bits == 4 ? 256 : 512, codes, d, m};
    const int64_t groups = n / 16, items = (groups + 1) / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (threads > 1)
    {
        float* p = rows >= SPECDEC_PANEL_ROWS ? aligned_alloc(64, sizeof(float) * 32 * k) : NULL;
        if (rows >= SPECDEC_PANEL_ROWS && !p) failed = 2;
        __m512 out[16];
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t g0 = 2 * it;
            const int C = g0 + 1 < groups ? 2 : 1;
            if (rows < SPECDEC_PANEL_ROWS) {
                for (int64_t r0 = 0; r0 < rows; r0 += 8) {
                    const int R = rows - r0 < 8 ? (int)(rows - r0) : 8;
                    direct(&w, R, C, x + r0 * ldx, ldx, g0, out);
                    store(out, R, C, r0, 16 * g0, n, bias, add, y);
                }
                continue;
            }
            if (!p) continue;
            for (int c = 0; c < 2; c++) {
                const int64_t g = g0 + (c < C ? c : 0);
                for (int64_t b = 0; b < w.blocks; b++) {
                    const int64_t at = (g * w.blocks + b) * 16;
                    __m512 dv = load_half(d + at), mv = bits == 4 ? load_half(m + at) : _mm512_setzero_ps();
                    for (int i = 0; i < 16; i++) {
                        __m512 wa, wb;
                        pair_weights(bits, group_block(&w, g, b), i, dv, mv, &wa, &wb);
                        _mm512_storeu_ps(p + 32 * (32 * b + 2 * i) + 16 * c, wa);
                        _mm512_storeu_ps(p + 32 * (32 * b + 2 * i + 1) + 16 * c, wb);
                    }
                }
            }
            for (int64_t r0 = 0; r0 < rows; r0 += 6) {
                const int R = rows - r0 < 6 ? (int)(rows - r0) : 6;
                panel(R, k, p, x + r0 * ldx, ldx, out);
                store(out, R, C, r0, 16 * g0, n, bias, add, y);
            }
        }
        free(p);
    }
    return failed;
}

int specdec_quantized_linear(int bits, const float* x, int64_t ldx, int64_t rows, int64_t k, const uint8_t* codes,
                             const uint16_t* d, const uint16_t* m, int64_t n, const float* bias, const float* add,
                             float* y, int threads) {
    if (k % 32 || n % 16 || (bits != 4 && bits != 8) || !specdec_quantized_available()) return 1;
    return quantized_linear(bits, x, ldx, rows, k, codes, d, m, n, bias, add, y, threads);
}

/* The same codes with the inputs quantized too: llama.cpp's arithmetic, for a draft model (which may
   propose from any distribution; the target's verdicts keep the output exact). Each row's block of
   32 inputs becomes int8 q_x with scale d_x = max |x| / 127 (q_x = round(x / d_x)), and a block's
   products are summed in integers with AVX-512 VNNI (vpdpbusd: 64 byte products a cycle):
     Q4_1: y_c += (d_c d_x) * sum_j q_c,j q_x,j + m_c * (d_x sum_j q_x,j)
     Q8_0: y_c += (d_c d_x) * sum_j q_c,j q_x,j   (the weights enter as q + 128, unsigned; 128 sum_j q_x,j
                                                   is taken off the integer sum)
   A 64-byte run of a block's codes is turned from (input, column) to (column, input) order by one
   byte permutation (vpermb), so that each 32-bit lane holds four of one column's inputs; the row's
   int8 inputs are stored in the order those lanes read them. The integer sums are exact and the float
   updates run per row in block order, so a row's result depends on that row alone. Needs VNNI and
   VBMI on top of the above: specdec_int8_available(). */
#define SPECDEC_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,avx512vbmi,fma")))

int specdec_int8_available(void) {
    static int available = -1;
    if (available < 0) {
        __builtin_cpu_init();
        available = specdec_quantized_available() && __builtin_cpu_supports("avx512vnni") &&
                    __builtin_cpu_supports("avx512vbmi");
    }
    return available;
}

/* One row's inputs, per block: 32 int8 in lane order (Q4_1: per 8 inputs the 4 even ones, then the
   4 odd ones, as a byte's low and high nibbles hold them; Q8_0: in order), d_x and sum q_x. */
SPECDEC_VNNI static void quantize_inputs(int bits, const float* x, int64_t k, int8_t* q, float* dx, int32_t* sums) {
    for (int64_t b = 0; b < k / 32; b++) {
        __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        dx[b] = amax / 127.0f;
        sums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        int8_t in_order[32], *out = q + 32 * b;
        _mm_storeu_si128((__m128i*)in_order, _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i*)(in_order + 16), _mm512_cvtepi32_epi8(qhi));
        for (int j = 0; j < 32; j++)
            out[j] = bits == 4 ? in_order[(j & ~7) + 2 * (j & 3) + ((j >> 2) & 1)] : in_order[j];
    }
}

/* The byte permutation of a 64-byte run of codes: output byte 4 c + j takes input byte 16 j + c. */
#define SPECDEC_COLUMN(c) c, 16 + c, 32 + c, 48 + c
static const uint8_t COLUMN_MAJOR[64] = {
    SPECDEC_COLUMN(0), SPECDEC_COLUMN(1), SPECDEC_COLUMN(2), SPECDEC_COLUMN(3), SPECDEC_COLUMN(4), SPECDEC_COLUMN(5),
    SPECDEC_COLUMN(6), SPECDEC_COLUMN(7), SPECDEC_COLUMN(8), SPECDEC_COLUMN(9), SPECDEC_COLUMN(10), SPECDEC_COLUMN(11),
    SPECDEC_COLUMN(12), SPECDEC_COLUMN(13), SPECDEC_COLUMN(14), SPECDEC_COLUMN(15)};

/* R rows (at most 8) by one group of 16 columns. */
SPECDEC_VNNI SPECDEC_INLINE void int8_tile(const qweight* w, int R, const int8_t* xq, const float* xd,
                                           const int32_t* xs, int64_t g, __m512* out) {
    const __m512i order = _mm512_loadu_si512(COLUMN_MAJOR);
    const __m512i low4 = _mm512_set1_epi8(15), bias128 = _mm512_set1_epi8((char)0x80);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->blocks; b++) {
        const uint8_t* blk = group_block(w, g, b);
        __m512i wv[8];
        if (w->bits == 4) {
            for (int t = 0; t < 4; t++) {
                __m512i v = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(blk + 64 * t));
                wv[2 * t] = _mm512_and_si512(v, low4);
                wv[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        } else {
            for (int t = 0; t < 8; t++)
                wv[t] = _mm512_xor_si512(_mm512_permutexvar_epi8(order, _mm512_loadu_si512(blk + 64 * t)), bias128);
        }
        const int64_t at = (g * w->blocks + b) * 16;
        const __m512 dv = load_half(w->d + at);
        const __m512 mv = w->bits == 4 ? load_half(w->m + at) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int32_t* xi = (const int32_t*)(xq + r * w->k + 32 * b);
            __m512i s2[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  /* two chains: exact either way */
            for (int u = 0; u < 8; u++) s2[u & 1] = _mm512_dpbusd_epi32(s2[u & 1], wv[u], _mm512_set1_epi32(xi[u]));
            __m512i s = _mm512_add_epi32(s2[0], s2[1]);
            const float dx = xd[r * w->blocks + b];
            const int32_t sx = xs[r * w->blocks + b];
            if (w->bits == 4) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc[r]);
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(dx * (float)sx), acc[r]);
            } else {
                s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * sx));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r * 2] = acc[r];
}

#define SPECDEC_INT8(R) \
    case R: int8_tile(w, R, xq, xd, xs, g, out); break;
SPECDEC_VNNI static void int8_rows(const qweight* w, int R, const int8_t* xq, const float* xd, const int32_t* xs,
                                   int64_t g, __m512* out) {
    switch (R) {
        SPECDEC_INT8(1) SPECDEC_INT8(2) SPECDEC_INT8(3) SPECDEC_INT8(4)
        SPECDEC_INT8(5) SPECDEC_INT8(6) SPECDEC_INT8(7) SPECDEC_INT8(8)
    }
}

int specdec_quantized_linear_int8(int bits, const float* x, int64_t ldx, int64_t rows, int64_t k,
                                  const uint8_t* codes, const uint16_t* d, const uint16_t* m, int64_t n,
                                  const float* bias, const float* add, float* y, int threads) {
    if (k % 32 || n % 16 || (bits != 4 && bits != 8) || !specdec_int8_available()) return 1;
    qweight w = {bits, k, n, k / 32, bits == 4 ? 256 : 512, codes, d, m};
    int8_t* xq = malloc(rows * k + 64);
    float* xd = malloc(sizeof(float) * rows * w.blocks + 64);
    int32_t* xs = malloc(sizeof(int32_t) * rows * w.blocks + 64);
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return 2;
    }
    for (int64_t r = 0; r < rows; r++)
        quantize_inputs(bits, x + r * ldx, k, xq + r * k, xd + r * w.blocks, xs + r * w.blocks);
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (threads > 1)
    {
        __m512 out[16];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < n / 16; g++)
            for (int64_t r0 = 0; r0 < rows; r0 += 8) {
                const int R = rows - r0 < 8 ? (int)(rows - r0) : 8;
                int8_rows(&w, R, xq + r0 * k, xd + r0 * w.blocks, xs + r0 * w.blocks, g, out);
                store(out, R, 1, r0, 16 * g, n, bias, add, y);
            }
    }
    free(xq), free(xd), free(xs);
    return 0;
}
#else
int specdec_quantized_available(void) { return 0; }
int specdec_int8_available(void) { return 0; }
int specdec_quantized_linear_int8(int bits, const float* x, int64_t ldx, int64_t rows, int64_t k,
                                  const uint8_t* codes, const uint16_t* d, const uint16_t* m, int64_t n,
                                  const float* bias, const float* add, float* y, int threads) {
    return 1;
}
int specdec_quantized_linear(int bits, const float* x, int64_t ldx, int64_t rows, int64_t k, const uint8_t* codes,
                             const uint16_t* d, const uint16_t* m, int64_t n, const float* bias, const float* add,
                             float* y, int threads) {
    return 1;
}
#endif
