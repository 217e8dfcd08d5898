// The hot tier's arithmetic, written once for every device library (compiled by nvcc for the CUDA one, by the
// host compiler for the emulation): a block of a row's dot product, one element of a down row, and the activation
// rule of backend/activation_rule.h on one neuron. Operands are as the CPU kernels take them (kernels/kernels.h):
// f32 rows for f32 and f16 weights, q8_0 blocks for q4_0 and q8_0 weights.
#pragma once

#include <cstdint>

#include "backend/down_runs.h"
#include "format/types.h"
#include "kernels/axpy_int.h"
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

// Parts laid out one after the other in a block of device memory, each 16-byte aligned (q8_0 rows are 34 bytes a
// block; biases and norms are floats): add returns a part's offset.
struct BlockParts {
    size_t bytes = 0;
    size_t add(size_t size) {
        const size_t at = bytes;
        bytes += (size + 15) / 16 * 16;
        return at;
    }
};

// Where the parts of a layer's hot rows lie in the one block of device memory that holds them: gate, up and
// down_t rows, then the biases, each part 16-byte aligned (q8_0 rows are 34 bytes a block; biases are floats).
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
    // Copies each part of `rows` into the block at `base` with copy(destination offset, source, bytes).
    template <class Copy>
    bool fill(const pi_device_layer &rows, bool gated, Copy copy) const {
        const size_t n = size_t(rows.n_rows);
        return copy(gate, rows.gate, n * gate_row) && (!gated || copy(up, rows.up, n * up_row)) &&
               copy(down_t, rows.down_t, n * down_row) && (!rows.gate_b || copy(gate_b, rows.gate_b, n * 4)) &&
               (!rows.up_b || copy(up_b, rows.up_b, n * 4));
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

// Block k (elements [32k, 32k + 32)) of row . x: x is the token's f32 row, xq its q8_0 blocks.
PI_HD inline float block_dot(uint32_t type, const uint8_t *row, int64_t k, const float *x, const BlockQ8_0 *xq) {
    float sum = 0.0f;
    if (type == TYPE_F32) {
        const float *w = reinterpret_cast<const float *>(row) + k * QK;
        for (int i = 0; i < QK; ++i) sum += w[i] * x[k * QK + i];
    } else if (type == TYPE_F16) {
        const uint16_t *w = reinterpret_cast<const uint16_t *>(row) + k * QK;
        for (int i = 0; i < QK; ++i) sum += f16_to_f32(w[i]) * x[k * QK + i];
    } else if (type == TYPE_Q8_0) {
        const BlockQ8_0 &a = reinterpret_cast<const BlockQ8_0 *>(row)[k];
        const BlockQ8_0 &b = xq[k];
        int32_t isum = 0;
        for (int i = 0; i < QK; ++i) isum += int32_t(a.qs[i]) * int32_t(b.qs[i]);
        sum = f16_to_f32(a.d) * f16_to_f32(b.d) * float(isum);
    } else if (type == TYPE_Q4_0) {
        const BlockQ4_0 &a = reinterpret_cast<const BlockQ4_0 *>(row)[k];
        const BlockQ8_0 &b = xq[k];
        int32_t isum = 0;
        for (int i = 0; i < QK / 2; ++i) {
            isum += (int32_t(a.qs[i] & 0x0f) - 8) * int32_t(b.qs[i]);
            isum += (int32_t(a.qs[i] >> 4) - 8) * int32_t(b.qs[i + QK / 2]);
        }
        sum = f16_to_f32(a.d) * f16_to_f32(b.d) * float(isum);
    }
    return sum;
}

// Element i of a row.
PI_HD inline float element(uint32_t type, const uint8_t *row, int64_t i) {
    if (type == TYPE_F32) return reinterpret_cast<const float *>(row)[i];
    if (type == TYPE_F16) return f16_to_f32(reinterpret_cast<const uint16_t *>(row)[i]);
    const int64_t k = i / QK, j = i % QK;
    if (type == TYPE_Q8_0) {
        const BlockQ8_0 &b = reinterpret_cast<const BlockQ8_0 *>(row)[k];
        return f16_to_f32(b.d) * float(b.qs[j]);
    }
    const BlockQ4_0 &b = reinterpret_cast<const BlockQ4_0 *>(row)[k];
    const int q = j < QK / 2 ? (b.qs[j] & 0x0f) : (b.qs[j - QK / 2] >> 4);
    return f16_to_f32(b.d) * float(q - 8);
}

// Element e of a token's down projection over q4_0 down_t rows, exactly as the CPU tier computes a decode
// step (backend/down_runs.h, kernels/axpy_int.h): the rows with a nonzero coefficient h in slot order, in runs of
// kDownRunRows (each summed from zero, the runs then added in order) and groups of kAxpyGroup (the coefficients
// h_r * d_r rounded against the group's largest, the products summed as integers). The same bits on either side
// of the tier boundary, so that a q8_0 model's next matrix quantizes the same inputs.
struct DownElement {
    int64_t k;
    int j;
    float c[kAxpyGroup];
    int32_t v[kAxpyGroup];
    int in_group = 0, in_run = 0;
    float y = 0.0f, partial = 0.0f;

    PI_HD void add_group() {
        partial = axpy_group_column(c, v, in_group, partial);
        in_group = 0;
    }
    PI_HD void add_run() {
        y = y + partial;
        partial = 0.0f;
        in_run = 0;
    }
};

PI_HD inline float down_element_q4_0(const uint8_t *down, uint32_t row_bytes, const float *h, int64_t n_rows, int64_t e) {
    DownElement d;
    d.k = e / QK;
    d.j = int(e % QK);
    for (int64_t r = 0; r < n_rows; ++r) {
        if (h[r] == 0.0f) continue;
        const BlockQ4_0 &b = reinterpret_cast<const BlockQ4_0 *>(down + size_t(r) * row_bytes)[d.k];
        d.c[d.in_group] = h[r] * f16_to_f32(b.d);
        d.v[d.in_group] = block_value(b, d.j);
        if (++d.in_group == kAxpyGroup) d.add_group();
        if (++d.in_run == kDownRunRows) d.add_run();
    }
    if (d.in_group > 0) d.add_group();
    if (d.in_run > 0) d.add_run();
    return d.y;
}

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
