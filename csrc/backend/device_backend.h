// The device tier backend: what a GPU holds of the model through a device library (pi_device.h), as the VRAM budget
// places it (backend/device_placement.h): the attention blocks and KV caches of a prefix of the layers, which the
// engine's forward pass hands to attend(), and the hot tier's rows of a prefix of the layers; the layers past the
// budget keep their hot tier on the CPU backend (docs/engine.md, "The GPU tier"). A hot tier's job on the device
// runs while the engine's threads compute the cold tier: submit hands it to the device's stream and returns, wait
// collects its output.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu_backend.h"
#include "backend/device_placement.h"
#include "backend/tier_backend.h"
#include "pi_device.h"

namespace pi {

// What the device holds and did, for pi_info_json and pi_stats_json.
struct DeviceUse {
    std::string library, device_name;
    int32_t device = 0;
    double free_bytes = 0, total_bytes = 0, budget_bytes = 0;
    int64_t layers_on_device = 0, hot_layers = 0;  // layers whose hot rows are on the device; layers with a hot tier
    DevicePlacement placement;
    double device_bytes = 0;  // what the device library allocated (weights, KV caches and scratch)
    double jobs = 0, tokens = 0, h2d_bytes = 0, d2h_bytes = 0;
    double device_seconds = 0;  // the hot tier's jobs' time on the device, input copy to output copy
    double wait_seconds = 0;    // time the engine waited for the device after computing the cold tier
    // attention blocks run on the device: how many, their traffic (in h2d_bytes and d2h_bytes too) and time
    double attention_jobs = 0, attention_seconds = 0;
    double head_jobs = 0, head_seconds = 0;  // the output head's, likewise
    double layer_jobs = 0, layer_seconds = 0;  // whole layers run on the device (their tokens in `tokens`)
    double split_jobs = 0, split_seconds = 0;  // split layers (attention and hot rows there, the cold tier here)
    // a mixture's experts on the device: how many, their jobs' count, pairs, time on the device, and the time the
    // engine waited for them after computing its own experts
    int64_t experts_on_device = 0;
    double expert_jobs = 0, expert_pairs = 0, expert_seconds = 0, expert_wait_seconds = 0;
    // every job's kernels launched and bytes read from device memory, and the device's copy rate (bytes read and
    // written per second) they are measured against: device_read_bytes / copy_rate is the jobs' floor
    double launches = 0, device_read_bytes = 0, copy_rate = 0;

    // The jobs' counts from zero again (pi_stats_reset), what is placed and held kept.
    void reset_counts() {
        jobs = tokens = h2d_bytes = d2h_bytes = device_seconds = wait_seconds = 0;
        attention_jobs = attention_seconds = head_jobs = head_seconds = layer_jobs = layer_seconds = 0;
        split_jobs = split_seconds = 0;
        expert_jobs = expert_pairs = expert_seconds = expert_wait_seconds = 0;
        launches = device_read_bytes = 0;
    }
    // A job's traffic over the bus and on the device.
    void traffic(const pi_device_counts &c) {
        h2d_bytes += c.h2d_bytes;
        d2h_bytes += c.d2h_bytes;
        launches += c.launches;
        device_read_bytes += c.device_bytes;
    }
    // A synchronous job's counts into its kind's (attention's, the head's) and the traffic.
    void take(const pi_device_counts &c, double *kind_jobs, double *kind_seconds) {
        *kind_jobs += 1;
        *kind_seconds += c.seconds;
        traffic(c);
    }
};

class DeviceTierBackend : public TierBackend {
public:
    // budget_bytes <= 0: the device's free memory less a reserve for its runtime. A budget above the free
    // memory is refused (PI_ERR_MEMORY). The placement is decided here; begin() uploads the attention blocks and
    // upload() the hot rows. cpu_* configure the CPU backend of the layers past the budget. with_attention: false
    // keeps every layer's attention on the CPU. experts: a mixture's device experts per layer (its plan's), refused
    // in one line where the budget left after the head and attention does not hold them all.
    DeviceTierBackend(const pi_device_api &api, const std::string &library, int32_t device, int64_t budget_bytes,
                      const Model &model, const KernelSet &ks, ThreadPool &pool,
                      int64_t n_batch, int64_t n_ctx, bool kv_f16, bool with_attention, int64_t max_rank,
                      int64_t largest_tier, const std::vector<std::vector<int32_t>> *experts = nullptr);
    ~DeviceTierBackend() override;
    const char *name() const override { return api_.name; }
    void upload(int64_t il, const Layer &layer, const FfnTier &tier) override;
    void submit(const TierJob &job) override;
    TierCounts wait() override;
    double weight_bytes() const override { return cpu_.weight_bytes(); }  // host copies: the CPU layers'
    const DeviceUse &use() const { return use_; }
    void reset_counts() { use_.reset_counts(); }

