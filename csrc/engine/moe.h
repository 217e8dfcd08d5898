// A mixture-of-experts layer's FFN on the CPU (docs/engine.md, "Mixture of experts"). Per token: the router's logits
// (ffn_gate_inp), their softmax, the n_expert_used largest, divided by their sum where the file says so (llama.cpp's
// and transformers' routing). Then per expert, the tokens routed to it as one group: the expert's gate and up rows
// against the whole group (each row read once per batch), the activation, its down projection, and each token's
// outputs added with its weights in the experts' order. A token gets the same bits in a prompt's batch as in a decode
// step (each matrix's rows through the same kernel whatever the token count, on the 8-row groups packed at load as
// attention's are: Model::pack_dense_matrices), and the weighted sum has one order. All the experts' rows of a
// projection go through one matmul job, each expert against its own tokens. ReLU experts go gate first: a neuron's up
// row and down row (Experts::down_t) are read only where its gate passes, the down rows by rows_product.
// With an expert tier (model/expert_tier.h, a memory budget), the experts come from its cache as they arrive, a job
// for each arrival's experts (each expert's rows through the same kernels, so the same bits), and a decode step's
// lookahead guesses the next layer's experts by its router on this layer's input and has the tier read them ahead.
// With a device holding some of a layer's experts (backend/device_backend.h, the plan's), the pairs routed to them go
// to the device as one job before the CPU computes the others (never asked of the tier), and the device's weighted
// sum is added to the CPU experts' sum once both are done.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/device_backend.h"
#include "backend/tier_backend.h"
#include "engine/matmul.h"
#include "kernels/kernels.h"
#include "model/expert_tier.h"
#include "model/model.h"
#include "runtime/threadpool.h"

namespace pi {

class MoeFfn {
public:
    // tier: where the experts are read from disk, else nullptr (all in memory); lookahead: a decode step has the tier
    // read the next layer's likely experts ahead; device: where some layers' experts are on a device, else nullptr
    MoeFfn(const HParams &hp, const KernelSet &ks, ThreadPool &pool, int64_t n_batch, ExpertTier *tier, bool lookahead,
           DeviceTierBackend *device = nullptr);
    // Bytes of the buffers an MoeFfn allocates.
    static double scratch_bytes(const HParams &hp, int64_t n_batch, int64_t threads);
    // y (n_tok rows of n_embd, overwritten) = the experts X on the n_tok tokens of x, the FFN's normed input (its q8_0
    // form made here where the router or the experts read one). every_up: ReLU experts compute every neuron's up
    // (dense mode), else only the ups of the neurons whose gate passes (the same values: ReLU drops only zeros).
    // il: the layer (the tier's); next: the next layer's experts (the lookahead's router), or nullptr.
    TierCounts run(const Experts &X, Operand &x, int64_t n_tok, bool every_up, float *y, int64_t il,
                   const Experts *next);
    // The last run's routing: token t's n_expert_used experts at t * n_expert_used, the most probable first.
    const int32_t *choices() const { return tok_expert_.data(); }

private:
    // The tokens' experts and weights, then the (token, expert) pairs grouped by expert (first_, pair_*); in a
    // batch, each pair's copy of its token's operand (xg_, xq_: an expert's tokens one after the other).
    void route(const Experts &X, Operand &x, int64_t n_tok);
    // The K most probable experts of softmaxed probabilities p (overwritten), the lower expert first among equal
    // ones, into chosen and their probabilities into w.
    void top_k(float *p, int32_t *chosen, float *w) const;
    // The SiLU experts[0, n)'s gate, up, products and down projection for their pairs (all in memory, or handed out
    // by the tier), timed into c.
    void compute(const Experts &X, const int32_t *experts, int64_t n, TierCounts &c);
    // A decode step's lookahead: the next layer's experts by its router on x, read ahead by the tier.
    void lookahead(const Experts &next, Operand &x, int64_t il_next);
    Matrix matrix(const Experts &X, int32_t e, int which) const;
    // Appends to targets_ matrix `which` (gate_of, up_of or down_of) of experts[0, n) against their pairs' operand
    // (ops: one per expert, from pair first_[e]; one token: x itself), out = `out` (ldo a pair).
    void add_targets(const Experts &X, const int32_t *experts, int64_t n, int which, Operand *ops, float *out,
                     int64_t ldo);
    // The operands of the experts' gate and up (x_ where one token runs), and of their down projections (h).
    void gate_up_operands(Operand &x, int64_t n_tok);
    void down_operands();
    // SiLU: h = silu(g) * u in g_, and its q8_0 form where the down projection reads one, for the pairs of
    // experts[0, n).
    void silu_products(const Experts &X, const int32_t *experts, int64_t n);
    // ReLU, gate first: the ups of the neurons whose gate passes (every_up: of every neuron), h = g * u in u_ (0 where
    // the gate does not pass). Then each pair's down_t rows with h != 0, listed; returns the neurons whose up was
    // computed.
    int64_t relu_products(const Experts &X, int64_t n_pairs, bool every_up);
    // ReLU: each pair's listed down_t rows into o_, by rows_product (engine/matmul.h).
    void relu_down(const Experts &X, int64_t n_pairs);
    // y = each token's experts' outputs, weighted, added in the experts' order (but those of the experts on_device
    // marks, where given); its columns split between threads.
    void weighted_sum(int64_t n_tok, float *y, const uint8_t *on_device);
    // The pairs of the device's experts[0, n) of layer il as one job, started on the device (into dev_y_).
    void submit_device(int64_t il, const Operand &x, int64_t n_tok, const int32_t *experts, int64_t n);
    // Pair p's operand for rows of `type` (its token's x in a decode step, its copy in a batch).
    const void *pair_x(int64_t p, uint32_t type) const;

