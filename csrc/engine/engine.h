// The inference context (docs/engine.md, "Layout"): a loaded Model, its RunState (every buffer, allocated at
// open), the thread pool, a TierBackend per FFN tier, the FfnPolicy that picks their modes, statistics and
// sampling. forward.cpp holds the forward pass; engine.cpp opening, the calls of the C API, and the rest.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/device_backend.h"
#include "backend/tier_backend.h"
#include "engine/ffn_policy.h"
#include "engine/input_kernels.h"
#include "engine/moe.h"
#include "engine/run_state.h"
#include "engine/sampler.h"
#include "engine/stats.h"
#include "kernels/kernels.h"
#include "model/disk_tier.h"
#include "model/model.h"
#include "runtime/page_memory.h"
#include "runtime/threadpool.h"

namespace pi {

class Engine {
public:
    // hot_backend: what computes the hot tier, "cpu" (the default) or "reference" (the scalar reference kernels,
    // one token and neuron at a time on a thread of its own: the testing API's check of the tier boundary).
    Engine(const std::string &path, const pi_options &opts, const std::string &hot_backend = "cpu");

    const Model &model() const { return *model_; }
    void set_ffn_mode(int32_t mode);
    void set_recall_check(bool on) { recall_check_ = on; }
    // Whether each eval records the experts its tokens' routers chose (a mixture of experts; refused elsewhere).
    void set_expert_trace(bool on);
    // The last eval's choices, [n][n_layer][n_expert_used] (-1 in a layer without experts); n: its token count.
    void expert_choices(int32_t *out, int32_t n) const;
    // The model-wide share of inputs input sparsity zeroes (0: off); refused above the file's largest level.
    void set_input_sparsity(float share);
    void eval(const int32_t *tokens, int32_t n, float *logits, bool all_logits);
    // The same, writing each token's last hidden state through the output norm (n * n_embd floats: what the head
    // reads; embeddings pool them) instead of logits; the next sample is refused until an eval makes logits.
    void eval_hidden(const int32_t *tokens, int32_t n, float *hidden);
    int32_t n_past() const { return int32_t(rs_->seqs[size_t(rs_->cur)].n_past); }
    void truncate(int32_t n_keep);
    int32_t n_seq() const { return int32_t(rs_->seqs.size()); }
    // The sequence that eval, eval_hidden, n_past, truncate, sample and set_seed act on (0 at open).
    void select(int32_t seq);
    // One decode step of n distinct sequences together (docs/engine.md, "Sequences"): tokens[t] evaluated as the
    // next token of sequence seqs[t], the weights read once for all of them, each attending to its own cache. Each
    // sequence's logits (row t of `logits`, n * n_vocab floats, may be NULL; and what sample draws from) are the
    // bits its own single-token eval would give. The selected sequence stays selected.
    void decode_step(const int32_t *seqs, const int32_t *tokens, int32_t n, float *logits);
    // allowed: NULL, or a bitmask of n_words words over the vocabulary (pi_sample_masked)
    int32_t sample(const pi_sampling &p, const uint32_t *allowed = nullptr, int64_t n_words = 0);
    void set_seed(uint64_t seed) { rs_->seq().rng.seed_with(seed); }
    const std::string &info_json();
    const std::string &stats_json();
    void reset_stats() {
        stats_.reset();
        if (device_) device_->reset_counts();
        if (disk_) disk_->reset_counts();
        if (experts_) experts_->reset_counts();
    }

private:
    // Refuses an empty or missing batch, one past the context, and token ids outside the vocabulary.
    void check_tokens(const int32_t *tokens, int32_t n) const;
    // decode_step's checks: its sequences distinct and in range, each with room for a token, the tokens in the
    // vocabulary, and an engine whose decode step computes each row as it would alone (dense FFN on the CPU).
    void check_steps(const int32_t *seqs, const int32_t *tokens, int32_t n);
    // Whether the batch being computed is a decode step of several sequences (steps_ lists them, one per row).
    bool stepping() const { return !steps_.empty(); }
    // tokens [0, n), checked, through batch(done, chunk) in batches of at most n_batch_, timed as one evaluation;
    // makes_logits: whether sampling may follow (eval), or not (eval_hidden).
    void in_batches(const int32_t *tokens, int32_t n, bool makes_logits,
                    const std::function<void(int64_t, int64_t)> &batch);
    // What the memory checks leave for the rest of the process: the allocator's slack, thread stacks, the caller's growth.
    static constexpr double kProcessMargin = 64.0 * (1 << 20);
    // Refuses (PI_ERR_MEMORY) before allocating when the buffers the hyperparameters imply exceed RAM.
    void check_working_memory(int64_t threads, pi_kv_type kv_type) const;
    // Bytes of weights the engine will copy out of the mapped file from here on (hot_ chosen, nothing uploaded):
    // the hot tier's copy (or what a device takes on the host) and the cold tiers' gate/up groups.
    // cold_on_disk: as if the cold tiers were on disk (they keep no groups), before the disk tier takes them.
    double weight_copy_bytes(bool cold_on_disk = false) const;
    double work_buffer_bytes(int64_t threads) const;
    // What check_working_memory counts but the margin: the KV cache at the full context, the work buffers, the
    // weight copies.
    double working_bytes(int64_t threads, pi_kv_type kv_type, bool cold_on_disk = false) const;
    // What a tier's budget may take: the memory check's limit (0: none found) and that limit less what the process
    // held before the engine copied anything (`held`: the engine's own copies made so far, counted in its budget).
    struct BudgetRoom {
        double limit = 0, room = 0;
    };
    static BudgetRoom budget_room(double held);
    // A given budget whose tier would hold `would_hold` (at most every bundle or expert) that does not fit the room
    // fails in one line (PI_ERR_MEMORY); nothing to check where no limit was found.
    static void check_budget_fits(double budget, double would_hold, const BudgetRoom &r);
    // The disk tier where opts.memory_budget asks for it (or, at 0, where the model's bundles are there and its FFN
    // would not fit the memory the process may use); nullptr otherwise.
    std::unique_ptr<DiskTier> open_disk_tier(const pi_options &opts, int64_t threads);
    // A mixture of experts' expert tier (model/expert_tier.h) where memory_budget asks for one, or where memory_budget
    // is 0 and the experts do not fit what the process may take (the machine's memory or its cgroup's); else nullptr.
    std::unique_ptr<ExpertTier> open_expert_tier(const pi_options &opts, int64_t threads);
    // Before the model loads (it holds a hot tier only for a device, or where asked): checks hot_backend and
    // opts.gpu, and returns the device library where opts ask for a device (gpu auto or on), give a gpuidx and
    // the library finds the device; else nullptr, with gpu_off_ saying why where a device was asked for.
    const pi_device_api *find_device(const pi_options &opts, const std::string &hot_backend);
    // The device library and device for opts (gpu auto or on), or nullptr with gpu_off_ saying why. A mixture of
    // experts, which takes no gpuidx, asks for it once the model is open (its device experts are its tier plan's).
    const pi_device_api *device_library(const pi_options &opts);
    // A mixture's device experts per layer, from the tier plan beside the model; empty with gpu_off_ saying why where
    // the plan places none (or the device cannot compute its experts).
    std::vector<std::vector<int32_t>> planned_device_experts();
    // The hot tier's backend where opts ask for a device: a DeviceTierBackend, or nullptr with gpu_off_ saying why
    // (auto: the hot tier, where the model kept one, stays on the CPU), or a failure (on).
    std::unique_ptr<TierBackend> device_tier(const pi_options &opts, int64_t rank);

