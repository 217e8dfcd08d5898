// The hot tier's definitions, written once for every device library (compiled by nvcc for the CUDA one, by the
// host compiler for the emulation): how a matrix is laid out in device memory (DeviceRows), a block of a row's dot
// product, one element of a row, the activation rule of backend/activation_rule.h on one neuron, and what a job
// launches and reads. Operands are f32 rows for f32 and f16 weights and their q8_0 quantization (the CPU
// kernels' quantizer, bit for bit) for q4_0 and q8_0 weights. Each library sums in its own order: the emulation
// block by block, the CUDA kernels lane by lane, then across lanes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "format/types.h"
#include "kernels/exp_ref.h"
#include "pi_device.h"

namespace pi {
namespace device {

// Bytes of a row of n elements (a whole number of blocks) of a type the kernels compute with; 0 for others.
PI_HD inline uint32_t row_bytes(uint32_t type, int64_t n) {
    if (!type_computable(type)) return 0;
    const TypeSize ts = type_size(type);
    return uint32_t(n / ts.block * ts.bytes);
}

inline bool reads_q8(uint32_t type) { return type == TYPE_Q4_0 || type == TYPE_Q8_0; }

// Bytes of one block's quants in DeviceRows' split layout: 16 for q4_0, 32 for q8_0, 0 for the float types.
PI_HD inline uint32_t quant_bytes(uint32_t type) { return type == TYPE_Q4_0 ? 16u : type == TYPE_Q8_0 ? 32u : 0u; }

// A matrix in device memory. f32 and f16 rows are the file's. q4_0 and q8_0 rows are split: first every block's
// quants (row after row, block after block), then every block's f16 scale in the same order. The same bytes as
// the file's 18- or 34-byte blocks, in an order where a block's quants are one (q4_0) or two (q8_0) aligned
// 16-byte loads and a warp's lanes read consecutive blocks.
struct DeviceRows {
    uint32_t type = 0;
    int64_t rows = 0, cols = 0;
    const uint8_t *data = nullptr;

    PI_HD int64_t blocks() const { return cols / QK; }
    PI_HD const uint8_t *row(int64_t r) const { return data + r * int64_t(row_bytes(type, cols)); }  // f32, f16
    PI_HD const uint8_t *quants(int64_t r, int64_t k) const { return data + (r * blocks() + k) * quant_bytes(type); }
    PI_HD float scale(int64_t r, int64_t k) const {
        return f16_to_f32(reinterpret_cast<const uint16_t *>(data + rows * blocks() * quant_bytes(type))[r * blocks() + k]);
    }
    PI_HD int64_t bytes() const { return rows * int64_t(row_bytes(type, cols)); }
};

// n_rows rows of the file's layout (src) in DeviceRows' layout: `bytes` of them, the same number as src's.
inline std::vector<uint8_t> split_rows(uint32_t type, int64_t n_rows, int64_t cols, const void *src) {
    const size_t bytes = size_t(n_rows) * row_bytes(type, cols);
    std::vector<uint8_t> out(bytes);
    const uint8_t *in = static_cast<const uint8_t *>(src);
    const uint32_t qb = quant_bytes(type);
    if (!qb) {
        std::memcpy(out.data(), in, bytes);
        return out;
    }
    const int64_t n = n_rows * (cols / QK);
    const uint32_t bb = type_size(type).bytes;  // the file's block: its f16 scale, then its quants
    uint8_t *scales = out.data() + n * qb;
    for (int64_t i = 0; i < n; ++i) {
        std::memcpy(scales + 2 * i, in + i * bb, 2);
        std::memcpy(out.data() + i * qb, in + i * bb + 2, qb);
    }
    return out;
}

// Copies rows of the file's layout into device memory in DeviceRows' layout, with copy(offset, source, bytes).
template <class Copy>
bool copy_rows(Copy &copy, size_t at, uint32_t type, int64_t n_rows, int64_t cols, const void *src) {
    const std::vector<uint8_t> split = split_rows(type, n_rows, cols, src);
    return copy(at, split.data(), split.size());
}

// Parts laid out one after the other in a block of device memory, each 16-byte aligned (biases and norms are
// floats; a DeviceRows' quants are 16-byte loads): add returns a part's offset.
struct BlockParts {
    size_t bytes = 0;
    size_t add(size_t size) {
        const size_t at = bytes;
        bytes += (size + 15) / 16 * 16;
        return at;
    }
};

// Where the parts of a layer's hot rows lie in the one block of device memory that holds them: gate, up and
// down_t rows (DeviceRows), then the biases, each part 16-byte aligned.
struct LayerLayout {
    size_t gate = 0, up = 0, down_t = 0, gate_b = 0, up_b = 0, bytes = 0;
    uint32_t gate_row = 0, up_row = 0, down_row = 0;  // bytes a row
    bool quantized = false;                           // some weight reads the q8_0 operand

