#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include <unistd.h>

#include "backend/cpu_backend.h"
#include "backend/device_backend.h"
#include "backend/device_library.h"
#include "backend/reference_backend.h"
#include "runtime/common.h"
#include "runtime/usable_memory.h"

namespace pi {
namespace {

const int64_t kDefaultCtx = 4096;
const int64_t kDefaultBatch = 64;
const int64_t kMaxSequences = 64;
// The disk tier's reading threads: enough reads in flight for an SSD's parallelism, whatever the compute threads
// (docs/bench.md, "Models larger than memory").
const int kDiskReadThreads = 32;
// The expert tier's: its reads are an expert's three runs of hundreds of KiB, so a few in flight keep a disk busy
const int kExpertReadThreads = 8;

// The largest hot (cold) tier of any layer.
int64_t largest_tier(const Model &model, bool hot) {
    int64_t n = 0;
    for (const Layer &l : model.layers()) n = std::max(n, (hot ? l.hot : l.cold).size());
    return n;
}

// The thread count asked for (0 or less: all cores), checked.
int thread_count(int requested) {
    if (requested > 256) fail(PI_ERR_ARGUMENT, "threads must be at most 256");
    return requested > 0 ? requested : int(std::max(1u, std::thread::hardware_concurrency()));
}

// Whether a llama.cpp file's ffn_down may stay as stored (Layer::down, a row per output, read whole by gemm8 in dense
// steps): nothing asked at open reads a row per neuron (a sparse FFN mode, a hot tier, neuron bundles, input
// sparsity's FFN). Auto mode, whose SiLU layers are dense unless a sparse mode prices lower, and a later switch to
// such a mode transpose it when one is taken (Model::transpose_down).
bool down_as_stored(const pi_options &opts, bool hot_tier, const std::string &path) {
    const bool gpuidx = opts.gpuidx_path && *opts.gpuidx_path && hot_tier;
    const bool bundles = opts.memory_budget > 0 ||
                         (opts.memory_budget == 0 && ::access(DiskTier::path_for(path).c_str(), F_OK) == 0);
    const bool mode = opts.ffn_mode == PI_FFN_DENSE || opts.ffn_mode == PI_FFN_AUTO;
    return mode && opts.input_sparsity <= 0.0f && !gpuidx && !bundles;
}

}  // namespace

Engine::Engine(const std::string &path, const pi_options &opts, const std::string &hot_backend)
    : device_api_(find_device(opts, hot_backend)),
      // a gpuidx places neurons on a device: without one its neurons join the cold tier, unless asked otherwise
      gpuidx_ignored_(opts.gpuidx_path && *opts.gpuidx_path && !device_api_ && opts.cpu_hot_tier == 0 &&
                      hot_backend != "reference"),
      model_(std::make_unique<Model>(path, opts.gpuidx_path ? opts.gpuidx_path : "", thread_count(opts.threads),
                                     !gpuidx_ignored_, opts.decode_cache ? opts.decode_cache : "",
                                     down_as_stored(opts, !gpuidx_ignored_, path))),
      hp_(model_->hp()),
      policy_(*model_),
      stats_(model_->hp().n_layer),
      sampler_(model_->hp().n_vocab) {
    ks_ = kernels_named(opts.isa);
    if (!ks_) fail(PI_ERR_UNSUPPORTED, std::string("kernel set '") + opts.isa + "' is not available on this CPU/build");
    const int threads = thread_count(opts.threads);
    n_ctx_ = opts.ctx_size > 0 ? opts.ctx_size : std::min(hp_.n_ctx_train, kDefaultCtx);
    if (n_ctx_ > (int64_t(1) << 20)) fail(PI_ERR_ARGUMENT, "ctx_size is too large");
    if (hp_.learned_pos) n_ctx_ = std::min(n_ctx_, hp_.n_ctx_train);  // no position beyond the learned table
    // A model the engine computes only within a context (HParams::n_ctx_limit: a window every layer shares,
    // longrope's original context): its default is capped there, a longer one refused
    if (hp_.n_ctx_limit > 0 && opts.ctx_size > hp_.n_ctx_limit)
        fail(PI_ERR_ARGUMENT, "ctx_size " + std::to_string(opts.ctx_size) + " is larger than " + hp_.ctx_limit_why);
    if (hp_.n_ctx_limit > 0) n_ctx_ = std::min(n_ctx_, hp_.n_ctx_limit);
    n_batch_ = opts.batch_size > 0 ? std::min<int64_t>(opts.batch_size, 4096) : kDefaultBatch;
    n_batch_ = std::min(n_batch_, n_ctx_);
    n_seq_ = opts.n_seq > 0 ? opts.n_seq : 1;
    if (n_seq_ > kMaxSequences) fail(PI_ERR_ARGUMENT, "n_seq must be at most " + std::to_string(kMaxSequences));
    recall_check_ = opts.recall_check != 0;
    if (opts.kv_type != PI_KV_F32 && opts.kv_type != PI_KV_F16 && opts.kv_type != PI_KV_Q8_0)
        fail(PI_ERR_ARGUMENT, "unknown KV cache type " + std::to_string(opts.kv_type));
    const pi_kv_type kv_type = pi_kv_type(opts.kv_type);
    if (kv_type == PI_KV_Q8_0 && hp_.d_head % QK != 0)  // a position's head vector is whole q8_0 blocks
        fail(PI_ERR_UNSUPPORTED, "kv_type q8_0 needs a head size that is a multiple of 32; this model's is " +
                                     std::to_string(hp_.d_head) + " (use f16 or f32)");
    policy_.set_mode(opts.ffn_mode);  // at load no layer is arranged yet: the first steps arrange them

    pool_ = std::make_unique<ThreadPool>(threads);
    const int64_t rank = model_->max_rank();
    gpu_mode_ = opts.gpu;
    // a mixture's device experts come from its tier plan, not a gpuidx: its device library is found now
    if (hp_.n_expert > 0 && hot_backend == "cpu" && opts.gpu != PI_GPU_OFF && (!opts.gpuidx_path || !*opts.gpuidx_path)) {
        gpu_off_.clear();
        device_api_ = device_library(opts);
    }
    if (hot_backend == "reference") hot_ = std::make_unique<ReferenceTierBackend>(hp_, n_batch_);
    else if (opts.gpu != PI_GPU_OFF) hot_ = device_tier(opts, rank);
    disk_ = open_disk_tier(opts, threads);                     // where the hot tier goes is known
    experts_ = open_expert_tier(opts, threads);
    if (!disk_ && !experts_) check_working_memory(threads, kv_type);  // a disk tier's budget holds it
    if (!model_->dense_mapped()) model_->pack_dense_matrices(threads);
    rs_ = std::make_unique<RunState>(hp_, n_ctx_, n_batch_, threads, kv_type, n_seq_);
    if (device_) device_->begin(*model_, rs_->rope_cos.data(), rs_->rope_sin.data());
    device_layer_modes_.assign(size_t(hp_.n_layer), TierMode::Dense);
    split_cold_.assign(size_t(hp_.n_layer), SplitCold{});
    if (!hot_) hot_ = std::make_unique<CpuTierBackend>(hp_, *ks_, *pool_, n_batch_, rank, true);
    cold_ = std::make_unique<CpuTierBackend>(hp_, *ks_, *pool_, n_batch_, rank, false, disk_.get());
    if (hp_.n_expert > 0)
        moe_ = std::make_unique<MoeFfn>(hp_, *ks_, *pool_, n_batch_, experts_.get(), opts.expert_lookahead != 0, device_);
    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        const Layer &L = model_->layers()[size_t(il)];
        if (L.hot.size() > 0) hot_->upload(il, L, L.hot);
        if (L.cold.size() > 0) cold_->upload(il, L, L.cold);
    }
    if (!model_->input_levels().empty()) allocate_input_scratch();
    set_input_sparsity(opts.input_sparsity);
}

