#include "engine.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <thread>

#include "common.h"
#include "packed.h"

namespace pi {
namespace {

// The least of the memory limits of the cgroup at `path` (relative to `base`) and of every cgroup above it, as
// `file` states them ("max", v2's "no limit", does not parse and leaves `limit` as it is).
double cgroup_limit(const std::string &base, std::string path, const char *file, double limit) {
    while (true) {
        std::ifstream in(base + (path == "/" ? "" : path) + "/" + file);
        double value;
        if (in >> value && value > 0) limit = std::min(limit, value);
        if (path.empty() || path == "/") return limit;
        path = path.substr(0, path.rfind('/'));
    }
}

// The memory this process may use: the machine's, or less where its cgroup (or one above it) sets a lower
// limit, a container's, which the kernel enforces by killing the process (the kernel's
// Documentation/admin-guide/cgroup-v2.rst, memory.max; cgroup-v1/memory.rst, memory.limit_in_bytes).
double usable_memory_bytes() {
    double limit = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
    std::ifstream groups("/proc/self/cgroup");
    std::string line;
    while (std::getline(groups, line)) {  // "0::/path" (v2), "4:memory:/path" or "4:cpu,memory:/path" (v1)
        const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",", path = line.substr(b + 1);
        if (controllers == ",,")
            limit = cgroup_limit("/sys/fs/cgroup", path, "memory.max", limit);
        else if (controllers.find(",memory,") != std::string::npos)
            limit = cgroup_limit("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", limit);
    }
    return limit;
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Columns per thread in axpy work: a multiple of the block so slices start on block boundaries.
int64_t column_align(uint32_t type) { return type_size(type).block == 1 ? 16 : QK; }

const uint8_t *column_slice(const uint8_t *row, uint32_t type, int64_t c0) {
    const TypeSize ts = type_size(type);
    return row + size_t(c0 / ts.block) * ts.bytes;
}


// Asks for the first rows of a list gathered by index a little before dot_rows reads them (the kernel
// prefetches further rows itself as it goes): into L2 (prefetch_row), as the kernel does.
const int kListAhead = 32;

// A layer's densities as auto mode keeps them: a moving average over tokens, 0.2 a token, so that n tokens weigh as
// n steps; where the average has not `started`, the value replaces its starting guess.
void take_into_average(double &average, double value, int64_t n_tokens, bool started) {
    const double a = 1.0 - std::pow(0.8, double(n_tokens));
    average = started ? (1 - a) * average + a * value : value;
}

// v when keep, else +0, by masking its bits: at moderate sparsity `keep` is a coin flip, and a branch
// on it (what compilers make of `keep ? v : 0`) mispredicts half the time.
float keep_if(bool keep, float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits &= 0u - uint32_t(keep);
    std::memcpy(&v, &bits, 4);
    return v;
}

bool reads_gate_whole(TierMode m) { return m == TierMode::Dense || m == TierMode::DenseRule || m == TierMode::Gate; }
bool reads_up_whole(TierMode m) { return m == TierMode::Dense || m == TierMode::DenseRule; }

const int64_t kDefaultCtx = 4096;
const int64_t kGrain = 1 << 16;     // multiply-adds below which a chunk is not worth handing to another thread
const int64_t kCacheReadCost = 16;  // multiply-adds a float read from the KV cache is worth (it misses the caches)
const int64_t kRowDotCost = 8;      // the same for a multiply-add of an f32/f16 row (no packed groups)
const double kBatchRowDot = 2.5;     // a batch's row dotted for one token by dot_rows, in gemm8 row-tokens (pp512)
// The price of changing a layer's decode kernels, per byte of gate/up matrix whose layout changes, in streamed bytes
// (the unit of choose_cold_mode's costs): grouping copies the rows into fresh pages (~2 GB/s: set_ffn_mode
// regroups 28.5 MiB in 14 ms, where a gemm8 streams a byte in ~21 ps); ungrouping unmaps the groups, and the next
// steps fault the mapped rows back in.
const double kGroupPrice = 25.0, kUngroupPrice = 5.0;
const int64_t kDefaultBatch = 64;
const int64_t kGroupsPerPass = 16;  // packed 8-row groups per pass over a batch's tokens (~40 KB at n_embd 576, q4_0)
const int64_t kDecodeGroupsPerPass = 64;  // the same for one token: nothing to reuse across tokens, longer lists
static_assert(kDecodeGroupsPerPass >= kGroupsPerPass, "gate_up_grouped's lists are sized for the longer pass");
// A thread's scratch for a batch pass's gate and up groups packed from rows (q8_0, the widest type that packs).
double pack_scratch_bytes(double n_embd) { return 2 * double(kGroupsPerPass) * (n_embd / QK) * double(packed_block_bytes(TYPE_Q8_0)); }
const int64_t kDownRows = 256;      // down_t rows per run of a decode step's down projection
const int64_t kPanelRows = 128;     // down_t rows widened per panel of a batch's down projection
const int64_t kPanelTokens = 64;    // tokens per gemm_f32 call over a panel
const int64_t kGatherRows = 64;     // selected rows per pass of the gathered gate/up path
const int64_t kDecodeGatherRows = 256;  // the same for one token: longer lists
static_assert(kDecodeGatherRows >= kGatherRows, "gate_up_gathered's lists are sized for the longer pass");
const int64_t kAttnTile = 64;       // tokens of a batch whose attention scores are computed together
const int64_t kPredictorProbeTokens = 16;  // a batch's last tokens auto mode scores the predictor for (measure_predictor)
const int64_t kHeadsPerTile = 4;    // query heads of a kv head whose outputs one gemm computes (its token tile)
const int64_t kKeyTile = 64;        // cached positions per tile of a kv head's keys ([d_head][kKeyTile] floats)

}  // namespace

const char *tier_mode_name(TierMode m) {
    switch (m) {
        case TierMode::Dense: return "dense";
        case TierMode::DenseRule: return "dense_rule";
        case TierMode::Gate: return "gate";
        case TierMode::Predictor: return "predictor";
        case TierMode::Oracle: return "oracle";
    }
    return "?";
}

namespace {

// The thread count asked for (0 or less: all cores), checked.
int thread_count(int requested) {
    if (requested > 256) fail(PI_ERR_ARGUMENT, "threads must be at most 256");
    return requested > 0 ? requested : int(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

Engine::Engine(const std::string &path, const pi_options &opts)
    : model_(std::make_unique<Model>(path, opts.gpuidx_path ? opts.gpuidx_path : "", thread_count(opts.threads))),
      hp_(model_->hp()),
      sampler_(model_->hp().n_vocab) {
    ks_ = kernels_named(opts.isa);
    if (!ks_) fail(PI_ERR_UNSUPPORTED, std::string("kernel set '") + opts.isa + "' is not available on this CPU/build");
    const int threads = thread_count(opts.threads);
    n_ctx_ = opts.ctx_size > 0 ? opts.ctx_size : std::min(hp_.n_ctx_train, kDefaultCtx);
    if (n_ctx_ > (int64_t(1) << 20)) fail(PI_ERR_ARGUMENT, "ctx_size is too large");
    if (hp_.learned_pos) n_ctx_ = std::min(n_ctx_, hp_.n_ctx_train);  // no position beyond the learned table
    n_batch_ = opts.batch_size > 0 ? std::min<int64_t>(opts.batch_size, 4096) : kDefaultBatch;
    n_batch_ = std::min(n_batch_, n_ctx_);
    recall_check_ = opts.recall_check != 0;
    if (opts.kv_type != PI_KV_F32 && opts.kv_type != PI_KV_F16) fail(PI_ERR_ARGUMENT, "unknown KV cache type " + std::to_string(opts.kv_type));
    kv_f16_ = opts.kv_type == PI_KV_F16;
    set_ffn_mode(opts.ffn_mode);

    const int64_t E = hp_.n_embd, F = hp_.n_ff, L = hp_.n_layer, B = n_batch_;
    const int64_t Q = hp_.n_head * hp_.d_head, KV = hp_.n_head_kv * hp_.d_head, R = std::max<int64_t>(model_->max_rank(), 1);
    check_working_memory(threads);
    k_cache_ = PageMemory(size_t(L * key_slots() * KV * kv_bytes()), true, "the KV cache");
    v_cache_ = PageMemory(size_t(L * n_ctx_ * KV * kv_bytes()), true, "the KV cache");
    history_.assign(size_t(n_ctx_), 0);

    const int64_t half = hp_.n_rot / 2;
    rope_cos_.resize(size_t(n_ctx_ * half));
    rope_sin_.resize(size_t(n_ctx_ * half));
    for (int64_t i = 0; i < half; ++i) {
        // float32 steps, as transformers builds inv_freq and the angles
        const float inv = 1.0f / std::pow(hp_.rope_base, float(2 * i) / float(hp_.n_rot));
        for (int64_t p = 0; p < n_ctx_; ++p) {
            const float angle = (float(p) * hp_.rope_freq_scale) * inv;
            rope_cos_[size_t(p * half + i)] = float(std::cos(double(angle)));
            rope_sin_[size_t(p * half + i)] = float(std::sin(double(angle)));
        }
    }

    for (std::vector<float> *b : {&x_, &xn_, &tmp_, &y_hot_, &y_cold_}) b->assign(size_t(B * E), 0.0f);
    q_.assign(size_t(B * Q), 0.0f);
    att_.assign(size_t(B * Q), 0.0f);
    k_.assign(size_t(B * KV), 0.0f);
    v_.assign(size_t(B * KV), 0.0f);
    g_.assign(size_t(B * (F + kPackRows)), 0.0f);
    u_.assign(size_t(B * (F + kPackRows)), 0.0f);
    h_.assign(size_t(B * F), 0.0f);
    hid_.assign(size_t(B * R), 0.0f);
    last_logits_.assign(size_t(hp_.n_vocab), 0.0f);
    mask_.assign(size_t(B * F), 0);
    truth_.assign(size_t(B * F), 0);
    selected_.assign(size_t(B * F), 0);
    every_neuron_.assign(size_t(F), 1);
    rows_.assign(size_t(F), 0);
    down_rows_.assign(size_t(F), nullptr);
    down_coef_.assign(size_t(F), 0.0f);
    down_partial_.assign(size_t((F + kDownRows - 1) / kDownRows * E), 0.0f);
    q_x_.resize(size_t(B * (E / QK)));
    q_xn_.resize(size_t(B * (E / QK)));
    q_att_.resize(size_t(B * (Q / QK)));
    q_hid_.resize(size_t(B * (R / QK)));
    op_x_ = {x_.data(), E, q_x_.data(), false};
    op_xn_ = {xn_.data(), E, q_xn_.data(), false};
    op_att_ = {att_.data(), Q, q_att_.data(), false};
    op_hid_ = {hid_.data(), R, q_hid_.data(), false};

    pool_ = std::make_unique<ThreadPool>(threads);
    chunk_lists_.assign(size_t(pool_->size()), ChunkList{});
    scores_.assign(size_t(std::max<int64_t>(threads * kAttnTile, hp_.n_head) * n_ctx_), 0.0f);
    panel_w_.assign(size_t(threads * kPanelRows * E), 0.0f);
    panel_h_.assign(size_t(threads * kPanelTokens * kPanelRows), 0.0f);
    zero_row_.assign(size_t(E / QK) * sizeof(BlockQ8_0), 0);  // the widest row that packs
    pack_scratch_bytes_ = size_t(pack_scratch_bytes(double(E)));
    pack_scratch_.assign(size_t(threads) * pack_scratch_bytes_, 0);
    ema_active_.assign(size_t(L), 1.0);
    ema_predicted_.assign(size_t(L), 1.0);
    ema_predicted_active_.assign(size_t(L), 1.0);
    predicted_seen_.assign(size_t(L), false);
    decode_mode_.assign(size_t(L), std::nullopt);
    switch_regret_.assign(size_t(L), 0.0);
    stats_.assign(size_t(L), LayerStats{});
}

int64_t Engine::key_slots() const { return (n_ctx_ + kKeyTile - 1) / kKeyTile * kKeyTile; }

double Engine::work_buffer_bytes(int64_t threads) const {
    const double E = double(hp_.n_embd), F = double(hp_.n_ff), L = double(hp_.n_layer), B = double(n_batch_);
    const double Q = double(hp_.n_head * hp_.d_head), KV = double(hp_.n_head_kv * hp_.d_head);
    const double R = double(std::max<int64_t>(model_->max_rank(), 1)), C = double(n_ctx_), T = double(threads);
    const double floats = C * double(hp_.n_rot) + B * (5 * E + 2 * Q + 2 * KV + 3 * F + 16 + R) +
                          (F / double(kDownRows) + 1) * E + double(hp_.n_vocab) +
                          std::max(T * double(kAttnTile), double(hp_.n_head)) * C +
                          T * double(kPanelRows) * (E + double(kPanelTokens));
    return 4 * floats + C * 4 + B * F * 3 + F * 9 + L * 32 + T * pack_scratch_bytes(E) + E / QK * double(sizeof(BlockQ8_0));
}

double Engine::kv_cache_bytes() const {
    return double(hp_.n_layer) * double(key_slots() + n_ctx_) * double(hp_.n_head_kv * hp_.d_head) * double(kv_bytes());
}

void Engine::check_working_memory(int64_t threads) const {
    // Refused before allocating when the buffers exceed the machine's memory, so a file that declares a huge
    // model fails with a message instead of an out-of-memory kill.
    const double bytes = kv_cache_bytes() + work_buffer_bytes(threads);
    const double available = usable_memory_bytes();
    if (available > 0 && bytes > available)
        fail(PI_ERR_MEMORY, model_->path() + ": the KV cache and work buffers would need " +
                                std::to_string(bytes / double(1 << 30)).substr(0, 8) + " GiB for ctx_size " +
                                std::to_string(n_ctx_) + ", more than the " +
                                std::to_string(available / double(1 << 30)).substr(0, 8) +
                                " GiB this process may use (the machine's memory or its cgroup's limit); lower ctx_size");
}

void Engine::set_ffn_mode(int32_t mode) {
    if (mode < PI_FFN_DENSE || mode > PI_FFN_ORACLE) fail(PI_ERR_ARGUMENT, "unknown FFN mode " + std::to_string(mode));
    if (mode == PI_FFN_PREDICTOR && !model_->has_predictor())
        fail(PI_ERR_ARGUMENT, model_->path() + " has no predictors: predictor mode needs a file converted with --predictors");
    mode_ = mode;
    // A switch arranges every layer for the new mode's decode steps now (at the densities measured so far): its
    // regrouping is paid here, not by the first token after it. At load there is no layer state yet
    // (decode_mode_ is empty) and the first steps arrange the layers.
    for (size_t il = 0; il < decode_mode_.size(); ++il) {
        decode_mode_[il] = std::nullopt;
        switch_regret_[il] = 0.0;
        const TierMode m = choose_cold_mode(int64_t(il), 1);
        model_->arrange_cold_tier(int64_t(il), reads_gate_whole(m), reads_up_whole(m), true);
    }
}

void Engine::truncate(int32_t n_keep) {
    if (n_keep < 0 || n_keep > n_past_) fail(PI_ERR_ARGUMENT, "cannot keep " + std::to_string(n_keep) + " of " +
                                                                  std::to_string(n_past_) + " cached tokens");
    n_past_ = n_keep;
}

void Engine::prepare(Operand &x, int64_t n_tok, uint32_t type) {
    if (!act_is_q8(type) || x.q_ready) return;
    for (int64_t t = 0; t < n_tok; ++t) ks_->quantize_q8_0(int(x.n), x.f + t * x.n, x.q + t * (x.n / QK));
    x.q_ready = true;
}

void Engine::matmul(const Matrix &W, Operand &x, int64_t n_tok, float *out, int64_t ldo) {
    const MatmulTarget one[1] = {{&W, out, ldo}};
    matmul(one, 1, x, n_tok);
}

// Several matrices against one operand in a single pool job (q, k and v): their rows are split as one
// range, so the threads synchronise once instead of once per matrix.
void Engine::matmul(const MatmulTarget *targets, int n_targets, Operand &x, int64_t n_tok) {
    int64_t total = 0, work = 0;
    for (int i = 0; i < n_targets; ++i) {
        prepare(x, n_tok, targets[i].W->type);
        total += targets[i].W->rows;
        // rows without packed groups (f32/f16: the predictor's fc1, float models) go through dot4 at several
        // times the cost of a packed multiply-add and wait on memory: they count kRowDotCost each
        work += targets[i].W->rows * targets[i].W->cols * n_tok * (targets[i].W->groups ? 1 : kRowDotCost);
    }
    // Rows one at a time (4 per pass over each token's operand): rows outside the packed groups.
    auto single_rows = [&](const MatmulTarget &tg, int64_t r0, int64_t r1) {
        const Matrix &W = *tg.W;
        const TypeKernels &k = ks_->for_type(W.type);
        const int n = int(W.cols);
        float *out = tg.out;
        const int64_t ldo = tg.ldo;
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) {
            const void *rows[4] = {W.row(r), W.row(r + 1), W.row(r + 2), W.row(r + 3)};
            float o[4];
            for (int64_t t = 0; t < n_tok; ++t) {
                k.dot4(n, rows, x.at(t, W.type), o);
                for (int j = 0; j < 4; ++j) out[t * ldo + r + j] = o[j];
            }
        }
        for (; r < r1; ++r) {
            const uint8_t *row = W.row(r);
            for (int64_t t = 0; t < n_tok; ++t) out[t * ldo + r] = k.dot(n, row, x.at(t, W.type));
        }
    };
    // Whole packed groups: a few at a time for every token, so a batch reuses them from cache.
    auto packed_groups = [&](const MatmulTarget &tg, int64_t g0, int64_t g1) {
        const Matrix &W = *tg.W;
        const TypeKernels &k = ks_->for_type(W.type);
        const int64_t group_bytes = W.group_bytes();
        const int64_t per_pass = n_tok == 1 ? kDecodeGroupsPerPass : kGroupsPerPass;
        for (int64_t g = g0; g < g1; g += per_pass) {
            const int ng = int(std::min<int64_t>(per_pass, g1 - g));
            k.gemm8(int(W.cols), ng, W.groups + g * group_bytes, int(n_tok), x.at(0, W.type), x.stride(W.type),
                    tg.out + g * kPackRows, tg.ldo);
        }
    };
    auto rows_of = [&](const MatmulTarget &tg, int64_t r0, int64_t r1) {
        const int64_t packed_end = tg.W->n_groups * kPackRows;
        const int64_t a = std::min(r1, (r0 + kPackRows - 1) / kPackRows * kPackRows);
        const int64_t b = std::max(a, std::min(packed_end, r1 / kPackRows * kPackRows));
        if (!tg.W->groups || a >= b) return single_rows(tg, r0, r1);
        single_rows(tg, r0, a);
        packed_groups(tg, a / kPackRows, b / kPackRows);
        single_rows(tg, b, r1);
    };
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t g0, g1;
        split_range(total, chunk, n_chunks, &g0, &g1, kPackRows);  // on group boundaries where rows allow
        int64_t base = 0;
        for (int i = 0; i < n_targets && g0 < g1; ++i) {
            const int64_t rows = targets[i].W->rows;
            const int64_t r0 = std::max<int64_t>(g0 - base, 0), r1 = std::min<int64_t>(g1 - base, rows);
            if (r0 < r1) rows_of(targets[i], r0, r1);
            base += rows;
        }
    };
    pool_->run(pool_->chunks_for(work, kGrain), job);
}

void Engine::norm(const float *x, const Matrix &w, const Matrix &b, int64_t n_tok, float *out) const {
    const int64_t E = hp_.n_embd;
    const float *wv = w.floats(), *bv = b.floats();
    for (int64_t t = 0; t < n_tok; ++t) {
        const float *xt = x + t * E;
        float *ot = out + t * E;
        if (hp_.norm == NormKind::Rms) {
            double ss = 0.0;
            for (int64_t i = 0; i < E; ++i) ss += double(xt[i]) * double(xt[i]);
            const float scale = 1.0f / std::sqrt(float(ss / double(E)) + hp_.norm_eps);
            for (int64_t i = 0; i < E; ++i) ot[i] = wv[i] * (xt[i] * scale);
        } else {  // LayerNorm: (x - mean) / sqrt(var + eps) * w + b
            double sum = 0.0;
            for (int64_t i = 0; i < E; ++i) sum += double(xt[i]);
            const double mean = sum / double(E);
            double ss = 0.0;
            for (int64_t i = 0; i < E; ++i) ss += (double(xt[i]) - mean) * (double(xt[i]) - mean);
            const float scale = 1.0f / std::sqrt(float(ss / double(E)) + hp_.norm_eps);
            for (int64_t i = 0; i < E; ++i) ot[i] = wv[i] * (float(double(xt[i]) - mean) * scale) + (bv ? bv[i] : 0.0f);
        }
    }
}

void Engine::add_bias(float *y, const Matrix &b, int64_t n_tok, int64_t ld) const {
    const float *bv = b.floats();
    if (!bv) return;
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t i = 0; i < b.cols; ++i) y[t * ld + i] += bv[i];
}

void Engine::eval(const int32_t *tokens, int32_t n, float *logits, bool all_logits) {
    if (n <= 0) fail(PI_ERR_ARGUMENT, "eval needs at least one token");
    if (!tokens) fail(PI_ERR_ARGUMENT, "tokens is NULL");
    if (n_past_ + n > n_ctx_)
        fail(PI_ERR_ARGUMENT, "context full: " + std::to_string(n_past_) + " cached + " + std::to_string(n) +
                                  " new tokens exceed ctx_size " + std::to_string(n_ctx_));
    for (int32_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= hp_.n_vocab)
            fail(PI_ERR_ARGUMENT, "token id " + std::to_string(tokens[i]) + " is outside the vocabulary (0.." +
                                      std::to_string(hp_.n_vocab - 1) + ")");
    const auto t0 = Clock::now();
    for (int64_t done = 0; done < n;) {
        const int64_t chunk = std::min<int64_t>(n_batch_, n - done);
        const bool last = done + chunk == n;
        float *out = nullptr;
        if (all_logits && logits) out = logits + done * hp_.n_vocab;
        forward(tokens + done, chunk, out, hp_.n_vocab, all_logits || last);
        done += chunk;
    }
    if (logits && !all_logits) std::memcpy(logits, last_logits_.data(), size_t(hp_.n_vocab) * sizeof(float));
    const double dt = seconds_since(t0);
    if (n == 1) {
        decode_tokens_ += 1;
        decode_seconds_ += dt;
    } else {
        batch_tokens_ += n;
        batch_seconds_ += dt;
    }
}

void Engine::forward(const int32_t *tokens, int64_t n_tok, float *logits, int64_t ld_logits, bool want_logits) {
    const int64_t E = hp_.n_embd, V = hp_.n_vocab;
    auto t0 = Clock::now();
    const TypeKernels &ke = ks_->for_type(model_->tok_embd().type);
    for (int64_t t = 0; t < n_tok; ++t) ke.to_float(int(E), model_->tok_embd().row(tokens[t]), x_.data() + t * E);
    if (hp_.learned_pos) {
        const Matrix &pe = model_->pos_embd();
        const TypeKernels &kp = ks_->for_type(pe.type);
        for (int64_t t = 0; t < n_tok; ++t) {
            kp.to_float(int(E), pe.row(n_past_ + t + hp_.pos_offset), tmp_.data());
            for (int64_t i = 0; i < E; ++i) x_[size_t(t * E + i)] += tmp_[size_t(i)];
        }
    }
    times_.embed += seconds_since(t0);

    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        // attention's output lands in tmp_; a parallel block adds it after the FFN has read the layer input
        t0 = Clock::now();
        const TierMode cold_mode = choose_cold_mode(il, n_tok);  // attention leaves what it reads unchanged
        attention(il, n_tok, cold_mode);
        if (!hp_.parallel_block) add_residual(tmp_.data(), n_tok);
        times_.attention += seconds_since(t0);
        ffn(il, n_tok, cold_mode);
        if (hp_.parallel_block) add_residual(tmp_.data(), n_tok);
    }
    for (int64_t t = 0; t < n_tok; ++t) history_[size_t(n_past_ + t)] = tokens[t];
    n_past_ += n_tok;

