// What the engine counts as it runs (per layer: tokens, densities, the predictor's selection and recall, the
// cold tier's modes; per phase: seconds), and the JSON objects pi_info_json and pi_stats_json return.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/device_backend.h"
#include "backend/tier_backend.h"
#include "engine/ffn_policy.h"
#include "engine/input_kernels.h"
#include "engine/tier_mode.h"
#include "model/disk_tier.h"
#include "model/expert_tier.h"
#include "model/model.h"

namespace pi {

struct LayerStats {
    double tokens = 0;        // tokens through this layer's FFN
    double active = 0;        // neurons passing the activation rule (all tiers)
    double hot_active = 0;    // of which in the hot tier
    double computed = 0;      // neurons whose up/down rows were used
    double cold_tokens = 0;   // token-tier pairs scored by the predictor
    double predicted = 0;     // cold neurons selected by the predictor
    double true_pos = 0;      // selected and truly active (recall check / oracle)
    double positives = 0;     // truly active cold neurons (recall check / oracle)
    double mode_tokens[kTierModes] = {};  // per TierMode, for the cold tier
    double kernel_changes = 0;            // decode steps whose cold-tier kernels differ from the step before's
};

struct PhaseTimes {
    double embed = 0, attention = 0, predictor = 0, gate_up = 0, down = 0, output = 0;
};

// Input sparsity: inputs seen and zeroed (every step), and of the decode steps the bytes of the transposed matrices'
// rows their inputs select from, and of those skipped.
struct InputStats {
    double share = 0, inputs = 0, zeroed = 0, decode_bytes = 0, decode_skipped = 0;
};

struct EngineStats {
    std::vector<LayerStats> layers;
    PhaseTimes times;
    InputStats input;
    double batch_tokens = 0, batch_seconds = 0, decode_tokens = 0, decode_seconds = 0;

    explicit EngineStats(int64_t n_layer) : layers(size_t(n_layer)) {}
    void reset() {
        const double share = input.share;
        *this = EngineStats(int64_t(layers.size()));
        input.share = share;
    }
    // A layer's FFN over n_tok tokens: what its tiers counted (the cold tier's in cold_mode).
    void take_ffn(int64_t il, int64_t n_tok, TierMode cold_mode, bool has_cold, const TierCounts &hot,
                  const TierCounts &cold);
    // A pi_eval call of n tokens that took `seconds`.
    void take_eval(int64_t n, double seconds);
    // a decode step of n sequences together: n decode tokens in `seconds`
    void take_steps(int64_t n, double seconds) {
        decode_tokens += double(n);
        decode_seconds += seconds;
    }
};

// The run's settings, as pi_info_json reports them.
struct RunSettings {
    int64_t n_ctx, n_batch, n_seq, threads;
    const char *isa, *hot_backend;
    int32_t ffn_mode;
    bool recall_check;
    int32_t kv_type;  // pi_kv_type
    double kv_cache_bytes, work_buffer_bytes;
    const char *gpu_mode;          // off, auto or on, as asked
    const DeviceUse *device;       // the hot tier's device, or nullptr: it runs on the CPU
    const std::string *gpu_off;    // why not, where the mode asked for a device
    bool gpuidx_ignored;           // a gpuidx was given and no device took it: its neurons are cold
};

std::string info_json(const Model &model, const RunSettings &run);
// copies: the Model's, with the hot tier's backend's bytes in `hot`
// device: as in RunSettings
// disk: the cold tier's disk tier, or nullptr (its "disk" object is then null)
// input_kernels: the layout of input sparsity's copies per site, and why
std::string stats_json(const Model &model, const WeightCopies &copies, const EngineStats &stats, const FfnPolicy &policy,
                       const DeviceUse *device, const DiskTier *disk, const ExpertTier *experts,
                       const InputKernelChoice &input_kernels);

}  // namespace pi
