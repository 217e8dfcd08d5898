// A q8_0 KV cache as the w operand of a gemm (KernelSet::gemm_q8_rows / gemm_q8_columns): int8 elements, each
// block of 32 with an f16 scale (llama.cpp's q8_0 block, its two parts in two arrays so that a key tile's rows
// stay contiguous), read as element * scale (one f32 rounding) wherever a gemm reads a widened element.
#pragma once

#include <cstdint>

#include "format/types.h"

namespace pi {

constexpr int64_t kKvKeyTile = 64;  // positions per tile of a kv head's keys (RunState's kKeyTile)

// Values [position][d_head]: blocks run along a row, so element e's scale is s[e / 32] (d_head % 32 == 0).
struct Q8Rows {
    const int8_t *q;
    const uint16_t *s;
    int64_t e = 0;  // the element this view starts at, from q (and from the first scale of s)
    Q8Rows operator+(int64_t k) const { return {q, s, e + k}; }
    static int64_t scale_of(int64_t i) { return i / QK; }
    float operator[](int64_t k) const { return float(q[e + k]) * f16_to_f32(s[scale_of(e + k)]); }
};

// Keys in tiles [d_head][kKvKeyTile]: a position's blocks run down its column, so element e (row e / 64,
// column e % 64) has scale s[e / (32 * 64) * 64 + e % 64].
struct Q8Columns {
    const int8_t *q;
    const uint16_t *s;
    int64_t e = 0;
    Q8Columns operator+(int64_t k) const { return {q, s, e + k}; }
    static int64_t scale_of(int64_t i) { return i / (QK * kKvKeyTile) * kKvKeyTile + i % kKvKeyTile; }
    float operator[](int64_t k) const { return float(q[e + k]) * f16_to_f32(s[scale_of(e + k)]); }
};

}  // namespace pi
