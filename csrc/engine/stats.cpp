#include "engine/stats.h"

#include <cmath>
#include <cstdio>

#include "engine/run_state.h"

namespace pi {

void EngineStats::take_ffn(int64_t il, int64_t n_tok, TierMode cold_mode, bool has_cold, const TierCounts &hot,
                           const TierCounts &cold) {
    LayerStats &st = layers[size_t(il)];
    st.tokens += double(n_tok);
    st.active += hot.active + cold.active;
    st.hot_active += hot.active;
    st.computed += hot.computed + cold.computed;
    st.predicted += cold.predicted;
    st.cold_tokens += cold.scored_tokens;
    st.true_pos += cold.true_pos;
    st.positives += cold.positives;
    if (has_cold) st.mode_tokens[int(cold_mode)] += double(n_tok);
    for (const TierCounts *c : {&hot, &cold}) {
        times.predictor += c->predictor_seconds;
        times.gate_up += c->gate_up_seconds;
        times.down += c->down_seconds;
    }
}

void EngineStats::take_eval(int64_t n, double seconds) {
    if (n == 1) {
        decode_tokens += 1;
        decode_seconds += seconds;
    } else {
        batch_tokens += double(n);
        batch_seconds += seconds;
    }
}

namespace {

std::string num(double v) {
    if (!std::isfinite(v)) return "null";
    char b[64];
    std::snprintf(b, sizeof b, "%.9g", v);
    return b;
}

std::string quoted(const std::string &s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        if (static_cast<unsigned char>(c) < 0x20) {
            char b[8];
            std::snprintf(b, sizeof b, "\\u%04x", c);
            out += b;
            continue;
        }
        out += c;
    }
    return out + "\"";
}

const char *mode_name(int32_t m) {
    static const char *names[] = {"dense", "gate", "predictor", "auto", "oracle"};
    return m >= 0 && m <= 4 ? names[m] : "?";
}

const char *activation_name(const HParams &h) {
    if (h.shifted_relu) return "fatrelu";
    return h.activation == Activation::Relu   ? "relu"
           : h.activation == Activation::Silu ? "silu"
           : h.activation == Activation::Gelu ? "gelu"
                                              : "drelu";
}

// ", "-separated f(layer) of every layer, in brackets
template <class F>
std::string per_layer(const Model &model, F f) {
    std::string out = "[";
    for (size_t i = 0; i < model.layers().size(); ++i) out += (i ? ", " : "") + f(model.layers()[i]);
    return out + "]";
}

std::string device_json(const DeviceUse *u) {
    if (!u) return "null";
    const DevicePlacement &p = u->placement;
    std::string layers = "[";
    for (size_t i = 0; i < p.attention.size(); ++i)
        layers += std::string(i ? ", " : "") + "{\"attention\": " + (p.attention[i] ? "\"device\"" : "\"cpu\"") +
                  ", \"hot_rows\": " + (p.hot[i] ? "\"device\"" : "\"cpu\"") +
                  ", \"predictor\": " + (p.predictor[i] ? "\"device\"" : "\"cpu\"") +
                  ", \"device_experts\": " + num(i < p.experts.size() ? double(p.experts[i].size()) : 0.0) + "}";
    layers += "]";
    return "{\"library\": " + quoted(u->library) + ", \"device\": " + num(u->device) + ", \"name\": " +
           quoted(u->device_name) + ", \"free_bytes\": " + num(u->free_bytes) + ", \"total_bytes\": " +
           num(u->total_bytes) + ", \"budget_bytes\": " + num(u->budget_bytes) + ", \"layers_on_device\": " +
           num(double(u->layers_on_device)) + ", \"hot_layers\": " + num(double(u->hot_layers)) +
           ", \"output_head\": " + (p.head ? "\"device\"" : "\"cpu\"") +
           ", \"attention_layers\": " + num(double(p.attention_layers())) + ", \"attention_reason\": " +
           (p.attention_off.empty() ? std::string("null") : quoted(p.attention_off)) +
           ", \"placed_bytes\": {\"scratch\": " + num(p.scratch) + ", \"head\": " + num(p.head_bytes) +
           ", \"attention\": " + num(p.attention_bytes) +
           ", \"kv_cache\": " + num(p.kv_bytes) + ", \"hot\": " + num(p.hot_bytes) +
           ", \"predictor\": " + num(p.predictor_bytes) + ", \"experts\": " + num(p.expert_bytes) +
           "}, \"layers\": " + layers + ", \"experts_on_device\": " + num(double(u->experts_on_device)) +
           ", \"device_bytes\": " + num(u->device_bytes) + ", \"jobs\": " + num(u->jobs) + ", \"tokens\": " +
           num(u->tokens) + ", \"h2d_bytes\": " + num(u->h2d_bytes) + ", \"d2h_bytes\": " + num(u->d2h_bytes) +
           ", \"device_seconds\": " + num(u->device_seconds) + ", \"wait_seconds\": " + num(u->wait_seconds) +
           ", \"attention_jobs\": " + num(u->attention_jobs) + ", \"attention_seconds\": " +
           num(u->attention_seconds) + ", \"head_jobs\": " + num(u->head_jobs) + ", \"head_seconds\": " +
           num(u->head_seconds) + ", \"layer_jobs\": " + num(u->layer_jobs) + ", \"layer_seconds\": " +
           num(u->layer_seconds) + ", \"split_jobs\": " + num(u->split_jobs) + ", \"split_seconds\": " +
           num(u->split_seconds) + ", \"expert_jobs\": " + num(u->expert_jobs) + ", \"expert_pairs\": " +
           num(u->expert_pairs) + ", \"expert_seconds\": " + num(u->expert_seconds) + ", \"expert_wait_seconds\": " +
           num(u->expert_wait_seconds) + ", \"launches\": " + num(u->launches) + ", \"device_read_bytes\": " +
           num(u->device_read_bytes) + ", \"copy_rate\": " + num(u->copy_rate) + "}";
}

// The matrices decoded at load (model/decode.h), one entry per kind.
std::string decoded_json(const DecodedWeights &d) {
    std::string json = "{\"seconds\": " + num(d.seconds()) + ", \"cache\": " + quoted(d.cache_state()) +
                       ", \"from_cache\": " + std::to_string(d.from_cache()) + ", \"kinds\": [";
    for (size_t i = 0; i < d.tallies().size(); ++i) {
        const DecodeTally &t = d.tallies()[i];
        json += std::string(i ? ", " : "") + "{\"from\": " + quoted(type_size(t.from).name) + ", \"to\": " +
                quoted(type_size(t.to).name) + ", \"transposed\": " + (t.transposed ? "true" : "false") +
                ", \"tensors\": " + std::to_string(t.tensors) + ", \"bytes\": " + std::to_string(t.bytes) +
                ", \"file_bytes\": " + std::to_string(t.file_bytes) + "}";
    }
    return json + "]}";
}

}  // namespace

