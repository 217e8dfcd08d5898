#include "model/tier_plan.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "model/disk_tier.h"
#include "pi_names.h"
#include "runtime/common.h"

namespace pi {
namespace {

constexpr uint32_t kTierPlanVersion = 3;  // 1: no expert section, 2: no device experts (both still read)
constexpr size_t kHeaderBytes = 4 + 3 * 4 + 2 * 8;  // magic, version, n_layer, n_ff, the two budgets
constexpr int64_t kMaxLayers = int64_t(1) << 16;    // tier_plan.py's MAX_LAYERS

uint32_t u32_at(const std::vector<uint8_t> &b, size_t at) {
    uint32_t v;
    std::memcpy(&v, b.data() + at, 4);
    return v;
}

}  // namespace

bool read_tier_plan(const std::string &path, int64_t n_layer, int64_t n_ff, int64_t n_expert, TierPlan &plan) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO must not make open wait
    if (fd < 0) {
        if (errno == ENOENT) return false;
        fail(PI_ERR_IO, path + ": cannot open the tier plan (" + std::strerror(errno) + ")");
    }
    std::vector<uint8_t> raw;
    struct stat st;
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    // the largest plan for this model: its dense counts, n_expert, each layer's three expert counts and all its experts
    // (pinned or on the device)
    const int64_t layers = std::min(std::max<int64_t>(n_layer, 0), kMaxLayers), experts = std::max<int64_t>(n_expert, 0);
    const int64_t largest = int64_t(kHeaderBytes) + 8 * layers + 4 + (12 + 4 * experts) * layers + 8;
    bool read_all = regular && st.st_size <= largest;
    if (read_all) {
        raw.resize(size_t(st.st_size));
        for (size_t done = 0; read_all && done < raw.size();) {
            const ssize_t n = ::pread(fd, raw.data() + done, raw.size() - done, off_t(done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) read_all = false;
            else done += size_t(n);
        }
    }
    ::close(fd);
    if (!regular) fail(PI_ERR_FORMAT, path + ": not a regular file");
    if (!read_all || raw.size() < kHeaderBytes + 8) fail(PI_ERR_FORMAT, path + ": too short or too long for a tier plan");
    const uint32_t version = u32_at(raw, 4);
    if (std::memcmp(raw.data(), names::kTierPlanMagic, 4) != 0 || version < 1 || version > kTierPlanVersion)
        fail(PI_ERR_FORMAT, path + ": not a version 1 to " + std::to_string(kTierPlanVersion) + " tier plan");
    if (int64_t(u32_at(raw, 8)) != n_layer || int64_t(u32_at(raw, 12)) != n_ff)
        fail(PI_ERR_FORMAT, path + ": made for " + std::to_string(u32_at(raw, 8)) + " layers of " +
                                std::to_string(u32_at(raw, 12)) + " neurons, not this model's " + std::to_string(n_layer) +
                                " of " + std::to_string(n_ff) + " (pi-tools plan --memory-budget writes it anew)");
    const size_t dense_end = kHeaderBytes + 8 * size_t(n_layer);
    size_t expected = dense_end + 8;
    int64_t file_experts = 0, all_pinned = 0, all_device = 0;
    size_t device_at = 0;  // version 3: where the device counts start
    if (version >= 2) {
        if (raw.size() < dense_end + 4 + 8) fail(PI_ERR_FORMAT, path + ": its size does not match its " + std::to_string(n_layer) + " layers");
        file_experts = u32_at(raw, dense_end);
        if (file_experts != n_expert)
            fail(PI_ERR_FORMAT, path + ": made for " + std::to_string(file_experts) + " experts a layer, not this model's " +
                                    std::to_string(n_expert) + " (pi-tools plan --memory-budget writes it anew)");
        expected = dense_end + 4 + 8;
        if (file_experts > 0) {
            expected += 8 * size_t(n_layer);
            if (raw.size() < expected) fail(PI_ERR_FORMAT, path + ": its size does not match its " + std::to_string(n_layer) + " layers");
            for (int64_t il = 0; il < n_layer; ++il) {
                const int64_t slots = u32_at(raw, dense_end + 4 + size_t(il) * 8), pinned = u32_at(raw, dense_end + 8 + size_t(il) * 8);
                if (slots + pinned > n_expert)
                    fail(PI_ERR_FORMAT, path + ": layer " + std::to_string(il) + " pins " + std::to_string(pinned) + " experts and caches " +
                                            std::to_string(slots) + ", more than its " + std::to_string(n_expert));
                all_pinned += pinned;
            }
            expected += 4 * size_t(all_pinned);
            if (version >= 3) {  // each layer's device count after the table, then (after the pinned ids) their ids
                if (raw.size() < expected + 4 * size_t(n_layer)) fail(PI_ERR_FORMAT, path + ": its size does not match its " + std::to_string(n_layer) + " layers");
                device_at = dense_end + 4 + 8 * size_t(n_layer);
                for (int64_t il = 0; il < n_layer; ++il) {
                    const int64_t on_device = u32_at(raw, device_at + size_t(il) * 4);
                    const int64_t slots = u32_at(raw, dense_end + 4 + size_t(il) * 8), pinned = u32_at(raw, dense_end + 8 + size_t(il) * 8);
                    if (slots + pinned + on_device > n_expert)
                        fail(PI_ERR_FORMAT, path + ": layer " + std::to_string(il) + " puts " + std::to_string(on_device) +
                                                " experts on the device, pins " + std::to_string(pinned) + " and caches " +
                                                std::to_string(slots) + ", more than its " + std::to_string(n_expert));
                    all_device += on_device;
                }
                expected += 4 * size_t(n_layer) + 4 * size_t(all_device);
            }
        }
    }
    if (raw.size() != expected)
        fail(PI_ERR_FORMAT, path + ": its size does not match its " + std::to_string(n_layer) + " layers" +
                                (file_experts > 0 ? " and their pinned and device experts" : ""));
    const size_t body = raw.size() - 8;
    uint64_t sum;
    std::memcpy(&sum, raw.data() + body, 8);
    if (bundle_checksum(raw.data(), body, 0) != sum) fail(PI_ERR_FORMAT, path + ": damaged (checksum mismatch)");
    plan.gpu.assign(size_t(n_layer), 0);
    plan.memory.assign(size_t(n_layer), 0);
    for (int64_t il = 0; il < n_layer; ++il) {
        const int64_t gpu = u32_at(raw, kHeaderBytes + size_t(il) * 8), memory = u32_at(raw, kHeaderBytes + size_t(il) * 8 + 4);
        if (gpu + memory > n_ff)
            fail(PI_ERR_FORMAT, path + ": layer " + std::to_string(il) + " places " + std::to_string(gpu + memory) +
                                    " neurons on the GPU and in memory, more than its " + std::to_string(n_ff));
        plan.gpu[size_t(il)] = gpu;
        plan.memory[size_t(il)] = memory;
    }
    plan.expert_slots.clear();
    plan.pinned.clear();
    plan.device.clear();
    if (file_experts == 0) return true;
    plan.expert_slots.resize(size_t(n_layer));
    plan.pinned.resize(size_t(n_layer));
    if (version >= 3) plan.device.resize(size_t(n_layer));
    std::vector<std::vector<bool>> seen(size_t(n_layer), std::vector<bool>(size_t(n_expert), false));
    // an id list of layer il (pinned or on the device), each id below n_expert and in neither list twice
    const auto ids = [&](int64_t il, size_t at, int64_t n, const char *verb, std::vector<int32_t> &out) {
        for (int64_t j = 0; j < n; ++j, at += 4) {
            const int64_t e = u32_at(raw, at);
            if (e >= n_expert || seen[size_t(il)][size_t(e)])
                fail(PI_ERR_FORMAT, path + ": layer " + std::to_string(il) + " " + verb + " expert " + std::to_string(e) +
                                        (e >= n_expert ? ", past its " + std::to_string(n_expert)
                                         : &out == &plan.pinned[size_t(il)] ? std::string(" twice")
                                                                            : std::string(" twice, or pins it too")));
            seen[size_t(il)][size_t(e)] = true;
            out.push_back(int32_t(e));
        }
        return at;
    };
    size_t at = dense_end + 4 + 8 * size_t(n_layer) + (version >= 3 ? 4 * size_t(n_layer) : 0);
    for (int64_t il = 0; il < n_layer; ++il) {
        plan.expert_slots[size_t(il)] = u32_at(raw, dense_end + 4 + size_t(il) * 8);
        at = ids(il, at, u32_at(raw, dense_end + 8 + size_t(il) * 8), "pins", plan.pinned[size_t(il)]);
    }
    if (version >= 3) {
        for (int64_t il = 0; il < n_layer; ++il)
            at = ids(il, at, u32_at(raw, device_at + size_t(il) * 4), "puts on the device", plan.device[size_t(il)]);
    }
    return true;
}

}  // namespace pi
