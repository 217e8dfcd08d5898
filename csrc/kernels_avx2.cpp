// AVX2 + FMA + F16C kernels. Compiled with per-function target attributes so that the rest of the
// library stays portable; only called after the CPU has been checked (kernels_dispatch.cpp).
#include "kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define PI_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace pi {
namespace {

PI_AVX2 inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 shuf = _mm_movehdup_ps(lo);
    __m128 sums = _mm_add_ps(lo, shuf);
    shuf = _mm_movehl_ps(shuf, sums);
    return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}

// 32 signed bytes of weights times 32 signed bytes of activations (never -128), as 8 int32 sums.
PI_AVX2 inline __m256 dot_i8x32(__m256i w, __m256i x) {
    const __m256i aw = _mm256_sign_epi8(w, w);
    const __m256i sx = _mm256_sign_epi8(x, w);
    const __m256i p16 = _mm256_maddubs_epi16(aw, sx);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// The 32 values of a q4_0 block as signed bytes in element order.
PI_AVX2 inline __m256i unpack_q4_0(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0f)), _mm256_set1_epi8(8));
}

PI_AVX2 float dot_f32(int n, const void *w, const void *x) {
    const float *a = static_cast<const float *>(w), *b = static_cast<const float *>(x);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

PI_AVX2 float dot_f16(int n, const void *w, const void *x) {
    const uint16_t *a = static_cast<const uint16_t *>(w);
    const float *b = static_cast<const float *>(x);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(a + i)));
        const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(a + i + 8)));
        acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(a + i)));
        acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b + i), acc0);
    }
    float sum = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; ++i) sum += f16_to_f32(a[i]) * b[i];
    return sum;
}

PI_AVX2 float dot_q8_0(int n, const void *w, const void *x) {
    const BlockQ8_0 *a = static_cast<const BlockQ8_0 *>(w), *b = static_cast<const BlockQ8_0 *>(x);
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < n / QK; ++k) {
        const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a[k].qs));
        const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[k].qs));
        const __m256 d = _mm256_set1_ps(f16_to_f32(a[k].d) * f16_to_f32(b[k].d));
        acc = _mm256_fmadd_ps(d, dot_i8x32(qa, qb), acc);
    }
    return hsum(acc);
}

PI_AVX2 float dot_q4_0(int n, const void *w, const void *x) {
    const BlockQ4_0 *a = static_cast<const BlockQ4_0 *>(w);
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(x);
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < n / QK; ++k) {
        const __m256i qa = unpack_q4_0(a[k].qs);
        const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[k].qs));
        const __m256 d = _mm256_set1_ps(f16_to_f32(a[k].d) * f16_to_f32(b[k].d));
        acc = _mm256_fmadd_ps(d, dot_i8x32(qa, qb), acc);
    }
    return hsum(acc);
}

// 8 signed bytes at p, widened to floats.
PI_AVX2 inline __m256 i8x8_to_f32(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}

PI_AVX2 void to_float_f32(int n, const void *w, float *out) {
    const float *a = static_cast<const float *>(w);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_loadu_ps(a + i));
    for (; i < n; ++i) out[i] = a[i];
}

PI_AVX2 void to_float_f16(int n, const void *w, float *out) {
    const uint16_t *a = static_cast<const uint16_t *>(w);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(a + i))));
    for (; i < n; ++i) out[i] = f16_to_f32(a[i]);
}

PI_AVX2 void to_float_q8_0(int n, const void *w, float *out) {
    const BlockQ8_0 *a = static_cast<const BlockQ8_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const __m256 d = _mm256_set1_ps(f16_to_f32(a[k].d));
        for (int j = 0; j < QK; j += 8) _mm256_storeu_ps(out + k * QK + j, _mm256_mul_ps(i8x8_to_f32(a[k].qs + j), d));
    }
}

