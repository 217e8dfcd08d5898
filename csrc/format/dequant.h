// Every GGML weight type the engine reads, as floats: ggml's reference dequantization (ggml-quants.c,
// dequantize_row_*), value for value, in the block layouts of ggml-common.h. The engine computes f32, f16,
// q4_0 and q8_0 directly (types.h); the others are decoded at load (model/decode.h).
#pragma once

#include <cstdint>

namespace pi {

// f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0 and q2_K to q6_K: the types people download (llama.cpp's
// quantizer and convert scripts write them).
bool type_readable(uint32_t type);
// "f32, f16, bf16, q4_0, ...": the readable types, for messages.
const char *readable_type_names();
// n values (a whole number of blocks) of a readable type at src, as floats.
void dequantize_row(uint32_t type, const uint8_t *src, float *dst, int64_t n);

}  // namespace pi
