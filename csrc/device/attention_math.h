// A layer's attention block's arithmetic, written once for every device library (compiled by nvcc for the CUDA
// one, by the host compiler for the emulation), as engine/forward.cpp computes it on the CPU: the norm's element
// rule, the q8_0 quantization of a projection's input (bit for bit the CPU kernels' and gguf-py's), a projection
// row's dot product (tier_math.h's blocks), RoPE's rotation of a pair, the KV cache's layout and elements, and
// where a layer's parts lie in the one block of device memory that holds them.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "device/tier_math.h"

namespace pi {
namespace device {

// The norm's scale from the sum of squares (RMSNorm: of x; LayerNorm: of x - mean), and one element of the
// output: the CPU's norm (engine/forward.cpp), whose sums run in double.
PI_HD inline float norm_scale(double ss, int64_t n, float eps) { return 1.0f / sqrtf(float(ss / double(n)) + eps); }
PI_HD inline float norm_element(int32_t kind, float x, double mean, float scale, float w, float b) {
    return kind == PI_DEVICE_NORM_RMS ? w * (x * scale) : w * (float(double(x) - mean) * scale) + b;
}

// 32 floats as one q8_0 block: the kernels' quantize_q8_0 (kernels/kernels.h).
PI_HD inline void quantize_block(const float *x, BlockQ8_0 *out) {
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out->d = f32_to_f16(d);
    for (int i = 0; i < QK; ++i) {
        const float r = roundf(x[i] * id);
        out->qs[i] = (r >= -127.0f && r <= 127.0f) ? int8_t(r) : int8_t(0);
    }
}

// A matrix as its library holds it (its data in DeviceRows' layout).
PI_HD inline DeviceRows device_rows(const pi_device_matrix &m) { return DeviceRows{m.type, m.rows, m.cols, static_cast<const uint8_t *>(m.data)}; }

// The two elements of a head's vector that pair i of RoPE rotates (i < n_rot / 2), and the rotation.
PI_HD inline void rope_pair(int32_t rope, int64_t i, int64_t half, int64_t *i0, int64_t *i1) {
    *i0 = rope == PI_DEVICE_ROPE_NEOX ? i : 2 * i;
    *i1 = rope == PI_DEVICE_ROPE_NEOX ? i + half : 2 * i + 1;
}
PI_HD inline void rotate(float *v, int64_t i0, int64_t i1, float c, float s) {
    const float x0 = v[i0], x1 = v[i1];
    v[i0] = x0 * c - x1 * s;
    v[i1] = x0 * s + x1 * c;
}

// A layer's KV cache on the device: keys, then values, each [position][kv head][d_head] in f16 or f32.
PI_HD inline int64_t kv_index(const pi_device_tier_desc &d, int64_t pos, int64_t kvh, int64_t i) {
    return (pos * d.n_head_kv + kvh) * d.d_head + i;
}
PI_HD inline float kv_get(const uint8_t *cache, bool f16, int64_t i) {
    return f16 ? f16_to_f32(reinterpret_cast<const uint16_t *>(cache)[i]) : reinterpret_cast<const float *>(cache)[i];
}
PI_HD inline void kv_put(uint8_t *cache, bool f16, int64_t i, float v) {
    if (f16) reinterpret_cast<uint16_t *>(cache)[i] = f32_to_f16(v);
    else reinterpret_cast<float *>(cache)[i] = v;
}

inline bool quantized(const pi_device_matrix &m) { return reads_q8(m.type); }

// Where a layer's attention parts lie in its block of device memory, each 16-byte aligned: the norm's vectors,
// the four matrices' rows (DeviceRows) and biases, the FFN norm's vectors, then its KV cache.
struct AttentionLayout {
    size_t norm_w = 0, norm_b = 0, data[4] = {}, bias[4] = {}, ffn_norm_w = 0, ffn_norm_b = 0, k_cache = 0, v_cache = 0,
           bytes = 0;