    if (!want_logits) return;
    t0 = Clock::now();
    // Only the rows whose logits are wanted go through the head: all of them, or the last one.
    const int64_t first = logits ? 0 : n_tok - 1;
    norm(x_.data() + first * E, model_->output_norm(), model_->output_norm_b(), n_tok - first, xn_.data());
    op_xn_.q_ready = false;
    float *out = logits ? logits : last_logits_.data();
    matmul(model_->output(), op_xn_, n_tok - first, out, ld_logits);
    if (logits) std::memcpy(last_logits_.data(), logits + (n_tok - 1) * ld_logits, size_t(V) * sizeof(float));
    times_.output += seconds_since(t0);
}

void Engine::attention(int64_t il, int64_t n_tok, TierMode cold_mode) {
    const Layer &L = model_->layers()[size_t(il)];
    const int64_t E = hp_.n_embd, D = hp_.d_head, H = hp_.n_head, HKV = hp_.n_head_kv;
    const int64_t Q = H * D, KV = HKV * D, half = hp_.n_rot / 2;
    norm(x_.data(), L.attn_norm, L.attn_norm_b, n_tok, xn_.data());
    op_xn_.q_ready = false;
    const MatmulTarget qkv[3] = {{&L.wq, q_.data(), Q}, {&L.wk, k_.data(), KV}, {&L.wv, v_.data(), KV}};
    matmul(qkv, 3, op_xn_, n_tok);
    add_bias(q_.data(), L.bq, n_tok, Q);
    add_bias(k_.data(), L.bk, n_tok, KV);
    add_bias(v_.data(), L.bv, n_tok, KV);

    // RoPE on the first n_rot dims of each head: llama.cpp "normal" mode rotates adjacent pairs (the
    // converter permuted llama's q/k rows to match), NeoX mode (falcon) pairs i with i + n_rot/2.
    const bool neox = hp_.rope == RopeKind::NeoX;
    auto rope = [&](float *vec, int64_t n_heads, int64_t pos) {
        if (hp_.rope == RopeKind::None) return;
        const float *c = rope_cos_.data() + pos * half, *s = rope_sin_.data() + pos * half;
        for (int64_t h = 0; h < n_heads; ++h) {
            float *v = vec + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                const float x0 = v[i0], x1 = v[i1];
                v[i0] = x0 * c[i] - x1 * s[i];
                v[i1] = x0 * s[i] + x1 * c[i];
            }
        }
    };
    // The layer's cache, one kv head after the other, so that a head's keys and values are each one stream:
    // keys in tiles of kKeyTile positions, each tile [D][kKeyTile] (a query's scores over a tile are a gemm
    // over contiguous rows), values [position][D].
    const int64_t key_slots = this->key_slots();
    uint8_t *kc = k_cache_.data() + il * key_slots * KV * kv_bytes(), *vc = v_cache_.data() + il * n_ctx_ * KV * kv_bytes();
    // element i of a layer's cache set to v (rounded to the nearest half in an f16 cache)
    auto put = [&](uint8_t *cache, int64_t i, float v) {
        if (kv_f16_) reinterpret_cast<uint16_t *>(cache)[i] = f32_to_f16(v);
        else reinterpret_cast<float *>(cache)[i] = v;
    };
    for (int64_t t = 0; t < n_tok; ++t) {
        const int64_t pos = n_past_ + t, tile = pos / kKeyTile, col = pos % kKeyTile;
        rope(q_.data() + t * Q, H, pos);
        rope(k_.data() + t * KV, HKV, pos);
        for (int64_t kvh = 0; kvh < HKV; ++kvh) {
            const float *k = k_.data() + t * KV + kvh * D, *v = v_.data() + t * KV + kvh * D;
            const int64_t kt = kvh * key_slots * D + tile * D * kKeyTile + col, vt = (kvh * n_ctx_ + pos) * D;
            for (int64_t d = 0; d < D; ++d) {
                put(kc, kt + d * kKeyTile, k[d]);
                put(vc, vt + d, v[d]);
            }
        }
    }

