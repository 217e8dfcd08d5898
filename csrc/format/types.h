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

enum GgmlType : uint32_t { TYPE_F32 = 0, TYPE_F16 = 1, TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7,
                           TYPE_Q8_0 = 8, TYPE_Q2_K = 10, TYPE_Q3_K = 11, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14,
                           TYPE_I32 = 26, TYPE_BF16 = 30 };
// PowerInfer's ggml (ggml.h's enum ggml_type, before the i-quants took ids 16..23) numbers i32 18, the id
// later ggml gives iq3_xxs: its gpu-index files carry that code, which is read as i32 in such a file only.
constexpr uint32_t TYPE_I32_POWERINFER = 18;

struct TypeSize {
    uint32_t block;  // elements per block (0: unknown type id)
    uint32_t bytes;  // bytes per block
    const char *name;
};

// Sizes of every GGML type id (so a file naming a type we cannot compute with is still parsed and
// reported precisely); block == 0 for ids that are not types. A switch, not a table, so that device code
// (csrc/device/) reads the same sizes.
PI_HD constexpr TypeSize type_size(uint32_t type) {
    switch (type) {
        case 0: return {1, 4, "f32"};
        case 1: return {1, 2, "f16"};
        case 2: return {32, 18, "q4_0"};
        case 3: return {32, 20, "q4_1"};
        case 6: return {32, 22, "q5_0"};
        case 7: return {32, 24, "q5_1"};
        case 8: return {32, 34, "q8_0"};
        case 9: return {32, 40, "q8_1"};
        case 10: return {256, 84, "q2_K"};
        case 11: return {256, 110, "q3_K"};
        case 12: return {256, 144, "q4_K"};
        case 13: return {256, 176, "q5_K"};
        case 14: return {256, 210, "q6_K"};
        case 15: return {256, 292, "q8_K"};
        case 16: return {256, 66, "iq2_xxs"};
        case 17: return {256, 74, "iq2_xs"};
        case 18: return {256, 98, "iq3_xxs"};
        case 19: return {256, 50, "iq1_s"};
        case 20: return {32, 18, "iq4_nl"};
        case 21: return {256, 110, "iq3_s"};
        case 22: return {256, 82, "iq2_s"};
        case 23: return {256, 136, "iq4_xs"};
        case 24: return {1, 1, "i8"};
        case 25: return {1, 2, "i16"};
        case 26: return {1, 4, "i32"};
        case 27: return {1, 8, "i64"};
        case 28: return {1, 8, "f64"};
        case 29: return {256, 56, "iq1_m"};
        case 30: return {1, 2, "bf16"};
        case 34: return {256, 54, "tq1_0"};
        case 35: return {256, 66, "tq2_0"};
        case 39: return {32, 17, "mxfp4"};
        case 40: return {64, 36, "nvfp4"};
        case 41: return {128, 18, "q1_0"};
        default: return {0, 0, nullptr};
    }
}
// f32, f16, q4_0 and q8_0: the types the kernels compute with.
PI_HD constexpr bool type_computable(uint32_t type) {
    return type == TYPE_F32 || type == TYPE_F16 || type == TYPE_Q4_0 || type == TYPE_Q8_0;
}
// (Other types a file may hold are decoded at load to one of these: format/dequant.h, model/decode.h.)

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
PI_HD inline uint16_t f32_to_f16(float f) {
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