    AttentionLayout(const pi_device_attention &a, const pi_device_tier_desc &d) {
        BlockParts parts;
        norm_w = parts.add(size_t(d.n_embd) * 4);
        norm_b = parts.add(a.norm_b ? size_t(d.n_embd) * 4 : 0);
        const pi_device_matrix *m[4] = {&a.q, &a.k, &a.v, &a.o};
        for (int i = 0; i < 4; ++i) {
            data[i] = parts.add(size_t(m[i]->rows) * row_bytes(m[i]->type, m[i]->cols));
            bias[i] = parts.add(m[i]->bias ? size_t(m[i]->rows) * 4 : 0);
        }
        ffn_norm_w = parts.add(a.ffn_norm_w ? size_t(d.n_embd) * 4 : 0);
        ffn_norm_b = parts.add(a.ffn_norm_b ? size_t(d.n_embd) * 4 : 0);
        const size_t cache = size_t(d.n_ctx) * size_t(d.n_head_kv) * size_t(d.d_head) * (d.kv_f16 ? 2 : 4);
        k_cache = parts.add(cache);
        v_cache = parts.add(cache);
        bytes = parts.bytes;
    }
    // Copies each part of `a` into the block with copy(destination offset, source, bytes); the caches stay.
    template <class Copy>
    bool fill(const pi_device_attention &a, const pi_device_tier_desc &d, Copy copy) const {
        const pi_device_matrix *m[4] = {&a.q, &a.k, &a.v, &a.o};
        if (!copy(norm_w, a.norm_w, size_t(d.n_embd) * 4)) return false;
        if (a.norm_b && !copy(norm_b, a.norm_b, size_t(d.n_embd) * 4)) return false;
        for (int i = 0; i < 4; ++i) {
            if (!copy_rows(copy, data[i], m[i]->type, m[i]->rows, m[i]->cols, m[i]->data)) return false;
            if (m[i]->bias && !copy(bias[i], m[i]->bias, size_t(m[i]->rows) * 4)) return false;
        }
        return (!a.ffn_norm_w || copy(ffn_norm_w, a.ffn_norm_w, size_t(d.n_embd) * 4)) &&
               (!a.ffn_norm_b || copy(ffn_norm_b, a.ffn_norm_b, size_t(d.n_embd) * 4));
    }
    // The layer's view of the block at `base`: the same matrices, pointing into it.
    pi_device_attention view(const pi_device_attention &a, const uint8_t *base) const {
        pi_device_attention v = a;
        v.norm_w = reinterpret_cast<const float *>(base + norm_w);
        v.norm_b = a.norm_b ? reinterpret_cast<const float *>(base + norm_b) : nullptr;
        pi_device_matrix *m[4] = {&v.q, &v.k, &v.v, &v.o};
        for (int i = 0; i < 4; ++i) {
            m[i]->data = base + data[i];
            m[i]->bias = m[i]->bias ? reinterpret_cast<const float *>(base + bias[i]) : nullptr;
        }
        v.ffn_norm_w = a.ffn_norm_w ? reinterpret_cast<const float *>(base + ffn_norm_w) : nullptr;
        v.ffn_norm_b = a.ffn_norm_b ? reinterpret_cast<const float *>(base + ffn_norm_b) : nullptr;
        return v;
    }
};

// Why a layer's attention cannot be uploaded, or nullptr (RoPE's tables, which the placement does not need yet, are
// the libraries' check).
inline const char *refuse_attention(const pi_device_attention &a, const pi_device_tier_desc &d) {
    if (d.n_head <= 0 || d.n_head_kv <= 0 || d.n_head % d.n_head_kv || d.d_head <= 0 || d.n_ctx <= 0 ||
        d.n_rot < 0 || d.n_rot > d.d_head || d.n_rot % 2)
        return "a tier described without attention's shape";
    const int32_t Q = d.n_head * d.d_head, KV = d.n_head_kv * d.d_head;
    const pi_device_matrix *m[4] = {&a.q, &a.k, &a.v, &a.o};
    const int32_t rows[4] = {Q, KV, KV, d.n_embd}, cols[4] = {d.n_embd, d.n_embd, d.n_embd, Q};
    if (!a.norm_w) return "an attention block without its norm";
    for (int i = 0; i < 4; ++i) {
        if (!m[i]->data) return "an attention matrix is missing";
        if (m[i]->rows != rows[i] || m[i]->cols != cols[i] || m[i]->cols % QK) return "an attention matrix of another shape";
        if (!type_computable(m[i]->type)) return "an attention weight type other than f32, f16, q8_0 and q4_0";
    }
    return nullptr;
}

// Where the output head's parts lie in its block: the norm's vectors, then the head's rows.
struct HeadLayout {
    size_t norm_w = 0, norm_b = 0, out = 0, bytes = 0;

