// The device tier backend: the hot tier's layers on a GPU through a device library (pi_device.h), as many as the
// VRAM budget holds, in layer order; the layers past it keep their hot tier on the CPU backend (docs/engine.md,
// "The GPU tier"). A job on the device runs while the engine's threads compute the cold tier: submit hands it
// to the device's stream and returns, wait collects its output.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu_backend.h"
#include "backend/tier_backend.h"
#include "pi_device.h"

namespace pi {

// What the device holds and did, for pi_info_json and pi_stats_json.
struct DeviceUse {
    std::string library, device_name;
    int32_t device = 0;
    double free_bytes = 0, total_bytes = 0, budget_bytes = 0;
    int64_t layers_on_device = 0, hot_layers = 0;
    double device_bytes = 0;  // what the device library allocated (weights and scratch)
    double jobs = 0, tokens = 0, h2d_bytes = 0, d2h_bytes = 0;
    double device_seconds = 0;  // the jobs' time on the device, input copy to output copy
    double wait_seconds = 0;    // time the engine waited for the device after computing the cold tier
};

class DeviceTierBackend : public TierBackend {
public:
    // budget_bytes <= 0: the device's free memory less a reserve for its runtime. A budget above the free
    // memory is refused (PI_ERR_MEMORY). cpu_* configure the CPU backend of the layers past the budget.
    DeviceTierBackend(const pi_device_api &api, const std::string &library, int32_t device, int64_t budget_bytes,
                      const HParams &hp, const KernelSet &ks, ThreadPool &pool, int64_t n_batch, int64_t max_rank,
                      int64_t largest_tier);
    ~DeviceTierBackend() override;
    const char *name() const override { return api_.name; }
    void upload(int64_t il, const Layer &layer, const FfnTier &tier) override;
    void submit(const TierJob &job) override;
    TierCounts wait() override;
    double weight_bytes() const override { return cpu_.weight_bytes(); }  // host copies: the CPU layers'
    const DeviceUse &use() const { return use_; }

    // Host bytes upload will take for `layers`, by its rule (a prefix of the layers within the budget): the
    // largest layer's rows gathered on their way to the device, and the copies of the layers past the budget.
    double host_bytes(const std::vector<Layer> &layers) const;

    // Device bytes of a layer's hot rows (and biases) and of a tier's scratch for `rows` neurons per layer.
    static double layer_bytes(const HParams &hp, const Layer &layer, const FfnTier &tier);
    static double scratch_bytes(const HParams &hp, int64_t n_batch, int64_t rows);

private:
    std::string error(const char *what) const;

    const pi_device_api &api_;
    const HParams hp_;
    pi_device_tier *tier_ = nullptr;
    CpuTierBackend cpu_;
    std::vector<uint8_t> on_device_;  // by layer
    double room_ = 0;                 // budget left for layers
    bool job_on_device_ = false;
    mutable char err_[512] = {};
    DeviceUse use_;
};

}  // namespace pi