const pi_device_api *Engine::find_device(const pi_options &opts, const std::string &hot_backend) {
    if (hot_backend != "cpu" && hot_backend != "reference")
        fail(PI_ERR_ARGUMENT, "unknown tier backend '" + hot_backend + "' (cpu or reference)");
    if (opts.gpu < PI_GPU_OFF || opts.gpu > PI_GPU_ON) fail(PI_ERR_ARGUMENT, "unknown gpu mode " + std::to_string(opts.gpu));
    if (hot_backend == "reference" || opts.gpu == PI_GPU_OFF) return nullptr;
    if (!opts.gpuidx_path || !*opts.gpuidx_path) {
        gpu_off_ = "no hot tier: give a .gpuidx (pi-tools plan writes one for a VRAM budget)";
        return nullptr;
    }
    return device_library(opts);
}

const pi_device_api *Engine::device_library(const pi_options &opts) {
    const pi_device_api *api = nullptr;
    try {
        device_library_ = device_library_path(opts.gpu_library ? opts.gpu_library : "");
        api = &load_device_library(device_library_);
    } catch (const EngineFailure &e) {
        gpu_off_ = e.what();
        return nullptr;
    }
    char err[256] = {};
    const int32_t n = api->device_count(err, sizeof err);
    if (opts.gpu_device >= 0 && opts.gpu_device < n) return api;
    gpu_off_ = n == 0 ? std::string(err[0] ? err : "no device")
                      : "no device " + std::to_string(opts.gpu_device) + " (" + std::to_string(n) + " found)";
    return nullptr;
}

