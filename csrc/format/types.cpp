#include "format/types.h"

namespace pi {

bool type_decodable(uint32_t type) { return type == TYPE_Q5_0 || type == TYPE_Q6_K; }

namespace {

uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

// q5_0 (22 bytes per 32): f16 scale d, 32 high bits, 16 bytes of low nibbles (element j low, j + 16 high);
// value = d * (5-bit code - 16).
void dequantize_q5_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(load_u16(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0x0f) | int(((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
        y[j] = d * float(lo - 16);
        y[j + 16] = d * float(hi - 16);
    }
}

// q6_K (210 bytes per 256): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per
// 16 values), f16 d; value = d * scale * (6-bit code - 32). Each half of 128 values takes 64 low bytes and 32
// high bytes: value l + 32 q of the half from nibble (q / 2) of low byte l + 32 (q % 2) and bits 2q of high byte l.
void dequantize_q6_K(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
    const float d = f16_to_f32(load_u16(b + 208));
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
    const TypeSize ts = type_size(type);
    for (int64_t i = 0; i < n / ts.block; ++i) {
        const uint8_t *b = src + size_t(i) * ts.bytes;
        float *y = dst + i * ts.block;
        if (type == TYPE_Q5_0) dequantize_q5_0(b, y);
        else dequantize_q6_K(b, y);
    }
}

}  // namespace pi