    // forward.cpp, in the order a batch runs them
    void forward(const int32_t *tokens, int64_t n_tok, float *logits, int64_t ld_logits, bool want_logits);
    void embed(const int32_t *tokens, int64_t n_tok);
    // cold_mode: the policy's verdict for the layer (attention fetches a predictor it will need)
    void attention(int64_t il, int64_t n_tok, TierMode cold_mode);
    // rows [row, row + n_tok) of the batch's q and k (RoPE) and v into the current sequence's cache
    void store_kv(int64_t il, int64_t n_tok, int64_t row = 0);
    // the heads of a batch of n_tok tokens, and of a decode step over n_keys cached positions, given the layer's
    // cache (kc, vc); att receives their outputs
    // window: the positions a query attends to, its own and those before it (a sliding-window layer's); 0: all
    void batch_heads(RunState::KvLayer kc, RunState::KvLayer vc, int64_t n_tok, int64_t window);
    // decode_heads: the query of batch row `row` (a decode step of several sequences has one per sequence)
    void decode_heads(RunState::KvLayer kc, RunState::KvLayer vc, int64_t n_keys, int64_t window, int64_t row = 0);
    // gemm_f32 (gemm_f16 for an f16 cache, gemm_q8_columns / gemm_q8_rows for a q8_0 cache's keys / values) with w
    // at element `at` (a tile's first) of the layer's keys or values
    void gemm_cache(int n_tok, int n_rows, int n_cols, const float *h, int ldh, RunState::KvLayer cache, bool keys,
                    int64_t at, int ldw, float *y, int ldy) const;
    // y[t] += sum over positions j < n_keys of p[t][j] * value j of kv head kvh in the layer's value cache; p is 0
    // before `first` (a sliding window's first key), so the sum starts at first's block
    void value_sum(int n_tok, int64_t n_keys, const float *p, int ldp, RunState::KvLayer cache, int64_t kvh, float *y,
                   int ldy, int64_t first) const;
    // Asks for the layer's predictor weights (fc1, the cold tier's fc2) while attention reads the KV cache.
    void prefetch_predictor(const Layer &L) const;
    void ffn(int64_t il, int64_t n_tok, TierMode cold_mode);
    // Both tiers' operands made from the FFN's input (rs_->xn, and x for the predictor), the cold tier arranged for
    // the step, and its job (writing y_cold).
    TierJob cold_job(int64_t il, int64_t n_tok, TierMode cold_mode, float down_zero_at);
    // Whether layer il runs whole on the device: its attention and hot rows there, no cold tier, no down bias, no
    // input sparsity (DeviceTierBackend::runs_layer).
    bool device_layer(int64_t il) const;
    // Whether layer il runs split: its attention and hot rows on the device, its cold tier here, no down bias, no
    // FFN post-norm, no input sparsity (DeviceTierBackend::splits); and running it (docs/engine.md, "A split
    // layer"), the stream coming from the device or going back to the host as `in` and `out` say; returns the
    // seconds its cold tier took here (its phases' time, not attention's).
    bool split_layer(int64_t il) const;
    double split(int64_t il, int64_t n_tok, TierMode cold_mode, bool in, bool out);
    // The device's whole and split layers' counts into the stats and the policy, once their stream has come back.
    void take_device_layers(int64_t n_tok);
    void output(int64_t n_tok, float *logits, int64_t ld_logits);
    // RMSNorm or LayerNorm (hp_.norm) of n_tok rows; b may be empty.
    void norm(const float *x, const Matrix &w, const Matrix &b, int64_t n_tok, float *out) const;
    // RMSNorm of n_heads consecutive vectors of w.cols values in place (a head's, or a token's q or k), by w
    void head_norm(float *x, const Matrix &w, int64_t n_heads) const;
    // y[t][i] += b[i] for each of n_tok rows ld apart (nothing when b is absent)
    void add_bias(float *y, const Matrix &b, int64_t n_tok, int64_t ld) const;
    // RMSNorm of a block's output in place where the layer has the norm (gemma3's post_attention_norm, post_ffw_norm)
    void post_norm(float *y, const Matrix &w, int64_t n_tok) const;
    void add_residual(const float *y, int64_t n_tok);
    void matmul(const MatmulTarget *targets, int n, Operand &x, int64_t n_tok) { pi::matmul(*ks_, *pool_, targets, n, x, n_tok); }

