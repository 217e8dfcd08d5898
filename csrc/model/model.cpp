#include "model/model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include "runtime/common.h"
#include "kernels/kernels.h"
#include "kernels/packed.h"
#include "format/dequant.h"
#include "format/types.h"
#include "model/rope_scaling.h"
#include "pi_names.h"

namespace pi {
namespace {

std::string shape_str(int64_t rows, int64_t cols) {
    return "(" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
}

std::string blk(int64_t i, const char *suffix) { return "blk." + std::to_string(i) + "." + suffix; }
std::string weight(int64_t i, const char *tensor) { return blk(i, tensor) + ".weight"; }
std::string bias(int64_t i, const char *tensor) { return blk(i, tensor) + ".bias"; }

}  // namespace

Model::Model(const std::string &path, const std::string &gpuidx_path, int threads, bool hot_tier,
             const std::string &decode_cache, bool down_as_stored)
    : threads_(std::max(threads, 1)), down_as_stored_(down_as_stored) {
    file_ = std::make_unique<GgufFile>(path);
    read_hparams();
    decoded_.open_cache(decode_cache, *file_);
    bind_tensors();
    build_tiers(gpuidx_path, hot_tier);
    decoded_.finish_cache();  // after the last decoding
}

std::vector<Matrix *> Model::dense_matrices() {
    std::vector<Matrix *> dense;
    for (Layer &l : layers_) {
        for (Matrix *m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.fc1, &l.experts.router}) dense.push_back(m);
        if (experts_in_file_) continue;  // an expert tier packs each expert as it reads it
        dense.push_back(&l.experts.gate);
        dense.push_back(&l.experts.down);
        // a mixture's experts: read whole, as attention is (engine/moe.h), but ReLU experts' up rows only where
        // their gate passes
        if (hp_.activation != Activation::Relu) dense.push_back(&l.experts.up);
    }
    dense.push_back(&output_);
    return dense;
}

std::vector<int64_t> Model::pack_offsets(const std::vector<Matrix *> &dense) {
    std::vector<int64_t> offsets{0};
    for (const Matrix *m : dense) offsets.push_back(offsets.back() + (packed_bytes(*m) + 63) / 64 * 64);
    return offsets;
}

int64_t Model::dense_pack_bytes() const {
    return pack_offsets(const_cast<Model *>(this)->dense_matrices()).back();
}

void Model::pack_dense_matrices(int threads) {
    if (dense_ != DenseLayout::Pending) fail(PI_ERR_INTERNAL, path() + ": the dense matrices are laid out already");
    dense_ = DenseLayout::Packed;
    std::vector<Matrix *> dense = dense_matrices();
    const std::vector<int64_t> offsets = pack_offsets(dense);
    packed_ = PageMemory(size_t(offsets.back()), true, "the packed weights");
    // Every token streams these matrices, so they are a model's size (a 7B model's attention: 1.2 GB at q4_0):
    // packed on the engine's threads, each claiming the next matrix (pack() touches nothing shared).
    std::atomic<size_t> next{0};
    auto work = [&] {
        for (size_t i = next++; i < dense.size(); i = next++) pack(*dense[i], packed_.data() + offsets[i]);
    };
    std::vector<std::thread> helpers;
    for (int t = 1; t < std::min<int>(threads, int(dense.size())); ++t) helpers.emplace_back(work);
    work();
    for (std::thread &h : helpers) h.join();
    free_grouped_decoded(dense);
    // llama.cpp's ffn_down kept as stored: each layer's groups in memory of their own (transpose_down frees them)
    for (Layer &l : layers_) {
        if (!l.down.data || packed_bytes(l.down) == 0) continue;
        l.down_groups = PageMemory(size_t(packed_bytes(l.down)), true, "8-row groups of ffn_down");
        pack(l.down, l.down_groups.data());
    }
}

void Model::transpose_down() {
    for (int64_t i = 0; i < hp_.n_layer; ++i) {
        Layer &l = layers_[size_t(i)];
        if (!l.down.data) continue;
        bool found = false;
        l.down_t = bind_optional(weight(i, names::kFfnDown), hp_.n_ff, hp_.n_embd, false, &found, true);
        l.cold.down_t = l.hot.down_t = l.down_t;
        l.down = Matrix{};
        l.down_groups = PageMemory();
    }
}

void Model::free_grouped_decoded(const std::vector<Matrix *> &dense) {
    const int64_t embedding = decoded_.holder(tok_embd_.data);  // its rows are looked up one by one
    for (int64_t i = 0; i < decoded_.count(); ++i) {
        std::vector<Matrix *> views;  // (a fused tensor's parts, as falcon's q, k and v)
        for (Matrix *m : dense)
            if (m->data && decoded_.holder(m->data) == i) views.push_back(m);
        bool grouped = !views.empty() && i != embedding;
        for (const Matrix *m : views) grouped = grouped && m->n_groups * kPackRows == m->rows;
        if (!grouped) continue;
        decoded_.discard(i);
        for (Matrix *m : views) m->data = nullptr;
    }
}

void FfnTier::pack_groups(const Matrix &src, int64_t g0, int64_t g1, const void *zero_row, uint8_t *out) const {
    const int64_t group_bytes = src.group_bytes();
    for (int64_t g = g0; g < g1; ++g) {
        const void *rows[kPackRows];
        for (int r = 0; r < kPackRows; ++r) {
            const int64_t slot = g * kPackRows + r;
            rows[r] = slot >= size() ? zero_row : src.row(ids[size_t(slot)]);
        }
        pack_rows8(src.type, int(src.cols), rows, out + (g - g0) * group_bytes);
    }
}

namespace {

// All of tier t's groups of src (see FfnTier::pack_groups) into out, t.n_groups() * src.group_bytes() bytes.
void group_rows(const FfnTier &t, const Matrix &src, uint8_t *out) {
    const std::vector<uint8_t> zeros(src.row_bytes, 0);
    t.pack_groups(src, 0, t.n_groups(), zeros.data(), out);
}

// The same in page memory of their own (a layer's gate/up groups: built and freed as its kernels change).
PageMemory groups_in_pages(const FfnTier &t, const Matrix &src) {
    PageMemory out(size_t(t.n_groups() * src.group_bytes()), false, "8-row groups of weights");
    group_rows(t, src, out.data());
    return out;
}

}  // namespace

void Model::arrange_cold_tier(int64_t il, bool gate_groups, bool up_groups, bool down_quads, bool may_drop) {
    FfnTier &t = layers_[size_t(il)].cold;
    if (t.on_disk()) return;  // its rows come from the bundles, read by index in every mode
    auto arrange = [&](const Matrix &m, PageMemory &groups, bool want) {
        if (want == !groups.empty() || (want && !t.groups_fit(m)) || (!want && !may_drop)) return;
        if (!want) {
            groups = PageMemory();  // unmapped; the rows are read from the mapped file again
            return;
        }
        groups = groups_in_pages(t, m);
        file_->release(m.data, m.bytes());
    };
    arrange(t.gate, t.gate_groups, gate_groups);
    if (hp_.gated) arrange(t.up, t.up_groups, up_groups);
    const bool quads = down_quads && t.quads_fit();
    if (quads == !t.down_quads.empty() || (!quads && !may_drop)) return;
    if (!quads) {
        t.down_quads = PageMemory();
        return;
    }
    std::vector<const void *> rows(size_t(t.size()));
    for (int64_t r = 0; r < t.size(); ++r) rows[size_t(r)] = t.row(t.down_t, r);
    t.down_quads = PageMemory(size_t(t.quad_bytes()), false, "4-row quads of down_t");
    pack_quads(int(t.down_t.cols), int(t.size()), rows.data(), t.down_quads.data());
    file_->release(t.down_t.data, t.down_t.bytes());
}