    // The predictor's weights come from DRAM every step (too little to stream at speed once the FFN asks
    // for them); asked for now, they arrive while the heads read the KV cache.
    if (n_tok == 1 && cold_mode == TierMode::Predictor) prefetch_predictor(L);
    if (n_tok == 1) decode_heads(kc, vc, n_past_ + 1);
    else batch_heads(kc, vc, n_tok);
    op_att_.q_ready = false;
    matmul(L.wo, op_att_, n_tok, tmp_.data(), E);
    add_bias(tmp_.data(), L.bo, n_tok, E);
}

void Engine::gemm_cache(int n_tok, int n_rows, int n_cols, const float *h, int ldh, const uint8_t *cache, int64_t at,
                        int ldw, float *y, int ldy) const {
    if (kv_f16_) ks_->gemm_f16(n_tok, n_rows, n_cols, h, ldh, reinterpret_cast<const uint16_t *>(cache) + at, ldw, y, ldy);
    else ks_->gemm_f32(n_tok, n_rows, n_cols, h, ldh, reinterpret_cast<const float *>(cache) + at, ldw, y, ldy);
}

void Engine::batch_heads(const uint8_t *kc, const uint8_t *vc, int64_t n_tok) {
    // Per query head and tile of kAttnTile tokens, two gemms: scores = q K^T over the keys the tile's last token
    // sees (earlier tokens' later keys get probability 0), out = p V.
    const int64_t D = hp_.d_head, H = hp_.n_head, HKV = hp_.n_head_kv, group = H / HKV, Q = H * D;
    const int64_t key_slots = this->key_slots(), n_tiles = (n_tok + kAttnTile - 1) / kAttnTile, n_all = n_past_ + n_tok;
    const float scale = 1.0f / std::sqrt(float(D));
    auto job = [&](int chunk, int n_chunks, int thread) {
        float *sc = scores_.data() + int64_t(thread) * kAttnTile * n_ctx_;
        int64_t w0, w1;
        split_range(n_tiles * H, chunk, n_chunks, &w0, &w1);
        for (int64_t w = w0; w < w1; ++w) {
            const int64_t t0 = w / H * kAttnTile, h = w % H, kvh = h / group;
            const int64_t nt = std::min(kAttnTile, n_tok - t0), n_keys = n_past_ + t0 + nt;
            std::fill(sc, sc + nt * n_keys, 0.0f);
            for (int64_t c = 0; c < n_keys; c += kKeyTile)
                gemm_cache(int(nt), int(D), int(std::min(kKeyTile, n_keys - c)), q_.data() + t0 * Q + h * D, int(Q), kc,
                           (kvh * key_slots + c) * D, int(kKeyTile), sc + c, int(n_keys));
            for (int64_t t = 0; t < nt; ++t) {  // softmax over the keys token t sees, 0 for the later ones
                const int64_t n_valid = n_past_ + t0 + t + 1;
                ks_->softmax(int(n_valid), scale, sc + t * n_keys);
                std::fill(sc + t * n_keys + n_valid, sc + (t + 1) * n_keys, 0.0f);
            }
            float *out = att_.data() + t0 * Q + h * D;
            for (int64_t t = 0; t < nt; ++t) std::fill(out + t * Q, out + t * Q + D, 0.0f);
            gemm_cache(int(nt), int(n_keys), int(D), sc, int(n_keys), vc, kvh * n_ctx_ * D, int(D), out, int(Q));
        }
    };
    // A head's keys and values come from the cache (memory-bound, not multiply-bound): its work is counted as
    // kCacheReadCost multiply-adds per float read.
    pool_->run(int(std::min<int64_t>(n_tiles * H, pool_->chunks_for(n_tok * H * n_all * D * 2 * kCacheReadCost, kGrain))), job);
}

