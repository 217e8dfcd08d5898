// Which mode each layer's FFN tiers run in (docs/engine.md, "Choosing a layer's kernels"): the file's FFN mode
// (pi_ffn_mode), and for gate and auto modes the cold tier's cheapest kernels by a cost model at the densities
// measured so far in the layer (moving averages over tokens), changed on decode steps only when that pays for
// the regrouping a change takes (rent or buy). The policy holds only its own state; the engine applies its
// verdicts (Model::arrange_cold_tier) and runs the tiers.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "backend/tier_backend.h"
#include "engine/tier_mode.h"
#include "model/model.h"
#include "pi_engine.h"

namespace pi {

class FfnPolicy {
public:
    explicit FfnPolicy(const Model &model);

    int32_t mode() const { return mode_; }
    // Checks and sets the FFN mode (pi_ffn_mode); every layer's decode history starts again.
    void set_mode(int32_t mode);
    // The hot tier's mode beside a cold tier in `cold_mode`: every neuron where the layer runs dense (dense mode,
    // auto's dense verdict), else every neuron the rule passes.
    static TierMode hot_mode(TierMode cold_mode) {
        return cold_mode == TierMode::Dense ? TierMode::Dense : TierMode::DenseRule;
    }
    // The cold tier's mode for layer il and a batch of n_tok tokens (a decode step may keep its last kernels).
    TierMode cold_mode(int64_t il, int64_t n_tok);
    // Whether a batch's cold tier reads every gate of layer il whole (and so holds them in groups).
    bool batch_reads_gates_whole(int64_t il) const;
    // Tokens of a batch whose predictor selection the cold tier also measures (TierJob::n_probe): auto mode, once
    // a sequence (its first batch) or until the layer has predictor densities.
    int64_t probe_tokens(int64_t il, int64_t n_tok, TierMode cold_mode, int64_t n_past) const;
    // A decode step ran layer il's cold tier in `cold_mode`; returns whether its kernels changed since the last one.
    bool decode_step(int64_t il, TierMode cold_mode);
    // What layer il's tiers counted for a batch of n_tok tokens, taken into its densities.
    void take(int64_t il, int64_t n_tok, TierMode cold_mode, const TierCounts &hot, const TierCounts &cold,
              int64_t n_probe);
    // The cold tier's mode at layer il's last decode step since the mode was set (none yet: nullopt).
    std::optional<TierMode> decode_mode(int64_t il) const { return decode_mode_[size_t(il)]; }

private:
    // The mode of the kernels that read every gate and up: auto computes every neuron there on a SiLU model
    // (dense's values, the exact model: the rule's threshold would change them), the rule's neurons otherwise
    // (a ReLU-family rule drops only zeros: dense's values, fewer down rows).
    TierMode whole_mode() const;
    // auto mode may run layer il's predictor: the file has predictors and train-predictor found this one useful
    bool auto_may_predict(int64_t il) const;

    const Model &model_;
    int32_t mode_ = PI_FFN_DENSE;
    // measured densities per layer (exponential moving averages over tokens)
    std::vector<double> ema_active_, ema_predicted_, ema_predicted_active_;
    std::vector<bool> predicted_seen_;
    // per layer, the cold tier's mode at its last decode step since the FFN mode was set, and what it has cost
    // beyond the cheapest mode's since it last was the cheapest
    std::vector<std::optional<TierMode>> decode_mode_;
    std::vector<double> switch_regret_;
};

}  // namespace pi