    // Creates the device's tier (RoPE's tables: RunState's) and uploads the output head and the placed layers'
    // attention blocks.
    void begin(const Model &model, const float *rope_cos, const float *rope_sin);
    // Whether the output head runs on the device; and running it: logits (rows ld apart) of n_tok rows x (null:
    // rows first.. of the stream the last layer() left on the device).
    bool heads() const { return tier_ && use_.placement.head; }
    void head(int64_t n_tok, const float *x, int64_t first, float *logits, int64_t ld);
    // Whether the device can run layer il whole (its attention, FFN norm and hot rows there; a sequential block);
    // the engine asks this only of a layer without a cold tier or a down bias. And running it: the residual stream
    // x += attention(x), x += ffn(x) for the batch (x_in null: the stream the last call left on the device;
    // x_out null: left there, the call maybe returning before the device is done). take_layers: the counts of the
    // layers run since the last call, once a layer() with x_out or a head() has returned.
    bool runs_layer(int64_t il) const;
    void layer(int64_t il, int64_t n_tok, int64_t n_past, bool dense, const float *x_in, float *x_out);
    std::vector<std::pair<int64_t, TierCounts>> take_layers();
    // Whether layer il can run split (its attention, FFN norm and hot rows on the device, a sequential block; the
    // engine asks this only of a layer with a cold tier and no down bias), and whether its predictor is there (to
    // select the hot rows by). Running it: split_begin, the residual stream x += attention(x) on the device (x_in
    // null: the stream the last call left there), the stream and its FFN norm down into x_mid and xn, the hot rows
    // (by hot_mode, pi_device_hot_mode) started there; then the caller's cold tier; then split_end, y_cold up and
    // x += y_hot + y_cold on the device (x_out null: the stream left there). Counts as layer()'s (take_layers).
    bool splits(int64_t il) const { return attends(il) && use_.placement.hot[size_t(il)] != 0 && !hp_.parallel_block; }
    bool predicts(int64_t il) const { return tier_ && use_.placement.predictor[size_t(il)] != 0; }
    void split_begin(int64_t il, int64_t n_tok, int64_t n_past, int32_t hot_mode, const float *x_in, float *x_mid,
                     float *xn);
    void split_end(const float *y_cold, float *x_out);
    // Whether layer il's attention runs on the device; and running it: the block's output for the batch's input x
    // at positions n_past .. n_past + n_tok - 1, into out (the layer's KV cache on the device takes the batch's).
    bool attends(int64_t il) const { return tier_ && use_.placement.attention[size_t(il)] != 0; }
    void attend(int64_t il, int64_t n_tok, int64_t n_past, const float *x, float *out);

    // A mixture's layer il: which of its experts are on the device ([expert] 1 there), or null where none is. And a
    // job of its pairs routed to them (pi_device_experts_job: the arrays untouched until experts_wait), started on
    // the device while the caller computes its own experts, then waited for: y written, the counts.
    const uint8_t *expert_mask(int64_t il) const {
        return tier_ && !expert_mask_.empty() && layer_has_experts_[size_t(il)] ? expert_mask_.data() + il * hp_.n_expert : nullptr;
    }
    void experts_submit(const pi_device_experts_job &job);
    TierCounts experts_wait();

    // Host bytes upload will take for `layers`, by the placement: the largest layer's rows gathered on their way
    // to the device, and the copies of the layers past the budget.
    double host_bytes(const std::vector<Layer> &layers) const;

private:
    std::string error(const char *what) const;

    const pi_device_api &api_;
    const HParams hp_;
    pi_device_tier *tier_ = nullptr;
    CpuTierBackend cpu_;
    const int64_t n_batch_, n_ctx_;
    const bool kv_f16_;
    bool job_on_device_ = false;
    std::vector<pi_device_counts> layer_counts_;  // [layer], written by the library by the stream's end
    std::vector<std::pair<int64_t, bool>> pending_layers_;  // layers run since the counts came down; split ones
    pi_device_split_job split_{};                             // the split layer begun
    std::vector<uint8_t> expert_mask_, layer_has_experts_;    // [layer][expert], [layer]: the placed device experts
    mutable char err_[512] = {};
    DeviceUse use_;
};

}  // namespace pi
