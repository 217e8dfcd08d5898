#include "backend/reference_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "backend/activation_rule.h"
#include "backend/down_runs.h"

namespace pi {

ReferenceTierBackend::ReferenceTierBackend(const HParams &hp, int64_t) : hp_(hp), layers_(size_t(hp.n_layer)) {}

ReferenceTierBackend::~ReferenceTierBackend() {
    if (worker_.joinable()) worker_.join();
}

void ReferenceTierBackend::upload(int64_t il, const Layer &layer, const FfnTier &tier) {
    Rows &r = layers_[size_t(il)];
    r.layer = &layer;
    r.tier = &tier;
    r.gate = gather_rows(layer.gate, tier.ids);  // ungated: the up projection (Layer::gate is up)
    if (hp_.gated) r.up = gather_rows(layer.up, tier.ids);
    r.down_t = gather_rows(layer.down_t, tier.ids);
}

double ReferenceTierBackend::weight_bytes() const {
    double bytes = 0;
    for (const Rows &r : layers_) bytes += double(r.gate.size() + r.up.size() + r.down_t.size());
    return bytes;
}

void ReferenceTierBackend::submit(const TierJob &job) {
    if (worker_.joinable()) worker_.join();  // a job left unwaited (its caller threw): finished first
    counts_ = TierCounts{};
    worker_ = std::thread([this, job] { compute(job); });
}

TierCounts ReferenceTierBackend::wait() {
    worker_.join();
    return counts_;
}

void ReferenceTierBackend::compute(const TierJob &job) {
    const auto t0 = std::chrono::steady_clock::now();
    const KernelSet &ks = scalar_kernels();
    const Rows &rows = layers_[size_t(job.layer)];
    const Layer &L = *rows.layer;
    const ActivationRule rule(hp_, L, *rows.tier, ks);
    const TypeKernels &kg = ks.for_type(L.gate.type), &ku = ks.for_type(L.up.type), &kd = ks.for_type(L.down_t.type);
    const int64_t E = hp_.n_embd, n = rows.tier->size();
    const bool dense = job.mode == TierMode::Dense;
    // one token (or each of a decode step of several sequences): the used rows with nonzero values listed, then
    // summed in the CPU backend's runs (down_runs.h)
    std::vector<const void *> used_rows;
    std::vector<float> used_coef, partials;
    for (int64_t t = 0; t < job.n_tok; ++t) {
        float *y = job.y + t * E;
        std::fill(y, y + E, 0.0f);
        used_rows.clear();
        used_coef.clear();
        for (int64_t r = 0; r < n; ++r) {
            float g = kg.dot(int(E), rows.gate.data() + size_t(r) * L.gate.row_bytes, job.xn->at(t, L.gate.type));
            rule.activate(&g, 1, [&](int64_t) { return r; });
            float a, h;
            bool pass = rule.gate_rule(g, r, &a);
            if (hp_.gated) {
                const float u = ku.dot(int(E), rows.up.data() + size_t(r) * L.up.row_bytes, job.xn->at(t, L.up.type));
                pass = rule.finish(pass, a, rule.up_value(u, r), &h);
            } else {
                h = a;
            }
            counts_.active += pass;
            if (!(dense || pass)) continue;
            counts_.computed += 1;
            const uint8_t *row = rows.down_t.data() + size_t(r) * L.down_t.row_bytes;
            if (job.n_tok > 1 && !job.steps) {
                kd.axpy(int(E), h, row, y);
            } else if (h != 0.0f) {
                used_rows.push_back(row);
                used_coef.push_back(h);
            }
        }
        if (job.n_tok == 1 || job.steps) {
            const int64_t n_used = int64_t(used_rows.size()), n_runs = down_run_count(n_used);
            partials.resize(size_t(n_runs * E));
            for (int64_t run = 0; run < n_runs; ++run)
                down_run(kd, E, n_used, used_rows.data(), used_coef.data(), run, partials.data() + run * E);
            sum_down_runs(E, n_runs, partials.data(), y);
        }
    }
    counts_.gate_up_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace pi
