// The CPU tier backend: a tier's FFN on this machine's cores through the engine's kernels and thread pool
// (docs/engine.md, "The CPU backend"). Its parts, in the order a job runs them: select (which neurons each token
// computes: every one, the predictor's, or the true mask), gate/up grouped (8-row groups by gemm8, for the modes
// that read every gate), gate/up gathered (rows by index), the fused predictor step (a decode step's scoring,
// listing and gates/ups in one pool job), down decode (one token's used rows in fixed runs) and down batch
// (q4_0/q8_0 rows: tiles requantized by pack_columns8 through gemm8, in integers; f32/f16: panels of widened rows
// through gemm_f32). Every path applies the one ActivationRule, so a neuron's value does
// not depend on the path that computed it.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "backend/activation_rule.h"
#include "backend/tier_backend.h"
#include "model/disk_tier.h"
#include "runtime/threadpool.h"

namespace pi {

class CpuTierBackend : public TierBackend {
public:
    // max_rank: the largest predictor rank of the file (0 without predictors). copies_tiers: upload takes a
    // packed_copy of each tier (the hot tier's, read whole every token), else reads the Model's tier in place
    // (the cold tier's mapped rows, grouped as Model::arrange_cold_tier keeps them).
    // disk: where the tiers' rows come from neuron bundles (model/disk_tier.h), the tier that fetches them before a
    // job reads them; such a tier reads its rows by index in every mode.
    CpuTierBackend(const HParams &hp, const KernelSet &ks, ThreadPool &pool, int64_t n_batch, int64_t max_rank,
                   bool copies_tiers, DiskTier *disk = nullptr);
    const char *name() const override { return "cpu"; }
    void upload(int64_t il, const Layer &layer, const FfnTier &tier) override;
    // Runs the job on the pool before it returns (the pool runs one job at a time: two CPU tiers take turns).
    void submit(const TierJob &job) override;
    TierCounts wait() override { return counts_; }
    double weight_bytes() const override;
    // Bytes of the scratch a backend allocates for tiers of up to `rows` neurons.
    static double scratch_bytes(const HParams &hp, int64_t rows, int64_t n_batch, int64_t threads, int64_t max_rank);

private:
    struct Pass;
    // neurons a part passed and computed (kept in the part's locals, added once: the byte stores of mask_ could
    // alias a counter held elsewhere)
    struct Tally {
        int64_t active = 0, computed = 0;
        Tally &operator+=(const Tally &o) {
            active += o.active;
            computed += o.computed;
            return *this;
        }
    };
    // select: mask_ rows [0, n_tok) of the neurons each token computes (1), counted where a predictor or the
    // true mask chose them
    void select(Pass &p);
    void count_selection(const Pass &p);
    // rows_[0, returned): the slots any token selected, in order
    int64_t list_rows(const Pass &p);
    void gate_up_grouped(Pass &p);
    Tally grouped_token(const Pass &p, int64_t t, int64_t r0, int64_t r1);
    Tally gate_up_gathered(const Pass &p, const int32_t *list, int64_t count);
    // A predictor-mode decode step of a tier on disk: the n_hits selected neurons in memory (hits_), then each read's as
    // it arrives; returns when every bundle is in (DiskTier::finish).
    void gate_up_arriving(const Pass &p, int64_t n_hits);
    void fused_predictor_step(Pass &p);
    // The ups of token t's n_up listed neurons by dot_rows, each neuron finished by the rule and settled.
    Tally listed_ups(const Pass &p, int64_t t, int n_up, const int64_t *slot, const void *const *rows, const float *a,
                     const bool *first_pass);
    // Records neuron slot r of token t: mask 2 (down row used, coefficient h) or 1.
    void settle(const Pass &p, int64_t t, int64_t r, bool pass, float h, Tally &c);
    void down_decode(const Pass &p, int64_t t);  // token t's (a decode step has one)
    void down_stored(const Pass &p);             // every token's, through Layer::down where a dense layer holds it
    // h_'s used values at or below t in magnitude zeroed (TierJob::down_zero_at), counted
    void zero_small_h(const Pass &p, float t);
    void down_batch(const Pass &p);
    // down_batch's integer path over the used rows rows_[0, n_used) (in slot order)
    void down_batch_int(const Pass &p, int64_t n_used);
    // bytes of one thread's requantized tile of down_batch_int
    static size_t down_tile_bytes();