void Model::hold_vectors() {
    std::vector<Matrix *> vectors;
    for (Layer &l : layers_)
        for (Matrix *m : {&l.attn_norm, &l.attn_norm_b, &l.ffn_norm, &l.ffn_norm_b, &l.bq, &l.bk, &l.bv, &l.bo,
                          &l.q_norm, &l.k_norm, &l.attn_post_norm, &l.ffn_post_norm, &l.gate_b, &l.up_b, &l.down_b})
            if (m->data) vectors.push_back(m);
    for (Matrix *m : {&output_norm_, &output_norm_b_})
        if (m->data) vectors.push_back(m);
    // one copy per tensor (falcon 7B's attention and FFN share a norm; the forward pass compares the pointers)
    std::vector<std::pair<const uint8_t *, size_t>> placed;  // (source, offset)
    size_t total = 0;
    for (const Matrix *m : vectors) {
        bool seen = false;
        for (const auto &pl : placed) seen = seen || pl.first == m->data;
        if (seen) continue;
        placed.push_back({m->data, total});
        total += (m->bytes() + 63) / 64 * 64;
    }
    held_vectors_.assign(total, 0);
    for (Matrix *m : vectors)
        for (const auto &pl : placed)
            if (pl.first == m->data) {
                std::memcpy(held_vectors_.data() + pl.second, m->data, m->bytes());
                m->data = held_vectors_.data() + pl.second;
                break;
            }
}

void Model::attach_bundles(int64_t il, const uint8_t *const *table, size_t up_offset, size_t down_offset) {
    FfnTier &t = layers_[size_t(il)].cold;
    t.gate_groups = PageMemory();
    t.up_groups = PageMemory();
    t.down_quads = PageMemory();
    t.bundle = table;
    t.bundle_up = hp_.gated ? up_offset : 0;
    t.bundle_down = down_offset;
}

void Model::release_grouped_rows(int64_t il, bool gate, bool up) {
    const FfnTier &t = layers_[size_t(il)].cold;
    if (t.on_disk()) return;
    if (gate && !t.gate_groups.empty()) file_->release(t.gate.data, t.gate.bytes());
    if (up && !t.up_groups.empty()) file_->release(t.up.data, t.up.bytes());
    if (!t.down_quads.empty()) file_->release(t.down_t.data, t.down_t.bytes());
}

int64_t Model::packed_bytes(const Matrix &m) {
    if (m.group_bytes() == 0 || m.rows < kPackRows || m.cols > kGemv8MaxCols || !m.data) return 0;
    return m.rows / kPackRows * m.group_bytes();
}

void Model::pack(Matrix &m, uint8_t *out) {
    if (packed_bytes(m) == 0) return;
    const int64_t n_groups = m.rows / kPackRows, group_bytes = m.group_bytes();
    for (int64_t g = 0; g < n_groups; ++g) {
        const void *rows[kPackRows];
        for (int r = 0; r < kPackRows; ++r) rows[r] = m.row(g * kPackRows + r);
        pack_rows8(m.type, int(m.cols), rows, out + g * group_bytes);
    }
    m.groups = out;
    m.n_groups = n_groups;
    // The mapped rows are read once more only where a row is needed alone (an embedding lookup of a tied
    // head, rows past the last group): hand their pages back so the copy does not double the footprint.
    file_->release(m.data, size_t(n_groups * kPackRows) * m.row_bytes);
}

namespace {

// The architectures the engine computes (model.h's ArchSpec): a family is one row.
const ArchSpec kArchs[] = {
    // name       norm             rope               gated  par    lpos   off all_b  qk_norm          width  escale post   swa plain    pwri     computes             experts              exp_norm
    {"llama",    NormKind::Rms,   RopeKind::Adjacent, true,  false, false, 0, false, QkNorm::None,    false, false, false, 0, "silu",  "relu",  "relu silu fatrelu", ExpertUse::Optional, true},
    {"bamboo",   NormKind::Rms,   RopeKind::Adjacent, true,  false, false, 0, false, QkNorm::None,    false, false, false, 0, "drelu", "drelu", "drelu",             ExpertUse::None,     false},
    {"qwen2",    NormKind::Rms,   RopeKind::NeoX,     true,  false, false, 0, false, QkNorm::None,    true,  false, false, 0, "silu",  "silu",  "silu relu",         ExpertUse::None,     false},
    {"qwen3",    NormKind::Rms,   RopeKind::NeoX,     true,  false, false, 0, false, QkNorm::PerHead, true,  false, false, 0, "silu",  "silu",  "silu relu",         ExpertUse::None,     false},
    {"qwen3moe", NormKind::Rms,   RopeKind::NeoX,     true,  false, false, 0, false, QkNorm::PerHead, true,  false, false, 0, "silu",  "silu",  "silu",              ExpertUse::Required, true},
    {"olmoe",    NormKind::Rms,   RopeKind::NeoX,     true,  false, false, 0, false, QkNorm::Whole,   false, false, false, 0, "silu",  "silu",  "silu",              ExpertUse::Required, false},
    {"phi3",     NormKind::Rms,   RopeKind::NeoX,     true,  false, false, 0, false, QkNorm::None,    false, false, false, 0, "silu",  "silu",  "silu relu",         ExpertUse::None,     false},
    {"gemma3",   NormKind::Rms,   RopeKind::NeoX,     true,  false, false, 0, false, QkNorm::PerHead, true,  true,  true,  6, "gelu",  "gelu",  "gelu relu",         ExpertUse::None,     false},
    {"falcon",   NormKind::Layer, RopeKind::NeoX,     false, true,  false, 0, false, QkNorm::None,    false, false, false, 0, "relu",  "relu",  "relu",              ExpertUse::None,     false},
    {"opt",      NormKind::Layer, RopeKind::None,     false, false, true,  2, true,  QkNorm::None,    false, false, false, 0, "relu",  "relu",  "relu",              ExpertUse::None,     false},
};

bool computes(const ArchSpec &a, const std::string &act) {
    const std::string list = std::string(" ") + a.activations + " ";
    return list.find(" " + act + " ") != std::string::npos;
}

}  // namespace

