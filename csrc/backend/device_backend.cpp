#include "backend/device_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "runtime/common.h"

namespace pi {
namespace {

// The runtime's own needs beside the tier's (its context is made before free memory is read; kernels' stacks,
// the allocator's rounding): what an unset budget leaves free.
double default_reserve(double total) { return std::max(256.0 * (1 << 20), 0.05 * total); }

std::string gib(double bytes) {
    char b[32];
    std::snprintf(b, sizeof b, "%.2f GiB", bytes / double(1 << 30));
    return b;
}

int32_t device_activation(const HParams &hp) {
    return hp.activation == Activation::Silu ? PI_DEVICE_ACT_SILU
           : hp.activation == Activation::DRelu ? PI_DEVICE_ACT_DRELU : PI_DEVICE_ACT_RELU;
}

std::vector<float> gather_bias(const Matrix &b, const std::vector<int32_t> &ids) {
    std::vector<float> out;
    if (!b.data) return out;
    for (int32_t id : ids) out.push_back(b.floats()[id]);
    return out;
}

}  // namespace

double DeviceTierBackend::layer_bytes(const HParams &hp, const Layer &L, const FfnTier &T) {
    const double n = double(T.size());
    double row = double(L.gate.row_bytes + L.down_t.row_bytes) + (hp.gated ? double(L.up.row_bytes) : 0.0);
    if (L.gate_b.data) row += 4;
    if (hp.gated && L.up_b.data) row += 4;
    return n * row;
}

double DeviceTierBackend::scratch_bytes(const HParams &hp, int64_t n_batch, int64_t rows) {
    const double E = double(hp.n_embd), B = double(n_batch);
    return B * E * 4 * 2 + B * (E / QK) * sizeof(BlockQ8_0) + B * double(rows) * 4 + 16;
}

DeviceTierBackend::DeviceTierBackend(const pi_device_api &api, const std::string &library, int32_t device,
                                     int64_t budget_bytes, const HParams &hp, const KernelSet &ks, ThreadPool &pool,
                                     int64_t n_batch, int64_t max_rank, int64_t largest_tier)
    : api_(api), hp_(hp), cpu_(hp, ks, pool, n_batch, max_rank, true), on_device_(size_t(hp.n_layer), 0) {
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
    room_ = use_.budget_bytes - scratch_bytes(hp, n_batch, largest_tier);
    const pi_device_tier_desc desc{device, int32_t(hp.n_embd), int32_t(hp.n_layer), int32_t(n_batch),
                                   device_activation(hp), hp.gated ? 1 : 0};
    if (room_ > 0) {
        tier_ = api_.tier_create(&desc, err_, sizeof err_);
        if (!tier_) fail(PI_ERR_MEMORY, error("setting up the hot tier"));
    }
}

DeviceTierBackend::~DeviceTierBackend() {
    if (tier_) api_.tier_destroy(tier_);
}

std::string DeviceTierBackend::error(const char *what) const {
    return std::string("device ") + std::to_string(use_.device) + " (" + api_.name + "): " + what + ": " + err_;
}

double DeviceTierBackend::host_bytes(const std::vector<Layer> &layers) const {
    double room = tier_ ? room_ : -1, staging = 0, on_cpu = 0;
    for (const Layer &L : layers) {
        if (L.hot.size() == 0) continue;
        const double need = layer_bytes(hp_, L, L.hot), copy = L.hot.copy_bytes(hp_.gated);
        if (need > room) {
            on_cpu += copy;
            room = -1;
        } else {
            staging = std::max(staging, copy);
            room -= need;
        }
    }
    return staging + on_cpu;
}

void DeviceTierBackend::upload(int64_t il, const Layer &L, const FfnTier &T) {
    use_.hot_layers += 1;
    const double need = layer_bytes(hp_, L, T);
    if (!tier_ || need > room_) {  // past the budget: this layer's hot tier stays on the CPU
        cpu_.upload(il, L, T);
        room_ = -1;  // and every later one: the device holds a prefix of the layers
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
    on_device_[size_t(il)] = 1;
    room_ -= need;
    use_.layers_on_device += 1;
    use_.device_bytes = double(api_.tier_bytes(tier_));
}

void DeviceTierBackend::submit(const TierJob &job) {
    job_on_device_ = on_device_[size_t(job.layer)] != 0;
    if (!job_on_device_) return cpu_.submit(job);
    const pi_device_job dj{int32_t(job.layer), int32_t(job.n_tok), job.mode == TierMode::Dense ? 1 : 0, job.xn->f,
                           job.xn->q_ready ? job.xn->q : nullptr, job.y};
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
    use_.h2d_bytes += dc.h2d_bytes;
    use_.d2h_bytes += dc.d2h_bytes;
    use_.device_seconds += dc.seconds;
    TierCounts c;
    c.active = dc.active;
    c.computed = dc.computed;
    return c;
}

}  // namespace pi
