#include "engine/sampler.h"

#include <algorithm>
#include <cmath>

namespace pi {

void Rng::seed_with(uint64_t seed) {
    for (uint64_t &s : s_) {  // splitmix64
        seed += 0x9e3779b97f4a7c15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        s = z ^ (z >> 31);
    }
}

uint64_t Rng::next() {
    auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
}

Sampler::Sampler(int64_t n_vocab) : n_vocab_(n_vocab), cand_(size_t(n_vocab)), stamp_(size_t(n_vocab), 0), count_(size_t(n_vocab), 0) {}

int32_t Sampler::sample(const float *logits, const pi_sampling &p, const int32_t *history, int64_t n_history, Rng &rng,
                        const uint32_t *allowed) {
    const int64_t V = n_vocab_;
    if (allowed) {  // a disallowed token's logit is -inf: no penalty, top-k, top-p or temperature brings it back
        bool any = false;
        for (int64_t i = 0; i < V; ++i) {
            const bool ok = (allowed[i >> 5] >> (i & 31)) & 1u;
            any = any || ok;
            cand_[size_t(i)] = {ok ? logits[i] : -INFINITY, int32_t(i)};
        }
        if (!any) return -1;
    } else {
        for (int64_t i = 0; i < V; ++i) cand_[size_t(i)] = {logits[i], int32_t(i)};
    }
    const bool penalize = p.repeat_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
    if (penalize && p.repeat_last_n > 0) {
        if (++epoch_ == 0) {  // wrapped: clear the stamps once
            std::fill(stamp_.begin(), stamp_.end(), 0);
            epoch_ = 1;
        }
        const int64_t from = std::max<int64_t>(0, n_history - p.repeat_last_n);
        seen_.clear();
        for (int64_t i = from; i < n_history; ++i) {
            const int32_t tok = history[i];
            if (tok < 0 || tok >= V) continue;
            if (stamp_[size_t(tok)] != epoch_) {
                stamp_[size_t(tok)] = epoch_;
                count_[size_t(tok)] = 0;
                seen_.push_back(tok);
            }
            ++count_[size_t(tok)];
        }
        // llama.cpp's order: the repetition penalty's scaling, then OpenAI's frequency and presence terms
        for (const int32_t tok : seen_) {
            float &l = cand_[size_t(tok)].first;
            if (p.repeat_penalty != 1.0f) l = l > 0.0f ? l / p.repeat_penalty : l * p.repeat_penalty;
            l -= float(count_[size_t(tok)]) * p.frequency_penalty + p.presence_penalty;
        }
    }
    auto greater = [](const std::pair<float, int32_t> &a, const std::pair<float, int32_t> &b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    if (!(p.temperature > 0.0f)) {
        return std::min_element(cand_.begin(), cand_.end(), greater)->second;  // first of the largest
    }
    int64_t n = V;
    if (p.top_k > 0 && p.top_k < n) {
        std::partial_sort(cand_.begin(), cand_.begin() + p.top_k, cand_.end(), greater);
        n = p.top_k;
    } else {
        std::sort(cand_.begin(), cand_.end(), greater);
    }
    while (n > 1 && cand_[size_t(n - 1)].first == -INFINITY) --n;  // masked out: never drawn, even by rounding
    const float top = cand_[0].first;
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const float e = float(std::exp(double(cand_[size_t(i)].first - top) / double(p.temperature)));
        cand_[size_t(i)].first = e;
        total += e;
    }
    if (p.top_p < 1.0f) {
        double cum = 0.0;
        int64_t keep = n;
        for (int64_t i = 0; i < n; ++i) {
            cum += cand_[size_t(i)].first / total;
            if (cum >= double(p.top_p)) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        total = 0.0;
        for (int64_t i = 0; i < n; ++i) total += cand_[size_t(i)].first;
    }
    const double r = rng.uniform() * total;
    double acc = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        acc += cand_[size_t(i)].first;
        if (r < acc) return cand_[size_t(i)].second;
    }
    return cand_[size_t(n - 1)].second;
}

}  // namespace pi