void Model::read_hparams() {
    const GgufFile &f = *file_;
    const std::string &p = f.path();
    // A SiLU (GELU) model converted here is written as <arch>-silu (<arch>-gelu) (docs/formats.md): PowerInfer refuses
    // the name rather than run the file through its ReLU-only sparse FFN. Files written before name it llama, with
    // ffn_activation silu.
    hp_.key_prefix = f.get_string(names::kKeyArchitecture);
    const std::string &k = hp_.key_prefix;
    std::string named;  // the activation the name ends with, or ""
    for (const char *act : {"silu", "gelu"}) {
        const std::string suffix = std::string("-") + act;
        if (k.size() > suffix.size() && k.compare(k.size() - suffix.size(), std::string::npos, suffix) == 0) named = act;
    }
    hp_.arch = named.empty() ? k : k.substr(0, k.size() - named.size() - 1);
    const ArchSpec *spec = nullptr;
    std::string known;
    for (const ArchSpec &a : kArchs) {
        if (hp_.arch == a.name && (named.empty() || computes(a, named))) spec = &a;
        known += std::string(known.empty() ? "" : ", ") + a.name;
        for (const char *act : {"silu", "gelu"})
            if (computes(a, act)) known += std::string(", ") + a.name + "-" + act;
    }
    if (!spec) fail(PI_ERR_UNSUPPORTED, p + ": unsupported architecture '" + k + "' (this engine runs " + known + ")");
    const std::string &a = hp_.arch;
    for (const std::string &key : f.keys_with_prefix(k + ".")) {
        const std::string suffix = key.substr(k.size() + 1);
        bool listed = false;
        for (const char *name : names::kArchKeys) listed = listed || suffix == name;
        if (!listed) fail(PI_ERR_UNSUPPORTED, p + ": key " + key + " is not computed by this engine (it would run another model)");
    }
    hp_.norm = spec->norm;
    hp_.rope = spec->rope;
    hp_.gated = spec->gated;
    hp_.parallel_block = spec->parallel_block;
    hp_.learned_pos = spec->learned_pos;
    hp_.pos_offset = spec->pos_offset;
    hp_.all_biases = spec->all_biases;
    hp_.qk_norm = spec->qk_norm;
    hp_.embd_scale = spec->embd_scale;
    hp_.post_norms = spec->post_norms;
    hp_.swa_pattern = spec->swa_pattern;
    const int64_t big = int64_t(1) << 20;
    hp_.n_embd = f.get_int(k + ".embedding_length", 1, 1 << 16);
    hp_.n_layer = f.get_int(k + ".block_count", 1, 4096);
    hp_.n_ff = f.get_int(k + ".feed_forward_length", 1, big);
    hp_.n_head = f.get_int(k + ".attention.head_count", 1, hp_.n_embd);
    hp_.n_head_kv = f.get_int_or(k + ".attention.head_count_kv", hp_.n_head, 1, hp_.n_head);
    hp_.n_ctx_train = f.get_int_or(k + ".context_length", 2048, 1, int64_t(1) << 24);
    // A head's width: attention.key_length where the architecture's heads may be of another width than
    // embedding_length / head_count (qwen3: 128 beside 1024 / 16), which value_length must equal.
    const std::string key_length = k + ".attention.key_length", value_length = k + ".attention.value_length";
    if (spec->head_width_key && f.has(key_length)) {
        hp_.d_head = f.get_int(key_length, 2, 1 << 12);
        const int64_t dv = f.get_int_or(value_length, hp_.d_head, 1, 1 << 12);
        if (dv != hp_.d_head)
            fail(PI_ERR_UNSUPPORTED, p + ": " + value_length + " " + std::to_string(dv) + " is not " + key_length +
                                         " " + std::to_string(hp_.d_head) + ": heads of two widths are not supported");
    } else {
        if (hp_.n_embd % hp_.n_head != 0)
            fail(PI_ERR_FORMAT, p + ": embedding_length " + std::to_string(hp_.n_embd) +
                                    " is not a multiple of head_count " + std::to_string(hp_.n_head));
        hp_.d_head = hp_.n_embd / hp_.n_head;
        for (const std::string &kv : {key_length, value_length})
            if (f.has(kv) && f.get_int(kv, 1, big) != hp_.d_head)
                fail(PI_ERR_UNSUPPORTED, p + ": " + kv + " " + std::to_string(f.get_int(kv, 1, big)) +
                                             " is not embedding_length / head_count (" + std::to_string(hp_.d_head) +
                                             "): heads of another width are not supported for " + a);
    }
    if (hp_.n_head % hp_.n_head_kv != 0)
        fail(PI_ERR_FORMAT, p + ": head_count " + std::to_string(hp_.n_head) + " is not a multiple of head_count_kv " +
                                std::to_string(hp_.n_head_kv));
    // 0: no window, as llama.cpp reads it (its phi3 converter writes 0 for Phi-4)
    hp_.n_swa = f.get_int_or(k + ".attention.sliding_window", 0, 0, int64_t(1) << 24);
    // Sliding-window attention (Mistral) equals full attention while every query sees at most the window, which
    // holds in a context no longer than it: the context is limited there rather than windowed attention computed,
    // but for a family whose window is some layers' (gemma3: HParams::swa_layer), computed by the heads
    if (hp_.n_swa > 0 && hp_.swa_pattern == 0)
        hp_.limit_context(hp_.n_swa, "the model's attention window (" + k + ".attention.sliding_window = " +
                                         std::to_string(hp_.n_swa) + "); this engine attends to the whole context, "
                                         "which equals the model only within the window");
    hp_.n_rot = f.get_int_or(k + ".rope.dimension_count", hp_.d_head, 2, hp_.d_head);
    if (hp_.n_rot % 2 != 0) fail(PI_ERR_FORMAT, p + ": rope.dimension_count must be even");
    const bool rms = hp_.norm == NormKind::Rms;
    const std::string eps_key = k + (rms ? ".attention.layer_norm_rms_epsilon" : ".attention.layer_norm_epsilon");
    // PowerInfer's OPT converter writes no epsilon (its engine then normalizes with 0): OPT's own, torch's
    // nn.LayerNorm default, as convert writes it
    const double eps = f.get_float_or(eps_key, a == "opt" ? 1e-5 : -1.0);
    if (!(eps > 0.0 && eps < 1.0)) fail(PI_ERR_FORMAT, p + ": " + eps_key + " is missing or outside (0, 1)");
    hp_.norm_eps = float(eps);
    const double base = f.get_float_or(k + ".rope.freq_base", 10000.0);
    if (!(base > 1.0)) fail(PI_ERR_FORMAT, p + ": rope.freq_base must be > 1");
    hp_.rope_base = float(base);
    const double base_swa = f.get_float_or(k + ".rope.freq_base_swa", 10000.0);  // llama.cpp's gemma3 default
    if (!(base_swa > 1.0)) fail(PI_ERR_FORMAT, p + ": rope.freq_base_swa must be > 1");
    hp_.rope_base_swa = float(base_swa);
    // 1/sqrt(d_head), or attention.scale (gemma3's query_pre_attn_scalar^-1/2, as convert writes it); a llama.cpp
    // gemma3 file has none, and llama.cpp scales its 62-layer one (27B) by 1/sqrt(n_embd / n_head)
    if (a == "gemma3" && hp_.n_layer == 62) hp_.attn_scale = float(1.0 / std::sqrt(double(hp_.n_embd / hp_.n_head)));
    if (f.has(k + ".attention.scale")) {
        const double scale = f.get_float_or(k + ".attention.scale", 0.0);
        if (!(scale > 0.0 && scale < 1e3)) fail(PI_ERR_FORMAT, p + ": attention.scale must be in (0, 1000)");
        hp_.attn_scale = float(scale);
    }
    if (a == "falcon" && f.has("falcon.tensor_data_layout") && f.get_string("falcon.tensor_data_layout") != "jploski")
        fail(PI_ERR_UNSUPPORTED, p + ": falcon.tensor_data_layout '" + f.get_string("falcon.tensor_data_layout") +
                                     "' is not supported (jploski: fused QKV as all q heads, then k heads, then v heads)");

    // Without powerinfer.ffn_activation (PowerInfer's converters never write it): the architecture's own, which for
    // a PWRI llama file is ReLU, as PowerInfer's sparse FFN computes nothing else.
    std::string act = !named.empty() ? named : f.pwri_magic() ? spec->pwri_activation : spec->plain_activation;
    if (f.has(names::kKeyFfnActivation)) act = f.get_string(names::kKeyFfnActivation);
    if (!named.empty() && act != named)
        fail(PI_ERR_FORMAT, p + ": architecture " + k + " with FFN activation '" + act + "' (it must be " + named + ")");
    if (!computes(*spec, act))
        fail(PI_ERR_UNSUPPORTED, p + ": FFN activation '" + act + "' is not supported for architecture " + a);
    hp_.activation = act == "silu"    ? Activation::Silu
                     : act == "gelu"  ? Activation::Gelu
                     : act == "drelu" ? Activation::DRelu
                                      : Activation::Relu;
    hp_.shifted_relu = act == "fatrelu";
    read_experts(*spec);
}

void Model::read_experts(const ArchSpec &spec) {
    const GgufFile &f = *file_;
    const std::string &p = f.path(), &k = hp_.key_prefix;
    hp_.n_expert = f.get_int_or(k + ".expert_count", 0, 0, 1 << 16);
    if (hp_.n_expert == 0) {
        if (spec.experts == ExpertUse::Required)
            fail(PI_ERR_FORMAT, p + ": " + k + ".expert_count is missing: " + hp_.arch + " is a mixture of experts");
        for (const std::string &key : f.keys_with_prefix(k + ".expert_"))
            fail(PI_ERR_FORMAT, p + ": key " + key + " in a model without experts (" + k + ".expert_count)");
        return;
    }
    if (spec.experts == ExpertUse::None)
        fail(PI_ERR_UNSUPPORTED, p + ": experts (" + k + ".expert_count) are not computed for architecture " + hp_.arch);
    if (hp_.activation != Activation::Silu && (hp_.activation != Activation::Relu || hp_.shifted_relu))
        fail(PI_ERR_UNSUPPORTED, p + ": experts compute SiLU or ReLU, not the FFN activation of this file");
    hp_.n_expert_used = f.get_int(k + ".expert_used_count", 1, hp_.n_expert);
    // llama.cpp's llama and olmoe write the experts' width as feed_forward_length, its qwen3moe as its own key
    hp_.n_ff_exp = f.get_int_or(k + ".expert_feed_forward_length", hp_.n_ff, 1, int64_t(1) << 20);
    hp_.expert_weights_norm = f.get_bool_or(k + ".expert_weights_norm", spec.experts_norm);
}

