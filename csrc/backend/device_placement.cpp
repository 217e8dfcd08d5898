#include "backend/device_placement.h"

#include <algorithm>

#include "device/attention_math.h"
#include "device/expert_math.h"

namespace pi {
namespace {

pi_device_matrix device_matrix(const Matrix &m, const Matrix &bias) {
    return pi_device_matrix{m.type, int32_t(m.rows), int32_t(m.cols), m.data, bias.floats()};
}

}  // namespace

int64_t DevicePlacement::attention_layers() const { return std::count(attention.begin(), attention.end(), 1); }
int64_t DevicePlacement::hot_layers() const { return std::count(hot.begin(), hot.end(), 1); }
int64_t DevicePlacement::experts_placed() const {
    int64_t n = 0;
    for (const auto &layer : experts) n += int64_t(layer.size());
    return n;
}

pi_device_tier_desc device_tier_desc(const HParams &hp, int32_t device, int64_t n_batch, int64_t n_ctx, bool kv_f16,
                                     const float *rope_cos, const float *rope_sin) {
    pi_device_tier_desc d{};
    d.device = device;
    d.n_embd = int32_t(hp.n_embd);
    d.n_layer = int32_t(hp.n_layer);
    d.n_batch = int32_t(n_batch);
    d.activation = hp.activation == Activation::Silu ? PI_DEVICE_ACT_SILU
                   : hp.activation == Activation::DRelu ? PI_DEVICE_ACT_DRELU : PI_DEVICE_ACT_RELU;
    d.gated = hp.gated ? 1 : 0;
    d.n_head = int32_t(hp.n_head);
    d.n_head_kv = int32_t(hp.n_head_kv);
    d.d_head = int32_t(hp.d_head);
    d.n_rot = hp.rope == RopeKind::None ? 0 : int32_t(hp.n_rot);
    d.rope = hp.rope == RopeKind::None ? PI_DEVICE_ROPE_NONE
             : hp.rope == RopeKind::NeoX ? PI_DEVICE_ROPE_NEOX : PI_DEVICE_ROPE_ADJACENT;
    d.norm = hp.norm == NormKind::Rms ? PI_DEVICE_NORM_RMS : PI_DEVICE_NORM_LAYER;
    d.norm_eps = hp.norm_eps;
    d.n_ctx = int32_t(n_ctx);
    d.kv_f16 = kv_f16 ? 1 : 0;
    d.rope_cos = d.n_rot ? rope_cos : nullptr;
    d.rope_sin = d.n_rot ? rope_sin : nullptr;
    d.n_vocab = int32_t(hp.n_vocab);
    d.n_expert = int32_t(hp.n_expert);
    d.n_expert_used = int32_t(hp.n_expert_used);
    d.n_ff_expert = hp.n_expert > 0 ? int32_t(hp.n_ff_exp) : 0;
    return d;
}

pi_device_attention device_attention(const HParams &hp, const Layer &L) {
    return pi_device_attention{L.attn_norm.floats(),
                               L.attn_norm_b.floats(),
                               device_matrix(L.wq, L.bq),
                               device_matrix(L.wk, L.bk),
                               device_matrix(L.wv, L.bv),
                               device_matrix(L.wo, L.bo),
                               hp.parallel_block ? nullptr : L.ffn_norm.floats(),
                               hp.parallel_block ? nullptr : L.ffn_norm_b.floats()};
}

pi_device_head device_head(const Model &model) {
    return pi_device_head{model.output_norm().floats(), model.output_norm_b().floats(),
                          device_matrix(model.output(), Matrix{})};
}

pi_device_expert device_expert(const Experts &X, int64_t e) {
    return pi_device_expert{device_matrix(X.gate_of(e), Matrix{}), device_matrix(X.up_of(e), Matrix{}),
                            device_matrix(X.down_of(e), Matrix{})};
}

pi_device_predictor device_predictor(const Layer &L) {
    return pi_device_predictor{device_matrix(L.fc1, Matrix{}), device_matrix(L.hot.fc2, Matrix{}), L.pred_threshold};
}

bool wants_predictor(const pi_device_tier_desc &desc, const HParams &hp, const Layer &L) {
    return !hp.parallel_block && L.cold.size() > 0 && L.hot.size() > 0 && L.fc1.rows > 0 &&
           !device::refuse_predictor(device_predictor(L), desc, L.hot.size());
}

double attention_layer_bytes(const pi_device_tier_desc &desc, const HParams &hp, const Layer &L) {
    return double(device::AttentionLayout(device_attention(hp, L), desc).bytes);
}

double hot_layer_bytes(const HParams &hp, const Layer &L, const FfnTier &T) {
    const double n = double(T.size());
    double row = double(L.gate.row_bytes + L.down_t.row_bytes) + (hp.gated ? double(L.up.row_bytes) : 0.0);
    if (L.gate_b.data) row += 4;
    if (hp.gated && L.up_b.data) row += 4;
    return n * row;
}

double hot_scratch_bytes(const HParams &hp, int64_t n_batch, int64_t rows) {
    const double E = double(hp.n_embd), B = double(n_batch);
    return B * E * 4 * 2 + B * (E / QK) * sizeof(BlockQ8_0) + B * double(rows) * 4 + double(device::kJobCountersBytes);
}

DevicePlacement place_on_device(const pi_device_tier_desc &desc, const Model &model, double budget,
                                bool with_attention, int64_t largest_tier,
                                const std::vector<std::vector<int32_t>> *experts) {
    const HParams &hp = model.hp();
    const std::vector<Layer> &layers = model.layers();
    DevicePlacement p;
    p.attention.assign(layers.size(), 0);
    p.hot.assign(layers.size(), 0);
    p.predictor.assign(layers.size(), 0);
    p.budget = budget;
    p.scratch = hot_scratch_bytes(hp, desc.n_batch, largest_tier);
    double room = budget - p.scratch;
    if (!with_attention) p.attention_off = "gpu_ffn_only (or kv_type q8_0): attention and the output head kept on the CPU";
    // the device's attention computes no per-head q/k norms and scores scaled by 1/sqrt(d_head) only: the head and
    // hot rows alone go there
    const bool qk_norm = hp.qk_norm != QkNorm::None;
    const bool attention = with_attention && !qk_norm && hp.attn_scale == 0.0f;
    if (with_attention && !attention)
        p.attention_off = "attention stays on the CPU: the device does not compute " +
                          std::string(qk_norm ? "per-head q/k norms" : "an attention.scale") + " (" + hp.arch + ")";
    const pi_device_head head = device_head(model);
    if (with_attention && !device::refuse_head(head, desc)) {
        const double need = double(device::HeadLayout(head, desc).bytes) + device::head_scratch_bytes(desc);
        if (need <= room) {
            p.head = true;
            p.head_bytes = need;
            room -= need;
        }
    }
    const double attention_scratch = device::attention_scratch_bytes(desc);
    for (size_t il = 0; attention && il < layers.size(); ++il) {
        const pi_device_attention a = device_attention(hp, layers[il]);
        if (const char *why = device::refuse_attention(a, desc)) {
            if (il == 0) p.attention_off = std::string("attention stays on the CPU: ") + why;
            break;
        }
        const device::AttentionLayout layout(a, desc);
        const double kv = double(layout.bytes - layout.k_cache);  // the caches come last
        const double need = double(layout.bytes) + (il == 0 ? attention_scratch : 0.0);
        if (need > room) {
            if (il == 0) p.attention_off = "the budget holds no layer's attention and KV cache";
            break;
        }
        p.attention[il] = 1;
        room -= need;
        p.attention_bytes += need - kv - (il == 0 ? attention_scratch : 0.0);
        p.kv_bytes += kv;
        if (il == 0) p.scratch += attention_scratch;
    }
    // the device computes SiLU, ReLU and dReLU neurons: a GELU model's (gemma3) stay on the CPU
    for (size_t il = 0; hp.activation != Activation::Gelu && il < layers.size(); ++il) {
        const Layer &L = layers[il];
        if (L.hot.size() == 0) continue;
        const bool predictor = p.attention[il] && wants_predictor(desc, hp, L);
        const double hot = hot_layer_bytes(hp, L, L.hot);
        const double pred = predictor ? double(device::PredictorLayout(device_predictor(L), desc).bytes) : 0.0;
        if (hot + pred > room) break;
        p.hot[il] = 1;
        p.predictor[il] = predictor;
        room -= hot + pred;
        p.hot_bytes += hot;
        p.predictor_bytes += pred;
    }
    p.experts.assign(layers.size(), {});
    double weights = 0;  // a layer's experts are one shape and type: its expert 0 prices them
    for (size_t il = 0; experts && il < experts->size() && il < layers.size(); ++il)
        if (!(*experts)[il].empty())
            weights += double((*experts)[il].size()) * device::expert_bytes(device_expert(layers[il].experts, 0));
    if (weights > 0) {
        const double scratch = device::experts_scratch_bytes(desc);
        const double need = scratch + weights;
        p.expert_room = room;
        if (need <= room) {
            p.experts = *experts;
            p.expert_bytes = need - scratch;
            p.scratch += scratch;
        }
    }
    return p;
}

}  // namespace pi
