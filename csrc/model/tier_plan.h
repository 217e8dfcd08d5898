// The three-tier plan beside a model (`pi-tools plan --memory-budget` writes it; powerinfer_tools/formats/tier_plan.py
// owns the format, docs/placement.md "Three tiers" says how it is chosen): per layer, how many of its hottest neurons
// go on the GPU and how many of the next are held in memory; the disk tier holds in memory those of a layer's
// gpu + memory hottest that its hot tier does not hold (docs/engine.md, "Models larger than memory"). For a mixture of
// experts (version 2), per layer also the experts held in memory for good (pinned) and the cache slots the layer's
// other experts share (docs/engine.md, "The expert tier"); version 3 adds the experts each layer keeps on a device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pi {

struct TierPlan {
    std::vector<int64_t> gpu, memory;  // [layer]
    // a mixture's experts (empty where the plan has none): [layer] cache slots, and the expert ids pinned in memory
    std::vector<int64_t> expert_slots;
    std::vector<std::vector<int32_t>> pinned;
    std::vector<std::vector<int32_t>> device;  // [layer] expert ids on the device (version 3; empty before)
};

// Reads the plan at `path` for a model of n_layer layers of n_ff neurons and n_expert experts (0: dense): false where
// no file is there; fails in one line where it is not a regular file, is damaged (magic, version, size, checksum) or
// is another model's shape, or a layer's counts exceed its neurons or experts, or an expert id is out of range or
// repeated, or both pinned and on the device. Version 1 files (no expert section) are read as plans without experts,
// version 2 files (no device experts) as plans without device experts.
bool read_tier_plan(const std::string &path, int64_t n_layer, int64_t n_ff, int64_t n_expert, TierPlan &plan);

}  // namespace pi
