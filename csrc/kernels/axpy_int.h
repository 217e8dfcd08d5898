// The q4_0 axpy_rows in integers: y += sum_r a[r] * w[r] over rows of q4_0 blocks (a down projection over
// ffn_down_t, a row per neuron), defined once here for the scalar reference, every SIMD set and the device tier.
// (q8_0 rows stay in floats: a block's 34 bytes hold 32 values, and the float FMAs keep up with them.)
//
// Rows go in groups of kAxpyGroup, in order. For each group and block k of the columns, the row coefficients
// folded with their block scales, c_r = a[r] * d_r,k, are rounded to integers against the group's largest,
// q_r = nearbyint(c_r * kAxpySteps / m) with m = max_r |c_r|, the products q_r * w_r,k,j summed exactly as integers
// (t_j), and y_j = fma(t_j, m / kAxpySteps, y_j). kAxpySteps = 127 * 128 keeps q within two signed bytes,
// q = 128 hi + lo, hi in [-127, 127] and lo in [-64, 63]: the SIMD sets multiply the weight bytes by hi and lo
// with integer dot products (VNNI's vpdpbusd), as llama.cpp's q8 x q4 dot products do, here along the rows.
// A coefficient carries 14 bits against its group's largest: the rounding moves a term by at most 2^-15 of the
// largest. A group whose block holds no nonzero coefficient adds nothing; one with an inf or NaN coefficient, or
// whose largest is too small for m's reciprocal to be finite, is summed in floats, row after row
// (axpy_group_column): inf and NaN still reach y.
#pragma once

#include <cmath>
#include <cstdint>

#include "format/types.h"

namespace pi {

constexpr int kAxpyGroup = 32;          // rows sharing one integer scale per block
constexpr float kAxpySteps = 16256.0f;  // 127 * 128
constexpr float kAxpyMinLargest = 1e-30f;  // a smaller m goes through floats (kAxpySteps / m would overflow)

// Element j of a block as a signed integer.
PI_HD inline int32_t block_value(const BlockQ4_0 &b, int j) {
    return j < QK / 2 ? int32_t(b.qs[j] & 0x0f) - 8 : int32_t(b.qs[j - QK / 2] >> 4) - 8;
}

// Whether a coefficient takes the integer path (finite).
PI_HD inline bool axpy_coef_finite(float c) { return fabsf(c) <= 3.40282347e38f; }

// a * b + c with the product rounded first, whatever the compiler's contraction (the float path's sums).
PI_HD inline float unfused_mul_add(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(__fmul_rn(a, b), c);
#else
    const volatile float p = a * b;
    return p + c;
#endif
}

// One group's terms in one column, added to y: coefficients c[r] (h * block scale) and the column's weights v[r],
// n rows. The rule every path computes (the scalar set per column, the SIMD sets' float path, the device tier).
PI_HD inline float axpy_group_column(const float *c, const int32_t *v, int n, float y) {
    float m = 0.0f;
    bool finite = true;
    for (int r = 0; r < n; ++r) {
        finite = finite && axpy_coef_finite(c[r]);
        m = fmaxf(m, fabsf(c[r]));
    }
    if (m == 0.0f && finite) return y;
    if (!finite || m < kAxpyMinLargest) {  // floats, rows in order
        for (int r = 0; r < n; ++r) y = unfused_mul_add(c[r], float(v[r]), y);
        return y;
    }
    const float inv = kAxpySteps / m, s = m / kAxpySteps;
    int32_t t = 0;
    for (int r = 0; r < n; ++r) t += int32_t(nearbyintf(c[r] * inv)) * v[r];
    return fmaf(float(t), s, y);
}

// One group's block k (coefficients c) into y[0, 32), column by column.
inline void axpy_group_block(int n_rows, const void *const *w, int k, const float *c, float *y) {
    for (int j = 0; j < QK; ++j) {
        int32_t v[kAxpyGroup];
        for (int r = 0; r < n_rows; ++r) v[r] = block_value(static_cast<const BlockQ4_0 *>(w[r])[k], j);
        y[j] = axpy_group_column(c, v, n_rows, y[j]);
    }
}

// The definition, plainly: blocks [col0 / QK, (col0 + n) / QK) of each row into y[0, n).
inline void axpy_rows_q4_0_reference(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    const int k0 = col0 / QK, nb = n / QK;
    for (int g = 0; g < n_rows; g += kAxpyGroup) {
        const int m_rows = n_rows - g < kAxpyGroup ? n_rows - g : kAxpyGroup;
        for (int k = 0; k < nb; ++k) {
            float c[kAxpyGroup];
            for (int r = 0; r < m_rows; ++r) c[r] = a[g + r] * f16_to_f32(static_cast<const BlockQ4_0 *>(w[g + r])[k0 + k].d);
            axpy_group_block(m_rows, w + g, k0 + k, c, y + k * QK);
        }
    }
}

}  // namespace pi