void Engine::decode_heads(const uint8_t *kc, const uint8_t *vc, int64_t n_keys) {
    // The query heads that share a kv head read its keys and values once, as the rows of one gemm (up to
    // kHeadsPerTile of them), in three jobs: the scores by (kv head, key tile), so that any head counts split
    // evenly; each head's softmax; the outputs by (kv head, tile of its heads). The same fma chains, so the
    // same bits, as one head at a time.
    const int64_t D = hp_.d_head, H = hp_.n_head, HKV = hp_.n_head_kv, group = H / HKV;
    const int64_t key_slots = this->key_slots(), n_key_tiles = (n_keys + kKeyTile - 1) / kKeyTile;
    const int64_t n_head_tiles = (group + kHeadsPerTile - 1) / kHeadsPerTile;
    float *sc = scores_.data();  // [head][n_keys]
    const float scale = 1.0f / std::sqrt(float(D));
    const int64_t reads = H * n_keys * D * kCacheReadCost;  // the keys, or the values
    auto scores = [&](int chunk, int n_chunks, int) {
        int64_t u0, u1;
        split_range(HKV * n_key_tiles, chunk, n_chunks, &u0, &u1);
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t kvh = u / n_key_tiles, c = u % n_key_tiles * kKeyTile, cols = std::min(kKeyTile, n_keys - c);
            float *y = sc + kvh * group * n_keys + c;
            for (int64_t i = 0; i < group; ++i) std::fill(y + i * n_keys, y + i * n_keys + cols, 0.0f);
            gemm_cache(int(group), int(D), int(cols), q_.data() + kvh * group * D, int(D), kc, (kvh * key_slots + c) * D,
                       int(kKeyTile), y, int(n_keys));
        }
    };
    pool_->run(int(std::min<int64_t>(HKV * n_key_tiles, pool_->chunks_for(reads, kGrain))), scores);
    auto softmax = [&](int chunk, int n_chunks, int) {
        int64_t h0, h1;
        split_range(H, chunk, n_chunks, &h0, &h1);
        for (int64_t h = h0; h < h1; ++h) ks_->softmax(int(n_keys), scale, sc + h * n_keys);
    };
    pool_->run(int(std::min<int64_t>(H, pool_->chunks_for(H * n_keys * kCacheReadCost, kGrain))), softmax);
    auto values = [&](int chunk, int n_chunks, int) {
        int64_t u0, u1;
        split_range(HKV * n_head_tiles, chunk, n_chunks, &u0, &u1);
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t kvh = u / n_head_tiles, h0 = kvh * group + u % n_head_tiles * kHeadsPerTile;
            const int64_t nh = std::min(kHeadsPerTile, (kvh + 1) * group - h0);
            float *out = att_.data() + h0 * D;
            std::fill(out, out + nh * D, 0.0f);
            gemm_cache(int(nh), int(n_keys), int(D), sc + h0 * n_keys, int(n_keys), vc, kvh * n_ctx_ * D, int(D), out,
                       int(D));
        }
    };
    pool_->run(int(std::min<int64_t>(HKV * n_head_tiles, pool_->chunks_for(reads, kGrain))), values);
}

void Engine::add_residual(const float *y, int64_t n_tok) {
    for (int64_t i = 0; i < n_tok * hp_.n_embd; ++i) x_[size_t(i)] += y[i];
}

bool Engine::auto_may_predict(int64_t il) const {
    return mode_ == PI_FFN_AUTO && model_->has_predictor() && model_->layers()[size_t(il)].predictor_useful;
}

TierMode Engine::choose_cold_mode(int64_t il, int64_t n_tok) {
    switch (mode_) {
        case PI_FFN_DENSE: return TierMode::Dense;
        case PI_FFN_PREDICTOR: return TierMode::Predictor;
        case PI_FFN_ORACLE: return TierMode::Oracle;
        default: break;  // gate mode: the gate rule through whichever kernels cost less (the dense rule's give the same values)
    }
    // gate and auto: the time each mode's step would take, at the densities measured so far in this layer, in
    // units of one weight byte streamed through the packed kernels (gemm8; the layer holds a matrix in 8-row
    // groups while its mode reads it whole, Model::arrange_cold_tier). Measured prices
    // (scripts/kernel_microbench.py, docs/perf-notes.md §12): a gate/up byte of a row read by index costs
    // ~1.8 (dot_rows), a down_t byte ~2.5 (axpy: unpack, convert and fma per element; the same kernel in
    // every mode, for the rows used). f32/f16 rows have no packed form: everything streams alike.
    const Layer &L = model_->layers()[size_t(il)];
    const double n = double(L.cold.size());
    const double g = double(L.gate.row_bytes), u = double(hp_.gated ? L.up.row_bytes : 0), d = double(L.down_t.row_bytes);
    const bool packable = packed_block_bytes(L.gate.type) != 0;
    const double gathered = packable ? 1.8 : 1.1, down = packable ? 2.5 : 1.0;
    // a batch reads a row when any of its tokens uses it: ~1 - (1 - rho)^n_tok of them (tokens taken as
    // independent; a prompt of a few dozen tokens already reads nearly every row)
    const double tokens = double(std::max<int64_t>(n_tok, 1));
    auto any_of = [&](double per_token) { return 1.0 - std::pow(1.0 - per_token, tokens); };
    const double rho = any_of(ema_active_[size_t(il)]);
    // gate mode's ups: a decode step reads the passing rows by index; a batch reads each pass's rows once and
    // then dots each token's passing rows on their own, kBatchRowDot times a gemm8 row-token (§33), so its
    // arithmetic, not its bytes, decides
    const bool batch = n_tok > 1;
    const double gate_ups = batch && packable ? kBatchRowDot * ema_active_[size_t(il)] : gathered * rho;
    double cost[kTierModes];  // per mode on offer; the others never chosen
    std::fill_n(cost, kTierModes, HUGE_VAL);
    cost[int(TierMode::DenseRule)] = n * (g + u) + down * rho * n * d;  // gate and up whole
    cost[int(TierMode::Gate)] = n * g + gate_ups * n * u + down * rho * n * d;
    if (auto_may_predict(il)) {
        // before the predictor has been measured in this layer (no batch yet, measure_predictor): a guess from the
        // activation density
        const bool seen = predicted_seen_[size_t(il)];
        const double pi = any_of(seen ? ema_predicted_[size_t(il)] : std::min(1.0, 1.2 * ema_active_[size_t(il)] + 0.02));
        const double rho_p = any_of(seen ? ema_predicted_active_[size_t(il)] : 0.8 * ema_active_[size_t(il)]);
        cost[int(TierMode::Predictor)] = 2.5 * (double(L.fc1.bytes()) + n * double(L.fc2.row_bytes)) +
                                         gathered * (pi * n * g + rho_p * n * u) + down * rho_p * n * d;
    }
    TierMode best = TierMode::DenseRule;
    for (TierMode m : {TierMode::Gate, TierMode::Predictor})
        if (cost[int(m)] < cost[int(best)]) best = m;
    // A layer's decode steps keep their kernels (and the layout they read) until what they have cost beyond the
    // cheapest's, summed over the steps since they last were the cheapest, would pay for the regrouping a change
    // takes (rent or buy: a change on every swing of the densities costs more than either kernel, docs/perf-notes.md
    // §36).
    const std::optional<TierMode> kept = decode_mode_[size_t(il)];
    if (batch || !kept) return best;
    double &regret = switch_regret_[size_t(il)];
    if (best == *kept) {
        regret = 0;
        return best;
    }
    regret += cost[int(*kept)] - cost[int(best)];
    // what regrouping a matrix costs, where the layer holds it in groups while its kernels read it whole
    auto relayout = [&](bool whole_before, bool whole_after, const Matrix &m) {
        if (whole_before == whole_after || !L.cold.groups_fit(m)) return 0.0;
        return n * double(m.row_bytes) * (whole_after ? kGroupPrice : kUngroupPrice);
    };
    const double change = relayout(reads_gate_whole(*kept), reads_gate_whole(best), L.cold.gate) +
                          (hp_.gated ? relayout(reads_up_whole(*kept), reads_up_whole(best), L.cold.up) : 0.0);
    if (regret < change) return *kept;
    regret = 0;
    return best;
}