std::string info_json(const Model &model, const RunSettings &run) {
    const HParams &h = model.hp();
    const Layer &l0 = model.layers()[0];
    std::string levels = "[";
    for (size_t k = 0; k < model.input_levels().size(); ++k) levels += (k ? ", " : "") + num(model.input_levels()[k]);
    levels += "]";
    return "{\"path\": " + quoted(model.path()) + ", \"magic\": " + quoted(model.pwri() ? "PWRI" : "GGUF") +
           ", \"arch\": " + quoted(h.arch) + ", \"activation\": " + quoted(activation_name(h)) +
           ", \"n_vocab\": " + num(double(h.n_vocab)) + ", \"n_embd\": " + num(double(h.n_embd)) +
           ", \"n_layer\": " + num(double(h.n_layer)) + ", \"n_ff\": " + num(double(h.n_ff)) +
           ", \"n_head\": " + num(double(h.n_head)) + ", \"n_head_kv\": " + num(double(h.n_head_kv)) +
           ", \"n_ctx_train\": " + num(double(h.n_ctx_train)) + ", \"n_ctx\": " + num(double(run.n_ctx)) +
           ", \"n_batch\": " + num(double(run.n_batch)) + ", \"n_seq\": " + num(double(run.n_seq)) + ", \"rope_base\": " + num(h.rope_base) +
           ", \"bos\": " + num(double(h.bos)) + ", \"eos\": " + num(double(h.eos)) +
           ", \"weight_type\": " + quoted(type_size((l0.experts.present() ? l0.experts.up : l0.up).type).name) +
           ", \"n_expert\": " + num(double(h.n_expert)) + ", \"n_expert_used\": " + num(double(h.n_expert_used)) +
           ", \"n_ff_exp\": " + num(double(h.n_ff_exp)) +
           ", \"decoded\": " + decoded_json(model.decoded()) +
           ", \"has_predictor\": " + (model.has_predictor() ? "true" : "false") +
           ", \"hot_neurons\": " + num(double(model.hot_neurons())) +
           ", \"threads\": " + num(double(run.threads)) + ", \"isa\": " + quoted(run.isa) +
           ", \"hot_backend\": " + quoted(run.hot_backend) +
           ", \"gpu\": {\"mode\": " + quoted(run.gpu_mode) + ", \"used\": " + (run.device ? "true" : "false") +
           ", \"reason\": " + (run.gpu_off && !run.gpu_off->empty() ? quoted(*run.gpu_off) : std::string("null")) +
           ", \"gpuidx_ignored\": " + (run.gpuidx_ignored ? "true" : "false") +
           ", \"device\": " + device_json(run.device) + "}" +
           ", \"ffn_mode\": " + quoted(mode_name(run.ffn_mode)) + ", \"recall_check\": " + (run.recall_check ? "true" : "false") +
           ", \"kv_type\": " + quoted(RunState::kv_type_name(run.kv_type)) +
           ", \"kv_cache_bytes\": " + std::to_string(int64_t(run.kv_cache_bytes)) +
           ", \"work_buffer_bytes\": " + std::to_string(int64_t(run.work_buffer_bytes)) +
           ", \"activation_thresholds\": " + per_layer(model, [](const Layer &l) { return num(l.act_threshold); }) +
           ", \"predictor_thresholds\": " + per_layer(model, [](const Layer &l) { return num(l.pred_threshold); }) +
           ", \"predictor_useful\": " +
           per_layer(model, [](const Layer &l) { return std::string(l.predictor_useful ? "true" : "false"); }) +
           ", \"input_sparsity_levels\": " + levels + "}";
}

