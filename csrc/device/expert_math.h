// A mixture's experts on a device (pi_device.h: pi_device_expert, pi_device_experts_job), written once for every device
// library (compiled by nvcc for the CUDA one, by the host compiler for the emulation): where an expert's three
// matrices lie in its block of device memory, what an upload and a job may be, the experts' scratch, and what a job
// launches, moves and reads. An expert is SiLU's gated FFN (engine/moe.h): h = silu(gate x) * (up x), out = down h,
// its operands f32 rows for f32 and f16 weights and their q8_0 form (the CPU kernels' quantizer) for q4_0 and q8_0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device/attention_math.h"

namespace pi {
namespace device {

inline size_t matrix_bytes(const pi_device_matrix &m) { return size_t(m.rows) * row_bytes(m.type, m.cols); }

// Where an expert's gate, up and down rows (DeviceRows' layout) lie in its one block, each part 16-byte aligned.
struct ExpertLayout {
    size_t gate = 0, up = 0, down = 0, bytes = 0;

    explicit ExpertLayout(const pi_device_expert &x) {
        BlockParts parts;
        gate = parts.add(matrix_bytes(x.gate));
        up = parts.add(matrix_bytes(x.up));
        down = parts.add(matrix_bytes(x.down));
        bytes = parts.bytes;
    }
    // Copies the three matrices into the block with copy(destination offset, source, bytes).
    template <class Copy>
    bool fill(const pi_device_expert &x, Copy copy) const {
        return copy_rows(copy, gate, x.gate.type, x.gate.rows, x.gate.cols, x.gate.data) &&
               copy_rows(copy, up, x.up.type, x.up.rows, x.up.cols, x.up.data) &&
               copy_rows(copy, down, x.down.type, x.down.rows, x.down.cols, x.down.data);
    }
    // The expert's view of the block at `base`.
    pi_device_expert view(const pi_device_expert &x, const uint8_t *base) const {
        pi_device_expert v = x;
        v.gate.data = base + gate;
        v.up.data = base + up;
        v.down.data = base + down;
        return v;
    }
};

// Device bytes of one expert of this shape and types (what the placement charges for it).
inline double expert_bytes(const pi_device_expert &x) { return double(ExpertLayout(x).bytes); }

// Why an expert cannot be uploaded to a tier of description d, or nullptr.
inline const char *refuse_expert(const pi_device_expert &x, const pi_device_tier_desc &d) {
    if (d.n_expert <= 0 || d.n_expert_used <= 0 || d.n_expert_used > d.n_expert || d.n_ff_expert <= 0 ||
        d.n_ff_expert % QK)
        return "an expert to a tier described without experts, or with an expert width not a multiple of 32";
    if (x.gate.rows != d.n_ff_expert || x.gate.cols != d.n_embd || x.up.rows != d.n_ff_expert ||
        x.up.cols != d.n_embd || x.down.rows != d.n_embd || x.down.cols != d.n_ff_expert)
        return "an expert whose matrices are not the tier's shape";
    if (!x.gate.data || !x.up.data || !x.down.data) return "an expert whose rows are missing";
    if (x.gate.bias || x.up.bias || x.down.bias) return "an expert with biases";
    for (uint32_t type : {x.gate.type, x.up.type, x.down.type})
        if (!type_computable(type)) return "an expert of a type other than f32, f16, q8_0 and q4_0";
    return nullptr;
}

// Why a job cannot run (its shape, its pairs: tokens and experts in range, each expert's pairs one after the other),
// or nullptr; whether its experts were uploaded: experts_job_refusal.
inline const char *refuse_experts_job(const pi_device_experts_job *j, const pi_device_tier_desc &d) {
    if (!j || j->layer < 0 || j->layer >= d.n_layer || j->n_tok <= 0 || j->n_tok > d.n_batch || j->n_pairs <= 0 ||
        int64_t(j->n_pairs) > int64_t(d.n_batch) * d.n_expert_used || !j->x || !j->y || !j->pair_token ||
        !j->pair_expert || !j->pair_weight)
        return "bad experts job";
    std::vector<uint8_t> seen(size_t(d.n_expert), 0);
    for (int32_t p = 0; p < j->n_pairs; ++p) {
        const int32_t t = j->pair_token[p], e = j->pair_expert[p];
        if (t < 0 || t >= j->n_tok || e < 0 || e >= d.n_expert) return "an experts job's pair out of range";
        if (p > 0 && e == j->pair_expert[p - 1]) continue;
        if (seen[size_t(e)]) return "an experts job whose expert's pairs are not one after the other";
        seen[size_t(e)] = 1;
    }
    return nullptr;
}

// Why a job cannot run on a library whose experts are `experts` (slot layer * n_expert + e, each with its
// `uploaded` flag): refuse_experts_job's reason, or the first pair's expert that was not uploaded; "" if it can.
template <class Experts>
inline std::string experts_job_refusal(const pi_device_experts_job *j, const pi_device_tier_desc &d, const Experts &experts) {
    if (const char *why = refuse_experts_job(j, d)) return why;
    for (int32_t p = 0; p < j->n_pairs; ++p) {
        const size_t i = size_t(int64_t(j->layer) * d.n_expert + j->pair_expert[p]);
        if (i >= experts.size() || !experts[i].uploaded)
            return "layer " + std::to_string(j->layer) + "'s expert " + std::to_string(j->pair_expert[p]) + " was not uploaded";
    }
    return "";
}

// The experts' scratch, allocated with the first expert: the tokens' rows, the pairs' gathered rows (with their
// q8_0 form), gate's and up's outputs, h (with its q8_0 form), the pairs' outputs, y, and the pairs' arrays (token,
// weight, each token's pairs and where they start).
inline double experts_scratch_bytes(const pi_device_tier_desc &d) {
    const double B = double(d.n_batch), P = B * double(d.n_expert_used), E = double(d.n_embd),
                 F = double(d.n_ff_expert), q8 = double(sizeof(BlockQ8_0)) / QK;
    return B * E * 4 + P * E * (4 + q8) + 2 * P * F * 4 + P * F * (4 + q8) + P * E * 4 + B * E * 4 +
           4 * (3 * P + B + 1);
}

// The runs of equal experts among a job's pairs (each expert's pairs one after the other): the experts it computes.
inline int64_t expert_groups(const pi_device_experts_job &j) {
    int64_t n = 0;
    for (int32_t p = 0; p < j.n_pairs; ++p) n += p == 0 || j.pair_expert[p] != j.pair_expert[p - 1];
    return n;
}

// Kernels a job launches: the gather of the pairs' rows (and its quantization where gate or up reads q8_0), gate
// and up of each expert in one launch, SiLU's products (and their quantization where down reads q8_0), each
// expert's down, the weighted sum.
inline double experts_launches(const pi_device_expert &x, int64_t groups) {
    return 3.0 + (reads_q8(x.gate.type) || reads_q8(x.up.type) ? 1.0 : 0.0) + (reads_q8(x.down.type) ? 1.0 : 0.0) +
           2.0 * double(groups);
}

// Bytes a job reads of the experts' weights: each expert's three matrices once a pass of kTokensPerPass of its pairs.
inline double experts_read_bytes(const pi_device_expert &x, const pi_device_experts_job &j) {
    const double one = double(matrix_bytes(x.gate) + matrix_bytes(x.up) + matrix_bytes(x.down));
    double bytes = 0;
    for (int32_t p = 0, p0 = 0; p < j.n_pairs; ++p)
        if (p + 1 == j.n_pairs || j.pair_expert[p + 1] != j.pair_expert[p]) {
            bytes += one * double(passes(p + 1 - p0));
            p0 = p + 1;
        }
    return bytes;
}

// A job's bus traffic: the tokens' rows and the pairs' arrays up, y down.
inline double experts_h2d_bytes(const pi_device_experts_job &j, int64_t n_embd) {
    return double(j.n_tok) * double(n_embd) * 4 + 4.0 * (3.0 * j.n_pairs + j.n_tok + 1);
}
inline double experts_d2h_bytes(const pi_device_experts_job &j, int64_t n_embd) { return double(j.n_tok) * double(n_embd) * 4; }

}  // namespace device
}  // namespace pi
