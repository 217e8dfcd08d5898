// A loaded model: hyperparameters, tensor views checked against them, and the FFN's hot/cold tiers.
//
// Architectures are described by ArchSpec (norm kind, activation rule, which tensors exist), so that
// the forward pass branches on properties rather than names; llama and bamboo are wired here, and
// the spec has room for falcon/opt (layer norms with biases, ungated FFN, learned positions).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gguf.h"

namespace pi {

enum class Activation { Relu, Silu, DRelu };

// A matrix in its stored type: `rows` rows of `cols` elements, each row `row_bytes` apart.
struct Matrix {
    uint32_t type = 0;
    int64_t rows = 0, cols = 0;
    size_t row_bytes = 0;
    const uint8_t *data = nullptr;
    const uint8_t *row(int64_t r) const { return data + size_t(r) * row_bytes; }
    size_t bytes() const { return size_t(rows) * row_bytes; }
};

struct HParams {
    std::string arch;  // general.architecture
    Activation activation = Activation::Silu;
    int64_t n_vocab = 0, n_embd = 0, n_layer = 0, n_ff = 0, n_head = 0, n_head_kv = 0, d_head = 0;
    int64_t n_ctx_train = 0, n_rot = 0;
    float norm_eps = 1e-5f;
    float rope_base = 10000.0f;
    float rope_freq_scale = 1.0f;
    int64_t bos = -1, eos = -1;
};

// One FFN tier: the neurons it holds and their rows. The hot tier owns packed copies (contiguous,
// ready for a device backend to take); the cold tier points into the mapped file via `ids`.
struct FfnTier {
    std::vector<int32_t> ids;  // neuron index in the layer for each row slot
    Matrix gate, up, down_t;   // row r of each = neuron ids[r] (packed) or row ids[r] (mapped, see packed)
    bool packed = false;
    std::vector<uint8_t> storage;  // backing of packed rows
    Matrix fc2;                    // predictor rows of this tier's neurons (cold tier only)
    std::vector<uint8_t> fc2_storage;
    int64_t size() const { return int64_t(ids.size()); }
    // Row of neuron slot r in matrix m (packed rows are contiguous; mapped rows are gathered).
    const uint8_t *row(const Matrix &m, int64_t r) const { return packed ? m.row(r) : m.row(ids[size_t(r)]); }
};

struct Layer {
    Matrix attn_norm, ffn_norm;  // f32 vectors (rows = 1)
    Matrix wq, wk, wv, wo;
    Matrix gate, up, down_t;
    Matrix fc1, fc2;  // predictor (empty when absent)
    float act_threshold = 0.0f;   // |a| threshold for SiLU (0 for the ReLU family)
    float pred_threshold = 0.0f;  // predictor logit threshold
    FfnTier hot, cold;
};

class Model {
public:
    // Throws EngineFailure with the file name and the first problem found.
    Model(const std::string &path, const std::string &gpuidx_path);

    const HParams &hp() const { return hp_; }
    const Matrix &tok_embd() const { return tok_embd_; }
    const Matrix &output_norm() const { return output_norm_; }
    const Matrix &output() const { return output_; }
    const std::vector<Layer> &layers() const { return layers_; }
    bool has_predictor() const { return has_predictor_; }
    bool pwri() const { return file_->pwri_magic(); }
    const std::string &path() const { return file_->path(); }
    int64_t hot_neurons() const;
    // Largest predictor rank over layers (0 without predictors).
    int64_t max_rank() const;

private:
    Matrix bind(const std::string &name, int64_t rows, int64_t cols, bool f32_only) const;
    Matrix bind_optional(const std::string &name, int64_t rows, int64_t cols, bool f32_only, bool *found) const;
    void read_hparams();
    void bind_tensors();
    void build_tiers(const std::string &gpuidx_path);

    std::unique_ptr<GgufFile> file_;
    HParams hp_;
    Matrix tok_embd_, output_norm_, output_;
    std::vector<Layer> layers_;
    bool has_predictor_ = false;
};

}  // namespace pi
