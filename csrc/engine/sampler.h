// Token sampling (greedy, temperature, top-k, top-p, repetition/frequency/presence penalties) with a seeded generator
// whose stream is the same on every platform. All buffers are sized once at construction.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "pi_engine.h"

namespace pi {

// xoshiro256** seeded through splitmix64: reproducible across compilers and standard libraries.
class Rng {
public:
    explicit Rng(uint64_t seed = 0x5eed) { seed_with(seed); }
    void seed_with(uint64_t seed);
    uint64_t next();
    double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)

private:
    uint64_t s_[4];
};

class Sampler {
public:
    explicit Sampler(int64_t n_vocab);
    // history: the tokens so far (the penalties look at its last repeat_last_n entries); allowed: NULL, or a bitmask
    // of the tokens that may be drawn (the others never are). -1 where it allows none.
    int32_t sample(const float *logits, const pi_sampling &p, const int32_t *history, int64_t n_history, Rng &rng,
                   const uint32_t *allowed = nullptr);

private:
    int64_t n_vocab_;
    std::vector<std::pair<float, int32_t>> cand_;
    std::vector<uint32_t> stamp_;  // == epoch_: the token was seen in this call's penalty window
    std::vector<int32_t> count_;   // its occurrences there (valid where stamped)
    std::vector<int32_t> seen_;    // the window's distinct tokens
    uint32_t epoch_ = 0;
};

}  // namespace pi
