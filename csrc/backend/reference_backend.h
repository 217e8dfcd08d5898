// A second tier backend, for tests: the tier computed one token and neuron at a time by the scalar reference
// kernels (dot and axpy, no packed groups, no gathered rows; a decode step's down projection in the runs of
// down_runs.h), from its own copy of the tier's rows, on a thread of its own that runs while the engine computes
// the other tier. Selected through the testing API (pi_engine_testing.h) for the hot tier; its logits agree with
// the CPU backend's within rounding (its dot products run in another order), which checks that the FFN reaches a
// tier only through TierBackend.
#pragma once

#include <thread>
#include <vector>

#include "backend/tier_backend.h"

namespace pi {

class ReferenceTierBackend : public TierBackend {
public:
    ReferenceTierBackend(const HParams &hp, int64_t n_batch);
    ~ReferenceTierBackend() override;
    const char *name() const override { return "reference"; }
    void upload(int64_t il, const Layer &layer, const FfnTier &tier) override;
    void submit(const TierJob &job) override;  // starts the job on its thread
    TierCounts wait() override;
    double weight_bytes() const override;

private:
    // A layer's tier as uploaded: its neurons' rows copied out of the file, in slot order.
    struct Rows {
        const Layer *layer = nullptr;
        const FfnTier *tier = nullptr;
        std::vector<uint8_t> gate, up, down_t;
    };
    void compute(const TierJob &job);

    const HParams hp_;
    std::vector<Rows> layers_;
    std::thread worker_;
    TierCounts counts_;
};

}  // namespace pi
