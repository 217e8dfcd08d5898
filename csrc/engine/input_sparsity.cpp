// Input sparsity (docs/engine.md, "Input sparsity"; TEAL, arXiv 2408.14690): every matrix's inputs at or below
// the layer's threshold for their site are zeroed. A decode step reads q4_0/q8_0 q/k/v, o and gate/up from a copy of
// the matrices' own blocks (InputColumns), and a q8_0 down projection (whose own blocks the file holds only
// transposed, along its outputs) from a copy requantized along its inputs: in the column layout, where gemv_columns
// reads only the weights of the kept inputs, or in 8-row groups for gemm8, whichever the probe found faster on this
// CPU (input_kernels.h; the same bits). Of a q4_0 down projection and of f32/f16 matrices it reads the rows of the
// transposed matrices (the file's *_t tensors, a row per input) of the kept inputs, scaled by their input, through
// rows_product, the down projection's path. A batch zeroes the same inputs and runs the dense kernels on them (its
// tokens together keep nearly every input, so nothing could be skipped).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/activation_rule.h"
#include "engine/engine.h"
#include "kernels/packed.h"
#include "runtime/common.h"
#include "runtime/usable_memory.h"

namespace pi {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

void Engine::set_input_sparsity(float share) {
    const std::vector<float> &levels = model_->input_levels();
    if (!std::isfinite(share) || share < 0.0f || share >= 1.0f)
        fail(PI_ERR_ARGUMENT, "input_sparsity must be a share in [0, 1), got " + std::to_string(share));
    if (share > 0.0f && hp_.n_expert > 0)
        fail(PI_ERR_UNSUPPORTED, "input sparsity is not computed for mixture-of-experts layers in this version");
    if (share > 0.0f && levels.empty())
        fail(PI_ERR_UNSUPPORTED, model_->path() + " has no input thresholds: convert it with a profile that has them "
                                                  "(pi-tools profile --input-allocation, then convert --profile)");
    if (share > 0.0f && share > levels.back() + 1e-6f)
        fail(PI_ERR_ARGUMENT, "input_sparsity " + std::to_string(share) + " is above the largest share calibrated (" +
                                  std::to_string(levels.back()) + ")");
    if (share > 0.0f) model_->transpose_down();  // its FFN and down site read a down row per neuron
    input_share_ = share;
    stats_.input.share = share;
    // input sparsity's own FFN reads down_t's rows: a tier arranged for dense steps before gives its quads back
    for (int64_t il = 0; input_ffn_on() && il < hp_.n_layer; ++il) {
        const FfnTier &t = model_->layers()[size_t(il)].cold;
        if (!t.down_quads.empty()) model_->arrange_cold_tier(il, !t.gate_groups.empty(), !t.up_groups.empty(), false, true);
    }
    const int64_t L = hp_.n_layer, S = Model::kInputSiteCount;
    input_thr_.assign(size_t(L * S), 0.0f);
    build_input_columns();  // made or freed as the share turns input sparsity on or off
    if (share <= 0.0f) return;
    // Linear between the two levels around the share (from 0 below the first), as InputThresholds.at in Python.
    size_t hi = 0;
    while (hi + 1 < levels.size() && share > levels[hi]) ++hi;
    const float lo_share = hi ? levels[hi - 1] : 0.0f, w = std::min(1.0f, (share - lo_share) / (levels[hi] - lo_share));
    for (int64_t il = 0; il < L; ++il)
        for (int64_t j = 0; j < S; ++j) {
            const float lo = hi ? model_->input_threshold(int64_t(hi) - 1, il, j) : 0.0f;
            input_thr_[size_t(il * S + j)] = (1.0f - w) * lo + w * model_->input_threshold(int64_t(hi), il, j);
        }
}

void Engine::allocate_input_scratch() {
    const int64_t E = hp_.n_embd, F = hp_.n_ff, Q = hp_.n_head * hp_.d_head, KV = hp_.n_head_kv * hp_.d_head;
    const int64_t n_in = std::max({E, Q, F}), n_out = std::max({E, Q + 2 * KV, F}), B = n_batch_;
    in_rows_.assign(size_t(3 * n_in), nullptr);
    in_coef_.assign(size_t(n_in), 0.0f);
    in_partials_.assign(size_t(3 * rows_partial_floats(n_in, n_out)), 0.0f);
    in_x_.assign(size_t(B * n_in), 0.0f);
    in_q_.resize(size_t(B * (n_in / QK + 1)));
    in_g_.assign(size_t(B * n_out), 0.0f);
    in_u_.assign(size_t(B * F), 0.0f);
    in_y_.assign(size_t(std::max({E, Q + 2 * KV, 2 * F}) + 2 * kColumnUnit), 0.0f);  // room for a span's padding
}

double Engine::input_scratch_bytes() const {
    if (model_->input_levels().empty()) return 0.0;
    const double E = double(hp_.n_embd), F = double(hp_.n_ff), Q = double(hp_.n_head * hp_.d_head);
    const double KV = double(hp_.n_head_kv * hp_.d_head), B = double(n_batch_);
    const double n_in = std::max({E, Q, F}), n_out = std::max({E, Q + 2 * KV, F});
    return 8 * 3 * n_in + 4 * (n_in + 3 * (n_in / double(kDownRunRows) + 2) * n_out + B * (n_in + n_out + F)) +
           B * (n_in / QK + 1) * double(sizeof(BlockQ8_0)) + 4 * (std::max({E, Q + 2 * KV, 2 * F}) + 2 * kColumnUnit);
}

std::vector<const Matrix *> Engine::input_site_matrices(const Layer &L, int site) const {
    if (site == kSiteQkv) return {&L.wq, &L.wk, &L.wv};
    if (site == kSiteO) return {&L.wo};
    return hp_.gated ? std::vector<const Matrix *>{&L.up, &L.gate} : std::vector<const Matrix *>{&L.up};
}

namespace {

// down_t (a row per input of the down projection, q8_0 blocks along the outputs) as q8_0 rows of the down projection
// itself (a row per output, blocks along the inputs): the transpose requantized per 32 inputs by pack_columns8, as a
// batch's down projection in integers does it, its 8-row groups taken apart.
std::vector<BlockQ8_0> down_rows_q8(const KernelSet &ks, const Matrix &down_t) {
    const int64_t n_in = down_t.rows, n_out = down_t.cols, nb = n_in / QK;
    std::vector<const void *> src(static_cast<size_t>(n_in));
    for (int64_t r = 0; r < n_in; ++r) src[size_t(r)] = down_t.row(r);
    const size_t bb = packed_block_bytes(TYPE_Q8_0);
    std::vector<uint8_t> groups(size_t(n_out / kPackRows * nb) * bb);
    ks.for_type(down_t.type).pack_columns8(int(n_in), src.data(), 0, int(n_out), groups.data());
    std::vector<BlockQ8_0> rows(size_t(n_out * nb));
    for (int64_t g = 0; g < n_out / kPackRows; ++g)
        for (int64_t k = 0; k < nb; ++k) {
            const uint8_t *blk = groups.data() + size_t(g * nb + k) * bb;
            for (int r = 0; r < kPackRows; ++r) {
                BlockQ8_0 &b = rows[size_t((g * kPackRows + r) * nb + k)];
                std::memcpy(&b.d, blk + 2 * r, 2);
                for (int c = 0; c < QK / 4; ++c) std::memcpy(b.qs + 4 * c, blk + 2 * kPackRows + 32 * c + 4 * r, 4);
            }
        }
    return rows;
}

}  // namespace

void Engine::build_input_columns() {
    const int64_t L = hp_.n_layer, S = Model::kInputSiteCount;
    in_cols_.resize(size_t(L * S));
    struct Job {
        InputColumns *c;
        int site;
        std::vector<const void *> rows;  // the stacked rows, or none: the down projection's, from down_t
        const Matrix *down_t;
        std::vector<const Matrix *> sources;  // the mapped matrices read, handed back once copied
    };
    std::vector<Job> jobs;
    double bytes = 0;
    for (int64_t il = 0; il < L; ++il)
        for (int site = 0; site < S; ++site) {
            InputColumns &c = in_cols_[size_t(il * S + site)];
            const Layer &layer = model_->layers()[size_t(il)];
            const bool wanted = input_on() && ((site != kSiteGateUp && site != kSiteDown) || input_ffn_on());
            if (!wanted) c = InputColumns{};
            if (!wanted || c.present()) continue;
            Job job{&c, site, {}, nullptr, {}};
            if (site == kSiteDown) {
                // q8_0 only: the copy of a q4_0 down_t would be q8_0, twice its bytes
                const Matrix &dt = layer.down_t;
                if (dt.type != TYPE_Q8_0 || !dt.data || dt.rows % QK || dt.cols % QK) continue;
                c.type = TYPE_Q8_0;
                c.n_in = dt.rows;
                c.n_out = (dt.cols + kColumnUnit - 1) / kColumnUnit * kColumnUnit;  // q8_0's span
                job.down_t = &dt;
                job.sources = {&dt};
            } else {
                const std::vector<const Matrix *> mats = input_site_matrices(layer, site);
                const uint32_t type = mats[0]->type;
                bool fits = type == TYPE_Q4_0 || type == TYPE_Q8_0;
                for (const Matrix *m : mats) {
                    fits = fits && m->type == type && m->cols == mats[0]->cols && m->data;
                    for (int64_t r = 0; fits && r < m->rows; ++r) job.rows.push_back(m->row(r));
                }
                if (!fits) continue;  // the transposed rows' path
                job.sources = mats;
                c.type = type;
                c.n_in = mats[0]->cols;
                const int64_t span = column_span(type);
                c.n_out = (int64_t(job.rows.size()) + span - 1) / span * span;
            }
            c.tile = column_tile(c.n_out);
            bytes += double(c.bytes());
            jobs.push_back(std::move(job));
        }
    if (jobs.empty()) return;
    const double limit = usable_memory_bytes(), held = process_anonymous_bytes();
    if (limit > 0 && bytes + kProcessMargin > limit - held)
        fail(PI_ERR_MEMORY, model_->path() + ": input sparsity's column copies need " +
                                std::to_string(bytes / double(1 << 30)).substr(0, 6) + " GiB, more than this process may "
                                "still take (the machine's memory or its cgroup's limit, less what it holds)");
    // each site's layout, chosen the first time the site is copied (the shapes of its first layer's copy)
    InputColumns shapes[Model::kInputSiteCount];
    for (const Job &job : jobs) {
        InputColumns &sh = shapes[job.site];
        if (sh.type) continue;
        sh.type = job.c->type;
        sh.n_in = job.c->n_in;
        sh.n_out = job.c->n_out;
        sh.tile = job.c->tile;
    }
    choose_input_layouts(shapes);
    for (Job &job : jobs) job.c->columns = in_kernels_.columns[job.site];
    auto pack = [&](int chunk, int n_chunks, int) {
        for (size_t j = size_t(chunk); j < jobs.size(); j += size_t(n_chunks)) {
            Job &job = jobs[j];
            InputColumns &c = *job.c;
            std::vector<BlockQ8_0> down;
            if (job.down_t) {
                down = down_rows_q8(*ks_, *job.down_t);
                for (int64_t o = 0; o < job.down_t->cols; ++o) job.rows.push_back(down.data() + o * (c.n_in / QK));
            }
            c.data = PageMemory(c.bytes(), true, "input sparsity's copies");
            pack_input_copy(c, int(job.rows.size()), job.rows.data(), c.data.data());
            for (const Matrix *m : job.sources) model_->release_mapped(*m);  // resident once: the copy
        }
    };
    pool_->run(int(std::min<size_t>(jobs.size(), size_t(pool_->size()))), pack);
}

void Engine::choose_input_layouts(const InputColumns *shapes) {
    const char *forced = std::getenv("PI_INPUT_KERNEL");
    if (!forced || !*forced)
        return choose_input_kernels(*ks_, *pool_, shapes, hp_.n_layer, input_share_, &in_kernels_);
    const std::string layout = forced;
    if (layout != "columns" && layout != "groups")
        fail(PI_ERR_ARGUMENT, "PI_INPUT_KERNEL must be columns or groups, got " + layout);
    for (int s = 0; s < InputKernelChoice::kSites; ++s) {
        if (!shapes[s].type) continue;
        in_kernels_.decided[s] = true;
        in_kernels_.columns[s] = layout == "columns";
    }
    in_kernels_.why = "PI_INPUT_KERNEL=" + layout;
}

int64_t Engine::column_tile(int64_t n_out) const {
    const int64_t threads = pool_->size();
    for (int64_t tile = 4 * kColumnWindow; tile > kColumnWindow; tile /= 2) {
        const int64_t n_tiles = (n_out + tile - 1) / tile, most = (n_tiles + threads - 1) / threads * tile;
        if (n_tiles >= threads && double(most) <= 1.15 * double(n_out) / double(threads)) return tile;
    }
    return kColumnWindow;
}

size_t Engine::input_columns_bytes() const {
    size_t bytes = 0;
    for (const InputColumns &c : in_cols_) bytes += c.data.size();
    return bytes;
}

void Engine::input_columns_decode(const InputColumns &c, const float *x, float t, float *out) {
    float *xz = in_x_.data();
    zero_small(x, c.n_in, 1, t, xz);
    BlockQ8_0 *q = in_q_.data();
    ks_->quantize_q8_0(int(c.n_in), xz, q);
    stats_.input.decode_bytes += double(c.bytes());
    if (c.columns) {  // gemv_columns skips the inputs whose quant is 0: zeroed, or rounded to 0
        int64_t unread = 0;
        for (int64_t k = 0; k < c.n_in / QK; ++k)
            for (int i = 0; i < QK; ++i) unread += q[k].qs[i] == 0;
        stats_.input.decode_skipped += double(unread) * double(column_piece_bytes(c.type, c.n_out));
    }
    input_copy_product(*ks_, *pool_, c, c.data.data(), q, out);
}

int64_t Engine::zero_small(const float *x, int64_t n, int64_t n_tok, float t, float *out) {
    int64_t zeroed = 0;
    for (int64_t i = 0; i < n * n_tok; ++i) {
        const bool keep = std::fabs(x[i]) > t;
        out[i] = keep ? x[i] : 0.0f;
        zeroed += !keep;
    }
    stats_.input.inputs += double(n * n_tok);
    stats_.input.zeroed += double(zeroed);
    return zeroed;
}

void Engine::input_rows_decode(const InputRows *const *mats, float *const *outs, int n_mats, const float *x, float t,
                               bool decode) {
    const int64_t n_in = mats[0]->t.rows;
    int64_t kept = 0;
    for (int64_t i = 0; i < n_in; ++i) {  // listed without branches (whether an input is kept is a coin flip)
        in_coef_[size_t(kept)] = x[i];
        for (int m = 0; m < n_mats; ++m) in_rows_[size_t(m * n_in + kept)] = mats[m]->t.row(i);
        kept += std::fabs(x[i]) > t;
    }
    RowsTarget targets[3];
    for (int m = 0; m < n_mats; ++m) {
        const Matrix &w = mats[m]->t;
        targets[m] = {w.type, mats[m]->n, in_rows_.data() + m * n_in, in_coef_.data(), kept, outs[m]};
        if (!decode) continue;
        stats_.input.decode_bytes += double(n_in) * double(w.row_bytes) * double(mats[m]->n) / double(w.cols);
        stats_.input.decode_skipped += double(n_in - kept) * double(w.row_bytes) * double(mats[m]->n) / double(w.cols);
    }
    stats_.input.inputs += double(n_in);
    stats_.input.zeroed += double(n_in - kept);
    rows_product(*ks_, *pool_, targets, n_mats, in_partials_.data());
}

// q, k and v of the layer's normed input xn (n_tok tokens), its inputs at or below the site's threshold zeroed.
void Engine::input_qkv(const Layer &L, int64_t il, int64_t n_tok) {
    RunState &s = *rs_;
    const int64_t E = hp_.n_embd, Q = hp_.n_head * hp_.d_head, KV = hp_.n_head_kv * hp_.d_head;
    const float t = input_thr(il, kSiteQkv);
    if (n_tok > 1) {
        zero_small(s.xn.data(), E, n_tok, t, in_x_.data());
        Operand in{in_x_.data(), E, in_q_.data(), false};
        const MatmulTarget qkv[3] = {{&L.wq, s.q.data(), Q}, {&L.wk, s.k.data(), KV}, {&L.wv, s.v.data(), KV}};
        matmul(qkv, 3, in, n_tok);
        return;
    }
    if (const InputColumns *c = input_columns(il, kSiteQkv)) {  // q, k and v stacked
        input_columns_decode(*c, s.xn.data(), t, in_y_.data());
        std::memcpy(s.q.data(), in_y_.data(), size_t(Q) * sizeof(float));
        std::memcpy(s.k.data(), in_y_.data() + Q, size_t(KV) * sizeof(float));
        std::memcpy(s.v.data(), in_y_.data() + Q + KV, size_t(KV) * sizeof(float));
        return;
    }
    if (L.q_t.t.data == L.k_t.t.data) {  // falcon's fused q/k/v_t: every column at once, then split
        InputRows all{L.q_t.t, 0, Q + 2 * KV};
        const InputRows *mats[1] = {&all};
        float *outs[1] = {in_g_.data()};
        input_rows_decode(mats, outs, 1, s.xn.data(), t, true);
        std::memcpy(s.q.data(), in_g_.data(), size_t(Q) * sizeof(float));
        std::memcpy(s.k.data(), in_g_.data() + Q, size_t(KV) * sizeof(float));
        std::memcpy(s.v.data(), in_g_.data() + Q + KV, size_t(KV) * sizeof(float));
        return;
    }
    const InputRows *mats[3] = {&L.q_t, &L.k_t, &L.v_t};
    float *outs[3] = {s.q.data(), s.k.data(), s.v.data()};
    input_rows_decode(mats, outs, 3, s.xn.data(), t, true);
}

// The attention output projection of att into tmp, att's inputs at or below the site's threshold zeroed.
void Engine::input_output_projection(const Layer &L, int64_t il, int64_t n_tok) {
    RunState &s = *rs_;
    const int64_t E = hp_.n_embd, Q = hp_.n_head * hp_.d_head;
    const float t = input_thr(il, kSiteO);
    if (n_tok > 1) {
        zero_small(s.att.data(), Q, n_tok, t, s.att.data());
        s.op_att.q_ready = false;
        const MatmulTarget wo[1] = {{&L.wo, s.tmp.data(), E}};
        matmul(wo, 1, s.op_att, n_tok);
        return;
    }
    if (const InputColumns *c = input_columns(il, kSiteO)) {
        input_columns_decode(*c, s.att.data(), t, in_y_.data());
        std::memcpy(s.tmp.data(), in_y_.data(), size_t(E) * sizeof(float));
        return;
    }
    const InputRows *mats[1] = {&L.o_t};
    float *outs[1] = {s.tmp.data()};
    input_rows_decode(mats, outs, 1, s.att.data(), t, true);
}

// The FFN of dense mode with input sparsity: gate and up of xn's kept inputs, the activation h over every neuron
// (the model's own: SiLU's silu(g) u, ReLU's and FATReLU's, dReLU's, an ungated FFN's relu(u + b)), then the down
// projection of h's kept values by their ffn_down_t rows, into y_cold.
void Engine::input_ffn(int64_t il, int64_t n_tok) {
    const Layer &L = model_->layers()[size_t(il)];
    RunState &s = *rs_;
    const int64_t E = hp_.n_embd, F = hp_.n_ff;
    auto t0 = Clock::now();
    const float t_in = input_thr(il, kSiteGateUp), t_down = input_thr(il, kSiteDown);
    float *g = in_g_.data(), *u = in_u_.data();  // [n_tok][F]
    if (n_tok > 1) {
        zero_small(s.xn.data(), E, n_tok, t_in, in_x_.data());
        Operand in{in_x_.data(), E, in_q_.data(), false};
        const MatmulTarget gate_up[2] = {{&L.up, u, F}, {&L.gate, g, F}};
        matmul(gate_up, hp_.gated ? 2 : 1, in, n_tok);
    } else if (const InputColumns *c = input_columns(il, kSiteGateUp)) {  // up and gate stacked
        input_columns_decode(*c, s.xn.data(), t_in, in_y_.data());
        std::memcpy(u, in_y_.data(), size_t(F) * sizeof(float));
        if (hp_.gated) std::memcpy(g, in_y_.data() + F, size_t(F) * sizeof(float));
    } else {
        const InputRows *mats[2] = {&L.up_t, &L.gate_t};
        float *outs[2] = {u, g};
        input_rows_decode(mats, outs, hp_.gated ? 2 : 1, s.xn.data(), t_in, true);
    }
    const float *gate_b = L.gate_b.floats(), *up_b = L.up_b.floats();
    float *h = in_x_.data();  // the gate/up input is used up
    for (int64_t tk = 0; tk < n_tok; ++tk) {
        float *gt = g + tk * F, *ut = u + tk * F, *ht = h + tk * F;
        if (up_b)
            for (int64_t i = 0; i < F; ++i) ut[i] += up_b[i];
        if (!hp_.gated) {  // a = relu(up x + b): an ungated FFN's bias is its up's
            for (int64_t i = 0; i < F; ++i) ht[i] = std::max(ut[i], 0.0f);
            continue;
        }
        if (gate_b)
            for (int64_t i = 0; i < F; ++i) gt[i] += gate_b[i];
        if (thresholded(hp_.activation)) {
            activate_thresholded(*ks_, hp_.activation, F, gt);  // the dense path's kernel
            for (int64_t i = 0; i < F; ++i) ht[i] = gt[i] * ut[i];
        } else if (hp_.activation == Activation::DRelu) {
            for (int64_t i = 0; i < F; ++i) ht[i] = std::max(gt[i], 0.0f) * std::max(ut[i], 0.0f);
        } else {  // ReLU, or FATReLU at the layer's threshold (0 for ReLU)
            for (int64_t i = 0; i < F; ++i) ht[i] = gt[i] > L.act_threshold ? gt[i] * ut[i] : 0.0f;
        }
    }
    stats_.times.gate_up += seconds_since(t0);
    t0 = Clock::now();
    // the down projection: a decode step's from its copy where there is one (q8_0), else one token at a time over
    // the kept rows of ffn_down_t (a batch's here too: a layer with a hot tier, Engine::ffn)
    const InputRows down{L.down_t, 0, E};
    const InputRows *mats[1] = {&down};
    if (const InputColumns *c = n_tok == 1 ? input_columns(il, kSiteDown) : nullptr) {
        input_columns_decode(*c, h, t_down, in_y_.data());
        std::memcpy(s.y_cold.data(), in_y_.data(), size_t(E) * sizeof(float));
    } else {
        for (int64_t tk = 0; tk < n_tok; ++tk) {
            float *outs[1] = {s.y_cold.data() + tk * E};
            input_rows_decode(mats, outs, 1, h + tk * F, t_down, n_tok == 1);
        }
    }
    stats_.times.down += seconds_since(t0);
    add_bias(s.y_cold.data(), L.down_b, n_tok, E);
    post_norm(s.y_cold.data(), L.ffn_post_norm, n_tok);
    add_residual(s.y_cold.data(), n_tok);
}

}  // namespace pi