    // The predictor's hidden layer relu(fc1 x), prepared as fc2's operand.
    Operand predictor_hidden(const Layer &L, Operand &x, int64_t n_tok);
    // mask_ of the tier's slots in fc2's units [u0, u1) (FfnTier::fc2_units).
    void predictor_score(const Layer &L, const FfnTier &T, const Operand &hid, int64_t n_tok, int64_t u0, int64_t u1);
    // mask_ rows [0, n_tok): the neurons the predictor selects for the n_tok tokens of x
    void predictor_select(const Layer &L, const FfnTier &T, Operand &x, int64_t n_tok);
    // out rows [0, n_tok): the neurons the rule passes, by the gathered kernels' values
    void true_mask(const Pass &p, uint8_t *out);
    // TierJob::n_probe: the predictor's selection for the last tokens (selected_), before the FFN, and its counts after
    void probe_select(const Pass &p);
    void probe_count(const Pass &p);
    // Token t's used down_t rows (mask_ 2) among list[0, count), with their coefficients h, written to
    // down_rows_ / down_coef_ from index `at`, in list order; returns how many.
    int64_t list_used_rows(const FfnTier &T, const int32_t *list, int64_t count, int64_t at, int64_t t = 0);

    const HParams hp_;
    const KernelSet &ks_;
    ThreadPool &pool_;
    const int64_t n_batch_, max_rank_;
    const bool copies_tiers_;
    DiskTier *const disk_;
    std::vector<FfnTier> copies_;  // by layer, where copies_tiers_
    struct Uploaded {
        const Layer *layer;
        const FfnTier *tier;
    };
    std::vector<Uploaded> tiers_;  // by layer
    int64_t ld_ = 0;              // the largest tier's neurons: the row stride of the [batch][neuron] scratch

    // scratch, allocated by upload for the largest tier
    std::vector<float> g_, u_;  // [batch][ld_ + 8]: gate and up (or the predictor's logits) of grouped tiers
    std::vector<float> h_, hid_;  // [batch][ld_] coefficients; [batch][max rank] the predictor's hidden layer
    std::vector<BlockQ8_0> q_hid_;
    std::vector<float> panel_w_;  // [threads][panel rows][n_embd]: widened down_t rows of a batch
    std::vector<float> panel_h_;  // [threads][panel tokens][panel rows]: their coefficients
    std::vector<BlockQ8_0> down_q_;  // [batch][used rows / 32 + 1]: the integer path's coefficients in q8_0
    std::vector<uint8_t> down_tile_;  // [threads][down_tile_bytes()]: a tile's transpose in q8_0 8-row groups
    std::vector<float> down_out_;     // [threads][batch][tile columns]: a panel's sums
    std::vector<int32_t> down_blocks_;       // [slots / 32 + 1]: the blocks of 32 slots a batch uses
    std::vector<int64_t> down_panel_first_;  // [panels + 1]: each panel's first among them
    // [threads][pack_scratch_bytes_]: a batch's pass of gate and up groups packed from rows (no kept groups)
    std::vector<uint8_t> pack_scratch_;
    size_t pack_scratch_bytes_ = 0;
    std::vector<uint8_t> zero_row_;  // the padding rows of a tier's last group
    std::vector<uint8_t> mask_, truth_;  // [batch][ld_]
    // [batch][ld_]: the neurons a batch's predictor selected, where the batch reads every gate in order (or the
    // probe's); and one row of ones, the selection of the modes that keep every neuron the rule passes
    std::vector<uint8_t> selected_, every_neuron_;
    std::vector<int32_t> rows_;  // [ld_]
    std::vector<int32_t> hits_;  // [ld_] a decode step on disk: its selected neurons in memory
    int64_t n_rows_ = 0;
    // Per chunk of a fused decode step: where its lists start (in rows_, down_rows_ and down_coef_), the
    // neurons it listed and the down_t rows they used.
    struct ChunkList {
        int64_t at = 0, listed = 0, used = 0;
    };
    std::vector<ChunkList> chunk_lists_;  // [threads]
    int64_t n_used_ = 0;                  // down_t rows the chunks listed, moved together (down_rows_, down_coef_)
    std::vector<const void *> down_rows_;  // [ld_] down_t rows used by the one token of a decode step
    std::vector<float> down_coef_;         // [ld_] their coefficients h
    std::vector<float> down_partial_;      // [runs of down_runs.h][n_embd] partial sums of those rows
    std::atomic<int64_t> n_active_{0}, n_computed_{0};
    TierCounts counts_;
};

}  // namespace pi