std::unique_ptr<TierBackend> Engine::device_tier(const pi_options &opts, int64_t rank) {
    // What is missing for a device is a reason to run on the CPU (auto) or a failure (on); a device that is there
    // but cannot take the request (a budget above its free memory) fails either way.
    std::vector<std::vector<int32_t>> experts;  // a mixture's, from its tier plan
    if (gpu_off_.empty() && hp_.n_expert > 0) experts = planned_device_experts();
    else if (gpu_off_.empty() && model_->hot_neurons() == 0)
        gpu_off_ = "no hot tier: the .gpuidx marks no neuron (pi-tools plan writes one for a VRAM budget)";
    if (!gpu_off_.empty()) {
        if (opts.gpu == PI_GPU_ON) fail(PI_ERR_UNSUPPORTED, "gpu on: " + gpu_off_);
        return nullptr;
    }
    auto device = std::make_unique<DeviceTierBackend>(*device_api_, device_library_, opts.gpu_device, opts.vram_budget, *model_,
                                                      *ks_, *pool_, n_batch_, n_ctx_,
                                                      opts.kv_type == PI_KV_F16,
                                                      opts.gpu_ffn_only == 0 && opts.kv_type != PI_KV_Q8_0, rank,
                                                      largest_tier(*model_, true), experts.empty() ? nullptr : &experts);
    device_ = device.get();
    return device;
}

std::vector<std::vector<int32_t>> Engine::planned_device_experts() {
    if (hp_.activation != Activation::Silu) {
        gpu_off_ = "the device computes SiLU experts; this model's experts are ReLU";
        return {};
    }
    TierPlan plan;
    if (!read_tier_plan(model_->path() + names::kTierPlanSuffix, hp_.n_layer, hp_.n_ff, hp_.n_expert, plan) ||
        plan.device.empty()) {
        gpu_off_ = "no device experts: no tier plan beside the model puts experts on the device (pi-tools plan "
                   "--vram-budget with --memory-budget writes one)";
        return {};
    }
    size_t n = 0;
    for (const auto &layer : plan.device) n += layer.size();
    if (n == 0) {
        gpu_off_ = "no device experts: the tier plan beside the model puts none on the device (planned with --vram-budget 0)";
        return {};
    }
    return plan.device;
}

double Engine::work_buffer_bytes(int64_t threads) const {
    double bytes = RunState::buffer_bytes(hp_, n_ctx_, n_batch_, threads, n_seq_) + double(hp_.n_layer) * 64 +  // + policy
                   input_scratch_bytes() + (hp_.n_expert > 0 ? MoeFfn::scratch_bytes(hp_, n_batch_, threads) : 0.0);
    for (bool hot : {true, false}) {
        const int64_t rows = largest_tier(*model_, hot);
        if (rows > 0) bytes += CpuTierBackend::scratch_bytes(hp_, rows, n_batch_, threads, model_->max_rank());
    }
    return bytes;
}

double Engine::weight_copy_bytes(bool cold_on_disk) const {
    double bytes = 0;
    for (const Layer &L : model_->layers()) {
        if (!L.cold.on_disk() && !cold_on_disk) {
            bytes += L.cold.group_bytes(hp_.gated);  // built as a mode that reads them whole runs
            if (down_quads_for(TierMode::Dense) && L.cold.quads_fit()) bytes += L.cold.quad_bytes();  // likewise
            if (L.down_groups.empty()) bytes += double(Model::packed_bytes(L.down));  // made with the packed matrices
        }
        if (!device_) bytes += L.hot.copy_bytes(hp_.gated);
    }
    return device_ ? bytes + device_->host_bytes(model_->layers()) : bytes;
}