namespace {

std::string count(double v) { return std::to_string(int64_t(v)); }  // exact: bytes pass 2^32 in minutes

std::string counts_json(const DiskCounts &c) {
    return "\"tokens\": " + count(c.tokens) + ", \"bytes\": " + count(c.bytes) + ", \"reads\": " + count(c.reads) +
           ", \"cache_hits\": " + count(c.cache_hits) + ", \"cache_misses\": " + count(c.cache_misses) +
           ", \"io_wait_seconds\": " + num(c.io_wait_seconds);
}

// The expert tier's counters in the same object as the disk tier's ("kind": "experts"; hits and misses count experts)
// and the lookahead's: experts it read ahead, and those a step then used; the hits on experts a plan pinned (among
// cache_hits), how many it pinned (among slots) and whether a plan was followed.
std::string experts_json(const ExpertTier &t) {
    const DiskCounts &c = t.counts();
    return "{\"kind\": \"experts\", " + counts_json(c) + ", \"prefetched\": " + count(c.prefetched) +
           ", \"prefetch_used\": " + count(c.prefetch_used) + ", \"pinned_hits\": " + count(c.pinned_hits) +
           ", \"pinned\": " + count(double(t.pinned())) + ", \"tier_plan\": " + (t.planned() ? "true" : "false") +
           ", \"resident_bytes\": " + count(t.resident_bytes()) +
           ", \"budget_bytes\": " + count(t.budget_bytes()) + ", \"fixed_bytes\": " + count(t.fixed_bytes()) +
           ", \"slots\": " + count(double(t.slots())) + ", \"slot_bytes\": " + count(t.slot_bytes()) + "}";
}

std::string disk_json(const DiskTier *disk, bool dense_mapped) {
    if (!disk) return "null";
    const DiskCounts &c = disk->counts();
    std::string resident = "[";  // per layer
    for (size_t il = 0; il < disk->resident_per_layer().size(); ++il)
        resident += (il ? ", " : "") + std::to_string(disk->resident_per_layer()[il]);
    resident += "]";
    return "{" + counts_json(c) + ", \"resident_bytes\": " + count(disk->resident_bytes()) +
           ", \"budget_bytes\": " + count(disk->budget_bytes()) +
           ", \"resident_room_bytes\": " + count(disk->resident_room_bytes()) + ", \"resident_neurons\": " + resident +
           ", \"tier_plan\": " + (disk->follows_plan() ? "true" : "false") +
           ", \"dense_mapped\": " + (dense_mapped ? "true" : "false") + "}";
}

}  // namespace

namespace {

// {"qkv": {"kernel": "gemv_columns", "why": "probe", "columns_ms": .., "groups_ms": ..}, ...}: the sites decided
std::string input_kernels_json(const InputKernelChoice &k) {
    static const char *const kSiteNames[InputKernelChoice::kSites] = {"qkv", "o", "gate_up", "down"};
    std::string json = "{";
    for (int s = 0; s < InputKernelChoice::kSites; ++s) {
        if (!k.decided[s]) continue;
        json += std::string(json.size() > 1 ? ", " : "") + quoted(kSiteNames[s]) + ": {\"kernel\": " +
                quoted(k.columns[s] ? "gemv_columns" : "gemm8") + ", \"why\": " + quoted(k.why) +
                ", \"columns_ms\": " + num(k.columns_ms[s]) + ", \"groups_ms\": " + num(k.groups_ms[s]) + "}";
    }
    return json + "}";
}

}  // namespace

