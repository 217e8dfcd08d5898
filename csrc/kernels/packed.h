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

#include "format/types.h"

namespace pi {

constexpr int kPackRows = 8;

// Bytes of one packed group-block (0 for types that are not packed).
size_t packed_block_bytes(uint32_t type);

// Packs rows[0..8) (n elements each, stored as `type`) into n / 32 group-blocks at out.
void pack_rows8(uint32_t type, int n, const void *const *rows, uint8_t *out);

// The 4-row layout of q4_0 ffn_down_t rows that a dense decode step reads whole (TypeKernels::axpy_quads): the
// byte transpose that the integer axpy_rows does in registers for each 4 rows and block (kernels/axpy_int.h),
// done once at load, and the 4 rows' block scales side by side. Quad q (rows 4q..4q+3) is QuadBytes(n) bytes:
//   n / 32 blocks of 4 f16 scales (block k: row 0..3), then n / 32 blocks of 64 bytes (block k: byte 4j + r is
//   byte j of row r's quants, so one 32-bit lane holds a column's 4 nibble bytes).
// As many bytes as the 4 rows: the copy replaces the mapped rows, it does not add to them.
constexpr int kQuadRows = 4;
inline size_t quad_bytes(int n) { return size_t(n / 32) * (8 + 64); }

// Packs n_rows q4_0 rows (n elements each) into (n_rows + 3) / 4 quads at out; the last quad's missing rows are
// zero rows (scale 0).
void pack_quads(int n, int n_rows, const void *const *rows, uint8_t *out);

// Input sparsity's column layout of a q4_0/q8_0 matrix (TypeKernels::gemv_columns): the matrix's own blocks (its
// rows' blocks of 32 inputs, no requantization) re-laid so that the weights of one input over a tile of outputs are
// one contiguous piece, read only when the input is kept. n_out outputs (a multiple of column_span; rows past the
// matrix's are zero rows, scale 0), n_in inputs (a multiple of 32), in tiles of `tile` outputs (the last one
// narrower), each tile's blocks one after the other (a thread streams its tiles as one ascending pass with holes).
// The tile width is the matrix's (a multiple of kColumnWindow, the outputs the kernel sums in registers at once):
// wider tiles make longer pieces, whose skipped bytes the hardware prefetchers do not fetch anyway.
// A tile of w outputs, input block k, is column_tile_block_bytes(type, w) bytes at column_block_offset:
//   w f16 scales (output o's scale of block k), then the 32 inputs' pieces of column_piece_bytes(type, w) each:
//   spans of 64 bytes, a q8_0 span 64 outputs (a stored quant byte each, signed), a q4_0 span 128 outputs (the
//   first 64 in the bytes' low nibbles, the next 64 in their high ones; offset 8, as stored). Within 64 outputs,
//   output r is at byte column_output(r): the order in which interleaving four pieces' bytes (unpack bytes, then
//   words, in each 16-byte lane) leaves the outputs in 16 consecutive int32 lanes.
constexpr int kColumnUnit = 64, kColumnWindow = 256;
inline int column_output(int P) { return 16 * ((P / 4) % 4) + 4 * (P / 16) + P % 4; }  // its own inverse
inline int column_span(uint32_t type) { return type == TYPE_Q4_0 ? 2 * kColumnUnit : kColumnUnit; }
// Output r of a tile: its byte in each piece, and (q4_0) whether in the high nibble.
inline int column_byte(uint32_t type, int r) { return 64 * (r / column_span(type)) + column_output(r % kColumnUnit); }
inline bool column_high(uint32_t type, int r) { return type == TYPE_Q4_0 && r % (2 * kColumnUnit) >= kColumnUnit; }
inline size_t column_piece_bytes(uint32_t type, int64_t w) { return size_t(type == TYPE_Q4_0 ? w / 2 : w); }
inline size_t column_tile_block_bytes(uint32_t type, int64_t w) { return 2 * size_t(w) + 32 * column_piece_bytes(type, w); }
// the tile starting at output o0 (a multiple of the tile width), its input block k
inline size_t column_block_offset(uint32_t type, int64_t n_in, int64_t n_out, int64_t tile, int64_t o0, int64_t k) {
    const int64_t w = n_out - o0 < tile ? n_out - o0 : tile;
    return size_t(n_in / 32) * column_tile_block_bytes(type, o0) + size_t(k) * column_tile_block_bytes(type, w);
}
inline size_t column_matrix_bytes(uint32_t type, int64_t n_in, int64_t n_out) {
    return size_t(n_in / 32) * column_tile_block_bytes(type, n_out);
}

// Packs n_rows rows (n_in elements each, stored as q4_0/q8_0 `type`) as the first outputs of an n_out-output
// matrix in the column layout with tiles of `tile` outputs at out (column_matrix_bytes).
void pack_columns(uint32_t type, int n_in, int n_rows, const void *const *rows, int n_out, int tile, uint8_t *out);

}  // namespace pi
