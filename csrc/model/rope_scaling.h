// YaRN RoPE scaling computed from a file's hyperparameters once at load, into what RoPE's tables take: a divisor
// of each rotated pair's frequency (HParams::rope_freq_factors) and the factor cos and sin are multiplied by
// (HParams::rope_attn_factor). YaRN is static in transformers (_compute_yarn_parameters: no dependence on the
// sequence length), so the tables are its model at every position.
#pragma once

#include <cstdint>
#include <vector>

namespace pi {

// Per rotated pair i of n_rot dims, what its frequency is divided by: transformers' blend of the interpolated
// (divided by `factor`) and extrapolated (unchanged) frequencies by a linear ramp from 0 at correction dim `low` to 1
// at `high`, those found from beta_fast and beta_slow rotations over n_ctx_orig positions and rounded outwards
// (truncate, as llama.cpp's ggml_rope_yarn_corr_dims always does).
std::vector<float> yarn_freq_factors(int64_t n_rot, double base, double factor, int64_t n_ctx_orig, double beta_fast,
                                     double beta_slow);

// YaRN's attention factor when the file gives none: 0.1 ln(factor) + 1 (1 for factor <= 1), the YaRN paper's Eq. 21
// as transformers' yarn_get_mscale and llama.cpp compute it.
double yarn_default_attn_factor(double factor);

}  // namespace pi