Matrix Model::bind_optional(const std::string &name, int64_t rows, int64_t cols, bool f32_only, bool *found,
                            bool transposed) {
    const std::string &p = file_->path();
    const GgufTensor *t = file_->tensor(name);
    *found = t != nullptr;
    if (!t) return Matrix{};
    const bool vector = rows == 1;
    const int64_t file_rows = transposed ? cols : rows, file_cols = transposed ? rows : cols;
    bool ok = int64_t(t->ne[0]) == file_cols && (vector || int64_t(t->ne[1]) == file_rows);
    for (uint32_t d = vector ? 1 : 2; d < 4; ++d) ok = ok && t->ne[d] == 1;
    if (!ok) {
        std::string got = "(";
        for (int d = int(t->n_dims) - 1; d >= 0; --d) got += std::to_string(t->ne[d]) + (d ? ", " : ")");
        fail(PI_ERR_FORMAT, p + ": tensor " + name + " has shape " + got + ", the hyperparameters say " +
                                (vector ? "(" + std::to_string(cols) + ",)" : shape_str(file_rows, file_cols)));
    }
    if (f32_only && t->type != TYPE_F32)
        fail(PI_ERR_UNSUPPORTED, p + ": tensor " + name + " has type " + type_size(t->type).name + "; it must be f32");
    return view_or_decode(*t, rows, cols, transposed);
}

Matrix Model::view_or_decode(const GgufTensor &t, int64_t rows, int64_t cols, bool transposed) {
    const std::string &p = file_->path();
    const TypeSize ts = type_size(t.type);
    if (!type_readable(t.type))
        fail(PI_ERR_UNSUPPORTED, p + ": tensor " + t.name + " has type " + ts.name + "; this engine reads " +
                                     readable_type_names());
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    if (transposed || !type_computable(t.type)) {
        const DecodedRows d = decoded_.decode(p, t, transposed ? cols : rows, transposed ? rows : cols, transposed,
                                              threads_);
        file_->release(t.data, size_t(t.n_bytes));  // read once: the decoded rows stand in for them
        m.type = d.type;
        m.row_bytes = d.row_bytes;
        m.data = d.data;
        return m;
    }
    m.type = t.type;
    m.row_bytes = size_t(cols) / ts.block * ts.bytes;
    m.data = t.data;
    return m;
}

Matrix Model::bind_stacked(const std::string &name, int64_t rows, int64_t cols, bool transposed) {
    const std::string &p = file_->path();
    const GgufTensor *t = file_->tensor(name);
    if (!t) fail(PI_ERR_FORMAT, p + ": tensor " + name + " is missing");
    const int64_t n = hp_.n_expert;
    if (t->n_dims != 3 || int64_t(t->ne[0]) != cols || int64_t(t->ne[1]) != rows || int64_t(t->ne[2]) != n) {
        std::string got = "(";
        for (int d = int(t->n_dims) - 1; d >= 0; --d) got += std::to_string(t->ne[d]) + (d ? ", " : ")");
        fail(PI_ERR_FORMAT, p + ": tensor " + name + " has shape " + got + ", the hyperparameters say (" +
                                std::to_string(n) + ", " + std::to_string(rows) + ", " + std::to_string(cols) + ")");
    }
    // the experts one after the other: one matrix of n * rows rows (transposed: cols rows of n * rows)
    Matrix m = view_or_decode(*t, transposed ? cols : n * rows, transposed ? n * rows : cols, transposed);
    // an expert's part of a transposed row starts on a whole block
    if (transposed && rows % int64_t(type_size(m.type).block) != 0)
        fail(PI_ERR_UNSUPPORTED, p + ": tensor " + name + ": the experts' rows of " + std::to_string(rows) +
                                     " values do not split into whole " + type_size(m.type).name + " blocks");
    return m;
}

std::vector<float> Model::bind_pair_factors(const char *name) {
    const std::string &p = file_->path();
    bool found = false;
    const Matrix m = bind_optional(name, 1, hp_.n_rot / 2, true, &found);
    if (!found) return {};
    if (hp_.rope == RopeKind::None)
        fail(PI_ERR_FORMAT, p + ": tensor " + name + " in a model without RoPE (" + hp_.arch + ")");
    std::vector<float> factors(m.floats(), m.floats() + hp_.n_rot / 2);
    for (float x : factors)
        if (!(std::isfinite(x) && x > 0.0f))
            fail(PI_ERR_FORMAT, p + ": tensor " + name + " holds a value that is not a positive number");
    return factors;
}

// The kinds and keys as llama.cpp reads them (llama-model.cpp, llama-context.cpp), computed as transformers'
// ROPE_INIT_FUNCTIONS compute the same configs (modeling_rope_utils.py): linear, llama3 (rope_freqs.weight, what
// llama.cpp's converter writes for it), yarn and longrope. rope.scaling.attn_factor multiplies cos and sin whatever
// the kind, as llama.cpp's does.
void Model::read_rope_scaling() {
    const GgufFile &f = *file_;
    const std::string &p = f.path(), key = hp_.key_prefix + ".rope.scaling.";
    // a factor without a type scales linearly (llama.cpp's default type)
    const std::string scaling = f.has(key + "type") ? f.get_string(key + "type") : "linear";
    if (scaling != "linear" && scaling != "none" && scaling != "yarn" && scaling != "longrope")
        fail(PI_ERR_UNSUPPORTED, p + ": rope scaling '" + scaling +
                                     "' is not supported (none, linear, yarn, longrope; llama3 as rope_freqs.weight)");
    const double factor = f.get_float_or(key + "factor", 1.0);
    if (!(factor >= 1.0 && factor <= 1024.0)) fail(PI_ERR_FORMAT, p + ": rope.scaling.factor out of range");
    if (scaling == "none" && factor != 1.0)
        fail(PI_ERR_FORMAT, p + ": rope.scaling.factor " + std::to_string(factor) + " with rope scaling '" + scaling + "'");
    const double attn_factor = f.get_float_or(key + "attn_factor", 1.0);
    if (!(attn_factor > 0.0 && attn_factor < 16.0)) fail(PI_ERR_FORMAT, p + ": rope.scaling.attn_factor must be in (0, 16)");
    const int64_t n_ctx_orig = f.get_int_or(key + "original_context_length", hp_.n_ctx_train, 1, int64_t(1) << 24);
    for (const char *yarn_key : {"yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow"})
        if (scaling != "yarn" && f.has(key + yarn_key))
            fail(PI_ERR_FORMAT, p + ": key " + key + yarn_key + " with rope scaling '" + scaling + "'");
    hp_.rope_freq_factors = bind_pair_factors(names::kRopeFreqs);
    const std::vector<float> short_factors = bind_pair_factors(names::kRopeFactorsShort);
    const bool long_factors = !bind_pair_factors(names::kRopeFactorsLong).empty();  // checked, not computed: below
    // llama.cpp's phi3 converter writes longrope as its tensors and rope.scaling.attn_factor, with no type
    const bool longrope = scaling == "longrope" || !short_factors.empty() || long_factors;
    if (!hp_.rope_freq_factors.empty() && (longrope || scaling == "yarn"))
        fail(PI_ERR_UNSUPPORTED, p + ": tensor " + names::kRopeFreqs + " with rope scaling '" +
                                     (longrope ? "longrope" : scaling) + "' is not computed by this engine");
    hp_.rope_attn_factor = float(attn_factor);
    if (longrope) {
        if (short_factors.empty() || !long_factors)
            fail(PI_ERR_FORMAT, p + ": longrope RoPE scaling needs both tensors " + names::kRopeFactorsShort + " and " +
                                    names::kRopeFactorsLong);
        if (factor != 1.0) fail(PI_ERR_FORMAT, p + ": rope.scaling.factor with longrope's tensors");
        // The model takes the long factors only once its sequence passes the original context (transformers'
        // longrope_frequency_update, for every position of that sequence; llama.cpp's past a context that long):
        // within it the short factors are the model at every position, so the context is limited there.
        hp_.rope_freq_factors = short_factors;
        hp_.limit_context(n_ctx_orig, "the model's original context (" + key + "original_context_length = " +
                                          std::to_string(n_ctx_orig) + "); this engine computes longrope's short " +
                                          "factors, which are the model only within it");
    } else if (scaling == "yarn") {
        if (f.get_float_or(key + "yarn_ext_factor", 1.0) != 1.0)
            fail(PI_ERR_UNSUPPORTED, p + ": " + key + "yarn_ext_factor other than 1 is not computed by this engine "
                                         "(transformers' YaRN blends by the whole ramp)");
        const double beta_fast = f.get_float_or(key + "yarn_beta_fast", 32.0);
        const double beta_slow = f.get_float_or(key + "yarn_beta_slow", 1.0);
        if (!(beta_slow > 0.0 && beta_fast > beta_slow && beta_fast < 1e6))
            fail(PI_ERR_FORMAT, p + ": " + key + "yarn_beta_fast must be above yarn_beta_slow, both positive");
        // llama.cpp's converter writes the config's attention_factor as yarn_attn_factor: the factor itself
        const double yarn_attn = f.get_float_or(key + "yarn_attn_factor", yarn_default_attn_factor(factor));
        if (!(yarn_attn > 0.0 && yarn_attn < 16.0)) fail(PI_ERR_FORMAT, p + ": " + key + "yarn_attn_factor must be in (0, 16)");
        hp_.rope_freq_factors = yarn_freq_factors(hp_.n_rot, hp_.rope_base, factor, n_ctx_orig, beta_fast, beta_slow);
        hp_.rope_attn_factor = float(yarn_attn * attn_factor);
    } else {
        hp_.rope_freq_scale = float(1.0 / factor);
    }
}

