// GGML tensor types: block sizes for every type a GGUF file may name, the block layouts of the
// types the engine computes with, and exact IEEE half <-> float conversion.
#pragma once

#include <cstdint>
#include <cstring>

// Functions that a device compiler (nvcc, for csrc/device/) also compiles for the device.
#ifdef __CUDACC__
#define PI_HD __host__ __device__
#else
#define PI_HD
#endif

namespace pi {

enum GgmlType : uint32_t { TYPE_F32 = 0, TYPE_F16 = 1, TYPE_Q4_0 = 2, TYPE_Q5_0 = 6, TYPE_Q8_0 = 8, TYPE_Q6_K = 14,
                           TYPE_I32 = 26 };
// PowerInfer's ggml (ggml.h's enum ggml_type, before the i-quants took ids 16..23) numbers i32 18, the id
// later ggml gives iq3_xxs: its gpu-index files carry that code, which is read as i32 in such a file only.
constexpr uint32_t TYPE_I32_POWERINFER = 18;

struct TypeSize {
    uint32_t block;  // elements per block (0: unknown type id)
    uint32_t bytes;  // bytes per block
    const char *name;
};

// Sizes of every GGML type id (so a file naming a type we cannot compute with is still parsed and
// reported precisely); block == 0 for ids that are not types.
TypeSize type_size(uint32_t type);
// f32, f16, q4_0 and q8_0: the types the kernels compute with.
bool type_computable(uint32_t type);
// q5_0 and q6_K: what PowerInfer's quantizer makes of the predictors (all but q4_0 files) and of output.weight
// (k-quant-able rows), which the engine decodes once at load instead of computing with.
bool type_decodable(uint32_t type);
// n values (a whole number of blocks) of a decodable type at src, as floats.
void dequantize_row(uint32_t type, const uint8_t *src, float *dst, int64_t n);

constexpr int QK = 32;  // elements per q4_0 / q8_0 block

struct BlockQ8_0 {
    uint16_t d;  // f16 scale
    int8_t qs[QK];
};
struct BlockQ4_0 {
    uint16_t d;         // f16 scale
    uint8_t qs[QK / 2];  // element j in the low nibble of byte j, element j+16 in the high nibble
};
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 block layout");
static_assert(sizeof(BlockQ4_0) == 18, "q4_0 block layout");

PI_HD inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal half: normalise
        int e = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            --e;
        }
        bits = sign | (uint32_t(e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Round to nearest even, as numpy's astype(float16) and the F16C instructions do.
inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));  // inf / nan
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds past the largest half: inf
    if (ax < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        if (ax < 0x33000000u) return sign;  // below half the smallest subnormal
        const uint32_t e = ax >> 23;
        const uint32_t m = (ax & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - e;  // 14..24
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1);
        const uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (r & 1))) ++r;
        return uint16_t(sign | r);
    }
    uint32_t r = ((ax >> 13) - (112u << 10));
    const uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
    return uint16_t(sign | r);
}

}  // namespace pi