void Engine::ffn(int64_t il, int64_t n_tok, TierMode cold_mode) {
    const Layer &L = model_->layers()[size_t(il)];
    LayerStats &st = stats_[size_t(il)];
    const int64_t E = hp_.n_embd;
    if (L.ffn_norm.data != L.attn_norm.data) {  // falcon 7B: attention's norm output is the FFN's too
        norm(x_.data(), L.ffn_norm, L.ffn_norm_b, n_tok, xn_.data());
        op_xn_.q_ready = false;
    }
    // The predictor's input, x_ as it stands: the residual entering the FFN block (llama family,
    // opt), or the layer's input in a parallel block (falcon), as PowerInfer feeds them.
    op_x_.q_ready = false;
    const double active_before = st.active, predicted_before = st.predicted, cold_before = st.cold_tokens;

    // Hot tier first (a device backend would run it concurrently), then the cold tier, its gates and ups held as
    // the layer's decode steps read them: in 8-row groups where read whole, else as the mapped rows. A batch
    // groups what every decode step of this mode reads whole and drops nothing: it packs what it needs as it
    // goes, and the mapped rows its kernels read by index are handed back after it where groups hold them.
    const bool has_hot = L.hot.size() > 0, batch = n_tok > 1;
    // auto: the predictor measured once a sequence (its first batch), or until the layer has predictor densities (on
    // every batch it cost ~3 % of a 512-token prompt's time, docs/perf-notes.md §37)
    const bool probe = batch && auto_may_predict(il) && cold_mode != TierMode::Predictor &&
                       L.cold.size() > 0 && (n_past_ == 0 || !predicted_seen_[size_t(il)]);
    const int64_t n_probe = probe ? select_for_last_tokens(L, n_tok) : 0;
    if (!batch) {
        model_->arrange_cold_tier(il, reads_gate_whole(cold_mode), reads_up_whole(cold_mode), true);
        const std::optional<TierMode> before = decode_mode_[size_t(il)];
        st.kernel_changes += double(before && *before != cold_mode);
        decode_mode_[size_t(il)] = cold_mode;
    } else {
        const bool gates_whole = mode_ == PI_FFN_DENSE || mode_ == PI_FFN_GATE || (mode_ == PI_FFN_AUTO && !auto_may_predict(il));
        model_->arrange_cold_tier(il, gates_whole, mode_ == PI_FFN_DENSE, false);
    }
    if (has_hot) ffn_tier(L, L.hot, mode_ == PI_FFN_DENSE ? TierMode::Dense : TierMode::DenseRule, n_tok, y_hot_.data(), st, false);
    if (L.cold.size() > 0) {
        ffn_tier(L, L.cold, cold_mode, n_tok, y_cold_.data(), st, true);
        st.mode_tokens[int(cold_mode)] += double(n_tok);
        if (batch) model_->release_grouped_rows(il, !reads_gate_whole(cold_mode), !reads_up_whole(cold_mode));
        if (n_probe > 0) measure_predictor(il, n_tok, n_probe);
    } else {
        std::fill(y_cold_.begin(), y_cold_.begin() + n_tok * E, 0.0f);
    }
    if (has_hot)
        for (int64_t i = 0; i < n_tok * E; ++i) y_cold_[size_t(i)] += y_hot_[size_t(i)];
    add_bias(y_cold_.data(), L.down_b, n_tok, E);
    add_residual(y_cold_.data(), n_tok);
    st.tokens += double(n_tok);

    // auto mode's (and gate-mode batches') view of this layer
    const double act_rate = (st.active - active_before) / double(n_tok) / double(hp_.n_ff);
    if (cold_mode != TierMode::Predictor) take_into_average(ema_active_[size_t(il)], act_rate, n_tok, true);
    else take_into_average(ema_predicted_active_[size_t(il)], act_rate, n_tok, predicted_seen_[size_t(il)]);
    if (st.cold_tokens > cold_before) {
        const double nc = double(std::max<int64_t>(L.cold.size(), 1));
        const double pred_rate = (st.predicted - predicted_before) / (st.cold_tokens - cold_before) / nc;
        take_into_average(ema_predicted_[size_t(il)], pred_rate, n_tok, predicted_seen_[size_t(il)]);
        predicted_seen_[size_t(il)] = true;
    }
}

int64_t Engine::select_for_last_tokens(const Layer &L, int64_t n_tok) {
    const auto t0 = Clock::now();
    const int64_t k = std::min(n_tok, kPredictorProbeTokens), first = n_tok - k, E = hp_.n_embd;
    Operand last{x_.data() + first * E, E, q_x_.data() + first * (E / QK), false};
    predictor_select(L, L.cold, last, k);
    std::memcpy(selected_.data(), mask_.data(), size_t(k * hp_.n_ff));
    times_.predictor += seconds_since(t0);
    return k;
}

void Engine::measure_predictor(int64_t il, int64_t n_tok, int64_t n_probe) {
    const int64_t F = hp_.n_ff, n = model_->layers()[size_t(il)].cold.size();
    int64_t selected = 0, computed = 0;  // integer counts, without branches
    for (int64_t t = 0; t < n_probe; ++t) {
        const uint8_t *sel = selected_.data() + t * F, *used = mask_.data() + (n_tok - n_probe + t) * F;
        for (int64_t r = 0; r < n; ++r) {
            selected += sel[r];
            computed += sel[r] & (used[r] == 2);
        }
    }
    // the layer's densities as predictor-mode steps keep them (ffn)
    const double per = double(n_probe) * double(n);
    const bool seen = predicted_seen_[size_t(il)];
    take_into_average(ema_predicted_[size_t(il)], double(selected) / per, n_probe, seen);
    take_into_average(ema_predicted_active_[size_t(il)], double(computed) / per, n_probe, seen);
    predicted_seen_[size_t(il)] = true;
}

Operand Engine::predictor_hidden(const Layer &L, Operand &x, int64_t n_tok) {
    const int64_t R = L.fc1.rows;
    matmul(L.fc1, x, n_tok, hid_.data(), R);
    for (int64_t i = 0; i < n_tok * R; ++i) hid_[size_t(i)] = std::max(hid_[size_t(i)], 0.0f);
    Operand hid = op_hid_;
    hid.n = R;
    hid.q_ready = false;
    prepare(hid, n_tok, L.fc2.type);
    return hid;
}

void Engine::predictor_score(const Layer &L, const FfnTier &T, const Operand &hid, int64_t n_tok, int64_t u0,
                             int64_t u1) {
    const int64_t F = hp_.n_ff, Fp = F + kPackRows, R = L.fc1.rows, unit = T.fc2_unit_rows();
    const Matrix &fc2 = T.fc2;
    const TypeKernels &k = ks_->for_type(fc2.type);
    const int64_t r0 = u0 * unit, r1 = std::min(T.size(), u1 * unit);
    if (r0 >= r1) return;
    if (T.fc2_transposed) {
        // logits of token t = sum over k of hidden[t][k] * weight k of the tile's neurons, tile by tile, row by
        // row (each streams in order; axpy_rows would interleave R streams at once)
        for (int64_t b = u0; b < u1; ++b) {
            const int64_t c0 = b * FfnTier::kFc2Tile, c1 = std::min(T.size(), c0 + FfnTier::kFc2Tile);
            for (int64_t t = 0; t < n_tok; ++t) {
                float *logit = g_.data() + t * Fp;
                std::fill(logit + c0, logit + c1, 0.0f);
                for (int64_t j = 0; j < R; ++j) k.axpy(int(c1 - c0), hid_[size_t(t * R + j)], T.fc2_tile_row(b, j), logit + c0);
            }
        }
    } else {  // quantized: 8-row groups, every token's logits by gemm8 (integer dots)
        k.gemm8(int(R), int(u1 - u0), fc2.groups + u0 * fc2.group_bytes(), int(n_tok), hid.at(0, fc2.type),
                hid.stride(fc2.type), g_.data() + r0, Fp);
    }
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = r0; r < r1; ++r) mask_[size_t(t * F + r)] = g_[size_t(t * Fp + r)] > L.pred_threshold;
}

int64_t Engine::list_used_rows(const FfnTier &T, const int32_t *list, int64_t count, int64_t at) {
    int64_t used = 0;
    for (int64_t i = 0; i < count; ++i) {  // without branches
        const int64_t r = list[i];
        down_rows_[size_t(at + used)] = T.row(T.down_t, r);
        down_coef_[size_t(at + used)] = h_[size_t(r)];
        used += mask_[size_t(r)] == 2;
    }
    return used;
}

void Engine::predictor_select(const Layer &L, const FfnTier &T, Operand &x, int64_t n_tok) {
    // hidden = relu(fc1 x); neuron j selected when fc2_j . hidden > threshold
    const Operand hid = predictor_hidden(L, x, n_tok);
    const int64_t units = T.fc2_units();
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t u0, u1;
        split_range(units, chunk, n_chunks, &u0, &u1);
        predictor_score(L, T, hid, n_tok, u0, u1);
    };
    // few multiply-adds per byte, and the bytes come from DRAM each step: counted as float rows are, so
    // that both threads take a share (one thread alone waited on memory: 136 against 107 us per token)
    pool_->run(int(std::min<int64_t>(units, pool_->chunks_for(T.size() * L.fc1.rows * n_tok * kRowDotCost, kGrain))), job);
}

void Engine::prefetch_predictor(const Layer &L) const {
    const Matrix &fc1 = L.fc1;
    if (fc1.groups) prefetch_row(fc1.groups, size_t(fc1.n_groups * fc1.group_bytes()));
    const int64_t loose = fc1.rows - fc1.n_groups * kPackRows;  // rows outside the groups (all of an f16 fc1)
    if (loose > 0) prefetch_row(fc1.row(fc1.n_groups * kPackRows), size_t(loose) * fc1.row_bytes);
    prefetch_row(L.cold.fc2_storage.data(), L.cold.fc2_storage.size());  // transposed tiles or 8-row groups
}

void Engine::true_mask(const Layer &L, const FfnTier &T, int64_t n_tok, uint8_t *out) {
    const int64_t F = hp_.n_ff, E = hp_.n_embd, n = T.size();
    prepare(op_xn_, n_tok, L.gate.type);
    prepare(op_xn_, n_tok, L.up.type);
    const TypeKernels &kg = ks_->for_type(L.gate.type), &ku = ks_->for_type(L.up.type);
    const Activation act = hp_.activation;
    const float thr = L.act_threshold;
    const float *gb = L.gate_b.floats(), *ub = L.up_b.floats();
    // the gate (and up) values of every path: dot_rows, in passes of kGatherRows rows per token
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t r0, r1;
        split_range(n, chunk, n_chunks, &r0, &r1);
        const void *gate_rows[kGatherRows], *up_rows[kGatherRows];
        float g[kGatherRows], u[kGatherRows];
        for (int64_t p0 = r0; p0 < r1; p0 += kGatherRows) {
            const int m = int(std::min(r1, p0 + kGatherRows) - p0);
            for (int j = 0; j < m; ++j) {
                gate_rows[j] = T.row(T.gate, p0 + j);
                if (act == Activation::DRelu) up_rows[j] = T.row(T.up, p0 + j);
            }
            for (int64_t t = 0; t < n_tok; ++t) {
                kg.dot_rows(int(E), m, gate_rows, op_xn_.at(t, L.gate.type), g);
                if (act == Activation::DRelu) ku.dot_rows(int(E), m, up_rows, op_xn_.at(t, L.up.type), u);
                for (int j = 0; j < m; ++j) {
                    const int32_t id = T.ids[size_t(p0 + j)];
                    const float gv = g[j] + (gb ? gb[id] : 0.0f);
                    bool on;
                    if (act == Activation::Relu) on = gv > thr;
                    else if (act == Activation::Silu) on = std::fabs(silu_ref(gv)) > thr;
                    else on = gv > 0.0f && u[j] + (ub ? ub[id] : 0.0f) > 0.0f;
                    out[size_t(t * F + p0 + j)] = on;
                }
            }
        }
    };
    pool_->run(pool_->chunks_for(n * E * n_tok, kGrain), job);
}

