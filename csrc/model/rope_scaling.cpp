#include "model/rope_scaling.h"

#include <algorithm>
#include <cmath>

namespace pi {

namespace {

// The dim at which a pair turns `rotations` times over n_ctx_orig positions (transformers' find_correction_dim).
double correction_dim(double rotations, int64_t n_rot, double base, int64_t n_ctx_orig) {
    const double two_pi = 2.0 * std::acos(-1.0);
    return double(n_rot) * std::log(double(n_ctx_orig) / (rotations * two_pi)) / (2.0 * std::log(base));
}

}  // namespace

std::vector<float> yarn_freq_factors(int64_t n_rot, double base, double factor, int64_t n_ctx_orig, double beta_fast,
                                     double beta_slow) {
    const double low = std::max(std::floor(correction_dim(beta_fast, n_rot, base, n_ctx_orig)), 0.0);
    double high = std::min(std::ceil(correction_dim(beta_slow, n_rot, base, n_ctx_orig)), double(n_rot - 1));
    if (high == low) high += 0.001;  // transformers' linear_ramp_factor: no zero width
    std::vector<float> factors(size_t(n_rot / 2));
    for (int64_t i = 0; i < n_rot / 2; ++i) {
        // float32 ramp, as transformers builds it; 0: extrapolated (the pair's own frequency), 1: interpolated
        const float ramp = std::clamp(float(double(i) - low) / float(high - low), 0.0f, 1.0f);
        factors[size_t(i)] = float(1.0 / (double(ramp) / factor + (1.0 - double(ramp))));
    }
    return factors;
}

double yarn_default_attn_factor(double factor) { return factor <= 1.0 ? 1.0 : 0.1 * std::log(factor) + 1.0; }

}  // namespace pi