double Engine::working_bytes(int64_t threads, pi_kv_type kv_type, bool cold_on_disk) const {
    return RunState::kv_cache_bytes(hp_, n_ctx_, kv_type, n_seq_) + work_buffer_bytes(threads) + weight_copy_bytes(cold_on_disk);
}

Engine::BudgetRoom Engine::budget_room(double held) {
    const double limit = usable_memory_bytes();
    return {limit, limit - std::max(0.0, process_anonymous_bytes() - held)};
}

void Engine::check_budget_fits(double budget, double would_hold, const BudgetRoom &r) {
    if (r.limit > 0 && std::min(budget, would_hold) > r.room)
        fail(PI_ERR_MEMORY, "memory_budget " + gib(budget) + " is more than this process may still take: " + gib(r.room) +
                                " of the " + gib(r.limit) + " limit (the machine's memory or its cgroup's), less what it holds");
}

std::unique_ptr<DiskTier> Engine::open_disk_tier(const pi_options &opts, int64_t threads) {
    if (opts.memory_budget < 0 || hp_.n_expert > 0) return nullptr;  // a mixture's: open_expert_tier
    const std::string path = DiskTier::path_for(model_->path());
    // What the engine holds whatever the tier keeps resident: the weights it has copied out of the file (the packed
    // matrices, the predictors, the decoded rows), what it will allocate (the KV cache at the full context, the work
    // buffers), the process's margin.
    const WeightCopies wc = model_->weight_copies();  // the packed matrices' copy is not made yet
    const double held = double(wc.predictor + wc.decoded), copied = double(wc.packed) + held;
    double fixed = copied + working_bytes(threads, pi_kv_type(opts.kv_type), true) + kProcessMargin;
    double budget = double(opts.memory_budget);
    std::string source = "memory_budget";
    // the most any budget may be (the tier's budget holds the working memory too, so it replaces
    // check_working_memory's check)
    const BudgetRoom r = budget_room(held);
    if (budget == 0) {
        source = "the machine's memory or its cgroup's limit, less what the process held";
        const bool all_cold = model_->hot_neurons() == 0;
        if (!all_cold || r.limit <= 0) return nullptr;
        budget = r.room;
        if (fixed + DiskTier::bundle_bytes_of(*model_) <= budget) return nullptr;
        if (::access(path.c_str(), F_OK) != 0) return nullptr;  // no bundles: the memory check decides
    } else {
        check_budget_fits(budget, fixed + DiskTier::bundle_bytes_of(*model_), r);
    }
    // Where the matrices every token reads whole, copied into groups, leave no room for a cache of one layer's
    // bundles, they stay mapped instead: the kernel pages them in from the file (a token reads them all, so under
    // pressure from the disk, as llama.cpp's mapped weights), and the budget holds the rest; a budget of the
    // engine's own choosing then takes no more than that rest, leaving the page cache the room for them.
    const double packed = double(wc.packed), min_cache = DiskTier::bundle_bytes_of(*model_) / double(hp_.n_layer);
    if (packed > 0 && fixed + min_cache > budget) {
        model_->map_dense_matrices();
        fixed -= packed;
        if (opts.memory_budget == 0) budget = std::min(budget, fixed + min_cache);
    }
    // a three-tier plan beside the model chooses the resident share (docs/engine.md, "Models larger than memory")
    TierPlan plan;
    const bool planned = read_tier_plan(model_->path() + names::kTierPlanSuffix, hp_.n_layer, hp_.n_ff, 0, plan);
    auto tier = std::make_unique<DiskTier>(path, *model_, budget, source, fixed, kDiskReadThreads, planned ? &plan : nullptr);
    model_->hold_vectors();  // a model that does not fit its memory: its page cache is under pressure
    return tier;
}