void Engine::ffn_tier(const Layer &L, const FfnTier &T, TierMode mode, int64_t n_tok, float *y, LayerStats &st,
                      bool is_cold) {
    const int64_t F = hp_.n_ff, E = hp_.n_embd, n = T.size();
    const Activation act = hp_.activation;
    const float thr = L.act_threshold;
    auto t0 = Clock::now();

    // A decode step in predictor mode without the recall check scores the predictor, lists the selected neurons
    // and computes their gates and ups in one pool job: each thread takes a range of the predictor's units and
    // computes the neurons it selected, so no listing on one thread and no wait in between (a sparse step's
    // fixed per-layer costs, docs/perf-notes.md §27).
    const bool fused = is_cold && mode == TierMode::Predictor && n_tok == 1 && !recall_check_;
    Operand hid;

    // Stage A: which neurons each token computes (mask_ 1 = compute the gate).
    if (fused) {
        hid = predictor_hidden(L, op_x_, n_tok);
    } else if (mode == TierMode::Predictor) {
        predictor_select(L, T, op_x_, n_tok);
        if (recall_check_) true_mask(L, T, n_tok, truth_.data());
    } else if (mode == TierMode::Oracle) {
        true_mask(L, T, n_tok, truth_.data());
        std::memcpy(mask_.data(), truth_.data(), size_t(n_tok * F));
    } else {
        for (int64_t t = 0; t < n_tok; ++t) std::fill(mask_.begin() + t * F, mask_.begin() + t * F + n, 1);
    }
    if (is_cold) {
        if ((mode == TierMode::Predictor || mode == TierMode::Oracle) && !fused) {  // the fused job counts its own
            int64_t selected = 0, tp = 0, pos = 0;  // integer counts: a double sum is a latency chain
            const bool have_truth = mode == TierMode::Oracle || recall_check_;
            for (int64_t t = 0; t < n_tok; ++t) {
                const uint8_t *mt = mask_.data() + t * F;
                for (int64_t r = 0; r < n; ++r) selected += mt[r];
                if (!have_truth) continue;
                const uint8_t *tt = truth_.data() + t * F;
                for (int64_t r = 0; r < n; ++r) {
                    pos += tt[r];
                    tp += tt[r] & mt[r];
                }
            }
            st.predicted += double(selected);
            st.cold_tokens += double(n_tok);
            st.true_pos += double(tp);
            st.positives += double(pos);
        }
        times_.predictor += seconds_since(t0);
        t0 = Clock::now();
    }

    // Stage B/C: gate (and up) for the selected rows; mask_ becomes 2 where up/down are used.
    int64_t n_listed = 0;
    if (fused) {
        // listed by the job below
    } else if (mode == TierMode::Predictor || mode == TierMode::Oracle) {
        for (int64_t r = 0; r < n; ++r) {  // listed without branches (whether a row is selected is a coin flip)
            uint8_t any = 0;
            for (int64_t t = 0; t < n_tok; ++t) any |= mask_[size_t(t * F + r)];
            rows_[size_t(n_listed)] = int32_t(r);
            n_listed += any != 0;
        }
    } else {
        std::iota(rows_.begin(), rows_.begin() + n, 0);  // every row
        n_listed = n;
    }
    n_rows_ = n_listed;
    // The gates (ups) in 8-row groups for gemm8: the tier's own, or for a batch each pass's groups packed from
    // the rows as it goes (cheap next to the batch's arithmetic on them, and no second copy of the weights).
    const bool gate_groups = !T.gate_groups.empty() || (n_tok > 1 && T.groups_fit(T.gate));
    const bool up_groups = !T.up_groups.empty() || (n_tok > 1 && T.groups_fit(T.up));
    // A batch whose tokens together select most of the tier reads every gate in order (the 8-row groups, as
    // gate mode does) and keeps each token's selected neurons: rows by index cost more here than all rows in
    // order from about half of them on (docs/perf-notes.md §19, §30). The same bits either way.
    const bool stream_selected = mode == TierMode::Predictor && n_tok > 1 && gate_groups && n_listed * 2 > n;
    if (stream_selected) std::memcpy(selected_.data(), mask_.data(), size_t(n_tok * F));
    prepare(op_xn_, n_tok, L.gate.type);
    prepare(op_xn_, n_tok, L.up.type);
    const TypeKernels &kg = ks_->for_type(L.gate.type), &ku = ks_->for_type(L.up.type);
    const bool dense = mode == TierMode::Dense, all_up = reads_up_whole(mode);
    const bool gated = hp_.gated;
    const float *gb = L.gate_b.floats(), *ub = L.up_b.floats();
    std::atomic<int64_t> n_active{0}, n_computed{0};
    // The pre-activation of neuron slot r (the gate of a gated FFN, up otherwise) plus its bias.
    auto with_bias = [&](float v, const float *bias, int64_t r) { return bias ? v + bias[T.ids[size_t(r)]] : v; };
    // SiLU of n gate values in place (biases added first; slot(j): the neuron slot of value j), by the silu
    // kernel: every path gets the same bits. Other activations keep their pre-activations for gate_rule.
    auto activate = [&](float *v, int64_t n_values, auto slot) {
        if (act != Activation::Silu) return;
        if (gb)
            for (int64_t j = 0; j < n_values; ++j) v[j] = with_bias(v[j], gb, slot(j));
        ks_->silu(int(n_values), v, v);
    };
    // The rule's verdict from the gate alone for neuron slot r, given what `activate` left (v), and the
    // activation a it leaves: SiLU's |a| > thr, else the pre-activation where it exceeds thr (0 but for
    // FATReLU), and 0 elsewhere.
    auto gate_rule = [&](float v, int64_t r, float *a) {
        if (act == Activation::Silu) {
            *a = v;
            return std::fabs(v) > thr;
        }
        const float g = with_bias(v, gb, r);
        const bool pass = g > thr;
        *a = keep_if(pass, g);
        return pass;
    };
    // h from a and the up projection u; whether the neuron passes the full rule.
    auto finish = [&](bool first_pass, float a, float u, float *h) {
        if (act == Activation::DRelu) {
            *h = a * std::max(u, 0.0f);
            return *h > 0.0f;
        }
        *h = a * u;
        return first_pass;
    };
    // Record neuron slot r of token t: mask 2 (down row used, coefficient h) or 1.
    // (branch-free: at moderate sparsity whether a neuron passes is a coin flip the predictor cannot learn)
    auto settle = [&](int64_t t, int64_t r, bool pass, float h, int64_t &active, int64_t &computed) {
        const bool used = dense || pass;
        active += pass;
        computed += used;
        mask_[size_t(t * F + r)] = uint8_t(1 + used);
        h_[size_t(t * F + r)] = keep_if(used, h);
    };
    // Rows read by index (predictor mode, or a tier without 8-row groups), in passes of kGatherRows selected
    // rows (they stay in cache across a batch's tokens). Per token, the pass's rows its mask selects go
    // through dot_rows for their gates, then the ones whose rule needs the up projection for their ups.
    auto gather_rows = [&](const int32_t *list, int64_t count) {
        int64_t active = 0, computed = 0;
        const void *gate_rows[kDecodeGatherRows], *up_rows[kDecodeGatherRows];
        int64_t gate_slot[kDecodeGatherRows], up_slot[kDecodeGatherRows];
        float g[kDecodeGatherRows], u[kDecodeGatherRows], up_a[kDecodeGatherRows];
        bool up_first[kDecodeGatherRows];
        const int64_t per_pass = n_tok == 1 ? kDecodeGatherRows : kGatherRows;
        for (int64_t p0 = 0; p0 < count; p0 += per_pass) {
            const int64_t p1 = std::min(count, p0 + per_pass);
            for (int64_t t = 0; t < n_tok; ++t) {
                const uint8_t *mt = mask_.data() + t * F;
                int n_gate = 0, n_up = 0;
                for (int64_t i = p0; i < p1; ++i) {  // listed without branches
                    const int64_t r = list[i];
                    gate_slot[n_gate] = r;
                    gate_rows[n_gate] = T.row(T.gate, r);
                    n_gate += mt[r] != 0;
                }
                kg.dot_rows(int(E), n_gate, gate_rows, op_xn_.at(t, L.gate.type), g);
                activate(g, n_gate, [&](int64_t j) { return gate_slot[j]; });
                for (int j = 0; j < n_gate; ++j) {
                    const int64_t r = gate_slot[j];
                    float a;
                    const bool first_pass = gate_rule(g[j], r, &a);
                    if (!gated) {
                        settle(t, r, first_pass, a, active, computed);  // ungated: the activation is the output
                        continue;
                    }
                    up_slot[n_up] = r;
                    up_rows[n_up] = T.row(T.up, r);
                    up_a[n_up] = a;
                    up_first[n_up] = first_pass;
                    if (n_up < kListAhead) prefetch_row(up_rows[n_up], T.up.row_bytes);
                    n_up += first_pass || all_up;
                    if (!all_up) settle(t, r, false, 0.0f, active, computed);  // for now: h is 0 unless listed
                }
                if (t + 1 == n_tok)  // the next pass's first gate rows arrive while this pass's ups are computed
                    for (int64_t i = p1; i < std::min(count, p1 + kListAhead); ++i)
                        prefetch_row(T.row(T.gate, list[i]), T.gate.row_bytes);
                if (!gated) continue;
                ku.dot_rows(int(E), n_up, up_rows, op_xn_.at(t, L.up.type), u);
                for (int j = 0; j < n_up; ++j) {
                    float h;
                    const bool pass = finish(up_first[j], up_a[j], with_bias(u[j], ub, up_slot[j]), &h);
                    settle(t, up_slot[j], pass, h, active, computed);
                    if (n_tok == 1) prefetch_row(pass ? T.row(T.down_t, up_slot[j]) : up_rows[j], T.down_t.row_bytes);
                }
            }
        }
        n_active += active;
        n_computed += computed;
    };
    auto gate_up_gathered = [&](int chunk, int n_chunks, int) {
        int64_t i0, i1;
        split_range(n_rows_, chunk, n_chunks, &i0, &i1);
        gather_rows(rows_.data() + i0, i1 - i0);
    };
    // The fused decode step: chunk c scores the predictor's units of range c, lists the neurons selected there
    // at the start of the same range of rows_ (so chunks never overlap), computes them and lists the down_t
    // rows they used from the same start in down_rows_ / down_coef_.
    double score_seconds = 0;  // the main thread's share of the scoring, reported as the predictor's time
    auto fused_select_gather = [&](int chunk, int n_chunks, int thread) {
        const auto ts = Clock::now();
        int64_t u0, u1;
        split_range(T.fc2_units(), chunk, n_chunks, &u0, &u1);
        const int64_t r0 = u0 * T.fc2_unit_rows(), r1 = std::min(n, u1 * T.fc2_unit_rows());
        predictor_score(L, T, hid, 1, u0, u1);
        int32_t *list = rows_.data() + r0;
        int64_t listed = 0;
        for (int64_t r = r0; r < r1; ++r) {  // listed without branches
            list[listed] = int32_t(r);
            listed += mask_[size_t(r)];
        }
        if (thread == 0) score_seconds += seconds_since(ts);  // the main thread may take more than one chunk
        gather_rows(list, listed);
        chunk_lists_[size_t(chunk)] = {r0, listed, list_used_rows(T, list, listed, r0)};
    };
    // Grouped tiers in the modes that read every gate: the gates (and, when every up is read, the ups) of
    // a few 8-row groups by gemm8 for all tokens, then each neuron's rule; in gate mode the ups of the
    // neurons the gate lets through come from their own rows, 4 at a time.
    const int64_t Fp = F + kPackRows;
    // The llama family without biases: the gate's value alone (SiLU'd by `activate`, raw for ReLU) decides,
    // and is the activation of a neuron that passes; both cases below take it in straight loops.
    const bool plain_rule = gated && act != Activation::DRelu && !gb && !ub;
    auto gate_passes = [act, thr](float v) { return act == Activation::Silu ? std::fabs(v) > thr : v > thr; };
    auto gate_up_grouped = [&](int chunk, int n_chunks, int thread) {
        int64_t g0, g1, active = 0, computed = 0;
        int64_t up_list[kDecodeGroupsPerPass * kPackRows];
        const void *up_rows[kDecodeGroupsPerPass * kPackRows];
        float up_a[kDecodeGroupsPerPass * kPackRows], u[kDecodeGroupsPerPass * kPackRows];
        split_range(T.n_groups(), chunk, n_chunks, &g0, &g1);
        const int64_t gate_group = T.gate.group_bytes();
        const int64_t per_pass = n_tok == 1 ? kDecodeGroupsPerPass : kGroupsPerPass;
        uint8_t *scratch = pack_scratch_.data() + size_t(thread) * pack_scratch_bytes_;
        // groups [g, g + ng) of m: the tier's own, or packed now into this thread's scratch (at `at`)
        auto groups_of = [&](const Matrix &m, const PageMemory &kept, int64_t g, int ng, size_t at) {
            if (!kept.empty()) return kept.data() + g * m.group_bytes();
            T.pack_groups(m, g, g + ng, zero_row_.data(), scratch + at);
            return static_cast<const uint8_t *>(scratch + at);
        };
        for (int64_t g = g0; g < g1; g += per_pass) {
            const int ng = int(std::min<int64_t>(per_pass, g1 - g));
            const int64_t r0 = g * kPackRows, r1 = std::min(n, (g + ng) * kPackRows);
            kg.gemm8(int(E), ng, groups_of(T.gate, T.gate_groups, g, ng, 0), int(n_tok), op_xn_.at(0, L.gate.type),
                     op_xn_.stride(L.gate.type), g_.data() + r0, Fp);
            if (gated && all_up)
                ku.gemm8(int(E), ng, groups_of(T.up, T.up_groups, g, ng, size_t(ng * gate_group)), int(n_tok),
                         op_xn_.at(0, L.up.type), op_xn_.stride(L.up.type), u_.data() + r0, Fp);
            for (int64_t t = 0; t < n_tok; ++t) {
                // Each neuron's rule (SiLU: the pass's activations by the silu kernel first); in gate mode the
                // neurons the gate lets through are listed, then their ups computed by dot_rows (gemm8's
                // arithmetic: the values dense mode's grouped ups would have).
                float *gt = g_.data() + t * Fp;
                const uint8_t *sel = stream_selected ? selected_.data() + t * F : every_neuron_.data();
                activate(gt + r0, r1 - r0, [&](int64_t j) { return r0 + j; });
                int64_t n_up = 0;
                if (plain_rule && all_up) {
                    // the dense modes, in one straight loop the compiler vectorizes
                    const bool silu_act = act == Activation::Silu;
                    const float *ut = u_.data() + t * Fp;
                    float *ht = h_.data() + t * F;
                    uint8_t *mt = mask_.data() + t * F;
                    for (int64_t r = r0; r < r1; ++r) {
                        const bool pass = gate_passes(gt[r]);
                        const float a = silu_act ? gt[r] : keep_if(pass, gt[r]);
                        const bool used = dense || pass;
                        active += pass;
                        computed += used;
                        mt[r] = uint8_t(1 + used);
                        ht[r] = keep_if(used, a * ut[r]);
                    }
                    continue;
                }
                if (plain_rule) {
                    // gate mode: every neuron settled as not passing at once, the ones the gate lets through
                    // listed without branches
                    std::fill(mask_.begin() + t * F + r0, mask_.begin() + t * F + r1, uint8_t(1));
                    std::fill(h_.begin() + t * F + r0, h_.begin() + t * F + r1, 0.0f);
                    for (int64_t r = r0; r < r1; ++r) {
                        up_list[n_up] = r;
                        n_up += gate_passes(gt[r]) & (sel[r] != 0);
                    }
                    for (int64_t i = 0; i < n_up; ++i) {
                        up_rows[i] = T.row(T.up, up_list[i]);
                        up_a[i] = gt[up_list[i]];
                        if (i < kListAhead) prefetch_row(up_rows[i], T.up.row_bytes);
                    }
                } else
                for (int64_t r = r0; r < r1; ++r) {
                    float a;
                    const bool first_pass = gate_rule(gt[r], r, &a) & (sel[r] != 0);
                    if (!gated) {
                        settle(t, r, first_pass, a, active, computed);
                    } else if (all_up) {
                        float h;
                        const bool pass = finish(first_pass, a, with_bias(u_[size_t(t * Fp + r)], ub, r), &h);
                        settle(t, r, pass, h, active, computed);
                    } else {  // listed when it passes (branch-free); settled for now as not passing
                        up_list[n_up] = r;
                        up_rows[n_up] = T.row(T.up, r);
                        up_a[n_up] = a;
                        if (n_up < kListAhead) prefetch_row(up_rows[n_up], T.up.row_bytes);
                        n_up += first_pass;
                        settle(t, r, false, 0.0f, active, computed);
                    }
                }
                if (n_up == 0) continue;
                ku.dot_rows(int(E), int(n_up), up_rows, op_xn_.at(t, L.up.type), u);
                for (int64_t i = 0; i < n_up; ++i) {
                    float h;
                    const bool pass = finish(true, up_a[i], with_bias(u[i], ub, up_list[i]), &h);
                    settle(t, up_list[i], pass, h, active, computed);
                    if (n_tok == 1) prefetch_row(pass ? T.row(T.down_t, up_list[i]) : up_rows[i], T.down_t.row_bytes);
                }
            }
        }
        n_active += active;
        n_computed += computed;
    };
    if ((reads_gate_whole(mode) || stream_selected) && gate_groups && (!gated || !all_up || up_groups)) {
        pool_->run(pool_->chunks_for(n * E * n_tok * 2, kGrain), gate_up_grouped);
    } else if (fused) {
        const int n_chunks = int(std::min<int64_t>(pool_->size(), T.fc2_units()));
        pool_->run(n_chunks, fused_select_gather);
        // the chunks' lists moved together in chunk order: slot order, as one pass over rows_ would list them
        n_rows_ = n_used_ = 0;
        for (int c = 0; c < n_chunks; ++c) {
            const ChunkList &cl = chunk_lists_[size_t(c)];
            std::memmove(rows_.data() + n_rows_, rows_.data() + cl.at, size_t(cl.listed) * sizeof(int32_t));
            std::memmove(down_rows_.data() + n_used_, down_rows_.data() + cl.at, size_t(cl.used) * sizeof(const void *));
            std::memmove(down_coef_.data() + n_used_, down_coef_.data() + cl.at, size_t(cl.used) * sizeof(float));
            n_rows_ += cl.listed;
            n_used_ += cl.used;
        }
        st.predicted += double(n_rows_);  // one token: the neurons listed are the ones selected
        st.cold_tokens += 1.0;
        times_.predictor += score_seconds;
        times_.gate_up -= score_seconds;
    } else pool_->run(pool_->chunks_for(n_rows_ * E * n_tok * 2, kGrain), gate_up_gathered);
    st.active += double(n_active.load());
    st.computed += double(n_computed.load());
    if (!is_cold) st.hot_active += double(n_active.load());

    times_.gate_up += seconds_since(t0);
    t0 = Clock::now();

    // Stage D: y = sum over used rows of h * down_t row (a batch: each thread owns a slice of the columns).
    const uint32_t dtype = T.down_t.type;
    const TypeKernels &kd = ks_->for_type(dtype);
    if (n_tok == 1) {
        // One token: the used rows (listed by the chunks above, else in one pass) in fixed runs of kDownRows, each
        // run added whole (rows stream in order, y's blocks held in registers) into its own partial y, then the
        // partials summed in run order: the same sums whatever the thread count or which thread ran which run.
        const int64_t n_used = fused ? n_used_ : list_used_rows(T, rows_.data(), n_rows_, 0);
        const int64_t n_runs = (n_used + kDownRows - 1) / kDownRows;
        auto run_rows = [&](int chunk, int, int) {
            const int64_t i0 = chunk * kDownRows, i1 = std::min(n_used, i0 + kDownRows);
            float *part = down_partial_.data() + chunk * E;
            std::fill(part, part + E, 0.0f);
            kd.axpy_rows(int(E), int(i1 - i0), down_rows_.data() + i0, 0, down_coef_.data() + i0, part);
        };
        pool_->run(int(n_runs), run_rows);
        std::fill(y, y + E, 0.0f);
        for (int64_t c = 0; c < n_runs; ++c) {
            const float *part = down_partial_.data() + c * E;
            for (int64_t i = 0; i < E; ++i) y[i] += part[i];
        }
    } else {
        // A batch: each thread owns a slice of the columns. The used rows go in panels of kPanelRows, widened
        // to floats once, and the tokens' coefficients (0 where a token leaves a row out) in chunks of
        // kPanelTokens, through gemm_f32 (tokens x columns tiles held in registers). Where every token's every
        // row was settled (h_ is 0 where a token leaves a row out), all of the tier's rows stay in order when
        // nearly all are used: the coefficients are then h_ itself, read in place by gemm_f32, instead of a copy
        // gathered per panel and thread.
        int64_t n_used = 0;
        for (int64_t i = 0; i < n_rows_; ++i) {  // counted (and compacted) without branches
            const int64_t r = rows_[size_t(i)];
            int32_t users = 0;
            for (int64_t t = 0; t < n_tok; ++t) users += mask_[size_t(t * F + r)] == 2;
            rows_[size_t(n_used)] = int32_t(r);
            n_used += users > 0;
        }
        // every token's every row settled: the modes that list every row, and a predictor batch that read every
        // gate in order (its unselected neurons settled as not used)
        const bool settled_all = (mode != TierMode::Predictor && mode != TierMode::Oracle) || stream_selected;
        const bool in_place = settled_all && n_used * 10 >= n * 9;
        if (in_place) {
            for (int64_t i = 0; i < n; ++i) rows_[size_t(i)] = int32_t(i);
            n_used = n;
        }
        const int64_t align = column_align(dtype);
        auto down = [&](int chunk, int n_chunks, int thread) {
            int64_t c0, c1;
            split_range(E, chunk, n_chunks, &c0, &c1, align);
            if (c0 >= c1) return;
            const int cn = int(c1 - c0);
            for (int64_t t = 0; t < n_tok; ++t) std::fill(y + t * E + c0, y + t * E + c1, 0.0f);
            float *wp = panel_w_.data() + int64_t(thread) * kPanelRows * E;
            float *hp = panel_h_.data() + int64_t(thread) * kPanelTokens * kPanelRows;
            for (int64_t p0 = 0; p0 < n_used; p0 += kPanelRows) {
                const int np = int(std::min<int64_t>(kPanelRows, n_used - p0));
                for (int i = 0; i < np; ++i)
                    kd.to_float(cn, column_slice(T.row(T.down_t, rows_[size_t(p0 + i)]), dtype, c0),
                                wp + int64_t(i) * cn);
                for (int64_t t0 = 0; t0 < n_tok; t0 += kPanelTokens) {
                    const int nt = int(std::min<int64_t>(kPanelTokens, n_tok - t0));
                    if (in_place) {
                        ks_->gemm_f32(nt, np, cn, h_.data() + t0 * F + p0, int(F), wp, cn, y + t0 * E + c0, int(E));
                        continue;
                    }
                    for (int t = 0; t < nt; ++t)
                        for (int i = 0; i < np; ++i) {
                            const size_t at = size_t((t0 + t) * F + rows_[size_t(p0 + i)]);
                            hp[t * np + i] = keep_if(mask_[at] == 2, h_[at]);
                        }
                    ks_->gemm_f32(nt, np, cn, hp, np, wp, cn, y + t0 * E + c0, int(E));
                }
            }
        };
        const int64_t column_units = (E + align - 1) / align;
        pool_->run(int(std::min<int64_t>(column_units, pool_->chunks_for(n_used * E * n_tok, kGrain))), down);
    }
    times_.down += seconds_since(t0);
}

