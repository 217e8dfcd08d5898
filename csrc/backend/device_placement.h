// What a device holds for a VRAM budget, as PowerInfer places it (docs/engine.md, "The GPU tier"): the tier's
// scratch first, then the output head (its norm and matrix, read whole by every token), then the attention blocks
// and KV caches of as many layers as fit, in layer order, then the layers' hot rows, in layer order while they fit. Each is a
// prefix of the layers: a layer past the budget, and every one after it, keeps that part on the CPU; a layer whose
// attention is placed and whose hot rows sit beside a cold tier takes its predictor with its hot rows. A mixture of
// experts has no hot rows: after the head and attention come the experts its three-tier plan puts on the device
// (model/tier_plan.h), all of them or, where the room left does not hold them, none (the plan was made for another
// budget: refused). The bytes
// charged are what the device libraries allocate (device/attention_math.h's and tier_math.h's layouts), so the
// placement is decided before anything is uploaded, and powerinfer_tools' plan reproduces it
// (stages/placement.py, device_placement).
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.h"
#include "pi_device.h"

namespace pi {

struct DevicePlacement {
    std::vector<uint8_t> attention, hot;  // by layer: on the device
    std::vector<uint8_t> predictor;       // by layer: its predictor on the device, for a split layer's hot rows
    bool head = false;                    // the output norm and head on the device
    double budget = 0;
    double head_bytes = 0;       // the head's weights and scratch
    double scratch = 0;          // the hot tier's scratch, and attention's where a layer's attention is placed
    double attention_bytes = 0;  // the placed layers' attention weights and norms
    double kv_bytes = 0;         // their KV caches
    double hot_bytes = 0;        // the placed layers' hot rows and biases
    double predictor_bytes = 0;  // the placed predictors (fc1, the hot rows' fc2, their scratch)
    std::string attention_off;   // why no layer's attention is on the device, where none is
    std::vector<std::vector<int32_t>> experts;  // [layer] a mixture's experts on the device (the plan's), or empty
    double expert_bytes = 0;     // their weights, and the experts' scratch (in `scratch` too)
    double expert_room = 0;      // what the budget left them after the scratch, head and attention
    int64_t experts_placed() const;
    int64_t attention_layers() const;
    int64_t hot_layers() const;
};

// The tier's description for a model, a batch size and a context (rope tables: RunState's, or null before they are
// made: placement reads only sizes).
pi_device_tier_desc device_tier_desc(const HParams &hp, int32_t device, int64_t n_batch, int64_t n_ctx, bool kv_f16,
                                     const float *rope_cos, const float *rope_sin);

// The device's view of a layer's attention block: pointers into the model's rows; a matrix's data is null where
// the model holds it only in 8-row groups (a matrix decoded at load: model/decode.h), which the device cannot read.
// With it the FFN's norm, which a whole layer on the device applies, except in a parallel block (the FFN reads
// attention's norm there).
pi_device_attention device_attention(const HParams &hp, const Layer &L);

// The device's view of the output norm and head (its data null where held only in 8-row groups).
pi_device_head device_head(const Model &model);

// The device's view of a layer's predictor for its hot rows (Model::keep_hot_predictor), and whether a split
// layer would run it: a sequential block with attention and hot rows on the device, a cold tier and a predictor the
// device reads (null data where the model holds fc1 only in 8-row groups).
pi_device_predictor device_predictor(const Layer &L);
bool wants_predictor(const pi_device_tier_desc &desc, const HParams &hp, const Layer &L);

// Device bytes of a layer's attention block and KV cache, and of its hot rows (and biases) for tier T.
double attention_layer_bytes(const pi_device_tier_desc &desc, const HParams &hp, const Layer &L);
double hot_layer_bytes(const HParams &hp, const Layer &L, const FfnTier &T);
double hot_scratch_bytes(const HParams &hp, int64_t n_batch, int64_t rows);

// The device's view of expert e of a mixture's layer (pointers into the model's rows).
pi_device_expert device_expert(const Experts &X, int64_t e);

// with_attention: whether attention may go to the device at all (pi_options.gpu_ffn_only clears it). experts: a
// mixture's planned device experts per layer (null or empty: none); they are placed where all fit, else none.
DevicePlacement place_on_device(const pi_device_tier_desc &desc, const Model &model, double budget,
                                bool with_attention, int64_t largest_tier,
                                const std::vector<std::vector<int32_t>> *experts = nullptr);

}  // namespace pi