std::unique_ptr<ExpertTier> Engine::open_expert_tier(const pi_options &opts, int64_t threads) {
    if (opts.memory_budget < 0 || hp_.n_expert == 0) return nullptr;
    // What the engine holds whatever the cache: the packed matrices but the experts (the cache packs those), the
    // decoded copies, the KV cache at the full context, the work buffers, the process's margin.
    model_->leave_experts_in_file(true);
    const WeightCopies wc = model_->weight_copies();
    const double held = double(wc.predictor + wc.decoded);
    const double fixed = double(wc.packed) + held + working_bytes(threads, pi_kv_type(opts.kv_type), true) + kProcessMargin;
    const double all = ExpertTier::all_expert_bytes(*model_);
    double budget = double(opts.memory_budget);
    std::string source = "memory_budget";
    const BudgetRoom r = budget_room(held);
    if (budget == 0) {
        // the engine's own rule: the tier only where the experts do not fit what the process may take
        if (r.limit <= 0 || fixed + all <= r.room) {
            model_->leave_experts_in_file(false);
            return nullptr;
        }
        source = "the machine's memory or its cgroup's limit, less what the process held";
        budget = r.room;
    } else {
        check_budget_fits(budget, fixed + all, r);
    }
    // a plan beside the model pins each layer's hottest experts and sizes its cache (docs/placement.md, "Three tiers")
    TierPlan plan;
    const bool planned = read_tier_plan(model_->path() + names::kTierPlanSuffix, hp_.n_layer, hp_.n_ff, hp_.n_expert, plan) &&
                         !plan.expert_slots.empty();
    // the plan's device experts never come from the tier, where a device holds them; else the tier reads them too
    if (!device_ || device_->use().placement.experts_placed() == 0) plan.device.clear();
    auto tier = std::make_unique<ExpertTier>(*model_, budget, source, fixed, kExpertReadThreads, planned ? &plan : nullptr);
    model_->hold_vectors();  // a model that does not fit its memory: its page cache is under pressure
    return tier;
}

void Engine::check_working_memory(int64_t threads, pi_kv_type kv_type) const {
    // Refused before allocating when what the engine will hold (the KV cache at the full context, the work
    // buffers, the weights it copies out of the mapped file) and a margin for the rest of the process exceed
    // what the process may still take, so that a context fails with a message instead of an out-of-memory kill
    // as it fills.
    const double bytes = working_bytes(threads, kv_type) + kProcessMargin;
    const double limit = usable_memory_bytes(), held = process_anonymous_bytes();
    const auto gib = [](double b) { return std::to_string(b / double(1 << 30)).substr(0, 8) + " GiB"; };
    if (limit > 0 && bytes > limit - held)
        fail(PI_ERR_MEMORY, model_->path() + ": the KV cache, work buffers and weight copies would need " + gib(bytes) +
                                " for ctx_size " + std::to_string(n_ctx_) +
                                (n_seq_ > 1 ? " and " + std::to_string(n_seq_) + " sequences (a KV cache each)" : "") + ", more than the " + gib(std::max(0.0, limit - held)) +
                                " left of the " + gib(limit) + " this process may use (the machine's memory or its "
                                "cgroup's limit; it holds " + gib(held) + " already); lower ctx_size" +
                                (n_seq_ > 1 ? " or the sequences" : ""));
}

void Engine::set_ffn_mode(int32_t mode) {
    policy_.set_mode(mode);
    if (mode != PI_FFN_DENSE && mode != PI_FFN_AUTO) model_->transpose_down();  // they read a down row per neuron
    // A switch arranges every layer for the new mode's decode steps now: its regrouping is paid here, not by the
    // first token after it.
    arrange_decode_layers();
    build_input_columns();  // dense mode's input sparsity reads gate/up's columns too, the others do not
}

void Engine::arrange_decode_layers() {
    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        const TierMode m = policy_.cold_mode(il, 1);
        model_->arrange_cold_tier(il, reads_gate_whole(m), reads_up_whole(m), down_quads_for(m), true);
    }
}

void Engine::truncate(int32_t n_keep) {
    if (n_keep < 0 || n_keep > rs_->seq().n_past)
        fail(PI_ERR_ARGUMENT, "cannot keep " + std::to_string(n_keep) + " of " + std::to_string(rs_->seq().n_past) + " cached tokens");
    rs_->seq().n_past = n_keep;
}

void Engine::select(int32_t seq) {
    if (seq < 0 || seq >= n_seq())
        fail(PI_ERR_ARGUMENT, "sequence " + std::to_string(seq) + " does not exist (the engine holds " +
                                  std::to_string(n_seq()) + ", pi_options.n_seq)");
    rs_->cur = seq;
}

