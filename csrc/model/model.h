// A loaded model: hyperparameters, tensor views checked against them, and the FFN's hot/cold tiers.
//
// Architectures are data: one ArchSpec each (model.cpp's table), whose properties HParams carries (norm kind,
// RoPE kind, gated or plain FFN, parallel or sequential block, learned positions, per-head q/k norms), so that
// the forward pass branches on properties rather than names: llama and bamboo (RMSNorm, gated FFN), qwen2 and
// qwen3 (llama's with NeoX RoPE; qwen3's heads normed), falcon (LayerNorm, fused QKV, NeoX RoPE, attention and
// FFN in parallel from the layer input), opt (LayerNorm, learned positions, biases), phi3 (qwen2's without biases)
// and gemma3 (GELU, a scaled embedding, norms after attention and the FFN, sliding-window layers). Mixtures of
// experts (llama's Mixtral, qwen3moe, olmoe) hold a router and stacked experts in place of the FFN (Experts).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "kernels/kernels.h"
#include "kernels/packed.h"
#include "model/decode.h"
#include "runtime/page_memory.h"
#include "format/types.h"

namespace pi {

enum class Activation { Relu, Silu, DRelu, Gelu };  // Gelu: tanh-approximated (gelu_pytorch_tanh)
// SiLU and GELU: nothing is exactly zero, a neuron counts where |a| exceeds the layer's calibrated threshold
inline bool thresholded(Activation a) { return a == Activation::Silu || a == Activation::Gelu; }
enum class NormKind { Rms, Layer };         // RMSNorm (llama family) or LayerNorm with bias
enum class RopeKind { None, Adjacent, NeoX };  // llama.cpp "normal" (pairs 2i, 2i+1), NeoX (i, i + n_rot/2)
// attn_q_norm/attn_k_norm, RMSNorms of the queries and keys before RoPE: none, each head's (qwen3), or the whole
// projection's at once (olmoe: its weights as long as q and k)
enum class QkNorm { None, PerHead, Whole };
// Whether an architecture's layers may (llama: Mixtral) or must (qwen3moe, olmoe) be mixtures of experts
enum class ExpertUse { None, Optional, Required };

// A matrix in its stored type: `rows` rows of `cols` elements, each row `row_bytes` apart.
struct Matrix {
    uint32_t type = 0;
    int64_t rows = 0, cols = 0;
    size_t row_bytes = 0;
    const uint8_t *data = nullptr;
    // Rows [0, 8 * n_groups) again in the 8-row interleaved layout of packed.h, for matrices always read
    // whole (q4_0/q8_0 attention projections, output head, predictor); the rest are read from `data`.
    const uint8_t *groups = nullptr;
    int64_t n_groups = 0;
    const uint8_t *row(int64_t r) const { return data + size_t(r) * row_bytes; }
    size_t bytes() const { return size_t(rows) * row_bytes; }
    // bytes of one 8-row group of these rows in the packed layout (0 for a type that does not pack)
    int64_t group_bytes() const { return cols / QK * int64_t(packed_block_bytes(type)); }
    // rows [r0, r0 + n) as a matrix of their own (the parts of a fused tensor, an expert's rows), with the groups
    // of their rows where r0 starts one
    Matrix rows_view(int64_t r0, int64_t n) const {
        Matrix m = *this;
        m.rows = n;
        m.data = data ? row(r0) : nullptr;
        const bool aligned = groups && r0 % kPackRows == 0 && r0 < n_groups * kPackRows;
        m.groups = aligned ? groups + r0 / kPackRows * group_bytes() : nullptr;
        m.n_groups = aligned ? std::min(n, n_groups * kPackRows - r0) / kPackRows : 0;
        return m;
    }
    // An f32 vector (norm weight, bias) or nullptr when the tensor is absent.
    const float *floats() const { return reinterpret_cast<const float *>(data); }
};

// An architecture the engine computes, as its file names it (llama.cpp's general.architecture).
struct ArchSpec {
    const char *name;
    NormKind norm;
    RopeKind rope;            // llama: its converters put q/k rows in adjacent pairs; qwen, falcon: NeoX (as is)
    bool gated, parallel_block, learned_pos;
    int64_t pos_offset;       // row of position 0 in position_embd
    bool all_biases;          // every projection has a bias (opt); elsewhere a bias is optional
    QkNorm qk_norm;           // attn_q_norm/attn_k_norm: RMSNorm of q and k before RoPE
    bool head_width_key;      // attention.key_length may set heads apart from embedding_length / head_count
    bool embd_scale;          // the token embedding times sqrt(n_embd) (gemma3)
    bool post_norms;          // post_attention_norm, post_ffw_norm: RMSNorm of attention's and the FFN's outputs
    // Layers il with il % swa_pattern < swa_pattern - 1 attend within attention.sliding_window, with RoPE base
    // rope.freq_base_swa, the others to the whole context (gemma3: 6, as llama.cpp); 0: the window, if any, is
    // every layer's and caps the context (Mistral's rule)
    int64_t swa_pattern;
    const char *plain_activation;  // the FFN activation of a file without powerinfer.ffn_activation: a GGUF's,
    const char *pwri_activation;   // a PWRI file's (PowerInfer's sparse FFN computes ReLU)
    const char *activations;       // those it computes, space-separated
    ExpertUse experts;
    // Whether the chosen experts' weights are divided by their sum where the file has no expert_weights_norm:
    // llama.cpp's choice for the architecture (llama and qwen3moe yes, olmoe no)
    bool experts_norm;
};

struct HParams {
    std::string arch;        // the architecture computed (ArchSpec::name)
    std::string key_prefix;  // general.architecture, which names the hyperparameter keys (llama-silu: below)
    Activation activation = Activation::Silu;
    bool shifted_relu = false;    // FATReLU (ProSparse): ReLU's rule at each layer's act_threshold instead of 0
    int64_t n_vocab = 0, n_embd = 0, n_layer = 0, n_ff = 0, n_head = 0, n_head_kv = 0, d_head = 0;
    int64_t n_ctx_train = 0, n_rot = 0;
    NormKind norm = NormKind::Rms;
    RopeKind rope = RopeKind::Adjacent;
    bool gated = true;            // FFN a = act(gate x) * (up x); otherwise a = act(up x + b)
    bool parallel_block = false;  // x + attn(norm x) + ffn(norm' x) (falcon) instead of two residual steps
    bool learned_pos = false;     // position_embd added to the token embedding (opt)
    int64_t pos_offset = 0;       // row of position 0 in position_embd (opt: 2)
    bool all_biases = false;      // ArchSpec::all_biases
    QkNorm qk_norm = QkNorm::None;  // ArchSpec::qk_norm
    float norm_eps = 1e-5f;
    float rope_base = 10000.0f;
    // RoPE scaling (Model::read_rope_scaling, one place for every kind): positions times rope_freq_scale (linear);
    // per rotated pair, what its frequency is divided by (llama3's rope_freqs, YaRN's blend, longrope's short
    // factors; empty: none); cos and sin times rope_attn_factor (YaRN's and longrope's attention factor)
    float rope_freq_scale = 1.0f;
    std::vector<float> rope_freq_factors;
    float rope_attn_factor = 1.0f;
    int64_t n_swa = 0;  // attention.sliding_window: positions a query attends to (0: all)
    // The longest context the engine computes as the model at every position (0: any): a window every layer
    // shares (swa_pattern 0), within which windowed attention is full attention, or longrope's original context,
    // within which the model takes the short factors. A longer ctx_size is refused, naming ctx_limit_why.
    int64_t n_ctx_limit = 0;
    std::string ctx_limit_why;
    void limit_context(int64_t n, const std::string &why) {
        if (n_ctx_limit == 0 || n < n_ctx_limit) n_ctx_limit = n, ctx_limit_why = why;
    }
    int64_t swa_pattern = 0;      // ArchSpec::swa_pattern; 0: the context is capped at n_swa instead
    float rope_base_swa = 10000.0f;  // the RoPE base of sliding-window layers (swa_pattern)
    bool embd_scale = false;      // ArchSpec::embd_scale
    bool post_norms = false;      // ArchSpec::post_norms
    float attn_scale = 0.0f;      // a head's scores times this before softmax; 0: 1/sqrt(d_head)
    float score_scale() const { return attn_scale > 0.0f ? attn_scale : 1.0f / std::sqrt(float(d_head)); }
    // whether layer il attends within the window (and its RoPE base is rope_base_swa)
    bool swa_layer(int64_t il) const { return swa_pattern > 0 && n_swa > 0 && il % swa_pattern < swa_pattern - 1; }
    int64_t bos = -1, eos = -1;
    // Mixture of experts (expert_count > 0): every layer's FFN is n_expert gated FFNs of n_ff_exp neurons, of which the
    // router picks n_expert_used per token, their softmax weights divided by their sum where expert_weights_norm
    int64_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0;
    bool expert_weights_norm = false;
    // The FFN neurons a token's layer computes (their share is the stats' density): its experts' or n_ff.
    int64_t ffn_neurons() const { return n_expert > 0 ? n_expert_used * n_ff_exp : n_ff; }
};

// One FFN tier: the neurons it holds and their rows. The Model's tiers point into the mapped file via `ids`; the
// hot tier's backend takes its own copy at load (packed_copy for the CPU's: contiguous rows and groups).
struct FfnTier {
    std::vector<int32_t> ids;  // neuron index in the layer for each row slot
    Matrix gate, up, down_t;   // row r of each = neuron ids[r] (packed) or row ids[r] (mapped, see packed)
    bool packed = false;
    std::vector<uint8_t> storage;  // backing of packed rows
    // The predictor's fc2 for this tier's neurons: the hot tier's as plain rows in slot order (a device's split
    // layer scores them, Model::keep_hot_predictor); the cold tier's as follows. f32/f16 predictors are kept transposed,
    // weight k of every neuron, so a token's logits are `rank` axpys over contiguous rows instead of a short
    // dot per neuron, in tiles of kFc2Tile neurons (each tile's rank rows contiguous: a thread's share of the
    // tiles is one stream); quantized ones in 8-row groups (fc2.groups, neuron slot order), scored by gemm8.
    static constexpr int64_t kFc2Tile = 256;
    Matrix fc2;
    std::vector<uint8_t> fc2_storage;
    bool fc2_transposed = false;
    int64_t fc2_tiles() const { return (size() + kFc2Tile - 1) / kFc2Tile; }
    // Byte offset in fc2 (fc2_transposed) of weights k of the neurons of tile b: min(kFc2Tile, size() -
    // b * kFc2Tile) values.
    int64_t fc2_tile_offset(int64_t b, int64_t k) const {
        const int64_t width = std::min(kFc2Tile, size() - b * kFc2Tile);
        return (b * kFc2Tile * fc2.rows + k * width) * int64_t(type_size(fc2.type).bytes);
    }
    const uint8_t *fc2_tile_row(int64_t b, int64_t k) const { return fc2.data + fc2_tile_offset(b, k); }
    // The units fc2 is scored in (tiles or 8-row groups): how many, and the neuron slots each covers.
    int64_t fc2_units() const { return fc2_transposed ? fc2_tiles() : n_groups(); }
    int64_t fc2_unit_rows() const { return fc2_transposed ? kFc2Tile : kPackRows; }
    // gate and up rows again in 8-row groups (packed.h, the last group padded with zero rows), kept where the
    // tier's mode reads those rows whole, so that a weight is held once (a packed copy's at load; the cold
    // tier's by Model::arrange_cold_tier, as the layer's mode changes); empty otherwise, or for f32/f16
    // weights. A packed copy whose gate and up are grouped holds no rows of them (gate.data and up.data are
    // null). Ungated FFNs have only gate_groups (gate is up).
    PageMemory gate_groups, up_groups;
    // down_t's rows in the 4-row layout of kernels/packed.h (pack_quads, slot order), kept where every decode
    // step uses every row (Model::arrange_cold_tier: a SiLU model's dense mode, q4_0): the down projection's
    // kernel then reads them without transposing (TypeKernels::axpy_quads). Empty otherwise.
    PageMemory down_quads;
    int64_t size() const { return int64_t(ids.size()); }
    // Whether down_t has the quad layout (q4_0), and the bytes of its quads.
    bool quads_fit() const { return size() > 0 && down_t.type == TYPE_Q4_0; }
    double quad_bytes() const { return double((size() + kQuadRows - 1) / kQuadRows) * double(down_t.row_bytes) * kQuadRows; }
    int64_t n_groups() const { return (size() + 7) / 8; }
    // Bytes of a copy of the tier's rows out of the mapped file, in whole 8-row groups: all three matrices (a
    // backend's copy of the hot tier), or gate and up where their type groups (the cold tier's groups).
    double copy_bytes(bool gated) const {
        return double(n_groups() * kPackRows) * double(gate.row_bytes + (gated ? up.row_bytes : 0) + down_t.row_bytes);
    }
    double group_bytes(bool gated) const {
        return double(n_groups() * kPackRows) *
               double((groups_fit(gate) ? gate.row_bytes : 0) + (gated && groups_fit(up) ? up.row_bytes : 0));
    }
    // Whether matrix m of this tier has an 8-row group layout (its type packs, gemm8 takes its width).
    bool groups_fit(const Matrix &m) const {
        return size() > 0 && packed_block_bytes(m.type) != 0 && m.cols <= kGemv8MaxCols;
    }
    // Where the cold tier is read from its neuron bundles (model/disk_tier.h): per slot, its bundle in memory while a
    // job runs (the disk tier fills the table before the job reads a row): gate at offset 0, up at bundle_up, down_t
    // at bundle_down. Null: the rows are the mapped file's.
    const uint8_t *const *bundle = nullptr;
    size_t bundle_up = 0, bundle_down = 0;
    bool on_disk() const { return bundle != nullptr; }
    // Row of neuron slot r in matrix m (packed rows are contiguous; mapped rows are gathered; bundled rows are in
    // their neuron's bundle).
    const uint8_t *row(const Matrix &m, int64_t r) const {
        if (bundle) return bundle[r] + (&m == &down_t ? bundle_down : &m == &up ? bundle_up : 0);
        return packed ? m.row(r) : m.row(ids[size_t(r)]);
    }
    // Groups [g0, g1) of the tier's rows of src (groups_fit), the layer's whole mapped matrix (row ids[slot] is
    // slot's), into out; the slots past size() are zero_row, src.row_bytes zero bytes: scale 0, so their dots
    // are 0. A batch packs a pass's groups this way where none are kept.
    void pack_groups(const Matrix &src, int64_t g0, int64_t g1, const void *zero_row, uint8_t *out) const;
};

// A tier's neurons copied out of the mapped rows `mapped` indexes, computed whole: gate and up as 8-row groups where
// their type packs (and then as nothing else), as rows otherwise; down_t as rows (the CPU backend's hot tier).
FfnTier packed_copy(const FfnTier &mapped, bool gated);
// The rows of m at neuron ids `ids`, one after the other (a backend's own copy of a tier's rows).
std::vector<uint8_t> gather_rows(const Matrix &m, const std::vector<int32_t> &ids);

// One of input sparsity's transposed matrices (docs/formats.md, "Input sparsity"): a row per input of the matrix,
// its outputs at columns [col0, col0 + n) of each row (falcon's q, k and v share the rows of attn_qkv_t).
struct InputRows {
    Matrix t;
    int64_t col0 = 0, n = 0;
    bool present() const { return t.data != nullptr; }
};

// Input sparsity's sites (names::kInputSites): the inputs a layer's matrices share, one threshold each.
enum InputSite { kSiteQkv = 0, kSiteO = 1, kSiteGateUp = 2, kSiteDown = 3 };

// A mixture-of-experts FFN as llama.cpp stores it (ffn_gate_inp, ffn_{gate,up,down}_exps): the router and the experts'
// matrices stacked, each expert's matrix a run of rows of the 3-D tensor (its rows keep the file's type, so a q4_0
// expert is whole blocks). computed by engine/moe.h.
struct Experts {
    Matrix router;    // [n_expert rows][n_embd]
    Matrix gate, up;  // [n_expert * n_ff rows][n_embd]: expert e's rows from e * n_ff
    Matrix down;      // [n_expert * n_embd rows][n_ff]: expert e's from e * n_embd (empty where down_t is held)
    // ReLU experts (computed gate first, a down row per neuron): ffn_down_exps transposed at load (model/decode.h),
    // [n_ff rows][n_expert * n_embd], expert e's row j at columns [e * n_embd, (e + 1) * n_embd); else empty
    Matrix down_t;
    int64_t n_ff = 0, n_embd = 0;
    bool present() const { return router.data != nullptr || router.groups != nullptr; }
    Matrix gate_of(int64_t e) const { return gate.rows_view(e * n_ff, n_ff); }
    Matrix up_of(int64_t e) const { return up.rows_view(e * n_ff, n_ff); }
    Matrix down_of(int64_t e) const { return down.rows_view(e * n_embd, n_embd); }
    // expert e's down_t: n_ff rows of n_embd values, each row_bytes of the whole tensor apart
    Matrix down_t_of(int64_t e) const {
        Matrix m = down_t;
        m.cols = n_embd;
        m.data = down_t.data + element_offset(down_t.type, e * n_embd);
        return m;
    }
};

// Vectors (norm weights and biases, rows = 1) are f32; an absent optional bias has data == nullptr.
struct Layer {
    Matrix attn_norm, attn_norm_b;  // the norm feeding attention
    Matrix ffn_norm, ffn_norm_b;    // the norm feeding the FFN (falcon 7B: the same tensor as attn_norm)
    Matrix wq, wk, wv, wo;          // falcon: row views into the fused attn_qkv
    Matrix bq, bk, bv, bo;
    Matrix q_norm, k_norm;          // RMSNorm weights (qk_norm): [d_head], or q's and k's whole width; else empty
    Matrix attn_post_norm, ffn_post_norm;  // RMSNorm of attention's and the FFN's outputs (post_norms), else empty
    Matrix gate, up, down_t;        // ungated FFN: gate is up (the rule reads the up projection)
    // llama.cpp's ffn_down as stored (n_embd rows of n_ff, q4_0/q8_0 blocks along the neurons), where the engine
    // keeps it so (the constructor's down_as_stored, engine.cpp's rule): a dense step multiplies it as every other
    // matrix, by gemm8 on its 8-row groups (down_groups, made with the packed matrices) against h in q8_0; down_t is
    // then empty until a mode that reads a row per neuron asks for it (Model::transpose_down). Empty otherwise.
    Matrix down;
    PageMemory down_groups;
    Matrix gate_b, up_b, down_b;    // per neuron (gate_b, up_b) and per output (down_b)
    Matrix fc1, fc2;  // predictor (empty when absent)
    InputRows q_t, k_t, v_t, o_t, gate_t, up_t;  // input sparsity's (empty when the file has none; gate_t: gated)
    float act_threshold = 0.0f;   // |a| threshold for SiLU, the gate's for FATReLU (0 for ReLU and dReLU)
    float pred_threshold = 0.0f;  // predictor logit threshold
    bool predictor_useful = true;  // train-predictor found it better than chance (auto mode leaves it out if not)
    FfnTier hot, cold;  // empty in a mixture of experts
    Experts experts;    // a mixture of experts' FFN (HParams::n_expert > 0), else empty
};

// Bytes of weights a model holds on the heap, in another layout than the file's (the rest stays mapped):
// matrices read whole in 8-row groups (attention, output head, predictor fc1), the predictor's fc2 for the
// cold tier, the hot tier (rows and groups: its backend's copy, which the engine adds), the cold tier's gate/up
// groups, the matrices decoded at load (model/decode.h), input sparsity's column copies (which the engine adds),
// llama.cpp's ffn_down in 8-row groups (Layer::down_groups).
struct WeightCopies {
    size_t packed = 0, predictor = 0, hot = 0, cold_groups = 0, down_quads = 0, decoded = 0, input_columns = 0,
           down_rows = 0;
};

class Model {
public:
    // Throws EngineFailure with the file name and the first problem found.
    // threads: how many decode rows at load (the engine's thread count); hot_tier: false puts every neuron in
    // the cold tier (the gpuidx is still checked); decode_cache: the file the rows decoded at load are kept in
    // and read from (model/decode_cache.h; "": none); down_as_stored: a llama.cpp file's q4_0/q8_0 ffn_down of a
    // SiLU/GeGLU FFN is kept as stored (Layer::down) instead of transposed into down_t, for dense steps
    Model(const std::string &path, const std::string &gpuidx_path, int threads = 1, bool hot_tier = true,
          const std::string &decode_cache = "", bool down_as_stored = false);

