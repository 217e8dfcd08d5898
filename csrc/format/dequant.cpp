#include "format/dequant.h"

#include <cstring>

#include "format/types.h"

namespace pi {

bool type_readable(uint32_t type) {
    switch (type) {
        case TYPE_F32: case TYPE_F16: case TYPE_BF16: case TYPE_Q4_0: case TYPE_Q4_1: case TYPE_Q5_0: case TYPE_Q5_1:
        case TYPE_Q8_0: case TYPE_Q2_K: case TYPE_Q3_K: case TYPE_Q4_K: case TYPE_Q5_K: case TYPE_Q6_K:
            return true;
        default:
            return false;
    }
}

const char *readable_type_names() { return "f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K"; }

namespace {

float f16_at(const uint8_t *p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return f16_to_f32(v);
}

uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// q4_0 (18 bytes per 32): f16 d, 16 bytes of nibbles (element j low, j + 16 high); value = d * (code - 8).
void q4_0(const uint8_t *b, float *y) {
    const float d = f16_at(b);
    for (int j = 0; j < 16; ++j) {
        y[j] = float((b[2 + j] & 0x0f) - 8) * d;
        y[j + 16] = float((b[2 + j] >> 4) - 8) * d;
    }
}

// q4_1 (20 bytes per 32): f16 d, f16 m, 16 bytes of nibbles; value = d * code + m.
void q4_1(const uint8_t *b, float *y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    for (int j = 0; j < 16; ++j) {
        y[j] = float(b[4 + j] & 0x0f) * d + m;
        y[j + 16] = float(b[4 + j] >> 4) * d + m;
    }
}

// q5_0 (22 bytes per 32): f16 d, 32 fifth bits, 16 bytes of nibbles; value = d * (5-bit code - 16).
void q5_0(const uint8_t *b, float *y) {
    const float d = f16_at(b);
    const uint32_t qh = u32_at(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0x0f) | int(((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
        y[j] = float(lo - 16) * d;
        y[j + 16] = float(hi - 16) * d;
    }
}

// q5_1 (24 bytes per 32): f16 d, f16 m, 32 fifth bits, 16 bytes of nibbles; value = d * 5-bit code + m.
void q5_1(const uint8_t *b, float *y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0x0f) | int(((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
        y[j] = float(lo) * d + m;
        y[j + 16] = float(hi) * d + m;
    }
}

// q8_0 (34 bytes per 32): f16 d, 32 int8 codes; value = d * code.
void q8_0(const uint8_t *b, float *y) {
    const float d = f16_at(b);
    for (int j = 0; j < 32; ++j) y[j] = float(int8_t(b[2 + j])) * d;
}

// The k-quants: super-blocks of 256 values in sub-blocks of 16 or 32, each with its own scale (and min).

// q2_K (84 bytes): 16 bytes of 4-bit scale | 4-bit min << 4, 64 bytes of 2-bit codes, f16 d, f16 dmin;
// value = d * scale * code - dmin * min. Each half of 128 values takes 32 code bytes: value 32 q + l of the
// half from bits 2q of byte l (sub-blocks of 16: l < 16 and l >= 16 have scales of their own).
void q2_K(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int half = 0; half < 2; ++half, qs += 32)
        for (int q = 0; q < 4; ++q)
            for (int part = 0; part < 2; ++part, ++sc) {
                const float dl = d * float(*sc & 0x0f), ml = dmin * float(*sc >> 4);
                for (int l = 0; l < 16; ++l) *y++ = dl * float((qs[16 * part + l] >> (2 * q)) & 3) - ml;
            }
}

// q3_K (110 bytes): 32 bytes of third bits (hmask), 64 bytes of 2-bit codes, 12 bytes of 16 6-bit scales,
// f16 d; value = d * (scale - 32) * (3-bit code - 4), the third bit set meaning "no -4". The codes lie as
// q2_K's; value 32 q + l of half h takes bit 4 h + q of hmask byte l. Scale j: its low 4 bits are nibble
// j / 8 of byte j % 8, its high 2 bits bits 2 (j / 4) of byte 8 + j % 4.
void q3_K(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = f16_at(b + 108);
    int j = 0;
    for (int half = 0; half < 2; ++half, qs += 32)
        for (int q = 0; q < 4; ++q)
            for (int part = 0; part < 2; ++part, ++j) {
                const int scale = ((sc[j % 8] >> (4 * (j / 8))) & 0x0f) | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
                const float dl = d * float(scale - 32);
                const int bit = 4 * half + q;
                for (int l = 16 * part; l < 16 * part + 16; ++l) {
                    const int code = ((qs[l] >> (2 * q)) & 3) - ((hm[l] >> bit) & 1 ? 0 : 4);
                    *y++ = dl * float(code);
                }
            }
}

// The 6-bit scale and min of sub-block j (of 8) of q4_K and q5_K, packed in 12 bytes (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// q4_K (144 bytes) and q5_K (176 bytes): f16 d, f16 dmin, 12 bytes of scales and mins, (q5_K: 32 bytes of fifth
// bits,) 128 bytes of nibbles; value = d * scale * code - dmin * min over sub-blocks of 32. Each 64 values take
// 32 nibble bytes, the low nibbles first; q5_K's fifth bit of value 32 s + l is bit s of byte l.
template <bool FifthBit>
void q45_K(const uint8_t *b, float *y) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (FifthBit ? 48 : 16);
    for (int s = 0; s < 8; ++s) {
        int scale, min;
        scale_min_k4(s, sc, &scale, &min);
        const float dl = d * float(scale), ml = dmin * float(min);
        const uint8_t *q = qs + 32 * (s / 2);
        for (int l = 0; l < 32; ++l) {
            int code = (q[l] >> (4 * (s % 2))) & 0x0f;
            if (FifthBit) code += ((qh[l] >> s) & 1) << 4;
            *y++ = dl * float(code) - ml;
        }
    }
}

// q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per 16 values),
// f16 d; value = d * scale * (6-bit code - 32). Each half of 128 values takes 64 low bytes and 32 high bytes:
// value l + 32 q of the half from nibble (q / 2) of low byte l + 32 (q % 2) and bits 2q of high byte l.
void q6_K(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
    const float d = f16_at(b + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            for (int q = 0; q < 4; ++q) {
                const int low = (ql[l + 32 * (q % 2)] >> (4 * (q / 2))) & 0x0f;
                const int code = low | (((qh[l] >> (2 * q)) & 3) << 4);
                y[l + 32 * q] = d * float(sc[is + 2 * q]) * float(code - 32);
            }
        }
    }
}

}  // namespace

void dequantize_row(uint32_t type, const uint8_t *src, float *dst, int64_t n) {
    if (type == TYPE_F32) {
        std::memcpy(dst, src, size_t(n) * 4);
        return;
    }
    if (type == TYPE_F16 || type == TYPE_BF16) {
        for (int64_t i = 0; i < n; ++i) {
            uint16_t h;
            std::memcpy(&h, src + 2 * i, 2);
            if (type == TYPE_F16) {
                dst[i] = f16_to_f32(h);
            } else {  // bf16: the high half of an f32
                const uint32_t bits = uint32_t(h) << 16;
                std::memcpy(dst + i, &bits, 4);
            }
        }
        return;
    }
    void (*block)(const uint8_t *, float *) = nullptr;
    switch (type) {
        case TYPE_Q4_0: block = q4_0; break;
        case TYPE_Q4_1: block = q4_1; break;
        case TYPE_Q5_0: block = q5_0; break;
        case TYPE_Q5_1: block = q5_1; break;
        case TYPE_Q8_0: block = q8_0; break;
        case TYPE_Q2_K: block = q2_K; break;
        case TYPE_Q3_K: block = q3_K; break;
        case TYPE_Q4_K: block = q45_K<false>; break;
        case TYPE_Q5_K: block = q45_K<true>; break;
        case TYPE_Q6_K: block = q6_K; break;
        default: return;
    }
    const TypeSize ts = type_size(type);
    for (int64_t i = 0; i < n / ts.block; ++i) block(src + size_t(i) * ts.bytes, dst + i * ts.block);
}

}  // namespace pi