Matrix Model::bind_vector(const std::string &name, int64_t n, bool required) {
    bool found = false;
    Matrix m = bind_optional(name, 1, n, true, &found);
    if (!found && required) fail(PI_ERR_FORMAT, file_->path() + ": tensor " + name + " is missing");
    return m;
}

Matrix Model::bind(const std::string &name, int64_t rows, int64_t cols, bool f32_only) {
    bool found = false;
    Matrix m = bind_optional(name, rows, cols, f32_only, &found);
    if (!found) fail(PI_ERR_FORMAT, file_->path() + ": tensor " + name + " is missing");
    return m;
}

void Model::bind_cold_predictor(Layer &l) {
    FfnTier &t = l.cold;
    const int64_t nc = t.size(), rank = l.fc2.cols;
    if (l.fc2.type == TYPE_F32 || l.fc2.type == TYPE_F16) {
        const size_t es = type_size(l.fc2.type).bytes;
        t.fc2_storage.resize(size_t(rank * nc) * es);
        t.fc2.rows = rank;
        t.fc2.cols = nc;
        t.fc2.row_bytes = size_t(nc) * es;
        t.fc2.data = t.fc2_storage.data();
        t.fc2_transposed = true;
        for (int64_t r = 0; r < nc; ++r) {
            const uint8_t *src = l.fc2.row(t.ids[size_t(r)]);
            const int64_t b = r / FfnTier::kFc2Tile, at = r % FfnTier::kFc2Tile;
            for (int64_t k = 0; k < rank; ++k)
                std::memcpy(t.fc2_storage.data() + t.fc2_tile_offset(b, k) + size_t(at) * es, src + size_t(k) * es, es);
        }
    } else {  // quantized: the tier's rows in 8-row groups, scored by gemm8
        t.fc2_storage.resize(size_t(t.n_groups() * l.fc2.group_bytes()));
        group_rows(t, l.fc2, t.fc2_storage.data());
        t.fc2.rows = nc;
        t.fc2.data = nullptr;
        t.fc2.groups = t.fc2_storage.data();
        t.fc2.n_groups = t.n_groups();
    }
    // no second copy: the mapped pages go back, or the decoded rows (a tensor of their own) are freed
    const int64_t held = decoded_.holder(l.fc2.data);
    if (held < 0) {
        file_->release(l.fc2.data, l.fc2.bytes());
    } else {
        decoded_.discard(held);
        l.fc2.data = nullptr;
    }
}

void Model::keep_hot_predictor(Layer &l) {
    FfnTier &t = l.hot;
    if (t.size() == 0 || !l.fc2.data) return;
    t.fc2 = l.fc2;
    t.fc2.rows = t.size();
    t.fc2.groups = nullptr;
    t.fc2.n_groups = 0;
    t.fc2_storage.resize(size_t(t.size()) * l.fc2.row_bytes);
    for (int64_t r = 0; r < t.size(); ++r)
        std::memcpy(t.fc2_storage.data() + size_t(r) * l.fc2.row_bytes, l.fc2.row(t.ids[size_t(r)]), l.fc2.row_bytes);
    t.fc2.data = t.fc2_storage.data();
}

