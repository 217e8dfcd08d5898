// The boundary between a layer's FFN and whatever computes one of its tiers (docs/engine.md, "Tier backends").
//
// The engine splits each layer's FFN neurons into a hot and a cold tier (Model::build_tiers) and hands each to a
// backend: `upload` once per layer at load, then per layer and batch `submit` and `wait`. A backend owns what it
// computes with (its copy or view of the tier's weights, its scratch), so the two tiers' backends share nothing
// but their inputs, which stay unchanged from `submit` until `wait` returns: the hot tier's job may run on
// another thread or device while the cold tier's runs here. `wait` returns the partial output written and what
// the tier counted; the engine sums the tiers' outputs in a fixed order, hot then cold.
#pragma once

#include <cstdint>

#include "engine/matmul.h"
#include "engine/tier_mode.h"
#include "model/model.h"

namespace pi {

// One tier's share of a layer's FFN for a batch.
struct TierJob {
    int64_t layer = 0;
    int64_t n_tok = 0;
    TierMode mode = TierMode::Dense;
    // The FFN's input (the normed residual), q8_0 form already made for the layer's gate and up types.
    const Operand *xn = nullptr;
    // The predictor's input (the residual entering the FFN block); Predictor mode makes its q8_0 form.
    Operand *x = nullptr;
    bool recall_check = false;  // Predictor mode: also compute the true mask, to count recall
    // auto mode, a batch run without the predictor: score the predictor for the last n_probe tokens too, and count
    // what it would have selected and computed there (TierCounts::probe_*)
    int64_t n_probe = 0;
    float *y = nullptr;  // [n_tok][n_embd], written whole (zeros where nothing is computed)
    // Input sparsity's down site (a batch of dense mode, docs/engine.md "Input sparsity"): the activations h at or
    // below it in magnitude are zeroed before the down projection; negative: none. Only the CPU backend takes it.
    float down_zero_at = -1.0f;
    // The tokens are decode steps of different sequences (Engine::decode_step): each computed with a decode
    // step's kernels from its own selection (the union of theirs read once), so that its output is the bits it
    // would get alone. The CPU backend only.
    bool steps = false;
};

// What a tier's job counted: neuron counts summed over tokens, and where its time went.
struct TierCounts {
    double active = 0;       // neurons passing the activation rule
    double computed = 0;     // neurons whose up/down rows were used
    double predicted = 0;    // neurons the predictor (or oracle) selected
    double scored_tokens = 0;  // tokens the predictor (or oracle) selected for
    double true_pos = 0, positives = 0;  // selected and truly active; truly active (recall check, oracle)
    double probe_selected = 0, probe_computed = 0;  // TierJob::n_probe's counts
    double predictor_seconds = 0, gate_up_seconds = 0, down_seconds = 0;
    double down_inputs = 0, down_zeroed = 0;  // TierJob::down_zero_at: the activations seen, and of them zeroed
};

class TierBackend {
public:
    virtual ~TierBackend() = default;
    virtual const char *name() const = 0;
    // Takes tier `tier` of layer il (its neurons' ids, the layer's matrices they index) at load, once per layer;
    // a backend keeps what it needs of it and sizes its scratch for the largest.
    virtual void upload(int64_t il, const Layer &layer, const FfnTier &tier) = 0;
    // Starts a job; its inputs and y stay untouched by the caller until wait returns.
    virtual void submit(const TierJob &job) = 0;
    // Returns when the submitted job's y is written, with what it counted.
    virtual TierCounts wait() = 0;
    // Bytes of weights the backend holds in this process's memory (its copies of the tiers' rows).
    virtual double weight_bytes() const = 0;

    TierCounts run(const TierJob &job) {
        submit(job);
        return wait();
    }
};

}  // namespace pi