    HeadLayout(const pi_device_head &h, const pi_device_tier_desc &d) {
        BlockParts parts;
        norm_w = parts.add(size_t(d.n_embd) * 4);
        norm_b = parts.add(h.norm_b ? size_t(d.n_embd) * 4 : 0);
        out = parts.add(size_t(h.out.rows) * row_bytes(h.out.type, h.out.cols));
        bytes = parts.bytes;
    }
    template <class Copy>
    bool fill(const pi_device_head &h, const pi_device_tier_desc &d, Copy copy) const {
        return copy(norm_w, h.norm_w, size_t(d.n_embd) * 4) && (!h.norm_b || copy(norm_b, h.norm_b, size_t(d.n_embd) * 4)) &&
               copy_rows(copy, out, h.out.type, h.out.rows, h.out.cols, h.out.data);
    }
    pi_device_head view(const pi_device_head &h, const uint8_t *base) const {
        pi_device_head v = h;
        v.norm_w = reinterpret_cast<const float *>(base + norm_w);
        v.norm_b = h.norm_b ? reinterpret_cast<const float *>(base + norm_b) : nullptr;
        v.out.data = base + out;
        v.out.bias = nullptr;
        return v;
    }
};

inline const char *refuse_head(const pi_device_head &h, const pi_device_tier_desc &d) {
    if (!h.norm_w || !h.out.data) return "the output head's rows are missing";
    if (h.out.rows != d.n_vocab || h.out.cols != d.n_embd || d.n_embd % QK) return "an output head of another shape";
    if (!type_computable(h.out.type)) return "an output head type other than f32, f16, q8_0 and q4_0";
    return nullptr;
}

inline const char *refuse_head_job(const pi_device_head_job *job, const pi_device_tier_desc &d) {
    if (!job || job->n_tok <= 0 || job->n_tok > d.n_batch || !job->logits || job->ld_logits < d.n_vocab ||
        job->first < 0 || job->first + job->n_tok > d.n_batch)
        return "bad head job";
    return nullptr;
}

// Bytes of the head's scratch for a batch: the rows, their norm and q8_0 form, the logits.
inline double head_scratch_bytes(const pi_device_tier_desc &d) {
    const double B = d.n_batch, E = d.n_embd;
    return B * (E * 4 * 2 + E / QK * double(sizeof(BlockQ8_0)) + double(d.n_vocab) * 4);
}

// Why an attention job cannot run on a tier (its layer's upload aside), or nullptr.
inline const char *refuse_attention_job(const pi_device_attention_job *job, const pi_device_tier_desc &d) {
    if (!job || job->layer < 0 || job->layer >= d.n_layer || job->n_tok <= 0 || job->n_tok > d.n_batch ||
        job->n_past < 0 || job->n_past + job->n_tok > d.n_ctx || !job->x || !job->out)
        return "bad attention job";
    return nullptr;
}

// Kernels an attention job launches: the norm (with its q8_0 form), q/k/v, RoPE and the cache's store, the
// heads, the heads' outputs' q8_0 form where o is quantized, o.
inline double attention_launches(const pi_device_attention &a) { return quantized(a.o) ? 6.0 : 5.0; }

// Bytes an attention job reads of device memory: the four matrices once a pass, and each head's keys and
// values over the positions its token sees.
inline double attention_bytes(const pi_device_attention &a, const pi_device_tier_desc &d, int64_t n_tok, int64_t n_past) {
    double weights = 0;
    for (const pi_device_matrix *m : {&a.q, &a.k, &a.v, &a.o}) weights += double(device_rows(*m).bytes());
    const double seen = double(n_tok) * double(n_past) + double(n_tok) * double(n_tok + 1) / 2;  // keys, all tokens
    return weights * double(passes(n_tok)) + seen * d.n_head * d.d_head * (d.kv_f16 ? 2 : 4) * 2;
}

// A whole layer's (layer_run): attention's, the o projection adding into the stream; the FFN's norm (with its
// q8_0 form), gate_up, down and the partials' sum into the stream.
inline double fused_ffn_launches() { return 4.0; }

// Why a layer job cannot run on a tier (its layer's uploads aside), or nullptr.
inline const char *refuse_layer_job(const pi_device_layer_job *job, const pi_device_tier_desc &d) {
    if (!job || job->layer < 0 || job->layer >= d.n_layer || job->n_tok <= 0 || job->n_tok > d.n_batch ||
        job->n_past < 0 || job->n_past + job->n_tok > d.n_ctx || !job->counts)
        return "bad layer job";
    return nullptr;
}

// Why a whole or split layer's job cannot run on tier t, or "": no tier or the job's own refusal (refuse_layer_job,
// refuse_split_job), its layer's uploads, the stream it continues, a split begun and not ended. One check for both
// libraries, whose tiers name these members alike.
template <class Tier, class Job>
std::string refuse_stream_job(const Tier *t, const Job *job,
                              const char *(*refuse_job)(const Job *, const pi_device_tier_desc &)) {
    if (!t) return refuse_job(nullptr, pi_device_tier_desc{});  // "bad ... job", as for no job
    if (const char *why = refuse_job(job, t->desc)) return why;
    const auto &A = t->attention[size_t(job->layer)];
    if (!A.uploaded || !A.view.ffn_norm_w || !t->layers[size_t(job->layer)].uploaded)
        return "layer " + std::to_string(job->layer) + "'s attention, FFN norm and hot rows were not all uploaded";
    if (!job->x_in && !t->stream_ready) return "no stream on the device to continue";
    if (t->split_pending) return "a split layer was begun and not ended";
    return "";
}

// Where a layer's predictor lies in its block of device memory, each part 16-byte aligned: fc1's rows and fc2's
// hot rows (DeviceRows), then its scratch for a batch of n_batch tokens: the hidden layer's rows, their q8_0
// quants and scales (kept with the layer: a placement then charges a predictor by its layer alone).
struct PredictorLayout {
    size_t fc1 = 0, fc2 = 0, hid = 0, hid_q = 0, hid_d = 0, bytes = 0;

