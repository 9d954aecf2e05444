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
