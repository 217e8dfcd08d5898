// The scalar reference kernels: plain C++, the definition every SIMD set is tested against.
#include <cmath>

#include "kernels.h"

namespace pi {
namespace {

float dot_f32(int n, const void *w, const void *x) {
    const float *a = static_cast<const float *>(w), *b = static_cast<const float *>(x);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

float dot_f16(int n, const void *w, const void *x) {
    const uint16_t *a = static_cast<const uint16_t *>(w);
    const float *b = static_cast<const float *>(x);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += f16_to_f32(a[i]) * b[i];
    return sum;
}

float dot_q8_0(int n, const void *w, const void *x) {
    const BlockQ8_0 *a = static_cast<const BlockQ8_0 *>(w), *b = static_cast<const BlockQ8_0 *>(x);
    float sum = 0.0f;
    for (int k = 0; k < n / QK; ++k) {
        int32_t isum = 0;
        for (int i = 0; i < QK; ++i) isum += int32_t(a[k].qs[i]) * int32_t(b[k].qs[i]);
        sum += f16_to_f32(a[k].d) * f16_to_f32(b[k].d) * float(isum);
    }
    return sum;
}

float dot_q4_0(int n, const void *w, const void *x) {
    const BlockQ4_0 *a = static_cast<const BlockQ4_0 *>(w);
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(x);
    float sum = 0.0f;
    for (int k = 0; k < n / QK; ++k) {
        int32_t isum = 0;
        for (int i = 0; i < QK / 2; ++i) {
            isum += (int32_t(a[k].qs[i] & 0x0f) - 8) * int32_t(b[k].qs[i]);
            isum += (int32_t(a[k].qs[i] >> 4) - 8) * int32_t(b[k].qs[i + QK / 2]);
        }
        sum += f16_to_f32(a[k].d) * f16_to_f32(b[k].d) * float(isum);
    }
    return sum;
}

void to_float_f32(int n, const void *w, float *out) {
    const float *a = static_cast<const float *>(w);
    for (int i = 0; i < n; ++i) out[i] = a[i];
}

void to_float_f16(int n, const void *w, float *out) {
    const uint16_t *a = static_cast<const uint16_t *>(w);
    for (int i = 0; i < n; ++i) out[i] = f16_to_f32(a[i]);
}

void to_float_q8_0(int n, const void *w, float *out) {
    const BlockQ8_0 *a = static_cast<const BlockQ8_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float d = f16_to_f32(a[k].d);
        for (int i = 0; i < QK; ++i) out[k * QK + i] = float(a[k].qs[i]) * d;
    }
}

void to_float_q4_0(int n, const void *w, float *out) {
    const BlockQ4_0 *a = static_cast<const BlockQ4_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float d = f16_to_f32(a[k].d);
        for (int i = 0; i < QK / 2; ++i) {
            out[k * QK + i] = float(int(a[k].qs[i] & 0x0f) - 8) * d;
            out[k * QK + i + QK / 2] = float(int(a[k].qs[i] >> 4) - 8) * d;
        }
    }
}

void axpy_f32(int n, float a, const void *w, float *y) {
    const float *b = static_cast<const float *>(w);
    for (int i = 0; i < n; ++i) y[i] += a * b[i];
}

void axpy_f16(int n, float a, const void *w, float *y) {
    const uint16_t *b = static_cast<const uint16_t *>(w);
    for (int i = 0; i < n; ++i) y[i] += a * f16_to_f32(b[i]);
}

void axpy_q8_0(int n, float a, const void *w, float *y) {
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float s = a * f16_to_f32(b[k].d);  // the block scale folded into the coefficient
        for (int i = 0; i < QK; ++i) y[k * QK + i] += s * float(b[k].qs[i]);
    }
}

void axpy_q4_0(int n, float a, const void *w, float *y) {
    const BlockQ4_0 *b = static_cast<const BlockQ4_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float s = a * f16_to_f32(b[k].d);
        for (int i = 0; i < QK / 2; ++i) {
            y[k * QK + i] += s * float(int(b[k].qs[i] & 0x0f) - 8);
            y[k * QK + i + QK / 2] += s * float(int(b[k].qs[i] >> 4) - 8);
        }
    }
}

// roundf: half away from zero, as ggml's reference and gguf-py's np_roundf.
void quantize_q8_0(int n, const float *x, void *out) {
    BlockQ8_0 *b = static_cast<BlockQ8_0 *>(out);
    for (int k = 0; k < n / QK; ++k) {
        float amax = 0.0f;
        for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(x[k * QK + i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[k].d = f32_to_f16(d);
        for (int i = 0; i < QK; ++i) {
            const float r = std::roundf(x[k * QK + i] * id);
            b[k].qs[i] = (r >= -127.0f && r <= 127.0f) ? int8_t(r) : int8_t(0);  // nan/inf from broken weights
        }
    }
}

#define PI_TYPE_KERNELS(T, TYPE) \
    {dot_##T, axpy_##T, to_float_##T, dot4_by_rows<dot_##T>, axpy_rows_by_row<axpy_##T, TYPE>}

const KernelSet kScalar = {
    "scalar",
    PI_TYPE_KERNELS(f32, TYPE_F32),
    PI_TYPE_KERNELS(f16, TYPE_F16),
    PI_TYPE_KERNELS(q4_0, TYPE_Q4_0),
    PI_TYPE_KERNELS(q8_0, TYPE_Q8_0),
    quantize_q8_0,
};

}  // namespace

const KernelSet &scalar_kernels() { return kScalar; }

}  // namespace pi