void Engine::check_steps(const int32_t *seqs, const int32_t *tokens, int32_t n) {
    if (n <= 0) fail(PI_ERR_ARGUMENT, "a decode step needs at least one sequence");
    if (!seqs || !tokens) fail(PI_ERR_ARGUMENT, "seqs or tokens is NULL");
    if (n > n_batch_) fail(PI_ERR_ARGUMENT, "a decode step takes at most batch_size (" + std::to_string(n_batch_) + ") sequences");
    // Each row computed with the kernels of its own decode step, on the CPU tiers (a hot tier there too, hot then
    // cold summed per row as alone): the cold tier reads the union
    // of the rows' selections once and computes each row's own (CpuTierBackend::submit). Auto mode's kernels
    // follow the densities its steps measured (a row's would depend on its company's); input sparsity's decode
    // kernels read each row's kept inputs' columns, the disk tier fetches one row's selection, a device runs a
    // step's rows as a batch, and a mixture's rows route to their own experts.
    const char *why = policy_.mode() == PI_FFN_AUTO ? "auto FFN mode (run it in dense, gate or predictor mode)"
                      : device_ ? "a hot tier on a device" : disk_ ? "a memory budget's disk tier"
                      : moe_ ? "a mixture of experts" : input_on() ? "input sparsity" : nullptr;
    if (n > 1 && why) fail(PI_ERR_UNSUPPORTED, std::string("a decode step of several sequences is not computed with ") + why);
    std::vector<bool> seen(size_t(n_seq()), false);
    for (int32_t t = 0; t < n; ++t) {
        select(seqs[t]);
        if (seen[size_t(seqs[t])]) fail(PI_ERR_ARGUMENT, "sequence " + std::to_string(seqs[t]) + " is twice in one decode step");
        seen[size_t(seqs[t])] = true;
        if (rs_->seq().n_past == 0) fail(PI_ERR_ARGUMENT, "sequence " + std::to_string(seqs[t]) + " is empty: evaluate its prompt first");
        check_tokens(tokens + t, 1);
    }
}