int32_t Engine::sample(const pi_sampling &p) {
    if (n_past_ == 0) fail(PI_ERR_ARGUMENT, "nothing evaluated yet: call pi_eval before pi_sample");
    if (!(p.temperature >= 0.0f || p.temperature < 0.0f)) fail(PI_ERR_ARGUMENT, "temperature is NaN");
    if (!(p.repeat_penalty > 0.0f)) fail(PI_ERR_ARGUMENT, "repeat_penalty must be > 0");
    if (!(p.top_p > 0.0f)) fail(PI_ERR_ARGUMENT, "top_p must be > 0");
    return sampler_.sample(last_logits_.data(), p, history_.data(), n_past_, rng_);
}

void Engine::reset_stats() {
    stats_.assign(stats_.size(), LayerStats{});
    times_ = PhaseTimes{};
    batch_tokens_ = batch_seconds_ = decode_tokens_ = decode_seconds_ = 0;
}

namespace {

std::string num(double v) {
    if (!std::isfinite(v)) return "null";
    char b[64];
    std::snprintf(b, sizeof b, "%.9g", v);
    return b;
}

std::string quoted(const std::string &s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        if (static_cast<unsigned char>(c) < 0x20) {
            char b[8];
            std::snprintf(b, sizeof b, "\\u%04x", c);
            out += b;
            continue;
        }
        out += c;
    }
    return out + "\"";
}