    const HParams &hp() const { return hp_; }
    const Matrix &tok_embd() const { return tok_embd_; }
    const Matrix &output_norm() const { return output_norm_; }
    const Matrix &output_norm_b() const { return output_norm_b_; }
    const Matrix &pos_embd() const { return pos_embd_; }  // rows: n_ctx_train + pos_offset (learned_pos)
    const Matrix &output() const { return output_; }
    const std::vector<Layer> &layers() const { return layers_; }
    bool has_predictor() const { return has_predictor_; }
    // Input sparsity's calibrated shares (powerinfer.input_sparsity_levels, increasing; empty when the file has no
    // input thresholds and transposed matrices) and the thresholds [level][layer][site] of each.
    const std::vector<float> &input_levels() const { return input_levels_; }
    float input_threshold(int64_t level, int64_t layer, int64_t site) const {
        return input_table_[size_t((level * hp_.n_layer + layer) * kInputSiteCount + site)];
    }
    static constexpr int64_t kInputSiteCount = 4;
    bool pwri() const { return file_->pwri_magic(); }
    const std::string &path() const { return file_->path(); }
    const SourceStamp &file_stamp() const { return file_->stamp(); }  // the mapped file's (runtime/derived_file.h)
    int64_t hot_neurons() const;
    // Every layer holding ffn_down as stored gets its down_t (transposed from the file, model/decode.h) and frees the
    // stored matrix's groups: the modes, tiers and input sparsity's FFN read a row per neuron. Refused (PI_ERR_MEMORY)
    // where the transposed rows would pass the memory the process may use.
    void transpose_down();
    // Holds the cold tier's gates (ups) of layer il in 8-row groups or as the mapped rows, as asked, where
    // the types allow: a mode reads a matrix whole with gemm8 on the groups, or rows of it by index; and its
    // down_t rows in quads (FfnTier::down_quads, q4_0 only) or as the mapped rows. Grouping hands the mapped
    // rows' pages back; ungrouping (only where may_drop) frees the groups, and the rows come from the file again.
    void arrange_cold_tier(int64_t il, bool gate_groups, bool up_groups, bool down_quads, bool may_drop);
    // Hands back the pages of layer il's mapped cold gate (up) rows where groups also hold them (rows a batch read
    // by index), and of its down_t rows where quads hold them (a batch reads rows).
    void release_grouped_rows(int64_t il, bool gate, bool up);
    // Hands back the pages of a matrix's mapped rows once a copy of the engine's stands in for them (input
    // sparsity's column copies); a later read of a row brings its page back from the file.
    void release_mapped(const Matrix &m) const { file_->release(m.data, m.bytes()); }
    // Copies the vectors every token reads (norm weights, biases) out of the mapped file into memory of the model's
    // own: under a memory limit the page cache may drop their pages, and each would be a read from disk per token.
    void hold_vectors();
    // Reads layer il's cold rows from neuron bundles through `table` (FfnTier::bundle) from here on: the tier keeps no
    // groups or quads, and the mapped rows are never read.
    void attach_bundles(int64_t il, const uint8_t *const *table, size_t up_offset, size_t down_offset);
    // Packs the matrices every token reads whole (attention's, the output head, the predictors' fc1) into 8-row
    // groups (see Matrix::groups), all in one buffer on 2 MiB pages (streamed every token: on 4 KiB pages a stream
    // misses the TLB every 4 KiB), on `threads` threads. Called once by the engine after open, unless it keeps them
    // mapped (`map_dense_matrices`: a memory budget that cannot hold the copy; the kernel pages them in from the
    // file, as llama.cpp's mapped weights). weight_copies() counts the copy until either is chosen.
    void pack_dense_matrices(int threads);
    void map_dense_matrices() { dense_ = DenseLayout::Mapped; }
    bool dense_mapped() const { return dense_ == DenseLayout::Mapped; }
    // The experts' gate, up and down are read from the file by an expert tier (model/expert_tier.h): left out of the
    // packed matrices. Before pack_dense_matrices.
    void leave_experts_in_file(bool on) { experts_in_file_ = on; }
    const GgufFile &file() const { return *file_; }
    WeightCopies weight_copies() const;
    // The bytes of m's 8-row groups where pack_dense_matrices packs it (0: its rows are read as they are).
    static int64_t packed_bytes(const Matrix &m);
    const DecodedWeights &decoded() const { return decoded_; }
    // Largest predictor rank over layers (0 without predictors).
    int64_t max_rank() const;

private:
    Matrix bind(const std::string &name, int64_t rows, int64_t cols, bool f32_only);
    // A matrix of rows x cols (the file's tensor cols x rows where `transposed`); one of a type the kernels do
    // not compute with, or transposed, comes back decoded into decoded_ (model/decode.h).
    Matrix bind_optional(const std::string &name, int64_t rows, int64_t cols, bool f32_only, bool *found,
                         bool transposed = false);
    // An f32 vector of n values; absent is an error when `required`, else an empty Matrix.
    Matrix bind_vector(const std::string &name, int64_t n, bool required);
    // A tensor found and shape-checked as a matrix of rows x cols (the file's cols x rows where `transposed`): a view of
    // the mapping, or decoded (a type the kernels do not compute with, or transposed).
    Matrix view_or_decode(const GgufTensor &t, int64_t rows, int64_t cols, bool transposed);
    void bind_attention(int64_t i, Layer &l);
    void bind_ffn(int64_t i, Layer &l);
    // A mixture of experts' router and 3-D expert tensors (their down transposed for ReLU experts).
    void bind_experts(int64_t i, Layer &l);
    // Expert tensor `name`: n_expert matrices of rows x cols, as Experts stacks them (transposed: see Experts::down_t).
    Matrix bind_stacked(const std::string &name, int64_t rows, int64_t cols, bool transposed);
    // Input sparsity's thresholds and transposed matrices, where the file has them (both, or neither).
    void bind_input_sparsity();
    void read_hparams();
    // expert_count and the keys of a mixture of experts (HParams::n_expert ...), checked against the architecture
    void read_experts(const ArchSpec &spec);
    void bind_tensors();
    // RoPE scaling's keys and tensors (linear, llama3's rope_freqs, YaRN, longrope) into hp_'s rope_freq_scale,
    // rope_freq_factors, rope_attn_factor and context limit
    void read_rope_scaling();
    // An f32 tensor of a value per rotated pair, each a positive number (a frequency's divisor); empty if absent
    std::vector<float> bind_pair_factors(const char *name);
    void build_tiers(const std::string &gpuidx_path, bool hot_tier);
    void check_neuron_order(const GgufFile &gpuidx) const;
    // The hot tier's predictor rows (FfnTier::fc2 as plain rows in slot order), which a device's split layer
    // scores, from the layer's fc2 before bind_cold_predictor gives its rows back.
    void keep_hot_predictor(Layer &l);
    // The cold tier's predictor rows (see FfnTier::fc2), from the layer's fc2 (whose rows are not read again).
    void bind_cold_predictor(Layer &l);
    std::vector<Matrix *> dense_matrices();
    int64_t dense_pack_bytes() const;  // the packed copy's bytes
    // each matrix's place in the one packed buffer (on a line boundary), then the buffer's size
    static std::vector<int64_t> pack_offsets(const std::vector<Matrix *> &dense);
    // Frees the decoded rows (model/decode.h) of the matrices among `dense` that every reader now takes from
    // their groups (all rows grouped, not the embedding's rows), as pack() hands back a mapped matrix's pages.
    void free_grouped_decoded(const std::vector<Matrix *> &dense);
    // bytes of m's groups (0 where it does not pack); pack writes them to `out` and points m at them
    void pack(Matrix &m, uint8_t *out);

    std::unique_ptr<GgufFile> file_;
    HParams hp_;
    Matrix tok_embd_, pos_embd_, output_norm_, output_norm_b_, output_;
    std::vector<Layer> layers_;
    bool has_predictor_ = false;
    std::vector<float> input_levels_, input_table_;
    PageMemory packed_;  // backing of the packed matrices' Matrix::groups
    enum class DenseLayout { Pending, Packed, Mapped };
    DenseLayout dense_ = DenseLayout::Pending;
    DecodedWeights decoded_;  // the matrices decoded at load (their Matrix::data)
    std::vector<uint8_t> held_vectors_;  // hold_vectors' copies
    int threads_ = 1;         // the engine's threads, which decode at load
    bool experts_in_file_ = false;
    bool down_as_stored_ = false;  // the constructor's: Layer::down may be kept
};

}  // namespace pi