void Model::bind_tensors() {
    const GgufFile &f = *file_;
    const std::string &p = f.path();
    const GgufTensor *emb = f.tensor("token_embd.weight");
    if (!emb) fail(PI_ERR_FORMAT, p + ": tensor token_embd.weight is missing");
    if (emb->n_dims != 2 || emb->ne[1] < 1 || emb->ne[1] > (uint64_t(1) << 24))
        fail(PI_ERR_FORMAT, p + ": tensor token_embd.weight is not a (n_vocab, n_embd) matrix");
    hp_.n_vocab = int64_t(emb->ne[1]);
    const int64_t V = hp_.n_vocab, E = hp_.n_embd, F = hp_.n_ff, L = hp_.n_layer;
    if (f.has(hp_.key_prefix + ".vocab_size")) f.get_int(hp_.key_prefix + ".vocab_size", V, V);
    if (const GgufValue *toks = f.find("tokenizer.ggml.tokens"))
        if (toks->type == GV_ARRAY && int64_t(toks->array_count) != V)
            fail(PI_ERR_FORMAT, p + ": the vocabulary has " + std::to_string(toks->array_count) +
                                    " tokens but token_embd.weight has " + std::to_string(V) + " rows");
    hp_.bos = f.get_int_or("tokenizer.ggml.bos_token_id", -1, -1, V - 1);
    hp_.eos = f.get_int_or("tokenizer.ggml.eos_token_id", -1, -1, V - 1);

    tok_embd_ = bind("token_embd.weight", V, E, false);
    const bool layer_norm = hp_.norm == NormKind::Layer;
    output_norm_ = bind_vector("output_norm.weight", E, true);
    output_norm_b_ = bind_vector("output_norm.bias", E, layer_norm);
    if (hp_.learned_pos) {
        // convert writes the positions (context_length) beside a table of n_ctx + 2 rows; PowerInfer's OPT converter
        // writes the table's rows there (2050, OptModel.set_gguf_parameters): both read here
        const GgufTensor *t = f.tensor("position_embd.weight");
        if (t && t->n_dims == 2 && int64_t(t->ne[1]) == hp_.n_ctx_train && hp_.n_ctx_train > hp_.pos_offset)
            hp_.n_ctx_train -= hp_.pos_offset;
        pos_embd_ = bind("position_embd.weight", hp_.n_ctx_train + hp_.pos_offset, E, false);
    }
    bool has_output = false;
    output_ = bind_optional("output.weight", V, E, false, &has_output);
    if (!has_output) output_ = tok_embd_;  // tied embeddings in a plain GGUF file
    read_rope_scaling();

    std::vector<float> act_thr(size_t(L), 0.0f), pred_thr(size_t(L), 0.0f);
    if (f.has(names::kKeyActivationThresholds)) act_thr = f.get_f32_array(names::kKeyActivationThresholds, uint64_t(L));
    for (float t : act_thr)
        if (t < 0.0f) fail(PI_ERR_FORMAT, p + ": powerinfer.activation_thresholds holds a negative value");
    if (f.has(names::kKeyPredictorThresholds)) {
        pred_thr = f.get_f32_array(names::kKeyPredictorThresholds, uint64_t(L));
    } else if (f.has(names::kKeySparseThreshold)) {
        std::fill(pred_thr.begin(), pred_thr.end(), float(f.get_float_or(names::kKeySparseThreshold, 0.0)));
    }

    std::vector<bool> pred_useful(size_t(L), true);
    if (f.has(names::kKeyPredictorUseful)) pred_useful = f.get_bool_array(names::kKeyPredictorUseful, uint64_t(L));

    has_predictor_ = f.tensor(weight(0, names::kPredictorFc1)) != nullptr || f.tensor(weight(0, names::kPredictorFc2)) != nullptr;
    layers_.resize(size_t(L));
    for (int64_t i = 0; i < L; ++i) {
        Layer &l = layers_[size_t(i)];
        bind_attention(i, l);
        bind_ffn(i, l);
        l.act_threshold = thresholded(hp_.activation) || hp_.shifted_relu ? act_thr[size_t(i)] : 0.0f;
        l.pred_threshold = pred_thr[size_t(i)];
        l.predictor_useful = pred_useful[size_t(i)];
        const std::string fc1 = weight(i, names::kPredictorFc1), fc2 = weight(i, names::kPredictorFc2);
        if (has_predictor_) {
            const GgufTensor *t1 = f.tensor(fc1);
            if (!t1)
                fail(PI_ERR_FORMAT, p + ": tensor " + fc1 + " is missing (" +
                                        (i == 0 ? fc2 + " is there" : std::string("layer 0 has a predictor")) + ")");
            if (t1->n_dims != 2 || t1->ne[1] < 1 || t1->ne[1] > uint64_t(F))
                fail(PI_ERR_FORMAT, p + ": tensor " + fc1 + " is not a (rank, n_embd) matrix with rank <= n_ff");
            const int64_t rank = int64_t(t1->ne[1]);
            l.fc1 = bind(fc1, rank, E, false);
            l.fc2 = bind(fc2, F, rank, false);
            if (act_is_q8(l.fc2.type) && rank > kGemv8MaxCols)
                fail(PI_ERR_FORMAT, p + ": tensor " + fc2 + " is quantized with rank " + std::to_string(rank) +
                                        " (at most " + std::to_string(kGemv8MaxCols) + ")");
        } else if (f.tensor(fc1) || f.tensor(fc2)) {
            fail(PI_ERR_FORMAT, p + ": layer " + std::to_string(i) + " has a predictor but layer 0 has none");
        }
    }
    bind_input_sparsity();
}

static_assert(Model::kInputSiteCount == names::kInputSiteCount, "input sparsity's sites, as the file orders them");

void Model::bind_input_sparsity() {
    const GgufFile &f = *file_;
    const std::string &p = f.path();
    const int64_t E = hp_.n_embd, F = hp_.n_ff, Q = hp_.n_head * hp_.d_head, KV = hp_.n_head_kv * hp_.d_head;
    const char *qkv_names[] = {names::kAttnQT, names::kAttnQkvT};
    const bool tensors = f.tensor(weight(0, qkv_names[hp_.parallel_block ? 1 : 0])) != nullptr;
    const bool keys = f.has(names::kKeyInputThresholds) || f.has(names::kKeyInputSparsityLevels);
    if (!tensors && !keys) return;
    if (hp_.n_expert > 0)
        fail(PI_ERR_UNSUPPORTED, p + ": input sparsity's thresholds and matrices are not computed for a mixture of experts");
    if (!tensors || !keys)
        fail(PI_ERR_FORMAT, p + ": input sparsity needs both its thresholds (" + names::kKeyInputThresholds + ", " +
                                names::kKeyInputSparsityLevels + ") and its transposed matrices; the file has only " +
                                (tensors ? "the matrices" : "the thresholds"));
    const GgufValue *lv = f.find(names::kKeyInputSparsityLevels);
    if (!lv || lv->type != GV_ARRAY || lv->array_count < 1 || lv->array_count > 1000)
        fail(PI_ERR_FORMAT, p + ": " + names::kKeyInputSparsityLevels + " must be an array of 1 to 1000 shares");
    input_levels_ = f.get_f32_array(names::kKeyInputSparsityLevels, lv->array_count);
    for (size_t k = 0; k < input_levels_.size(); ++k)
        if (!(input_levels_[k] > (k ? input_levels_[k - 1] : 0.0f)) || input_levels_[k] > 1.0f)
            fail(PI_ERR_FORMAT, p + ": " + names::kKeyInputSparsityLevels + " must be increasing shares in (0, 1]");
    input_table_ = f.get_f32_array(names::kKeyInputThresholds,
                                   uint64_t(input_levels_.size()) * uint64_t(hp_.n_layer) * kInputSiteCount);
    for (float t : input_table_)
        if (t < 0.0f) fail(PI_ERR_FORMAT, p + ": " + names::kKeyInputThresholds + " holds a negative value");
    auto rows = [&](const char *name, int64_t n_in, int64_t n_out, int64_t i) {
        return InputRows{bind(weight(i, name), n_in, n_out, false), 0, n_out};
    };
    for (int64_t i = 0; i < hp_.n_layer; ++i) {
        Layer &l = layers_[size_t(i)];
        if (hp_.parallel_block) {  // one matrix for falcon's fused q/k/v: each its own columns of every row
            const Matrix qkv = bind(weight(i, names::kAttnQkvT), E, Q + 2 * KV, false);
            l.q_t = {qkv, 0, Q};
            l.k_t = {qkv, Q, KV};
            l.v_t = {qkv, Q + KV, KV};
        } else {
            l.q_t = rows(names::kAttnQT, E, Q, i);
            l.k_t = rows(names::kAttnKT, E, KV, i);
            l.v_t = rows(names::kAttnVT, E, KV, i);
        }
        l.o_t = rows(names::kAttnOutputT, Q, E, i);
        if (hp_.gated) l.gate_t = rows(names::kFfnGateT, E, F, i);
        l.up_t = rows(names::kFfnUpT, E, F, i);
    }
}

