#include "kernels/packed.h"

#include <cstring>

#include "format/types.h"

namespace pi {

size_t packed_block_bytes(uint32_t type) {
    switch (type) {
        case TYPE_Q4_0: return 2 * kPackRows + kPackRows * QK / 2;
        case TYPE_Q8_0: return 2 * kPackRows + kPackRows * QK;
        default: return 0;
    }
}

namespace {

template <class Block>
void pack(int n, const void *const *rows, uint8_t *out) {
    const int quant_bytes = int(sizeof(Block::qs));
    for (int k = 0; k < n / QK; ++k, out += 2 * kPackRows + kPackRows * quant_bytes) {
        for (int r = 0; r < kPackRows; ++r) {
            const Block &b = static_cast<const Block *>(rows[r])[k];
            std::memcpy(out + 2 * r, &b.d, 2);
            for (int c = 0; c < quant_bytes / 4; ++c) std::memcpy(out + 2 * kPackRows + 32 * c + 4 * r, b.qs + 4 * c, 4);
        }
    }
}

}  // namespace

void pack_rows8(uint32_t type, int n, const void *const *rows, uint8_t *out) {
    if (type == TYPE_Q4_0) pack<BlockQ4_0>(n, rows, out);
    else if (type == TYPE_Q8_0) pack<BlockQ8_0>(n, rows, out);
}

void pack_columns(uint32_t type, int n_in, int n_rows, const void *const *rows, int n_out, int tile, uint8_t *out) {
    const bool q4 = type == TYPE_Q4_0;
    const size_t row_block = q4 ? sizeof(BlockQ4_0) : sizeof(BlockQ8_0);
    uint8_t zero[sizeof(BlockQ8_0)] = {};  // a padding output: scale 0, quants 0 (q4_0: nibble 8)
    if (q4) std::memset(zero + 2, 0x88, QK / 2);
    for (int o = 0; o < n_out; ++o) {
        const int o0 = o / tile * tile, w = n_out - o0 < tile ? n_out - o0 : tile;
        const int r = o - o0, at = column_byte(type, r);
        const bool high = column_high(type, r);
        const size_t piece = column_piece_bytes(type, w);
        for (int k = 0; k < n_in / QK; ++k) {
            const uint8_t *b = o < n_rows ? static_cast<const uint8_t *>(rows[o]) + size_t(k) * row_block : zero;
            uint8_t *blk = out + column_block_offset(type, n_in, n_out, tile, o0, k);
            std::memcpy(blk + 2 * r, b, 2);  // the f16 scale leads both block types
            uint8_t *quants = blk + 2 * size_t(w);
            for (int i = 0; i < QK; ++i) {
                uint8_t *c = quants + size_t(i) * piece;
                if (!q4) {
                    c[at] = b[2 + i];
                    continue;
                }
                // element i of a q4_0 block: byte i % 16, low nibble for i < 16
                const uint8_t v = i < QK / 2 ? b[2 + i] & 0x0f : b[2 + i - QK / 2] >> 4;
                c[at] = high ? uint8_t((c[at] & 0x0f) | (v << 4)) : uint8_t((c[at] & 0xf0) | v);
            }
        }
    }
}

void pack_quads(int n, int n_rows, const void *const *rows, uint8_t *out) {
    const int nb = n / QK;
    for (int q = 0; q < (n_rows + kQuadRows - 1) / kQuadRows; ++q, out += quad_bytes(n)) {
        uint8_t *quants = out + size_t(nb) * 8;
        for (int r = 0; r < kQuadRows; ++r) {
            const int row = q * kQuadRows + r;
            for (int k = 0; k < nb; ++k) {
                BlockQ4_0 b{};  // a missing row: scale 0, every nibble 8 (value 0)
                std::memset(b.qs, 0x88, sizeof b.qs);
                if (row < n_rows) b = static_cast<const BlockQ4_0 *>(rows[row])[k];
                std::memcpy(out + 8 * k + 2 * r, &b.d, 2);
                for (int j = 0; j < QK / 2; ++j) quants[64 * k + 4 * j + r] = b.qs[j];
            }
        }
    }
}

}  // namespace pi
