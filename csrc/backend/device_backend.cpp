#include "backend/device_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "device/expert_math.h"
#include "runtime/common.h"

namespace pi {
namespace {

// The runtime's own needs beside the tier's (its context is made before free memory is read; kernels' stacks,
// the allocator's rounding): what an unset budget leaves free.
double default_reserve(double total) { return std::max(256.0 * (1 << 20), 0.05 * total); }

std::vector<float> gather_bias(const Matrix &b, const std::vector<int32_t> &ids) {
    std::vector<float> out;
    if (!b.data) return out;
    for (int32_t id : ids) out.push_back(b.floats()[id]);
    return out;
}

}  // namespace

DeviceTierBackend::DeviceTierBackend(const pi_device_api &api, const std::string &library, int32_t device,
                                     int64_t budget_bytes, const Model &model, const KernelSet &ks, ThreadPool &pool,
                                     int64_t n_batch, int64_t n_ctx, bool kv_f16, bool with_attention,
                                     int64_t max_rank, int64_t largest_tier,
                                     const std::vector<std::vector<int32_t>> *experts)
    : api_(api), hp_(model.hp()), cpu_(model.hp(), ks, pool, n_batch, max_rank, true), n_batch_(n_batch), n_ctx_(n_ctx), kv_f16_(kv_f16) {
    use_.library = library;
    use_.device = device;
    uint64_t free = 0, total = 0;
    char device_name[256] = {};
    if (api_.device_memory(device, &free, &total, device_name, sizeof device_name, err_, sizeof err_))
        fail(PI_ERR_UNSUPPORTED, error("reading the device's memory"));
    use_.device_name = device_name;
    use_.free_bytes = double(free);
    use_.total_bytes = double(total);
    if (budget_bytes > 0 && double(budget_bytes) > double(free))
        fail(PI_ERR_MEMORY, "a VRAM budget of " + gib(double(budget_bytes)) + " is more than the " + gib(double(free)) +
                                " free on device " + std::to_string(device) + " (" + device_name + ")");
    use_.budget_bytes = budget_bytes > 0 ? double(budget_bytes) : std::max(0.0, double(free) - default_reserve(double(total)));
    const pi_device_tier_desc desc = device_tier_desc(hp_, device, n_batch, n_ctx, kv_f16, nullptr, nullptr);
    const std::vector<Layer> &layers = model.layers();
    if (experts && !layers.empty() && layers[0].experts.present()) {
        if (const char *why = device::refuse_expert(device_expert(layers[0].experts, 0), desc))
            fail(PI_ERR_UNSUPPORTED, std::string("the plan puts experts on the device, which cannot take them: ") + why);
    }
    use_.placement = place_on_device(desc, model, use_.budget_bytes, with_attention, largest_tier, experts);
    const DevicePlacement &p = use_.placement;
    int64_t planned = 0;
    for (const auto &layer : experts ? *experts : std::vector<std::vector<int32_t>>()) planned += int64_t(layer.size());
    if (planned > 0 && p.experts_placed() == 0)
        fail(PI_ERR_MEMORY, "the tier plan beside the model puts " + std::to_string(planned) + " experts on the device, " +
                                gib(device::experts_scratch_bytes(desc) + double(planned) *
                                    device::expert_bytes(device_expert(layers[0].experts, 0))) +
                                " with their scratch, more than the " + gib(std::max(0.0, p.expert_room)) + " the VRAM budget of " +
                                gib(use_.budget_bytes) + " leaves after the scratch, output head and attention; plan again "
                                "at this budget (pi-tools plan --vram-budget)");
    if (p.experts_placed() > 0) {
        expert_mask_.assign(size_t(hp_.n_layer * hp_.n_expert), 0);
        layer_has_experts_.assign(size_t(hp_.n_layer), 0);
        for (size_t il = 0; il < p.experts.size(); ++il)
            for (int32_t e : p.experts[il]) {
                expert_mask_[il * size_t(hp_.n_expert) + size_t(e)] = 1;
                layer_has_experts_[il] = 1;
            }
    }
}

void DeviceTierBackend::begin(const Model &model, const float *rope_cos, const float *rope_sin) {
    const DevicePlacement &p = use_.placement;
    const std::vector<Layer> &layers = model.layers();
    if (!p.head && p.attention_layers() == 0 && p.hot_layers() == 0 && p.experts_placed() == 0) return;  // nothing: no tier
    const pi_device_tier_desc desc = device_tier_desc(hp_, use_.device, n_batch_, n_ctx_, kv_f16_, rope_cos, rope_sin);
    tier_ = api_.tier_create(&desc, err_, sizeof err_);
    if (!tier_) fail(PI_ERR_MEMORY, error("setting up the tier"));
    const pi_device_head h = device_head(model);
    if (p.head && api_.head_upload(tier_, &h, err_, sizeof err_)) fail(PI_ERR_MEMORY, error("uploading the output head"));
    for (size_t il = 0; il < layers.size(); ++il) {
        if (!p.attention[il]) continue;
        const pi_device_attention a = device_attention(hp_, layers[il]);
        if (api_.attention_upload(tier_, &a, int32_t(il), err_, sizeof err_))
            fail(PI_ERR_MEMORY, error(("uploading layer " + std::to_string(il) + "'s attention").c_str()));
    }
    for (size_t il = 0; il < p.experts.size(); ++il)
        for (int32_t e : p.experts[il]) {
            const pi_device_expert x = device_expert(layers[il].experts, e);
            if (api_.expert_upload(tier_, &x, int32_t(il), e, err_, sizeof err_))
                fail(PI_ERR_MEMORY, error(("uploading layer " + std::to_string(il) + "'s expert " + std::to_string(e)).c_str()));
            use_.experts_on_device += 1;
        }
    use_.device_bytes = double(api_.tier_bytes(tier_));
    layer_counts_.resize(layers.size());
    if (api_.copy_rate(use_.device, &use_.copy_rate, err_, sizeof err_)) fail(PI_ERR_INTERNAL, error("probing its copy rate"));
}

void DeviceTierBackend::head(int64_t n_tok, const float *x, int64_t first, float *logits, int64_t ld) {
    const pi_device_head_job job{int32_t(n_tok), x, logits, ld, int32_t(first)};
    pi_device_counts dc{};
    if (api_.head_run(tier_, &job, &dc, err_, sizeof err_)) fail(PI_ERR_INTERNAL, error("running the output head"));
    use_.take(dc, &use_.head_jobs, &use_.head_seconds);
}

bool DeviceTierBackend::runs_layer(int64_t il) const {
    return attends(il) && use_.placement.hot[size_t(il)] != 0 && !hp_.parallel_block;
}

void DeviceTierBackend::layer(int64_t il, int64_t n_tok, int64_t n_past, bool dense, const float *x_in, float *x_out) {
    const pi_device_layer_job job{int32_t(il), int32_t(n_tok), int32_t(n_past), dense ? 1 : 0, x_in, x_out,
                                  &layer_counts_[size_t(il)]};
    if (api_.layer_run(tier_, &job, err_, sizeof err_))
        fail(PI_ERR_INTERNAL, error(("running layer " + std::to_string(il)).c_str()));
    pending_layers_.push_back({il, false});
    use_.tokens += double(n_tok);
}

void DeviceTierBackend::split_begin(int64_t il, int64_t n_tok, int64_t n_past, int32_t hot_mode, const float *x_in,
                                    float *x_mid, float *xn) {
    split_ = pi_device_split_job{int32_t(il), int32_t(n_tok), int32_t(n_past), hot_mode, x_in, x_mid, xn,
                                 &layer_counts_[size_t(il)]};
    if (api_.split_begin(tier_, &split_, err_, sizeof err_))
        fail(PI_ERR_INTERNAL, error(("running layer " + std::to_string(il) + "'s attention and hot rows").c_str()));
}

void DeviceTierBackend::split_end(const float *y_cold, float *x_out) {
    if (api_.split_end(tier_, y_cold, x_out, err_, sizeof err_))
        fail(PI_ERR_INTERNAL, error(("adding layer " + std::to_string(split_.layer) + "'s tiers").c_str()));
    pending_layers_.push_back({split_.layer, true});
    use_.tokens += double(split_.n_tok);
}

std::vector<std::pair<int64_t, TierCounts>> DeviceTierBackend::take_layers() {
    std::vector<std::pair<int64_t, TierCounts>> out;
    for (const auto &[il, split] : pending_layers_) {
        const pi_device_counts &dc = layer_counts_[size_t(il)];
        if (split) use_.take(dc, &use_.split_jobs, &use_.split_seconds);
        else use_.take(dc, &use_.layer_jobs, &use_.layer_seconds);
        TierCounts c;
        c.active = dc.active;
        c.computed = dc.computed;
        out.push_back({il, c});
    }
    pending_layers_.clear();
    return out;
}

void DeviceTierBackend::attend(int64_t il, int64_t n_tok, int64_t n_past, const float *x, float *out) {
    const pi_device_attention_job job{int32_t(il), int32_t(n_tok), int32_t(n_past), x, out};
    pi_device_counts dc{};
    if (api_.attention_run(tier_, &job, &dc, err_, sizeof err_)) fail(PI_ERR_INTERNAL, error("running attention"));
    use_.take(dc, &use_.attention_jobs, &use_.attention_seconds);
}

void DeviceTierBackend::experts_submit(const pi_device_experts_job &job) {
    if (api_.experts_submit(tier_, &job, err_, sizeof err_))
        fail(PI_ERR_INTERNAL, error(("starting layer " + std::to_string(job.layer) + "'s device experts").c_str()));
    use_.expert_pairs += double(job.n_pairs);
}

TierCounts DeviceTierBackend::experts_wait() {
    pi_device_counts dc{};
    const auto t0 = std::chrono::steady_clock::now();
    if (api_.experts_wait(tier_, &dc, err_, sizeof err_)) fail(PI_ERR_INTERNAL, error("running the device experts"));
    use_.expert_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    use_.take(dc, &use_.expert_jobs, &use_.expert_seconds);
    TierCounts c;
    c.active = dc.active;
    c.computed = dc.computed;
    return c;
}

DeviceTierBackend::~DeviceTierBackend() {
    if (tier_) api_.tier_destroy(tier_);
}

std::string DeviceTierBackend::error(const char *what) const {
    return std::string("device ") + std::to_string(use_.device) + " (" + api_.name + "): " + what + ": " + err_;
}

double DeviceTierBackend::host_bytes(const std::vector<Layer> &layers) const {
    double staging = 0, on_cpu = 0;
    for (size_t il = 0; il < layers.size(); ++il) {
        const Layer &L = layers[il];
        if (L.hot.size() == 0) continue;
        const double copy = L.hot.copy_bytes(hp_.gated);
        if (use_.placement.hot[il]) staging = std::max(staging, copy);
        else on_cpu += copy;
    }
    return staging + on_cpu;
}

void DeviceTierBackend::upload(int64_t il, const Layer &L, const FfnTier &T) {
    use_.hot_layers += 1;
    if (!tier_ || !use_.placement.hot[size_t(il)]) {  // past the budget: this layer's hot tier stays on the CPU
        cpu_.upload(il, L, T);
        return;
    }
    const std::vector<uint8_t> gate = gather_rows(L.gate, T.ids), up = hp_.gated ? gather_rows(L.up, T.ids) : std::vector<uint8_t>(),
                               down = gather_rows(L.down_t, T.ids);
    const std::vector<float> gate_b = gather_bias(L.gate_b, T.ids), up_b = hp_.gated ? gather_bias(L.up_b, T.ids) : std::vector<float>();
    const pi_device_layer rows{int32_t(T.size()), L.gate.type, L.up.type, L.down_t.type, gate.data(),
                               hp_.gated ? up.data() : nullptr, down.data(), gate_b.empty() ? nullptr : gate_b.data(),
                               up_b.empty() ? nullptr : up_b.data(), L.act_threshold};
    if (api_.tier_upload(tier_, &rows, int32_t(il), err_, sizeof err_))
        fail(PI_ERR_MEMORY, error(("uploading layer " + std::to_string(il)).c_str()));
    const pi_device_predictor predictor = device_predictor(L);
    if (use_.placement.predictor[size_t(il)] && api_.predictor_upload(tier_, &predictor, int32_t(il), err_, sizeof err_))
        fail(PI_ERR_MEMORY, error(("uploading layer " + std::to_string(il) + "'s predictor").c_str()));
    use_.layers_on_device += 1;
    use_.device_bytes = double(api_.tier_bytes(tier_));
}

void DeviceTierBackend::submit(const TierJob &job) {
    job_on_device_ = tier_ && use_.placement.hot[size_t(job.layer)] != 0;
    if (!job_on_device_) return cpu_.submit(job);
    const pi_device_job dj{int32_t(job.layer), int32_t(job.n_tok), job.mode == TierMode::Dense ? 1 : 0, job.xn->f, job.y};
    if (api_.tier_submit(tier_, &dj, err_, sizeof err_)) fail(PI_ERR_INTERNAL, error("starting a job"));
    use_.tokens += double(job.n_tok);
}

TierCounts DeviceTierBackend::wait() {
    if (!job_on_device_) return cpu_.wait();
    pi_device_counts dc{};
    const auto t0 = std::chrono::steady_clock::now();
    if (api_.tier_wait(tier_, &dc, err_, sizeof err_)) fail(PI_ERR_INTERNAL, error("running a job"));
    use_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    use_.jobs += 1;
    use_.traffic(dc);
    use_.device_seconds += dc.seconds;
    TierCounts c;
    c.active = dc.active;
    c.computed = dc.computed;
    return c;
}

}  // namespace pi