    // input_sparsity.cpp
    bool input_on() const { return input_share_ > 0.0f; }
    // the FFN computed by input sparsity's own path: dense mode (the other FFN modes keep their own sparsity)
    bool input_ffn_on() const { return input_on() && policy_.mode() == PI_FFN_DENSE; }
    // Whether the cold tiers' down_t rows are held in quads (FfnTier::down_quads) for decode steps in `m`: where
    // every step uses every row (dense mode on a SiLU model, whose h is never exactly 0) and the kernels have
    // axpy_quads; a ReLU model's dense steps leave its zeros' rows unread instead.
    bool down_quads_for(TierMode m) const {
        return m == TierMode::Dense && thresholded(hp_.activation) && !input_ffn_on() && ks_->q4_0.axpy_quads;
    }
    // Arranges every layer's cold tier for the decode steps of the current mode (at the densities measured so far).
    void arrange_decode_layers();
    float input_thr(int64_t il, int site) const { return input_thr_[size_t(il * Model::kInputSiteCount + site)]; }
    void allocate_input_scratch();
    double input_scratch_bytes() const;
    // out = x (n_tok rows of n) with the values at or below t zeroed (counted); returns how many
    int64_t zero_small(const float *x, int64_t n, int64_t n_tok, float t, float *out);
    // outs[m] = matrix m of `mats` (transposed: a row per input, all with as many) times x with its values at or
    // below t zeroed, reading only the rows of the kept inputs; `decode`: counted as a decode step's bytes
    void input_rows_decode(const InputRows *const *mats, float *const *outs, int n_mats, const float *x, float t,
                           bool decode);
    // The matrices of a layer's site q/k/v, o or gate/up, stacked as its column copy stacks them
    std::vector<const Matrix *> input_site_matrices(const Layer &L, int site) const;
    // Makes the column copies the current mode's decode steps read and frees the others (checked against the
    // memory the process may still take); sites whose matrices are not all q4_0 or all q8_0 keep the rows path.
    void build_input_columns();
    size_t input_columns_bytes() const;
    // The widest tile (1024, 512 or 256 outputs) that gives no thread more than 1.15x an even share of the outputs
    // (threads split a step's tiles; a wider tile makes longer pieces)
    int64_t column_tile(int64_t n_out) const;
    // The layout of the sites of `shapes` (one layer's copies, by site) not chosen yet: PI_INPUT_KERNEL's
    // ("columns" or "groups", for tests), else the probe's (choose_input_kernels)
    void choose_input_layouts(const InputColumns *shapes);
    const InputColumns *input_columns(int64_t il, int site) const {
        const InputColumns &c = in_cols_[size_t(il * Model::kInputSiteCount + site)];
        return c.present() ? &c : nullptr;
    }
    // out[0, c.n_out) = the site's stacked matrices times x (one token) with its values at or below t zeroed, by
    // the kernel of c's layout (gemv_columns reads only the kept inputs' columns)
    void input_columns_decode(const InputColumns &c, const float *x, float t, float *out);
    void input_qkv(const Layer &L, int64_t il, int64_t n_tok);
    void input_output_projection(const Layer &L, int64_t il, int64_t n_tok);
    void input_ffn(int64_t il, int64_t n_tok);

