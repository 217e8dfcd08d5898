// The inference context: a loaded Model, the KV cache, preallocated scratch, the thread pool, the
// FFN modes, statistics and sampling. Everything the decode loop touches is allocated here, once.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "model/model.h"
#include "runtime/page_memory.h"
#include "engine/sampler.h"
#include "runtime/threadpool.h"

namespace pi {

// How one FFN tier is computed for one layer and batch.
enum class TierMode { Dense, DenseRule, Gate, Predictor, Oracle };
constexpr int kTierModes = 5;
const char *tier_mode_name(TierMode m);

// A row-major [tokens, n] activation matrix plus, on demand, its q8_0 quantization: the operand of
// dot products against rows of any weight type.
struct Operand {
    const float *f = nullptr;
    int64_t n = 0;
    BlockQ8_0 *q = nullptr;  // capacity for the batch, allocated by the engine
    bool q_ready = false;
    const void *at(int64_t t, uint32_t type) const {
        return act_is_q8(type) ? static_cast<const void *>(q + t * (n / QK)) : static_cast<const void *>(f + t * n);
    }
    // bytes from one token's operand to the next
    size_t stride(uint32_t type) const {
        return act_is_q8(type) ? size_t(n / QK) * sizeof(BlockQ8_0) : size_t(n) * sizeof(float);
    }
};

struct LayerStats {
    double tokens = 0;        // tokens through this layer's FFN
    double active = 0;        // neurons passing the activation rule (all tiers)
    double hot_active = 0;    // of which in the hot tier
    double computed = 0;      // neurons whose up/down rows were used
    double cold_tokens = 0;   // token-tier pairs scored by the predictor
    double predicted = 0;     // cold neurons selected by the predictor
    double true_pos = 0;      // selected and truly active (recall check / oracle)
    double positives = 0;     // truly active cold neurons (recall check / oracle)
    double mode_tokens[kTierModes] = {};  // per TierMode, for the cold tier
    double kernel_changes = 0;            // decode steps whose cold-tier kernels differ from the step before's
};

struct PhaseTimes {
    double embed = 0, attention = 0, predictor = 0, gate_up = 0, down = 0, output = 0;
};

class Engine {
public:
    Engine(const std::string &path, const pi_options &opts);

    const Model &model() const { return *model_; }
    void set_ffn_mode(int32_t mode);
    void set_recall_check(bool on) { recall_check_ = on; }
    void eval(const int32_t *tokens, int32_t n, float *logits, bool all_logits);
    int32_t n_past() const { return int32_t(n_past_); }
    void truncate(int32_t n_keep);
    int32_t sample(const pi_sampling &p);
    void set_seed(uint64_t seed) { rng_.seed_with(seed); }
    const std::string &info_json();
    const std::string &stats_json();
    void reset_stats();

private:
    // Refuses (PI_ERR_MEMORY) before allocating when the buffers the hyperparameters imply exceed RAM.
    void check_working_memory(int64_t threads) const;
    // Bytes of the KV cache, and of every other buffer the hyperparameters, ctx_size, batch and threads imply
    // (in doubles: no overflow for a hostile file's sizes).
    double kv_cache_bytes() const;
    double work_buffer_bytes(int64_t threads) const;
    void forward(const int32_t *tokens, int64_t n_tok, float *logits, int64_t ld_logits, bool all_logits);
    // cold_mode: choose_cold_mode's verdict for the layer (attention fetches a predictor it will need)
    void attention(int64_t il, int64_t n_tok, TierMode cold_mode);
    // the heads of a batch of n_tok tokens, and of a decode step over n_keys cached positions, given the layer's
    // cache (kc, vc); att_ receives their outputs
    void batch_heads(const uint8_t *kc, const uint8_t *vc, int64_t n_tok);
    void decode_heads(const uint8_t *kc, const uint8_t *vc, int64_t n_keys);
    // gemm_f32 (or gemm_f16 for an f16 cache) with w at element `at` of the cache bytes `cache`
    void gemm_cache(int n_tok, int n_rows, int n_cols, const float *h, int ldh, const uint8_t *cache, int64_t at,
                    int ldw, float *y, int ldy) const;
    void ffn(int64_t il, int64_t n_tok, TierMode cold_mode);
    TierMode choose_cold_mode(int64_t il, int64_t n_tok);
    // auto mode may run layer il's predictor: the file has predictors and train-predictor found this one useful
    bool auto_may_predict(int64_t il) const;
    void ffn_tier(const Layer &L, const FfnTier &T, TierMode mode, int64_t n_tok, float *y, LayerStats &st,
                  bool is_cold);
    // mask_ rows [0, n_tok): the tier's neurons the predictor selects for the n_tok tokens of x
    void predictor_select(const Layer &L, const FfnTier &T, Operand &x, int64_t n_tok);
    // auto mode, a batch that runs the layer without the predictor: the predictor scored for its last tokens
    // (selected_ rows [0, returned count)), and after the FFN, what it would have selected and computed there,
    // taken into the layer's predictor densities, so that its first decode steps price predictor mode at
    // densities measured on the prompt rather than guessed
    int64_t select_for_last_tokens(const Layer &L, int64_t n_tok);
    void measure_predictor(int64_t il, int64_t n_tok, int64_t n_probe);
    // The predictor's hidden layer relu(fc1 x), prepared as fc2's operand.
    Operand predictor_hidden(const Layer &L, Operand &x, int64_t n_tok);
    // mask_ of the tier's slots in fc2's units [u0, u1) (FfnTier::fc2_units).
    void predictor_score(const Layer &L, const FfnTier &T, const Operand &hid, int64_t n_tok, int64_t u0, int64_t u1);
    // Asks for the layer's predictor weights (fc1, the cold tier's fc2) ahead of predictor_select.
    void prefetch_predictor(const Layer &L) const;
    void true_mask(const Layer &L, const FfnTier &T, int64_t n_tok, uint8_t *out);
    // The one token's used down_t rows (mask_ 2) among list[0, count), with their coefficients h, written to
    // down_rows_ / down_coef_ from index `at`, in list order; returns how many.
    int64_t list_used_rows(const FfnTier &T, const int32_t *list, int64_t count, int64_t at);
    struct MatmulTarget {
        const Matrix *W;
        float *out;
        int64_t ldo;
    };
    void matmul(const Matrix &W, Operand &x, int64_t n_tok, float *out, int64_t ldo);
    void matmul(const MatmulTarget *targets, int n_targets, Operand &x, int64_t n_tok);
    void prepare(Operand &x, int64_t n_tok, uint32_t type);
    // RMSNorm or LayerNorm (hp_.norm) of n_tok rows; b may be empty.
    void norm(const float *x, const Matrix &w, const Matrix &b, int64_t n_tok, float *out) const;
    // y[t][i] += b[i] for each of n_tok rows ld apart (nothing when b is absent)
    void add_bias(float *y, const Matrix &b, int64_t n_tok, int64_t ld) const;
    void add_residual(const float *y, int64_t n_tok);

