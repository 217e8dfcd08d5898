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

PI_AVX2 inline __m256i block_values(const BlockQ4_0 &b) { return unpack_q4_0(b.qs); }
PI_AVX2 inline __m256i block_values(const BlockQ8_0 &b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b.qs));
}

// The dot kernels are written for R rows sharing the operand x (R = 1: dot, R = 4: dot4). Each row
// keeps its own accumulators and reduction, so a row's result does not depend on R.

template <int R>
PI_AVX2 inline void dot_f32_rows(int n, const void *const *w, const void *x, float *out) {
    const float *b = static_cast<const float *>(x);
    const float *a[R];
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) {
        a[r] = static_cast<const float *>(w[r]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    }
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256 b0 = _mm256_loadu_ps(b + i), b1 = _mm256_loadu_ps(b + i + 8), b2 = _mm256_loadu_ps(b + i + 16),
                     b3 = _mm256_loadu_ps(b + i + 24);
        for (int r = 0; r < R; ++r) {
            acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i), b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i + 8), b1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i + 16), b2, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i + 24), b3, acc[r][3]);
        }
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 b0 = _mm256_loadu_ps(b + i);
        for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r] + i), b0, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
        float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
        for (int k = i; k < n; ++k) sum += a[r][k] * b[k];
        out[r] = sum;
    }
}

PI_AVX2 inline __m256 load8_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