const char *mode_name(int32_t m) {
    static const char *names[] = {"dense", "gate", "predictor", "auto", "oracle"};
    return m >= 0 && m <= 4 ? names[m] : "?";
}

const char *activation_name(const HParams &h) {
    if (h.shifted_relu) return "fatrelu";
    return h.activation == Activation::Relu ? "relu" : h.activation == Activation::Silu ? "silu" : "drelu";
}

}  // namespace

const std::string &Engine::info_json() {
    const HParams &h = hp_;
    const Layer &l0 = model_->layers()[0];
    json_ = "{\"path\": " + quoted(model_->path()) + ", \"magic\": " + quoted(model_->pwri() ? "PWRI" : "GGUF") +
            ", \"arch\": " + quoted(h.arch) + ", \"activation\": " + quoted(activation_name(h)) +
            ", \"n_vocab\": " + num(double(h.n_vocab)) + ", \"n_embd\": " + num(double(h.n_embd)) +
            ", \"n_layer\": " + num(double(h.n_layer)) + ", \"n_ff\": " + num(double(h.n_ff)) +
            ", \"n_head\": " + num(double(h.n_head)) + ", \"n_head_kv\": " + num(double(h.n_head_kv)) +
            ", \"n_ctx_train\": " + num(double(h.n_ctx_train)) + ", \"n_ctx\": " + num(double(n_ctx_)) +
            ", \"n_batch\": " + num(double(n_batch_)) + ", \"rope_base\": " + num(h.rope_base) +
            ", \"bos\": " + num(double(h.bos)) + ", \"eos\": " + num(double(h.eos)) +
            ", \"weight_type\": " + quoted(type_size(l0.up.type).name) +
            ", \"has_predictor\": " + (model_->has_predictor() ? "true" : "false") +
            ", \"hot_neurons\": " + num(double(model_->hot_neurons())) +
            ", \"threads\": " + num(pool_->size()) + ", \"isa\": " + quoted(ks_->isa) +
            ", \"ffn_mode\": " + quoted(mode_name(mode_)) + ", \"recall_check\": " + (recall_check_ ? "true" : "false") +
            ", \"kv_type\": " + quoted(kv_f16_ ? "f16" : "f32") +
            ", \"kv_cache_bytes\": " + std::to_string(int64_t(kv_cache_bytes())) +
            ", \"work_buffer_bytes\": " + std::to_string(int64_t(work_buffer_bytes(pool_->size()))) +
            ", \"activation_thresholds\": [";
    for (size_t i = 0; i < model_->layers().size(); ++i) json_ += (i ? ", " : "") + num(model_->layers()[i].act_threshold);
    json_ += "], \"predictor_thresholds\": [";
    for (size_t i = 0; i < model_->layers().size(); ++i) json_ += (i ? ", " : "") + num(model_->layers()[i].pred_threshold);
    json_ += "], \"predictor_useful\": [";
    for (size_t i = 0; i < model_->layers().size(); ++i)
        json_ += std::string(i ? ", " : "") + (model_->layers()[i].predictor_useful ? "true" : "false");
    json_ += "]}";
    return json_;
}

const std::string &Engine::stats_json() {
    json_ = "{\"ffn_mode\": " + quoted(mode_name(mode_)) + ", \"batch_tokens\": " + num(batch_tokens_) +
            ", \"batch_seconds\": " + num(batch_seconds_) + ", \"decode_tokens\": " + num(decode_tokens_) +
            ", \"decode_seconds\": " + num(decode_seconds_) + ", \"phases\": {\"embed\": " + num(times_.embed) +
            ", \"attention\": " + num(times_.attention) + ", \"predictor\": " + num(times_.predictor) +
            ", \"gate_up\": " + num(times_.gate_up) + ", \"down\": " + num(times_.down) + ", \"output\": " + num(times_.output) + "}";
    const WeightCopies wc = model_->weight_copies();
    json_ += ", \"weight_copies\": {\"packed\": " + std::to_string(wc.packed) + ", \"predictor\": " + std::to_string(wc.predictor) +
             ", \"hot\": " + std::to_string(wc.hot) + ", \"cold_groups\": " + std::to_string(wc.cold_groups) + "}, \"layers\": [";
    const double F = double(hp_.n_ff);
    for (size_t i = 0; i < stats_.size(); ++i) {
        const LayerStats &s = stats_[i];
        const Layer &L = model_->layers()[i];
        const double nc = double(L.cold.size());
        json_ += std::string(i ? ", " : "") + "{\"layer\": " + num(double(i)) + ", \"tokens\": " + num(s.tokens) +
                 ", \"density\": " + num(s.tokens > 0 ? s.active / s.tokens / F : NAN) +
                 ", \"computed_density\": " + num(s.tokens > 0 ? s.computed / s.tokens / F : NAN) +
                 ", \"hot_neurons\": " + num(double(L.hot.size())) +
                 ", \"hot_density\": " + num(s.tokens > 0 && L.hot.size() ? s.hot_active / s.tokens / double(L.hot.size()) : NAN) +
                 ", \"predicted_density\": " + num(s.cold_tokens > 0 && nc > 0 ? s.predicted / s.cold_tokens / nc : NAN) +
                 ", \"recall\": " + num(s.positives > 0 ? s.true_pos / s.positives : NAN) +
                 ", \"decode_mode\": " + (decode_mode_[i] ? quoted(tier_mode_name(*decode_mode_[i])) : std::string("null")) +
                 ", \"cold_groups\": " + std::to_string(L.cold.gate_groups.size() + L.cold.up_groups.size()) +
                 ", \"kernel_changes\": " + num(s.kernel_changes) + ", \"modes\": {";
        bool first = true;
        for (int m = 0; m < kTierModes; ++m) {
            if (s.mode_tokens[m] == 0) continue;
            json_ += std::string(first ? "" : ", ") + quoted(tier_mode_name(TierMode(m))) + ": " + num(s.mode_tokens[m]);
            first = false;
        }
        json_ += "}}";
    }
    json_ += "]}";
    return json_;
}

}  // namespace pi
