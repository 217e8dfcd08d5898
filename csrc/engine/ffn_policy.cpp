#include "engine/ffn_policy.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "runtime/common.h"

namespace pi {
namespace {

const double kBatchRowDot = 2.5;  // a batch's row dotted for one token by dot_rows, in gemm8 row-tokens
// The price of changing a layer's decode kernels, per byte of gate/up matrix whose layout changes, in streamed bytes
// (the unit of cold_mode's costs): grouping copies the rows into fresh pages; ungrouping unmaps the groups, and
// the next steps fault the mapped rows back in.
const double kGroupPrice = 25.0, kUngroupPrice = 5.0;
const int64_t kPredictorProbeTokens = 16;  // a batch's last tokens auto mode scores the predictor for

// A layer's densities as auto mode keeps them: a moving average over tokens, 0.2 a token, so that n tokens weigh as
// n steps; where the average has not `started`, the value replaces its starting guess.
void take_into_average(double &average, double value, int64_t n_tokens, bool started) {
    const double a = 1.0 - std::pow(0.8, double(n_tokens));
    average = started ? (1 - a) * average + a * value : value;
}

}  // namespace

FfnPolicy::FfnPolicy(const Model &model) : model_(model) {
    const size_t L = size_t(model.hp().n_layer);
    ema_active_.assign(L, 1.0);
    ema_predicted_.assign(L, 1.0);
    ema_predicted_active_.assign(L, 1.0);
    predicted_seen_.assign(L, false);
    decode_mode_.assign(L, std::nullopt);
    switch_regret_.assign(L, 0.0);
}

void FfnPolicy::set_mode(int32_t mode) {
    if (mode < PI_FFN_DENSE || mode > PI_FFN_ORACLE) fail(PI_ERR_ARGUMENT, "unknown FFN mode " + std::to_string(mode));
    const HParams &hp = model_.hp();
    if (hp.n_expert > 0 && (mode == PI_FFN_PREDICTOR || mode == PI_FFN_ORACLE))
        fail(PI_ERR_UNSUPPORTED, std::string(mode == PI_FFN_PREDICTOR ? "predictor" : "oracle") +
                                     " mode selects neurons by a predictor, which the experts of a mixture of experts do "
                                     "not have in this version (dense, auto; gate for ReLU experts)");
    if (hp.n_expert > 0 && mode == PI_FFN_GATE && hp.activation != Activation::Relu)
        fail(PI_ERR_UNSUPPORTED, "gate mode thresholds SiLU neurons at a profile's thresholds, which the experts of a "
                                 "mixture of experts do not have in this version (dense, auto)");
    if (mode == PI_FFN_PREDICTOR && !model_.has_predictor())
        fail(PI_ERR_ARGUMENT, model_.path() + " has no predictors: predictor mode needs a file converted with --predictors");
    mode_ = mode;
    std::fill(decode_mode_.begin(), decode_mode_.end(), std::nullopt);
    std::fill(switch_regret_.begin(), switch_regret_.end(), 0.0);
}

bool FfnPolicy::auto_may_predict(int64_t il) const {
    return mode_ == PI_FFN_AUTO && model_.has_predictor() && model_.layers()[size_t(il)].predictor_useful;
}

TierMode FfnPolicy::whole_mode() const {
    return mode_ == PI_FFN_AUTO && thresholded(model_.hp().activation) ? TierMode::Dense : TierMode::DenseRule;
}

bool FfnPolicy::batch_reads_gates_whole(int64_t il) const {
    return mode_ == PI_FFN_DENSE || mode_ == PI_FFN_GATE || (mode_ == PI_FFN_AUTO && !auto_may_predict(il));
}

int64_t FfnPolicy::probe_tokens(int64_t il, int64_t n_tok, TierMode cold_mode, int64_t n_past) const {
    // on every batch it would cost a long prompt time: once a sequence is enough
    const bool probe = n_tok > 1 && auto_may_predict(il) && cold_mode != TierMode::Predictor &&
                       model_.layers()[size_t(il)].cold.size() > 0 && (n_past == 0 || !predicted_seen_[size_t(il)]);
    return probe ? std::min(n_tok, kPredictorProbeTokens) : 0;
}

TierMode FfnPolicy::cold_mode(int64_t il, int64_t n_tok) {
    // experts: ReLU ones gate first in gate and auto modes (the rule drops only zeros), every neuron otherwise
    if (model_.hp().n_expert > 0)  // every layer of a mixture holds experts (Model::bind_ffn)
        return mode_ != PI_FFN_DENSE && model_.hp().activation == Activation::Relu ? TierMode::Gate : TierMode::Dense;
    switch (mode_) {
        case PI_FFN_DENSE: return TierMode::Dense;
        case PI_FFN_PREDICTOR: return TierMode::Predictor;
        case PI_FFN_ORACLE: return TierMode::Oracle;
        default: break;  // gate mode: the gate rule through whichever kernels cost less (the dense rule's give the same values)
    }
    // gate and auto: the time each mode's step would take, at the densities measured so far in this layer, in
    // units of one weight byte streamed through the packed kernels (gemm8; the layer holds a matrix in 8-row
    // groups while its mode reads it whole, Model::arrange_cold_tier). Measured prices (scripts/kernel_microbench.py,
    // docs/engine.md "Choosing a layer's kernels"): a gate/up byte of a row read by index costs ~1.8 (dot_rows), a
    // down_t byte ~2.5 (axpy_rows over the rows used: the same kernel in every mode, so its price weighs the rows a
    // mode uses, not which mode reads them). f32/f16 rows have no packed form: everything streams alike.
    const HParams &hp = model_.hp();
    const Layer &L = model_.layers()[size_t(il)];
    const double n = double(L.cold.size());
    const double g = double(L.gate.row_bytes), u = double(hp.gated ? L.up.row_bytes : 0), d = double(L.down_t.row_bytes);
    const bool packable = packed_block_bytes(L.gate.type) != 0;
    const double gathered = packable ? 1.8 : 1.1, down = packable ? 2.5 : 1.0;
    // a batch reads a row when any of its tokens uses it: ~1 - (1 - rho)^n_tok of them (tokens taken as
    // independent; a prompt of a few dozen tokens already reads nearly every row)
    const double tokens = double(std::max<int64_t>(n_tok, 1));
    auto any_of = [&](double per_token) { return 1.0 - std::pow(1.0 - per_token, tokens); };
    const double rho = any_of(ema_active_[size_t(il)]);
    // gate mode's ups: a decode step reads the passing rows by index; a batch reads each pass's rows once and
    // then dots each token's passing rows on their own, kBatchRowDot times a gemm8 row-token, so its
    // arithmetic, not its bytes, decides
    const bool batch = n_tok > 1;
    const double gate_ups = batch && packable ? kBatchRowDot * ema_active_[size_t(il)] : gathered * rho;
    double cost[kTierModes];  // per mode on offer; the others never chosen
    std::fill_n(cost, kTierModes, HUGE_VAL);
    // gate and up whole. Where auto computes every neuron of a SiLU layer instead of the rule's (whole_mode), its
    // down rows are still priced as the rule's: a sparse mode must beat the rule's kernels to be chosen, as it
    // must in gate mode, since at such densities the gate's kernels price lower than they run (on SmolLM2 q8_0
    // at 50 % sparsity, gate mode's gate and up took longer than dense mode's: docs/bench.md, "Where a generated
    // token's time goes").
    const TierMode whole = whole_mode();
    cost[int(whole)] = n * (g + u) + down * rho * n * d;
    cost[int(TierMode::Gate)] = n * g + gate_ups * n * u + down * rho * n * d;
    if (auto_may_predict(il)) {
        // before the predictor has been measured in this layer (no batch yet, probe_tokens): a guess from the
        // activation density
        const bool seen = predicted_seen_[size_t(il)];
        const double pi = any_of(seen ? ema_predicted_[size_t(il)] : std::min(1.0, 1.2 * ema_active_[size_t(il)] + 0.02));
        const double rho_p = any_of(seen ? ema_predicted_active_[size_t(il)] : 0.8 * ema_active_[size_t(il)]);
        cost[int(TierMode::Predictor)] = 2.5 * (double(L.fc1.bytes()) + n * double(L.fc2.row_bytes)) +
                                         gathered * (pi * n * g + rho_p * n * u) + down * rho_p * n * d;
    }
    TierMode best = whole;
    for (TierMode m : {TierMode::Gate, TierMode::Predictor})
        if (cost[int(m)] < cost[int(best)]) best = m;
    // A layer's decode steps keep their kernels (and the layout they read) until what they have cost beyond the
    // cheapest's, summed over the steps since they last were the cheapest, would pay for the regrouping a change
    // takes (rent or buy: a change on every swing of the densities costs more than either kernel).
    const std::optional<TierMode> kept = decode_mode_[size_t(il)];
    if (batch || !kept) return best;
    double &regret = switch_regret_[size_t(il)];
    if (best == *kept) {
        regret = 0;
        return best;
    }
    regret += cost[int(*kept)] - cost[int(best)];
    // what regrouping a matrix costs, where the layer holds it in groups while its kernels read it whole
    auto relayout = [&](bool whole_before, bool whole_after, const Matrix &m) {
        if (whole_before == whole_after || !L.cold.groups_fit(m)) return 0.0;
        return n * double(m.row_bytes) * (whole_after ? kGroupPrice : kUngroupPrice);
    };
    const double change = relayout(reads_gate_whole(*kept), reads_gate_whole(best), L.cold.gate) +
                          (hp.gated ? relayout(reads_up_whole(*kept), reads_up_whole(best), L.cold.up) : 0.0);
    if (regret < change) return *kept;
    regret = 0;
    return best;
}

bool FfnPolicy::decode_step(int64_t il, TierMode cold_mode) {
    const std::optional<TierMode> before = decode_mode_[size_t(il)];
    decode_mode_[size_t(il)] = cold_mode;
    return before && *before != cold_mode;
}

void FfnPolicy::take(int64_t il, int64_t n_tok, TierMode cold_mode, const TierCounts &hot, const TierCounts &cold,
                     int64_t n_probe) {
    const size_t i = size_t(il);
    const int64_t n = model_.layers()[i].cold.size();
    if (n_probe > 0) {  // the predictor's densities as predictor-mode steps would keep them
        const double per = double(n_probe) * double(n);
        take_into_average(ema_predicted_[i], cold.probe_selected / per, n_probe, predicted_seen_[i]);
        take_into_average(ema_predicted_active_[i], cold.probe_computed / per, n_probe, predicted_seen_[i]);
        predicted_seen_[i] = true;
    }
    const double act_rate = (hot.active + cold.active) / double(n_tok) / double(model_.hp().n_ff);
    if (cold_mode != TierMode::Predictor) take_into_average(ema_active_[i], act_rate, n_tok, true);
    else take_into_average(ema_predicted_active_[i], act_rate, n_tok, predicted_seen_[i]);
    if (cold.scored_tokens > 0) {
        const double pred_rate = cold.predicted / cold.scored_tokens / double(std::max<int64_t>(n, 1));
        take_into_average(ema_predicted_[i], pred_rate, n_tok, predicted_seen_[i]);
        predicted_seen_[i] = true;
    }
}

}  // namespace pi
