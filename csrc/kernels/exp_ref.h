// e^x and SiLU by fixed steps: the definitions every kernel set reproduces bit for bit, and the device tier
// (csrc/device/) computes with, so that a neuron's activation is the same number wherever it is computed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "format/types.h"

namespace pi {

// 2^n for -126 <= n <= 127, from its exponent bits.
PI_HD inline float ldexp_bits(int n) {
    const uint32_t bits = uint32_t(n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// e^x with exp as a degree-6 polynomial on [-ln2/2, ln2/2] times 2^n (Cephes' expf steps, each an fma), clamped
// to [-87.3, 88.3], infinity above.
PI_HD inline float exp_ref(float x) {
    const float v = fminf(fmaxf(x, -87.3f), 88.3f);  // 2^n stays a normal float
    const float n = floorf(fmaf(v, 1.44269504088896341f, 0.5f));
    float r = fmaf(n, -0.693359375f, v);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float e = (fmaf(p, r * r, r) + 1.0f) * ldexp_bits(int(n));
    return x > 88.3f ? INFINITY : e;  // past the clamp
}

// x * sigmoid(x): within 2 ulp of the exact value; above 88.3, x / inf: sigmoid 0.
PI_HD inline float silu_ref(float x) { return x / (1.0f + exp_ref(-x)); }

// GELU, tanh-approximated as torch's gelu(approximate="tanh") (transformers' gelu_pytorch_tanh)
PI_HD inline float gelu_ref(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x))); }

}  // namespace pi
