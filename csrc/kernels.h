// Compute kernels, one set per instruction-set level, chosen once at load (runtime dispatch).
//
// Every weight row is read in its stored type. The activation operand of a dot product is f32 for
// f32/f16 weights and q8_0 blocks for q4_0/q8_0 weights (integer dot products, as llama.cpp).
// Every set computes the same functions; tests compare each against the scalar reference.
#pragma once

#include <cstddef>
#include <cstdint>

#include "types.h"

namespace pi {

struct TypeKernels {
    // sum_i w[i] * x[i] over n elements (n a multiple of the type's block size)
    float (*dot)(int n, const void *w, const void *x);
    // y[i] += a * w[i]
    void (*axpy)(int n, float a, const void *w, float *y);
    // out[i] = w[i]
    void (*to_float)(int n, const void *w, float *out);
};

struct KernelSet {
    const char *isa;
    TypeKernels f32, f16, q4_0, q8_0;
    // x (n floats, n % 32 == 0) -> n/32 q8_0 blocks, bit-exact with gguf-py's Q8_0 quantizer
    void (*quantize_q8_0)(int n, const float *x, void *out);

    const TypeKernels &for_type(uint32_t type) const {
        switch (type) {
            case TYPE_F16: return f16;
            case TYPE_Q4_0: return q4_0;
            case TYPE_Q8_0: return q8_0;
            default: return f32;
        }
    }
};

// Whether the activation operand of `type` is q8_0 blocks (else f32).
inline bool act_is_q8(uint32_t type) { return type == TYPE_Q4_0 || type == TYPE_Q8_0; }

const KernelSet &scalar_kernels();
// nullptr when the build or the CPU lacks the instruction set.
const KernelSet *avx2_kernels();

// "scalar", "avx2"; nullptr when unknown or unavailable.
const KernelSet *kernels_named(const char *isa);
// The best available set, selected on first use.
const KernelSet &best_kernels();

}  // namespace pi