    const HParams &hp_;  // the model's, which outlives the engine's FFN
    const KernelSet &ks_;
    ThreadPool &pool_;
    const int64_t n_batch_, n_expert_, k_, E_, F_;
    ExpertTier *tier_;
    const bool lookahead_;
    DeviceTierBackend *device_;

    Operand *x_ = nullptr;  // run's x, while it runs
    int64_t n_tok_ = 0;
    std::vector<float> logits_;                        // [batch][n_expert]
    std::vector<int32_t> tok_expert_;                  // [batch][k]
    std::vector<float> tok_weight_;                    // [batch][k]
    std::vector<int64_t> first_, cursor_;              // [n_expert + 1]: each expert's first pair
    std::vector<int32_t> pair_token_, pair_expert_;    // [batch * k]
    std::vector<float> pair_weight_;
    std::vector<float> xg_;                            // [batch * k][n_embd]: each pair's input (a batch)
    std::vector<BlockQ8_0> xq_;                        // [batch * k][n_embd / 32]: the same in q8_0
    std::vector<float> g_, u_;                         // [batch * k][n_ff]: gate (then h for SiLU) and up (h for ReLU)
    std::vector<BlockQ8_0> hq_;                        // [batch * k][n_ff / 32]: h in q8_0
    std::vector<float> o_;                             // [batch * k][n_embd]: each pair's expert output
    std::vector<Operand> in_ops_, h_ops_;              // [n_expert]: each expert's gate/up and down operands
    std::vector<Matrix> mats_;                         // [3 * n_expert]: the matrices targets_ point to
    std::vector<MatmulTarget> targets_;                // [2 * n_expert]: a matmul's targets
    std::vector<const void *> used_rows_;              // ReLU: [batch * k][n_ff] the down_t rows a pair uses
    std::vector<float> used_coef_;                     // ReLU: their coefficients h
    std::vector<int64_t> n_used_, n_computed_;         // ReLU: [batch * k] rows listed, ups computed
    std::vector<float> partials_;                      // ReLU: rows_product's, for kRowsTargets pairs
    std::vector<int32_t> wanted_, arrived_;            // [n_expert]: the experts with tokens; those a wait handed out
    std::vector<int64_t> sel_pairs_;                   // [batch * k]: the pairs of the experts computed now
    std::vector<float> look_p_, look_w_;               // [n_expert], [k]: the lookahead's probabilities, weights
    std::vector<int32_t> look_chosen_;                 // [k]: its experts
    std::vector<int32_t> dev_experts_;                 // [n_expert]: the experts with tokens that the device holds
    std::vector<int32_t> dev_token_, dev_expert_;      // [batch * k]: the device job's pairs
    std::vector<float> dev_weight_;
    std::vector<float> dev_y_;                         // [batch][n_embd]: its weighted sum
};

}  // namespace pi