template <int R>
PI_AVX2 inline void dot_f16_rows(int n, const void *const *w, const void *x, float *out) {
    const float *b = static_cast<const float *>(x);
    const uint16_t *a[R];
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
        a[r] = static_cast<const uint16_t *>(w[r]);
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 b0 = _mm256_loadu_ps(b + i), b1 = _mm256_loadu_ps(b + i + 8);
        for (int r = 0; r < R; ++r) {
            acc[r][0] = _mm256_fmadd_ps(load8_f16(a[r] + i), b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(load8_f16(a[r] + i + 8), b1, acc[r][1]);
        }
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 b0 = _mm256_loadu_ps(b + i);
        for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(load8_f16(a[r] + i), b0, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
        float sum = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        for (int k = i; k < n; ++k) sum += f16_to_f32(a[r][k]) * b[k];
        out[r] = sum;
    }
}

// q4_0 and q8_0 rows against q8_0 blocks of x: integer products per block, scaled by the two f16
// scales (converted with F16C: exact, as f16_to_f32).
template <class Block, int R>
PI_AVX2 inline void dot_q_rows(int n, const void *const *w, const void *x, float *out) {
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(x);
    const Block *a[R];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
        a[r] = static_cast<const Block *>(w[r]);
        acc[r] = _mm256_setzero_ps();
    }
    for (int k = 0; k < n / QK; ++k) {
        const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[k].qs));
        const float db = _cvtsh_ss(b[k].d);
        for (int r = 0; r < R; ++r) {
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(a[r][k].d) * db);
            acc[r] = _mm256_fmadd_ps(d, dot_i8x32(block_values(a[r][k]), qb), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

PI_AVX2 float dot_f32(int n, const void *w, const void *x) {
    float out;
    dot_f32_rows<1>(n, &w, x, &out);
    return out;
}
PI_AVX2 void dot4_f32(int n, const void *const *w, const void *x, float *out) { dot_f32_rows<4>(n, w, x, out); }
PI_AVX2 float dot_f16(int n, const void *w, const void *x) {
    float out;
    dot_f16_rows<1>(n, &w, x, &out);
    return out;
}
PI_AVX2 void dot4_f16(int n, const void *const *w, const void *x, float *out) { dot_f16_rows<4>(n, w, x, out); }
PI_AVX2 float dot_q4_0(int n, const void *w, const void *x) {
    float out;
    dot_q_rows<BlockQ4_0, 1>(n, &w, x, &out);
    return out;
}
PI_AVX2 void dot4_q4_0(int n, const void *const *w, const void *x, float *out) {
    dot_q_rows<BlockQ4_0, 4>(n, w, x, out);
}
PI_AVX2 float dot_q8_0(int n, const void *w, const void *x) {
    float out;
    dot_q_rows<BlockQ8_0, 1>(n, &w, x, &out);
    return out;
}
PI_AVX2 void dot4_q8_0(int n, const void *const *w, const void *x, float *out) {
    dot_q_rows<BlockQ8_0, 4>(n, w, x, out);
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

// The 32 values of a quantized block as 4 vectors of 8 floats, q * d (exactly to_float's values).
PI_AVX2 inline void spread(__m256i q, __m256 d, __m256 v[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    v[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
    v[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
    v[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
    v[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
}

template <class Block>
PI_AVX2 inline void block_floats(const Block &b, __m256 v[4]) {
    spread(block_values(b), _mm256_set1_ps(_cvtsh_ss(b.d)), v);
}

template <class Block>
PI_AVX2 inline void to_float_q(int n, const void *w, float *out) {
    const Block *a = static_cast<const Block *>(w);
    __m256 v[4];
    for (int k = 0; k < n / QK; ++k) {
        block_floats(a[k], v);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + k * QK + 8 * j, v[j]);
    }
}

template <class Block>
PI_AVX2 inline void axpy_q(int n, float a, const void *w, float *y) {
    const Block *b = static_cast<const Block *>(w);
    const __m256 va = _mm256_set1_ps(a);
    __m256 v[4];
    for (int k = 0; k < n / QK; ++k) {
        block_floats(b[k], v);
        float *yk = y + k * QK;
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(yk + 8 * j, _mm256_fmadd_ps(va, v[j], _mm256_loadu_ps(yk + 8 * j)));
    }
}

PI_AVX2 void to_float_q8_0(int n, const void *w, float *out) { to_float_q<BlockQ8_0>(n, w, out); }
PI_AVX2 void to_float_q4_0(int n, const void *w, float *out) { to_float_q<BlockQ4_0>(n, w, out); }

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
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8_f16(b + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * f16_to_f32(b[i]);
}

PI_AVX2 void axpy_q8_0(int n, float a, const void *w, float *y) { axpy_q<BlockQ8_0>(n, a, w, y); }
PI_AVX2 void axpy_q4_0(int n, float a, const void *w, float *y) { axpy_q<BlockQ4_0>(n, a, w, y); }

// axpy_rows: rows go in groups of kRowGroup (a few KB, L1-resident); for each group, y[c, c+64) lives
// in 8 registers while the group's rows add into it, and the next group's slices are prefetched while
// the first column chunk runs. Every element still sums the rows in order, as the single-row axpy, so
// the result is bit-identical; columns left over (fewer than 8 floats) go through that axpy.
constexpr int kRowGroup = 32;

PI_AVX2 inline void prefetch_slice(const void *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char *>(p) + off, _MM_HINT_T0);
}

PI_AVX2 inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
PI_AVX2 inline __m256 load8(const uint16_t *p) { return load8_f16(p); }

template <class T, void (*Axpy)(int, float, const void *, float *)>
PI_AVX2 inline void axpy_rows_float(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    for (int g = 0; g < n_rows; g += kRowGroup) {
        const int ge = n_rows < g + kRowGroup ? n_rows : g + kRowGroup;
        for (int r = ge; r < n_rows && r < ge + kRowGroup; ++r)
            prefetch_slice(static_cast<const T *>(w[r]) + col0, n * int(sizeof(T)));
        int c = 0;
        for (; c + 64 <= n; c += 64) {
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_loadu_ps(y + c + 8 * j);
            for (int r = g; r < ge; ++r) {
                const T *row = static_cast<const T *>(w[r]) + col0 + c;
                const __m256 va = _mm256_set1_ps(a[r]);
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(va, load8(row + 8 * j), acc[j]);
            }
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(y + c + 8 * j, acc[j]);
        }
        for (; c + 8 <= n; c += 8) {
            __m256 acc = _mm256_loadu_ps(y + c);
            for (int r = g; r < ge; ++r)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(a[r]), load8(static_cast<const T *>(w[r]) + col0 + c), acc);
            _mm256_storeu_ps(y + c, acc);
        }
        if (c < n)
            for (int r = g; r < ge; ++r) Axpy(n - c, a[r], static_cast<const T *>(w[r]) + col0 + c, y + c);
    }
}

template <class Block>
PI_AVX2 inline void axpy_rows_q(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    const int k0 = col0 / QK;
    __m256 v[4];
    for (int g = 0; g < n_rows; g += kRowGroup) {
        const int ge = n_rows < g + kRowGroup ? n_rows : g + kRowGroup;
        for (int r = ge; r < n_rows && r < ge + kRowGroup; ++r)
            prefetch_slice(static_cast<const Block *>(w[r]) + k0, n / QK * int(sizeof(Block)));
        int c = 0;
        for (; c + 2 * QK <= n; c += 2 * QK) {
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_loadu_ps(y + c + 8 * j);
            for (int r = g; r < ge; ++r) {
                const Block *b = static_cast<const Block *>(w[r]) + k0 + c / QK;
                const __m256 va = _mm256_set1_ps(a[r]);
                block_floats(b[0], v);
                for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(va, v[j], acc[j]);
                block_floats(b[1], v);
                for (int j = 0; j < 4; ++j) acc[4 + j] = _mm256_fmadd_ps(va, v[j], acc[4 + j]);
            }
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(y + c + 8 * j, acc[j]);
        }
        if (c < n) {  // one block left
            __m256 acc[4];
            for (int j = 0; j < 4; ++j) acc[j] = _mm256_loadu_ps(y + c + 8 * j);
            for (int r = g; r < ge; ++r) {
                block_floats(static_cast<const Block *>(w[r])[k0 + c / QK], v);
                const __m256 va = _mm256_set1_ps(a[r]);
                for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(va, v[j], acc[j]);
            }
            for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + c + 8 * j, acc[j]);
        }
    }
}

PI_AVX2 void axpy_rows_f32(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    axpy_rows_float<float, axpy_f32>(n, n_rows, w, col0, a, y);
}
PI_AVX2 void axpy_rows_f16(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    axpy_rows_float<uint16_t, axpy_f16>(n, n_rows, w, col0, a, y);
}
PI_AVX2 void axpy_rows_q8_0(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    axpy_rows_q<BlockQ8_0>(n, n_rows, w, col0, a, y);
}
PI_AVX2 void axpy_rows_q4_0(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    axpy_rows_q<BlockQ4_0>(n, n_rows, w, col0, a, y);
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
    {dot_f32, axpy_f32, to_float_f32, dot4_f32, axpy_rows_f32},
    {dot_f16, axpy_f16, to_float_f16, dot4_f16, axpy_rows_f16},
    {dot_q4_0, axpy_q4_0, to_float_q4_0, dot4_q4_0, axpy_rows_q4_0},
    {dot_q8_0, axpy_q8_0, to_float_q8_0, dot4_q8_0, axpy_rows_q8_0},
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