    // (declared before model_: set before the model loads)
    std::string gpu_off_;                        // why the hot tier is not on a device, where opts asked for one
    std::string device_library_;                 // its path, where opts ask for a device and give a gpuidx
    const pi_device_api *device_api_ = nullptr;  // the device library, where a device takes the hot tier
    bool gpuidx_ignored_ = false;                // a gpuidx was given, no device took it: every neuron is cold
    std::unique_ptr<Model> model_;
    const KernelSet *ks_;
    std::unique_ptr<ThreadPool> pool_;
    HParams hp_;
    int64_t n_ctx_, n_batch_, n_seq_;
    bool recall_check_;
    std::unique_ptr<RunState> rs_;
    FfnPolicy policy_;
    std::unique_ptr<DiskTier> disk_;  // the cold tier's rows on disk (before cold_, which holds a pointer to it)
    std::unique_ptr<TierBackend> hot_, cold_;
    std::unique_ptr<ExpertTier> experts_;  // a mixture's experts read from disk (before moe_, which points to it)
    std::unique_ptr<MoeFfn> moe_;     // the experts of a mixture of experts' layers (hp_.n_expert > 0)
    // set_expert_trace: the last eval's routing, [token][layer][k], and the first token of the batch in flight
    bool expert_trace_ = false;
    std::vector<int32_t> trace_;
    int64_t trace_tokens_ = 0, trace_at_ = 0;
    int32_t gpu_mode_ = PI_GPU_OFF;
    DeviceTierBackend *device_ = nullptr;  // hot_, where it is a device's
    std::vector<TierMode> device_layer_modes_;  // [layer] the cold mode a whole or split layer on the device ran in
    // [layer] a split layer's cold tier's counts, held until its hot rows' come down (take_device_layers)
    struct SplitCold {
        bool has_cold = false;
        TierCounts counts;
        int64_t n_probe = 0;
    };
    std::vector<SplitCold> split_cold_;
    bool stream_on_device_ = false;             // the last layer's output is on the device, not in rs_->x
    // a forward pass has run since open: until then a batch leaves the cold tier's layout to the decode steps
    // (Engine::cold_job), so a fresh process's first prompt does not wait for it
    bool ran_ = false;
    EngineStats stats_;
    Sampler sampler_;
    std::vector<int32_t> steps_;  // during decode_step: the sequence of each batch row; empty otherwise
    std::string json_;
    float input_share_ = 0.0f;
    std::vector<float> input_thr_;  // [layer][site]
    // input sparsity's scratch (allocated where the file has its matrices): the rows of a decode step's kept
    // inputs and their coefficients, rows_product's partials, a batch's zeroed input (then its h) and its q8_0
    // form, gate (or fused q/k/v) and up outputs
    std::vector<const void *> in_rows_;
    std::vector<float> in_coef_, in_partials_, in_x_, in_g_, in_u_, in_y_;
    std::vector<BlockQ8_0> in_q_;
    std::vector<InputColumns> in_cols_;  // [layer][site]: the copies a decode step reads
    InputKernelChoice in_kernels_;       // their layout per site, chosen when a site's copies are first made
};

}  // namespace pi