void Model::bind_attention(int64_t i, Layer &l) {
    const int64_t E = hp_.n_embd, Q = hp_.n_head * hp_.d_head, KV = hp_.n_head_kv * hp_.d_head;
    const bool layer_norm = hp_.norm == NormKind::Layer, all_biases = hp_.all_biases;
    l.attn_norm = bind_vector(blk(i, "attn_norm.weight"), E, true);
    l.attn_norm_b = bind_vector(blk(i, "attn_norm.bias"), E, layer_norm);
    if (hp_.parallel_block) {
        // PowerInfer's falcon: attn_norm (ln_mlp, or the 7B's only norm) feeds the FFN; attn_norm_2
        // (ln_attn, new decoder only) feeds attention.
        l.ffn_norm = l.attn_norm;
        l.ffn_norm_b = l.attn_norm_b;
        bool has_norm_2 = false;
        const Matrix norm_2 = bind_optional(blk(i, "attn_norm_2.weight"), 1, E, true, &has_norm_2);
        if (has_norm_2) {
            l.attn_norm = norm_2;
            l.attn_norm_b = bind_vector(blk(i, "attn_norm_2.bias"), E, true);
        }
    } else {
        l.ffn_norm = bind_vector(weight(i, names::kFfnNorm), E, true);
        l.ffn_norm_b = bind_vector(bias(i, names::kFfnNorm), E, layer_norm);
    }
    // q, k and v fused in attn_qkv, q rows then k then v: falcon's always, llama.cpp's phi3 files
    if (hp_.parallel_block || file_->tensor(blk(i, "attn_qkv.weight"))) {
        const Matrix qkv = bind(blk(i, "attn_qkv.weight"), Q + 2 * KV, E, false);
        l.wq = qkv.rows_view(0, Q);
        l.wk = qkv.rows_view(Q, KV);
        l.wv = qkv.rows_view(Q + KV, KV);
        const Matrix qkv_b = bind_vector(blk(i, "attn_qkv.bias"), Q + 2 * KV, false);
        const float *b = qkv_b.floats();
        if (b) {  // the bias vector split the same way as the rows
            l.bq = qkv_b;
            l.bk = qkv_b;
            l.bk.data = reinterpret_cast<const uint8_t *>(b + Q);
            l.bv = qkv_b;
            l.bv.data = reinterpret_cast<const uint8_t *>(b + Q + KV);
        }
    } else {
        l.wq = bind(blk(i, "attn_q.weight"), Q, E, false);
        l.wk = bind(blk(i, "attn_k.weight"), KV, E, false);
        l.wv = bind(blk(i, "attn_v.weight"), KV, E, false);
        l.bq = bind_vector(blk(i, "attn_q.bias"), Q, all_biases);
        l.bk = bind_vector(blk(i, "attn_k.bias"), KV, all_biases);
        l.bv = bind_vector(blk(i, "attn_v.bias"), KV, all_biases);
    }
    const bool whole = hp_.qk_norm == QkNorm::Whole, qk_norm = hp_.qk_norm != QkNorm::None;
    l.q_norm = bind_vector(weight(i, names::kAttnQNorm), whole ? Q : hp_.d_head, qk_norm);
    l.k_norm = bind_vector(weight(i, names::kAttnKNorm), whole ? KV : hp_.d_head, qk_norm);
    if (!qk_norm && (l.q_norm.data || l.k_norm.data))
        fail(PI_ERR_UNSUPPORTED, file_->path() + ": tensor " + weight(i, l.q_norm.data ? names::kAttnQNorm : names::kAttnKNorm) +
                                     " (per-head q/k norms) is not computed for architecture " + hp_.arch);
    l.attn_post_norm = bind_vector(weight(i, names::kPostAttentionNorm), E, hp_.post_norms);
    l.ffn_post_norm = bind_vector(weight(i, names::kPostFfwNorm), E, hp_.post_norms);
    if (!hp_.post_norms && (l.attn_post_norm.data || l.ffn_post_norm.data))
        fail(PI_ERR_UNSUPPORTED, file_->path() + ": tensor " +
                                     weight(i, l.attn_post_norm.data ? names::kPostAttentionNorm : names::kPostFfwNorm) +
                                     " (a norm of a block's output) is not computed for architecture " + hp_.arch);
    l.wo = bind(blk(i, "attn_output.weight"), E, Q, false);
    l.bo = bind_vector(blk(i, "attn_output.bias"), E, all_biases);
}

void Model::bind_experts(int64_t i, Layer &l) {
    const int64_t E = hp_.n_embd, F = hp_.n_ff_exp;
    Experts &x = l.experts;
    x.n_ff = F;
    x.n_embd = E;
    x.router = bind(weight(i, names::kFfnGateInp), hp_.n_expert, E, false);
    x.gate = bind_stacked(weight(i, names::kFfnGateExps), F, E, false);
    x.up = bind_stacked(weight(i, names::kFfnUpExps), F, E, false);
    // ReLU experts read a down row per neuron whose gate passes (engine/moe.h), so their down is transposed at load
    const bool relu = hp_.activation == Activation::Relu;
    (relu ? x.down_t : x.down) = bind_stacked(weight(i, names::kFfnDownExps), E, F, relu);
    // every other FFN tensor of the layer (a dense FFN beside the experts, a shared expert, biases) would be left out
    const std::string ffn = blk(i, "ffn_");
    for (const GgufTensor &t : file_->tensors()) {
        if (t.name.compare(0, ffn.size(), ffn) != 0) continue;
        bool computed = false;
        for (const char *name : {names::kFfnNorm, names::kFfnGateInp, names::kFfnGateExps, names::kFfnUpExps,
                                 names::kFfnDownExps})
            computed = computed || t.name == weight(i, name);
        if (!computed)
            fail(PI_ERR_UNSUPPORTED, file_->path() + ": tensor " + t.name + " beside the experts of layer " +
                                         std::to_string(i) + " (a dense FFN, a shared expert, a bias) is not computed");
    }
}

void Model::bind_ffn(int64_t i, Layer &l) {
    if (hp_.n_expert > 0) return bind_experts(i, l);
    const GgufFile &f = *file_;
    const int64_t E = hp_.n_embd, F = hp_.n_ff;
    const bool all_biases = hp_.all_biases;
    // llama.cpp's phi3 files fuse gate and up in one ffn_up of 2 * n_ff rows, the gate's first
    const GgufTensor *up = f.tensor(weight(i, names::kFfnUp));
    if (hp_.gated && !f.tensor(weight(i, names::kFfnGate)) && up && up->n_dims == 2 && int64_t(up->ne[1]) == 2 * F) {
        const Matrix gate_up = bind(weight(i, names::kFfnUp), 2 * F, E, false);
        l.gate = gate_up.rows_view(0, F);
        l.up = gate_up.rows_view(F, F);
        if (f.tensor(bias(i, names::kFfnUp)))
            fail(PI_ERR_UNSUPPORTED, f.path() + ": tensor " + bias(i, names::kFfnUp) + " of a fused gate and up is not computed");
    } else {
        if (hp_.gated) {
            l.gate = bind(weight(i, names::kFfnGate), F, E, false);
            l.gate_b = bind_vector(bias(i, names::kFfnGate), F, false);
        }
        l.up = bind(weight(i, names::kFfnUp), F, E, false);
    }
    l.up_b = bind_vector(bias(i, names::kFfnUp), F, all_biases);
    if (!hp_.gated) {  // the activation rule reads up's output
        l.gate = l.up;
        l.gate_b = l.up_b;
    }
    // llama.cpp's files hold ffn_down (a row per output), transposed here into ffn_down_t (a row per neuron), or kept
    // as stored where the engine asks and dense steps can read it whole by gemm8 (q4_0/q8_0, a SiLU/GeGLU FFN, whose
    // dense steps use every neuron): docs/engine.md, "The down projection as stored"
    const GgufTensor *stored = f.tensor(weight(i, names::kFfnDown));
    const bool llama_cpp_down = !f.tensor(weight(i, names::kFfnDownT)) && stored;
    const char *down = llama_cpp_down ? names::kFfnDown : names::kFfnDownT;
    l.down_b = bind_vector(bias(i, down), E, all_biases);
    if (llama_cpp_down && down_as_stored_ && thresholded(hp_.activation) && packed_block_bytes(stored->type) != 0 &&
        F <= kGemv8MaxCols) {
        l.down = bind(weight(i, down), E, F, false);
        return;
    }
    bool found = false;
    l.down_t = bind_optional(weight(i, down), F, E, false, &found, llama_cpp_down);
    if (!found) fail(PI_ERR_FORMAT, f.path() + ": tensor " + weight(i, names::kFfnDownT) + " is missing");
}

// A file converted with a profile stores each layer's neurons hottest first and records the order
// (powerinfer_tools.neuron_order, docs/formats.md); pi-tools plan copies it into the GPU index it makes for
// the file. An index without it numbers the source order (PowerInfer's solver over a profile's activation
// files): on such a file it would mark other neurons than its author meant, so it is refused.
void Model::check_neuron_order(const GgufFile &g) const {
    static const std::string key = names::kKeyNeuronOrder;
    const GgufValue *ours = file_->find(key), *theirs = g.find(key);
    const auto text = [](const GgufValue *v) { return v && v->type == GV_STRING ? v->str : std::string(); };
    if (text(ours) == text(theirs)) return;
    const std::string &p = g.path(), &m = file_->path();
    if (!theirs)
        fail(PI_ERR_FORMAT, p + ": this GPU index numbers neurons in the model's source order, but " + m +
                                " stores them in a profile's order (" + key + "): make the index with pi-tools plan");
    fail(PI_ERR_FORMAT, p + ": this GPU index was made for a file with another neuron order (" + key + ") than " + m);
}

