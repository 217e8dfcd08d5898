#include "engine/run_state.h"

#include <algorithm>
#include <cmath>

namespace pi {

RunState::RunState(const HParams &hp, int64_t n_ctx_, int64_t n_batch, int64_t threads, pi_kv_type kv_type_, int64_t n_seq)
    : n_ctx(n_ctx_), kv_type(kv_type_), kv_block(kv_block_for(hp, n_ctx_, kv_type_)) {
    const int64_t E = hp.n_embd, L = hp.n_layer, B = n_batch;
    const int64_t Q = hp.n_head * hp.d_head, KV = hp.n_head_kv * hp.d_head;
    const int64_t elements = L * kv_slots(hp, n_ctx, kv_type) * KV;
    seqs.resize(size_t(n_seq));
    for (Sequence &sq : seqs) {  // mapped, never populated: a cache's pages come in as its positions fill
        sq.k_cache = PageMemory(size_t(elements * kv_bytes()), true, "the KV cache", false);
        sq.v_cache = PageMemory(size_t(elements * kv_bytes()), true, "the KV cache", false);
        if (kv_type == PI_KV_Q8_0) {
            sq.k_scales = PageMemory(size_t(elements / QK * 2), true, "the KV cache", false);
            sq.v_scales = PageMemory(size_t(elements / QK * 2), true, "the KV cache", false);
        }
        sq.history.assign(size_t(n_ctx), 0);
        sq.last_logits.assign(size_t(hp.n_vocab), 0.0f);
    }

    const int64_t half = hp.n_rot / 2;
    auto tables = [&](float base, float freq_scale, const std::vector<float> &factors, float mscale,
                      std::vector<float> &cos_t, std::vector<float> &sin_t) {
        cos_t.resize(size_t(n_ctx * half));
        sin_t.resize(size_t(n_ctx * half));
        for (int64_t i = 0; i < half; ++i) {
            // float32 steps, as transformers builds inv_freq and the angles; scaling divides pair i's frequency
            // (llama3, YaRN, longrope) and multiplies cos and sin (YaRN's and longrope's attention factor)
            const float plain = 1.0f / std::pow(base, float(2 * i) / float(hp.n_rot));
            const float inv = factors.empty() ? plain : plain / factors[size_t(i)];
            for (int64_t p = 0; p < n_ctx; ++p) {
                const float angle = (float(p) * freq_scale) * inv;
                cos_t[size_t(p * half + i)] = float(std::cos(double(angle))) * mscale;
                sin_t[size_t(p * half + i)] = float(std::sin(double(angle))) * mscale;
            }
        }
    };
    tables(hp.rope_base, hp.rope_freq_scale, hp.rope_freq_factors, hp.rope_attn_factor, rope_cos, rope_sin);
    // sliding-window layers (layer 0 slides whenever any does): their own base, unscaled (gemma3's, as llama.cpp's)
    if (hp.swa_layer(0)) tables(hp.rope_base_swa, 1.0f, {}, 1.0f, rope_cos_swa, rope_sin_swa);

    for (std::vector<float> *b : {&x, &xn, &tmp, &y_hot, &y_cold}) b->assign(size_t(B * E), 0.0f);
    q.assign(size_t(B * Q), 0.0f);
    att.assign(size_t(B * Q), 0.0f);
    k.assign(size_t(B * KV), 0.0f);
    v.assign(size_t(B * KV), 0.0f);
    step_logits.assign(size_t(n_seq * hp.n_vocab), 0.0f);
    scores.assign(size_t(std::max<int64_t>(threads * kAttnTile, hp.n_head) * n_ctx), 0.0f);
    q_x.resize(size_t(B * (E / QK)));
    q_xn.resize(size_t(B * (E / QK)));
    q_att.resize(size_t(B * (Q / QK)));
    op_x = {x.data(), E, q_x.data(), false};
    op_xn = {xn.data(), E, q_xn.data(), false};
    op_att = {att.data(), Q, q_att.data(), false};
}

int64_t RunState::kv_block_for(const HParams &hp, int64_t n_ctx, pi_kv_type kv_type) {
    const int64_t position_bytes = std::max<int64_t>(1, hp.n_head_kv * hp.d_head * element_bytes(kv_type));
    const int64_t tiles = std::max<int64_t>(1, (int64_t(2) << 20) / position_bytes / kKeyTile);
    return std::min(tiles * kKeyTile, key_slots(n_ctx));
}

int64_t RunState::kv_slots(const HParams &hp, int64_t n_ctx, pi_kv_type kv_type) {
    const int64_t block = kv_block_for(hp, n_ctx, kv_type);
    return (n_ctx + block - 1) / block * block;
}

double RunState::kv_cache_bytes(const HParams &hp, int64_t n_ctx, pi_kv_type kv_type, int64_t n_seq) {
    return double(n_seq) * double(hp.n_layer) * double(2 * kv_slots(hp, n_ctx, kv_type)) *
           double(hp.n_head_kv * hp.d_head) * bytes_per_element(kv_type);
}

double RunState::buffer_bytes(const HParams &hp, int64_t n_ctx, int64_t n_batch, int64_t threads, int64_t n_seq) {
    const double E = double(hp.n_embd), B = double(n_batch), C = double(n_ctx), T = double(threads), S = double(n_seq);
    const double Q = double(hp.n_head * hp.d_head), KV = double(hp.n_head_kv * hp.d_head);
    const double floats = C * double(hp.n_rot) + B * (5 * E + 2 * Q + 2 * KV) + 2 * S * double(hp.n_vocab) +
                          std::max(T * double(kAttnTile), double(hp.n_head)) * C;
    return 4 * floats + S * C * 4 + B * (2 * E + Q) / QK * double(sizeof(BlockQ8_0));
}

}  // namespace pi
