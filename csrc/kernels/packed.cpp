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

}  // namespace pi
