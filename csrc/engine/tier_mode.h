// How one FFN tier is computed for one layer and batch, and which of its matrices each mode reads whole.
#pragma once

namespace pi {

enum class TierMode { Dense, DenseRule, Gate, Predictor, Oracle };
constexpr int kTierModes = 5;

inline const char *tier_mode_name(TierMode m) {
    switch (m) {
        case TierMode::Dense: return "dense";
        case TierMode::DenseRule: return "dense_rule";
        case TierMode::Gate: return "gate";
        case TierMode::Predictor: return "predictor";
        case TierMode::Oracle: return "oracle";
    }
    return "?";
}

// Whether a mode reads every gate (every up) row of its tier, in order: those it can take in 8-row groups.
inline bool reads_gate_whole(TierMode m) { return m == TierMode::Dense || m == TierMode::DenseRule || m == TierMode::Gate; }
inline bool reads_up_whole(TierMode m) { return m == TierMode::Dense || m == TierMode::DenseRule; }

}  // namespace pi