    LayerLayout(const pi_device_layer &rows, int64_t n_embd, bool gated) {
        const size_t n = size_t(rows.n_rows);
        gate_row = row_bytes(rows.gate_type, n_embd);
        up_row = gated ? row_bytes(rows.up_type, n_embd) : 0;
        down_row = row_bytes(rows.down_type, n_embd);
        quantized = reads_q8(rows.gate_type) || (gated && reads_q8(rows.up_type));
        BlockParts parts;
        gate = parts.add(n * gate_row);
        up = parts.add(n * up_row);
        down_t = parts.add(n * down_row);
        gate_b = parts.add(rows.gate_b ? n * 4 : 0);
        up_b = parts.add(rows.up_b ? n * 4 : 0);
        bytes = parts.bytes;
    }
    // Copies each part of `rows` into the block with copy(destination offset, source, bytes).
    template <class Copy>
    bool fill(const pi_device_layer &rows, int64_t n_embd, bool gated, Copy copy) const {
        const int64_t n = rows.n_rows;
        return copy_rows(copy, gate, rows.gate_type, n, n_embd, rows.gate) &&
               (!gated || copy_rows(copy, up, rows.up_type, n, n_embd, rows.up)) &&
               copy_rows(copy, down_t, rows.down_type, n, n_embd, rows.down_t) &&
               (!rows.gate_b || copy(gate_b, rows.gate_b, size_t(n) * 4)) &&
               (!rows.up_b || copy(up_b, rows.up_b, size_t(n) * 4));
    }
};

// Why a layer's rows cannot be uploaded, or nullptr.
inline const char *refuse_layer(const pi_device_layer &rows, bool gated) {
    if (rows.n_rows <= 0) return "a layer without rows";
    if (!rows.gate || !rows.down_t || (gated && !rows.up)) return "a layer's rows are missing";
    for (uint32_t type : {rows.gate_type, rows.down_type, gated ? rows.up_type : uint32_t(TYPE_F32)})
        if (!type_computable(type)) return "a weight type other than f32, f16, q8_0 and q4_0";
    return nullptr;
}

// Block k (elements [32k, 32k + 32)) of row r of m times a token: x its f32 row, xq its q8_0 blocks. Integer
// sums for the quantized types, scaled once per block.
PI_HD inline float block_dot(const DeviceRows &m, int64_t r, int64_t k, const float *x, const BlockQ8_0 *xq) {
    float sum = 0.0f;
    if (m.type == TYPE_F32) {
        const float *w = reinterpret_cast<const float *>(m.row(r)) + k * QK;
        for (int i = 0; i < QK; ++i) sum += w[i] * x[k * QK + i];
    } else if (m.type == TYPE_F16) {
        const uint16_t *w = reinterpret_cast<const uint16_t *>(m.row(r)) + k * QK;
        for (int i = 0; i < QK; ++i) sum += f16_to_f32(w[i]) * x[k * QK + i];
    } else {
        const uint8_t *q = m.quants(r, k);
        const int8_t *b = xq[k].qs;
        int32_t isum = 0;
        if (m.type == TYPE_Q8_0) {
            for (int i = 0; i < QK; ++i) isum += int32_t(int8_t(q[i])) * int32_t(b[i]);
        } else {
            for (int i = 0; i < QK / 2; ++i) {
                isum += (int32_t(q[i] & 0x0f) - 8) * int32_t(b[i]);
                isum += (int32_t(q[i] >> 4) - 8) * int32_t(b[i + QK / 2]);
            }
        }
        sum = m.scale(r, k) * f16_to_f32(xq[k].d) * float(isum);
    }
    return sum;
}

// Element i of row r of m.
PI_HD inline float element(const DeviceRows &m, int64_t r, int64_t i) {
    if (m.type == TYPE_F32) return reinterpret_cast<const float *>(m.row(r))[i];
    if (m.type == TYPE_F16) return f16_to_f32(reinterpret_cast<const uint16_t *>(m.row(r))[i]);
    const int64_t k = i / QK, j = i % QK;
    const uint8_t *q = m.quants(r, k);
    if (m.type == TYPE_Q8_0) return m.scale(r, k) * float(int8_t(q[j]));
    const int v = j < QK / 2 ? (q[j] & 0x0f) : (q[j - QK / 2] >> 4);
    return m.scale(r, k) * float(v - 8);
}

// Bytes of a hot job's (or a whole or split layer's) counters of active and computed neurons and of the rows whose
// gate (and up) were read, which come back with its output: part of its bus traffic in both libraries.
constexpr size_t kJobCountersBytes = 24;

// Tokens a matrix-vector kernel takes per pass over a matrix's rows: a batch reads the matrix once a pass.
constexpr int kTokensPerPass = 8;
PI_HD inline int64_t passes(int64_t n_tok) { return (n_tok + kTokensPerPass - 1) / kTokensPerPass; }

// The down projection's neurons split in up to kDownSplits interleaved sets, each summed by its own blocks into a
// partial output, the partials then added in order by a second kernel: enough blocks to fill the device for a
// decode step, in a fixed order (the same output every run). A batch's tokens share the splits (its rows'
// partials take the job's input scratch: n_batch rows).
constexpr int64_t kDownSplits = 32;
inline int64_t down_splits(int64_t n_batch, int64_t n_tok) {
    return std::max<int64_t>(1, std::min<int64_t>(kDownSplits, n_batch / n_tok));
}

// Kernels a hot job launches: the operand's quantization, gate_up, down, and the partials' sum where split.
inline double hot_launches(int64_t n_batch, int64_t n_tok) { return 3.0 + (down_splits(n_batch, n_tok) > 1 ? 1.0 : 0.0); }

// Bytes a hot job reads of device memory: the gate (and up) rows read (every row once a pass, or a split layer's
// predicted rows: those a token of the pass selects), each token's computed neurons' down rows.
inline double hot_bytes(const LayerLayout &l, double rows_read, double computed) {
    return rows_read * double(l.gate_row + l.up_row) + computed * double(l.down_row);
}
inline double rows_read(int64_t n_rows, int64_t n_tok) { return double(n_rows) * double(passes(n_tok)); }

// The activation rule (backend/activation_rule.h) of one neuron from its gate's and up's dot products (biases
// not yet added): its down row's coefficient h, 0 where the neuron is skipped; *pass: whether the rule passes it.
struct Rule {
    int32_t activation;  // pi_device_activation
    int32_t gated;
    float threshold;

    PI_HD float coefficient(float g, float u, float gate_b, float up_b, bool dense, bool *pass) const {
        float a, h;
        bool passes;
        if (activation == PI_DEVICE_ACT_SILU) {
            a = silu_ref(g + gate_b);
            passes = fabsf(a) > threshold;
        } else {
            const float v = g + gate_b;
            passes = v > threshold;
            a = passes ? v : 0.0f;
        }
        if (!gated) {
            h = a;
        } else if (activation == PI_DEVICE_ACT_DRELU) {
            h = a * fmaxf(u + up_b, 0.0f);
            passes = h > 0.0f;
        } else {
            h = a * (u + up_b);
        }
        *pass = passes;
        return dense || passes ? h : 0.0f;
    }
};

}  // namespace device
}  // namespace pi