    std::unique_ptr<Model> model_;
    const KernelSet *ks_;
    std::unique_ptr<ThreadPool> pool_;
    HParams hp_;
    int64_t n_ctx_, n_batch_;
    int32_t mode_;
    bool recall_check_;

    // KV cache, a kv head's positions together (each head reads one stream): keys
    // [layer][kv head][pos / kKeyTile][d_head][pos % kKeyTile] (a query's scores over a tile are a gemm over
    // contiguous rows), values [layer][kv head][pos][d_head]
    PageMemory k_cache_, v_cache_;
    bool kv_f16_ = false;                                 // elements in f16 (else f32)
    int64_t kv_bytes() const { return kv_f16_ ? 2 : 4; }  // bytes of one cache element
    int64_t key_slots() const;  // positions a kv head's keys hold: n_ctx rounded up to whole tiles
    int64_t n_past_ = 0;
    std::vector<int32_t> history_;
    std::vector<float> rope_cos_, rope_sin_;  // [pos][n_rot/2]

    // scratch, [batch, ...]
    std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, y_hot_, y_cold_, h_, hid_, last_logits_;
    std::vector<float> g_, u_;  // [batch][n_ff rounded up to 8]: gate and up of grouped tiers
    std::vector<float> scores_;  // [threads][attention tile][n_ctx], or a decode step's [head][n_ctx]
    std::vector<float> panel_w_;  // [threads][panel rows][n_embd]: widened down_t rows of a batch
    std::vector<float> panel_h_;  // [threads][panel tokens][panel rows]: their coefficients
    // [threads][pack_scratch_bytes_]: a batch's pass of gate and up groups packed from rows (no kept groups)
    std::vector<uint8_t> pack_scratch_;
    size_t pack_scratch_bytes_ = 0;
    std::vector<uint8_t> zero_row_;  // the padding rows of a tier's last group
    std::vector<BlockQ8_0> q_x_, q_xn_, q_att_, q_hid_;
    Operand op_x_, op_xn_, op_att_, op_hid_;
    std::vector<uint8_t> mask_, truth_;  // [batch][n_ff]
    // [batch][n_ff]: the neurons a batch's predictor selected, where the batch reads every gate in order; and
    // one row of ones, the selection of the modes that keep every neuron the rule passes
    std::vector<uint8_t> selected_, every_neuron_;
    std::vector<int32_t> rows_;  // [n_ff]
    // Per chunk of a fused decode step: where its lists start (in rows_, down_rows_ and down_coef_), the
    // neurons it listed and the down_t rows they used.
    struct ChunkList {
        int64_t at = 0, listed = 0, used = 0;
    };
    std::vector<ChunkList> chunk_lists_;  // [threads]
    int64_t n_used_ = 0;                  // down_t rows the chunks listed, moved together (down_rows_, down_coef_)
    std::vector<const void *> down_rows_;    // [n_ff] down_t rows used by the one token of a decode step
    std::vector<float> down_coef_;           // [n_ff] their coefficients h
    std::vector<float> down_partial_;        // [n_ff / 256 runs][n_embd] partial sums of those rows
    int64_t n_rows_ = 0;

    // auto mode: measured densities per layer (exponential moving averages over tokens)
    std::vector<double> ema_active_, ema_predicted_, ema_predicted_active_;
    // per layer, the cold tier's mode at its last decode step since the FFN mode was set, and what it has cost beyond
    // the cheapest mode's since it last was the cheapest (gate and auto change modes when that would pay for the
    // regrouping a change takes)
    std::vector<std::optional<TierMode>> decode_mode_;
    std::vector<double> switch_regret_;
    std::vector<bool> predicted_seen_;

    std::vector<LayerStats> stats_;
    PhaseTimes times_;
    double batch_tokens_ = 0, batch_seconds_ = 0, decode_tokens_ = 0, decode_seconds_ = 0;
    Sampler sampler_;
    Rng rng_;
    std::string json_;
};

}  // namespace pi