void Engine::decode_step(const int32_t *seqs, const int32_t *tokens, int32_t n, float *logits) {
    const int64_t selected = rs_->cur;
    try {
        check_steps(seqs, tokens, n);
    } catch (...) {
        rs_->cur = selected;
        throw;
    }
    const auto t0 = std::chrono::steady_clock::now();
    steps_.assign(seqs, seqs + n);
    try {
        forward(tokens, n, rs_->step_logits.data(), hp_.n_vocab, true);
    } catch (...) {
        steps_.clear();
        rs_->cur = selected;
        throw;
    }
    steps_.clear();
    rs_->cur = selected;
    if (logits) std::memcpy(logits, rs_->step_logits.data(), size_t(n) * size_t(hp_.n_vocab) * sizeof(float));
    stats_.take_steps(n, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void Engine::eval_hidden(const int32_t *tokens, int32_t n, float *hidden) {
    if (!hidden) fail(PI_ERR_ARGUMENT, "hidden is NULL");
    const int64_t E = hp_.n_embd;
    in_batches(tokens, n, false, [&](int64_t done, int64_t chunk) {
        forward(tokens + done, chunk, nullptr, 0, false);  // the stream ends on the host without logits
        norm(rs_->x.data(), model_->output_norm(), model_->output_norm_b(), chunk, hidden + done * E);
    });
}

void Engine::check_tokens(const int32_t *tokens, int32_t n) const {
    if (n <= 0) fail(PI_ERR_ARGUMENT, "eval needs at least one token");
    if (!tokens) fail(PI_ERR_ARGUMENT, "tokens is NULL");
    if (rs_->seq().n_past + n > n_ctx_)
        fail(PI_ERR_ARGUMENT, "context full: " + std::to_string(rs_->seq().n_past) + " cached + " + std::to_string(n) +
                                  " new tokens exceed ctx_size " + std::to_string(n_ctx_));
    for (int32_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= hp_.n_vocab)
            fail(PI_ERR_ARGUMENT, "token id " + std::to_string(tokens[i]) + " is outside the vocabulary (0.." +
                                      std::to_string(hp_.n_vocab - 1) + ")");
}

void Engine::eval(const int32_t *tokens, int32_t n, float *logits, bool all_logits) {
    in_batches(tokens, n, true, [&](int64_t done, int64_t chunk) {
        float *out = all_logits && logits ? logits + done * hp_.n_vocab : nullptr;
        forward(tokens + done, chunk, out, hp_.n_vocab, all_logits || done + chunk == n);
    });
    if (logits && !all_logits) std::memcpy(logits, rs_->seq().last_logits.data(), size_t(hp_.n_vocab) * sizeof(float));
}

void Engine::set_expert_trace(bool on) {
    if (on && hp_.n_expert == 0) fail(PI_ERR_UNSUPPORTED, "the expert trace records a mixture of experts' routing: this model has no experts");
    expert_trace_ = on;
    trace_.clear();
    trace_tokens_ = 0;
}

void Engine::expert_choices(int32_t *out, int32_t n) const {
    if (!expert_trace_) fail(PI_ERR_ARGUMENT, "the expert trace is off: call pi_set_expert_trace before pi_eval");
    if (!out) fail(PI_ERR_ARGUMENT, "choices is NULL");
    if (n != trace_tokens_)
        fail(PI_ERR_ARGUMENT, "the last eval ran " + std::to_string(trace_tokens_) + " tokens, not " + std::to_string(n));
    std::copy(trace_.begin(), trace_.end(), out);
}

void Engine::in_batches(const int32_t *tokens, int32_t n, bool makes_logits,
                        const std::function<void(int64_t, int64_t)> &batch) {
    check_tokens(tokens, n);
    const auto t0 = std::chrono::steady_clock::now();
    rs_->seq().logits_current = makes_logits;
    if (expert_trace_) {
        trace_.assign(size_t(n) * size_t(hp_.n_layer * hp_.n_expert_used), -1);
        trace_tokens_ = n;
    }
    for (int64_t done = 0; done < n;) {
        const int64_t chunk = std::min<int64_t>(n_batch_, n - done);
        trace_at_ = done;
        batch(done, chunk);
        done += chunk;
    }
    stats_.take_eval(n, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

int32_t Engine::sample(const pi_sampling &p, const uint32_t *allowed, int64_t n_words) {
    if (rs_->seq().n_past == 0) fail(PI_ERR_ARGUMENT, "nothing evaluated yet: call pi_eval before pi_sample");
    if (!rs_->seq().logits_current) fail(PI_ERR_ARGUMENT, "the last evaluation made hidden states, not logits: call pi_eval before pi_sample");
    if (!(p.temperature >= 0.0f || p.temperature < 0.0f)) fail(PI_ERR_ARGUMENT, "temperature is NaN");
    if (!(p.repeat_penalty > 0.0f)) fail(PI_ERR_ARGUMENT, "repeat_penalty must be > 0");
    if (!(p.top_p > 0.0f)) fail(PI_ERR_ARGUMENT, "top_p must be > 0");
    if (!std::isfinite(p.frequency_penalty) || !std::isfinite(p.presence_penalty))
        fail(PI_ERR_ARGUMENT, "frequency_penalty and presence_penalty must be finite");
    if (allowed && n_words < (int64_t(hp_.n_vocab) + 31) / 32)
        fail(PI_ERR_ARGUMENT, "the token mask has " + std::to_string(n_words) + " words, the vocabulary needs " +
                                  std::to_string((int64_t(hp_.n_vocab) + 31) / 32));
    const int32_t token = sampler_.sample(rs_->seq().last_logits.data(), p, rs_->seq().history.data(), rs_->seq().n_past, rs_->seq().rng, allowed);
    if (token < 0) fail(PI_ERR_ARGUMENT, "the token mask allows no token");
    return token;
}

const std::string &Engine::info_json() {
    static const char *gpu_modes[] = {"off", "auto", "on"};
    const RunSettings run{n_ctx_, n_batch_, n_seq_, pool_->size(), ks_->isa, hot_->name(), policy_.mode(), recall_check_, rs_->kv_type,
                          RunState::kv_cache_bytes(hp_, n_ctx_, rs_->kv_type, n_seq_), work_buffer_bytes(pool_->size()),
                          gpu_modes[gpu_mode_], device_ ? &device_->use() : nullptr, &gpu_off_, gpuidx_ignored_};
    json_ = pi::info_json(*model_, run);
    return json_;
}

const std::string &Engine::stats_json() {
    WeightCopies copies = model_->weight_copies();
    copies.hot = size_t(hot_->weight_bytes());
    copies.input_columns = input_columns_bytes();
    json_ = pi::stats_json(*model_, copies, stats_, policy_, device_ ? &device_->use() : nullptr, disk_.get(), experts_.get(), in_kernels_);
    return json_;
}

}  // namespace pi
