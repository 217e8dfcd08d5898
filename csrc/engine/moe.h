// A mixture-of-experts layer's FFN on the CPU (docs/engine.md, "Mixture of experts"). Per token: the router's logits
// (ffn_gate_inp), their softmax, the n_expert_used largest, divided by their sum where the file says so (llama.cpp's
// and transformers' routing). Then per expert, the tokens routed to it as one group: the expert's gate and up rows
// against the whole group (each row read once per batch), the activation, its down projection, and each token's
// outputs added with its weights in the experts' order. A token gets the same bits in a prompt's batch as in a decode
// step: one token's rows go through dot_rows, a group's through gemm8 on the same rows packed (the same arithmetic),
// and the weighted sum has one order. ReLU experts go gate first: a neuron's up row and down row (Experts::down_t) are
// read only where its gate passes, the down rows in the runs of backend/down_runs.h.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/tier_backend.h"
#include "engine/matmul.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "runtime/threadpool.h"

namespace pi {

// One expert's matrix against the group of tokens routed to it: out[t * ldo + r] = row r of W . token t of x.
struct ExpertRows {
    Matrix W;
    const uint8_t *x = nullptr;  // the group's operand, token t's at x + t * x_stride (q8_0 blocks or floats)
    size_t x_stride = 0;
    int64_t n_tok = 0;
    float *out = nullptr;
    int64_t ldo = 0;
};

class MoeFfn {
public:
    MoeFfn(const HParams &hp, const KernelSet &ks, ThreadPool &pool, int64_t n_batch);
    // Bytes of the buffers an MoeFfn allocates.
    static double scratch_bytes(const HParams &hp, int64_t n_batch, int64_t threads);
    // y (n_tok rows of n_embd, overwritten) = the experts X on the n_tok tokens of x, the FFN's normed input (its q8_0
    // form made here where the router or the experts read one). every_up: ReLU experts compute every neuron's up
    // (dense mode), else only the ups of the neurons whose gate passes (the same values: ReLU drops only zeros).
    TierCounts run(const Experts &X, Operand &x, int64_t n_tok, bool every_up, float *y);
    // The last run's routing: token t's n_expert_used experts at t * n_expert_used, the most probable first.
    const int32_t *choices() const { return tok_expert_.data(); }

private:
    // The tokens' experts and weights, then the (token, expert) pairs grouped by expert (first_, pair_*), and each
    // pair's copy of its token's operand (xg_, xq_).
    void route(const Experts &X, Operand &x, int64_t n_tok);
    // Appends to items_ the matrix `which` (gate_of, up_of or down_of) of every expert with tokens against its pairs'
    // operands (xq: q8_0 blocks, xf: floats, as the matrix reads; a pair's stride apart), out = `out` (ldo a pair).
    void add_items(const Experts &X, int which, const uint8_t *xq, const uint8_t *xf, size_t q_stride, size_t f_stride,
                   float *out, int64_t ldo);
    // Every item of items_ in one pool job, its rows split between the threads.
    void rows_job();
    void item_rows(const ExpertRows &it, int64_t r0, int64_t r1, int thread);
    // SiLU: h = silu(g) * u in g_, and its q8_0 form where the down projection reads one.
    void silu_products(const Experts &X, int64_t n_pairs);
    // ReLU, gate first: the ups of the neurons whose gate passes (h = g * u in u_, 0 elsewhere); every_up: u_ holds
    // every up already. Then each pair's down_t rows with h != 0, listed; returns the neurons whose up was computed.
    int64_t relu_products(const Experts &X, int64_t n_pairs, bool every_up);
    // ReLU: each pair's listed down_t rows, in waves of pairs, into o_.
    void relu_down(const Experts &X, int64_t n_pairs);

    const HParams &hp_;  // the model's, which outlives the engine's FFN
    const KernelSet &ks_;
    ThreadPool &pool_;
    const int64_t n_batch_, n_expert_, k_, E_, F_;
    const int64_t wave_;  // pairs whose down runs one job computes (ReLU experts)

    std::vector<float> logits_;                        // [batch][n_expert]
    std::vector<int32_t> tok_expert_;                  // [batch][k]
    std::vector<float> tok_weight_;                    // [batch][k]
    std::vector<int64_t> first_, cursor_;              // [n_expert + 1]: each expert's first pair
    std::vector<int32_t> pair_token_, pair_expert_;    // [batch * k]
    std::vector<float> pair_weight_;
    std::vector<float> xg_;                            // [batch * k][n_embd]: each pair's input
    std::vector<BlockQ8_0> xq_;                        // [batch * k][n_embd / 32]: the same in q8_0
    std::vector<float> g_, u_;                         // [batch * k][n_ff]: gate (then h for SiLU) and up (h for ReLU)
    std::vector<BlockQ8_0> hq_;                        // [batch * k][n_ff / 32]: h in q8_0
    std::vector<float> o_;                             // [batch * k][n_embd]: each pair's expert output
    std::vector<uint8_t> pack_;                        // [threads][pack_bytes_]: a pass of rows packed for gemm8
    size_t pack_bytes_ = 0;
    std::vector<float> pass_out_;                      // [threads][batch][a pass's rows]: gemm8's outputs
    std::vector<uint8_t> zero_row_;                    // a group's padding rows
    std::vector<ExpertRows> items_;                    // [2 * n_expert]: a rows job's items
    std::vector<const void *> used_rows_;              // ReLU: [batch * k][n_ff] the down_t rows a pair uses
    std::vector<float> used_coef_;                     // ReLU: their coefficients h
    std::vector<int64_t> n_used_;                      // ReLU: [batch * k]
    std::vector<float> partials_;                      // ReLU: [wave][runs][n_embd]
};

}  // namespace pi