std::string stats_json(const Model &model, const WeightCopies &wc, const EngineStats &stats, const FfnPolicy &policy,
                       const DeviceUse *device, const DiskTier *disk, const ExpertTier *experts,
                       const InputKernelChoice &input_kernels) {
    const PhaseTimes &t = stats.times;
    std::string json = "{\"ffn_mode\": " + quoted(mode_name(policy.mode())) + ", \"batch_tokens\": " + num(stats.batch_tokens) +
                       ", \"batch_seconds\": " + num(stats.batch_seconds) + ", \"decode_tokens\": " + num(stats.decode_tokens) +
                       ", \"decode_seconds\": " + num(stats.decode_seconds) + ", \"phases\": {\"embed\": " + num(t.embed) +
                       ", \"attention\": " + num(t.attention) + ", \"predictor\": " + num(t.predictor) +
                       ", \"gate_up\": " + num(t.gate_up) + ", \"down\": " + num(t.down) + ", \"output\": " + num(t.output) + "}";
    const InputStats &in = stats.input;
    json += ", \"input_sparsity\": {\"share\": " + num(in.share) + ", \"inputs\": " + num(in.inputs) +
            ", \"zeroed\": " + num(in.zeroed) + ", \"decode_bytes\": " + num(in.decode_bytes) +
            ", \"decode_bytes_skipped\": " + num(in.decode_skipped) +
            ", \"kernels\": " + input_kernels_json(input_kernels) + "}";
    json += ", \"weight_copies\": {\"packed\": " + std::to_string(wc.packed) + ", \"predictor\": " + std::to_string(wc.predictor) +
            ", \"hot\": " + std::to_string(wc.hot) + ", \"cold_groups\": " + std::to_string(wc.cold_groups) +
            ", \"down_quads\": " + std::to_string(wc.down_quads) + ", \"decoded\": " + std::to_string(wc.decoded) +
            ", \"input_columns\": " + std::to_string(wc.input_columns) + ", \"down_rows\": " +
            std::to_string(wc.down_rows) + "}, \"gpu\": " + device_json(device) +
            ", \"disk\": " + (experts ? experts_json(*experts) : disk_json(disk, model.dense_mapped())) + ", \"layers\": [";
    const double F = double(model.hp().ffn_neurons());  // a token's neurons in a layer: its experts' in a mixture
    for (size_t i = 0; i < stats.layers.size(); ++i) {
        const LayerStats &s = stats.layers[i];
        const Layer &L = model.layers()[i];
        const double nc = double(L.cold.size());
        const std::optional<TierMode> decode_mode = policy.decode_mode(int64_t(i));
        json += std::string(i ? ", " : "") + "{\"layer\": " + num(double(i)) + ", \"tokens\": " + num(s.tokens) +
                ", \"density\": " + num(s.tokens > 0 ? s.active / s.tokens / F : NAN) +
                ", \"computed_density\": " + num(s.tokens > 0 ? s.computed / s.tokens / F : NAN) +
                ", \"hot_neurons\": " + num(double(L.hot.size())) +
                ", \"hot_density\": " + num(s.tokens > 0 && L.hot.size() ? s.hot_active / s.tokens / double(L.hot.size()) : NAN) +
                ", \"predicted_density\": " + num(s.cold_tokens > 0 && nc > 0 ? s.predicted / s.cold_tokens / nc : NAN) +
                ", \"recall\": " + num(s.positives > 0 ? s.true_pos / s.positives : NAN) +
                ", \"decode_mode\": " + (decode_mode ? quoted(tier_mode_name(*decode_mode)) : std::string("null")) +
                ", \"cold_groups\": " + std::to_string(L.cold.gate_groups.size() + L.cold.up_groups.size()) +
                ", \"down_quads\": " + std::to_string(L.cold.down_quads.size()) +
                ", \"kernel_changes\": " + num(s.kernel_changes) + ", \"modes\": {";
        bool first = true;
        for (int m = 0; m < kTierModes; ++m) {
            if (s.mode_tokens[m] == 0) continue;
            json += std::string(first ? "" : ", ") + quoted(tier_mode_name(TierMode(m))) + ": " + num(s.mode_tokens[m]);
            first = false;
        }
        json += "}}";
    }
    return json + "]}";
}

}  // namespace pi