    PredictorLayout(const pi_device_predictor &p, const pi_device_tier_desc &d) {
        const size_t B = size_t(d.n_batch), rank = size_t(p.fc1.rows);
        BlockParts parts;
        fc1 = parts.add(size_t(p.fc1.rows) * row_bytes(p.fc1.type, p.fc1.cols));
        fc2 = parts.add(size_t(p.fc2.rows) * row_bytes(p.fc2.type, p.fc2.cols));
        hid = parts.add(B * rank * 4);
        hid_q = parts.add(B * rank);
        hid_d = parts.add(B * (rank / QK) * 2);
        bytes = parts.bytes;
    }
    template <class Copy>
    bool fill(const pi_device_predictor &p, Copy copy) const {
        return copy_rows(copy, fc1, p.fc1.type, p.fc1.rows, p.fc1.cols, p.fc1.data) &&
               copy_rows(copy, fc2, p.fc2.type, p.fc2.rows, p.fc2.cols, p.fc2.data);
    }
    pi_device_predictor view(const pi_device_predictor &p, const uint8_t *base) const {
        pi_device_predictor v = p;
        v.fc1.data = base + fc1;
        v.fc2.data = base + fc2;
        v.fc1.bias = v.fc2.bias = nullptr;
        return v;
    }
};

// Why a layer's predictor cannot go to the device beside its n_rows hot rows, or nullptr.
inline const char *refuse_predictor(const pi_device_predictor &p, const pi_device_tier_desc &d, int64_t n_rows) {
    if (!p.fc1.data || !p.fc2.data) return "a predictor held only in 8-row groups";
    if (p.fc1.cols != d.n_embd || p.fc1.rows <= 0 || p.fc1.rows % QK || p.fc2.cols != p.fc1.rows || p.fc2.rows != n_rows)
        return "a predictor of another shape (its rank a multiple of 32)";
    if (!type_computable(p.fc1.type) || !type_computable(p.fc2.type))
        return "a predictor type other than f32, f16, q8_0 and q4_0";
    return nullptr;
}

// Kernels a split layer's predictor launches: the stream's q8_0 form where fc1 is quantized, fc1 (with the ReLU),
// the hidden layer's q8_0 form where fc2 is quantized (fc2 itself is scored inside gate_up).
inline double predictor_launches(const pi_device_predictor &p) {
    return 1.0 + (quantized(p.fc1) ? 1.0 : 0.0) + (quantized(p.fc2) ? 1.0 : 0.0);
}
// Bytes it reads: fc1 once a pass; fc2's rows once a pass.
inline double predictor_bytes(const pi_device_predictor &p, int64_t n_tok) {
    return double(device_rows(p.fc1).bytes() + device_rows(p.fc2).bytes()) * double(passes(n_tok));
}

// A split layer's kernels: attention's (o adding into the stream), the FFN's norm (with its q8_0 form and the
// stream's copy for the one copy down), the predictor's where it selects, gate_up, down, and the sum of the
// down splits' partials and the cold tier's output into the stream.
inline double split_launches(const pi_device_attention &a, const pi_device_predictor *p) {
    return attention_launches(a) + 4.0 + (p ? predictor_launches(*p) : 0.0);
}

inline const char *refuse_split_job(const pi_device_split_job *job, const pi_device_tier_desc &d) {
    if (!job || job->layer < 0 || job->layer >= d.n_layer || job->n_tok <= 0 || job->n_tok > d.n_batch ||
        job->n_past < 0 || job->n_past + job->n_tok > d.n_ctx || !job->x_mid || !job->xn ||
        !job->counts || job->hot_mode < PI_DEVICE_HOT_DENSE || job->hot_mode > PI_DEVICE_HOT_PREDICTOR)
        return "bad split job";
    return nullptr;
}

// The head's: the norm (with its q8_0 form) and the projection, which reads the head once a pass.
inline double head_launches() { return 2.0; }
inline double head_bytes(const pi_device_head &h, int64_t n_tok) { return double(device_rows(h.out).bytes()) * double(passes(n_tok)); }

// Bytes of the scratch a tier's attention needs for a batch of n_batch tokens (both libraries allocate it as
// laid out here; the engine charges it to the budget): the input, its norm and q8_0 form, q, k, v, the heads'
// outputs and their q8_0 form, the block's output, every head's scores over the context, and a split layer's
// rows down (the FFN's norm and the stream) and up (the cold tier's output).
inline double attention_scratch_bytes(const pi_device_tier_desc &d) {
    const double B = d.n_batch, E = d.n_embd, Q = double(d.n_head) * d.d_head, KV = double(d.n_head_kv) * d.d_head;
    const double q8 = double(sizeof(BlockQ8_0)) / QK;
    return B * (E * 4 * 6 + E * q8 + Q * 4 * 2 + KV * 4 * 2 + Q * q8 + double(d.n_head) * d.n_ctx * 4) +
           double(d.n_ctx) * (d.n_rot / 2) * 4 * 2;
}

}  // namespace device
}  // namespace pi
