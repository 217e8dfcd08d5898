// The 8-row interleaved layout of q4_0 / q8_0 matrices that are always read whole (attention
// projections, the output head): one pass over a group of 8 rows computes their 8 dot products
// in the 8 lanes of one register, with the 8 block scales converted by one instruction and no
// horizontal sums (llama.cpp's CPU "repack" buffers do the same).
//
// Group g, block k is PackedBlocks(type) bytes at offset (g * n_blocks + k) * that:
//   8 f16 scales (row 0..7), then chunks of 32 bytes: chunk c holds bytes [4c, 4c + 4) of the
//   block's quants for rows 0..7 in turn (q4_0: 4 chunks of the 16 nibble bytes; q8_0: 8 chunks).
// Quants keep their stored encoding (q4_0 nibbles with offset 8, q8_0 signed bytes).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pi {

constexpr int kPackRows = 8;

// Bytes of one packed group-block (0 for types that are not packed).
size_t packed_block_bytes(uint32_t type);

// Packs rows[0..8) (n elements each, stored as `type`) into n / 32 group-blocks at out.
void pack_rows8(uint32_t type, int n, const void *const *rows, uint8_t *out);

}  // namespace pi