PI_AVX2 void to_float_q4_0(int n, const void *w, float *out) {
    const BlockQ4_0 *a = static_cast<const BlockQ4_0 *>(w);
    alignas(32) int8_t q[QK];
    for (int k = 0; k < n / QK; ++k) {
        _mm256_store_si256(reinterpret_cast<__m256i *>(q), unpack_q4_0(a[k].qs));
        const __m256 d = _mm256_set1_ps(f16_to_f32(a[k].d));
        for (int j = 0; j < QK; j += 8) _mm256_storeu_ps(out + k * QK + j, _mm256_mul_ps(i8x8_to_f32(q + j), d));
    }
}

PI_AVX2 void axpy_f32(int n, float a, const void *w, float *y) {
    const float *b = static_cast<const float *>(w);
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(b + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * b[i];
}

PI_AVX2 void axpy_f16(int n, float a, const void *w, float *y) {
    const uint16_t *b = static_cast<const uint16_t *>(w);
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 wb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(b + i)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, wb, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; ++i) y[i] += a * f16_to_f32(b[i]);
}

PI_AVX2 void axpy_q8_0(int n, float a, const void *w, float *y) {
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(w);
    const __m256 va = _mm256_set1_ps(a);
    for (int k = 0; k < n / QK; ++k) {
        const __m256 d = _mm256_set1_ps(f16_to_f32(b[k].d));
        float *yk = y + k * QK;
        for (int j = 0; j < QK; j += 8) {
            const __m256 wv = _mm256_mul_ps(i8x8_to_f32(b[k].qs + j), d);
            _mm256_storeu_ps(yk + j, _mm256_fmadd_ps(va, wv, _mm256_loadu_ps(yk + j)));
        }
    }
}

PI_AVX2 void axpy_q4_0(int n, float a, const void *w, float *y) {
    const BlockQ4_0 *b = static_cast<const BlockQ4_0 *>(w);
    const __m256 va = _mm256_set1_ps(a);
    alignas(32) int8_t q[QK];
    for (int k = 0; k < n / QK; ++k) {
        _mm256_store_si256(reinterpret_cast<__m256i *>(q), unpack_q4_0(b[k].qs));
        const __m256 d = _mm256_set1_ps(f16_to_f32(b[k].d));
        float *yk = y + k * QK;
        for (int j = 0; j < QK; j += 8) {
            const __m256 wv = _mm256_mul_ps(i8x8_to_f32(q + j), d);
            _mm256_storeu_ps(yk + j, _mm256_fmadd_ps(va, wv, _mm256_loadu_ps(yk + j)));
        }
    }
}

// Round half away from zero (roundf), exactly: t = trunc(v); v - t is exact in float.
PI_AVX2 inline __m256i round_away(__m256 v) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_andnot_ps(sign_mask, _mm256_sub_ps(v, t));
    const __m256 one = _mm256_or_ps(_mm256_and_ps(v, sign_mask), _mm256_set1_ps(1.0f));
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one);
    return _mm256_cvtps_epi32(_mm256_add_ps(t, up));
}

PI_AVX2 void quantize_q8_0(int n, const float *x, void *out) {
    BlockQ8_0 *b = static_cast<BlockQ8_0 *>(out);
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int k = 0; k < n / QK; ++k) {
        const float *xk = x + k * QK;
        __m256 v[4];
        __m256 vmax = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(xk + 8 * j);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign_mask, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[k].d = f32_to_f16(d);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i i0 = round_away(_mm256_mul_ps(v[0], vid)), i1 = round_away(_mm256_mul_ps(v[1], vid));
        __m256i i2 = round_away(_mm256_mul_ps(v[2], vid)), i3 = round_away(_mm256_mul_ps(v[3], vid));
        const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(b[k].qs), p);
    }
}

const KernelSet kAvx2 = {
    "avx2",
    {dot_f32, axpy_f32, to_float_f32},
    {dot_f16, axpy_f16, to_float_f16},
    {dot_q4_0, axpy_q4_0, to_float_q4_0},
    {dot_q8_0, axpy_q8_0, to_float_q8_0},
    quantize_q8_0,
};

}  // namespace

const KernelSet *avx2_kernels() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return &kAvx2;
    return nullptr;
}

}  // namespace pi

#else

namespace pi {
const KernelSet *avx2_kernels() { return nullptr; }
}  // namespace pi

#endif