void Model::build_tiers(const std::string &gpuidx_path, bool hot_tier) {
    const int64_t F = hp_.n_ff, L = hp_.n_layer;
    std::vector<std::vector<uint8_t>> is_hot(size_t(L), std::vector<uint8_t>(size_t(F), 0));
    if (!gpuidx_path.empty()) {
        if (hp_.n_expert > 0)
            fail(PI_ERR_UNSUPPORTED, gpuidx_path + ": a GPU index places neurons of a dense FFN; the experts of " +
                                         file_->path() + " are not split into hot and cold neurons in this version");
        GgufFile g(gpuidx_path);
        const std::string &p = g.path();
        const std::string arch = g.get_string(names::kKeyArchitecture);
        if (arch != names::kGpuIndexArch)
            fail(PI_ERR_FORMAT, p + ": not a GPU index file (architecture '" + arch + "', expected generic.gpu_index)");
        check_neuron_order(g);
        const int64_t blocks = g.get_int(names::kKeyGpuIndexBlockCount, 0, 1 << 20);
        if (blocks != L)
            fail(PI_ERR_FORMAT, p + ": GPU index is for a model with " + std::to_string(blocks) + " layers; " +
                                    file_->path() + " has " + std::to_string(L));
        for (int64_t i = 0; i < L; ++i) {
            const std::string name = blk(i, names::kGpuIdx);
            const GgufTensor *t = g.tensor(name);
            if (!t) fail(PI_ERR_FORMAT, p + ": tensor " + name + " is missing");
            if (t->type != TYPE_I32 || t->n_dims != 1)
                fail(PI_ERR_FORMAT, p + ": tensor " + name + " must be a 1-D i32 vector");
            if (int64_t(t->ne[0]) != F)
                fail(PI_ERR_FORMAT, p + ": GPU index is for a model with n_ff " + std::to_string(t->ne[0]) + "; " +
                                        file_->path() + " has n_ff " + std::to_string(F));
            int64_t n_hot = 0;
            for (int64_t j = 0; j < F; ++j) {
                int32_t v;
                std::memcpy(&v, t->data + 4 * j, 4);
                if (v != 0 && v != 1) fail(PI_ERR_FORMAT, p + ": tensor " + name + " holds a value other than 0 and 1");
                is_hot[size_t(i)][size_t(j)] = uint8_t(v);
                n_hot += v;
            }
            const std::string bname = blk(i, names::kGpuBucket);
            if (const GgufTensor *b = g.tensor(bname)) {
                if (b->type != TYPE_I32 || b->n_dims != 1 || int64_t(b->ne[0]) != n_hot)
                    fail(PI_ERR_FORMAT, p + ": tensor " + bname + " must list the " + std::to_string(n_hot) +
                                            " neurons that " + name + " marks");
                int32_t prev = -1;
                for (int64_t k = 0; k < n_hot; ++k) {
                    int32_t v;
                    std::memcpy(&v, b->data + 4 * k, 4);
                    if (v <= prev || v >= F || !is_hot[size_t(i)][size_t(v)])
                        fail(PI_ERR_FORMAT, p + ": tensor " + bname + " is not the sorted list of " + name + "'s neurons");
                    prev = v;
                }
            }
        }
    }
    for (int64_t i = 0; i < L; ++i) {
        Layer &l = layers_[size_t(i)];
        if (l.experts.present()) continue;  // its experts are computed whole (engine/moe.h): no tiers
        for (int32_t j = 0; j < int32_t(F); ++j) (hot_tier && is_hot[size_t(i)][size_t(j)] ? l.hot : l.cold).ids.push_back(j);
        // Cold tier: rows stay in the mapping, gathered by id.
        l.cold.gate = l.gate;
        l.cold.up = l.up;
        l.cold.down_t = l.down_t;
        l.cold.packed = false;
        l.cold.fc2 = l.fc2;
        // the predictor scores the cold neurons on the host; a device's split layer scores its hot ones (its rows
        // kept for the device backend's upload)
        if (has_predictor_ && hot_tier) keep_hot_predictor(l);
        if (has_predictor_) bind_cold_predictor(l);
        // Hot tier: the same mapped views; its backend takes what it computes from (TierBackend::upload).
        l.hot.gate = l.gate;
        l.hot.up = l.up;
        l.hot.down_t = l.down_t;
        l.hot.packed = false;
    }
}

std::vector<uint8_t> gather_rows(const Matrix &m, const std::vector<int32_t> &ids) {
    std::vector<uint8_t> out(ids.size() * m.row_bytes);
    for (size_t r = 0; r < ids.size(); ++r) std::memcpy(out.data() + r * m.row_bytes, m.row(ids[r]), m.row_bytes);
    return out;
}

FfnTier packed_copy(const FfnTier &mapped, bool gated) {
    // Contiguous copies, computed whole: gate and up as 8-row groups where their type packs (and then as nothing
    // else), as rows otherwise; down_t as rows.
    FfnTier t;
    t.ids = mapped.ids;
    t.packed = true;
    const int64_t n = t.size();
    if (n == 0) return t;
    const int n_matrices = gated ? 3 : 2;  // ungated: gate is up
    const Matrix *src[3] = {&mapped.down_t, &mapped.up, &mapped.gate};
    Matrix *dst[3] = {&t.down_t, &t.up, &t.gate};
    // (ungated: the up rows are the rule's, so their groups are gate_groups)
    PageMemory *groups[3] = {nullptr, gated ? &t.up_groups : &t.gate_groups, &t.gate_groups};
    bool as_rows[3];
    size_t total = 0;
    for (int k = 0; k < n_matrices; ++k) {
        *dst[k] = *src[k];
        dst[k]->rows = n;
        dst[k]->data = nullptr;
        as_rows[k] = !groups[k] || !t.groups_fit(*src[k]);
        if (as_rows[k]) total += size_t(n) * src[k]->row_bytes;
        else *groups[k] = groups_in_pages(t, *src[k]);
    }
    t.storage.resize(total);
    uint8_t *at = t.storage.data();
    for (int k = 0; k < n_matrices; ++k) {
        if (!as_rows[k]) continue;
        dst[k]->data = at;
        for (int64_t r = 0; r < n; ++r) std::memcpy(at + size_t(r) * src[k]->row_bytes, src[k]->row(t.ids[size_t(r)]),
                                                    src[k]->row_bytes);
        at += size_t(n) * src[k]->row_bytes;
    }
    if (!gated) t.gate = t.up;
    return t;
}

int64_t Model::hot_neurons() const {
    int64_t n = 0;
    for (const Layer &l : layers_) n += l.hot.size();
    return n;
}

WeightCopies Model::weight_copies() const {
    WeightCopies c;
    c.packed = dense_ == DenseLayout::Pending ? size_t(dense_pack_bytes()) : packed_.size();
    c.decoded = decoded_.bytes();
    for (const Layer &l : layers_) {
        c.predictor += l.cold.fc2_storage.size() + l.hot.fc2_storage.size();
        c.cold_groups += l.cold.gate_groups.size() + l.cold.up_groups.size();
        c.down_quads += l.cold.down_quads.size();
        c.down_rows += dense_ == DenseLayout::Pending && l.down.data ? size_t(packed_bytes(l.down)) : l.down_groups.size();
    }
    return c;
}

int64_t Model::max_rank() const {
    int64_t r = 0;
    for (const Layer &l : layers_) r = std::max(r, l.fc1.rows);
    return r;
}

}  // namespace pi
