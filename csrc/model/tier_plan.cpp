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

constexpr uint32_t kTierPlanVersion = 1;
constexpr size_t kHeaderBytes = 4 + 3 * 4 + 2 * 8;  // magic, version, n_layer, n_ff, the two budgets
constexpr int64_t kMaxLayers = int64_t(1) << 16;    // tier_plan.py's MAX_LAYERS

uint32_t u32_at(const std::vector<uint8_t> &b, size_t at) {
    uint32_t v;
    std::memcpy(&v, b.data() + at, 4);
    return v;
}

}  // namespace

bool read_tier_plan(const std::string &path, int64_t n_layer, int64_t n_ff, TierPlan &plan) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO must not make open wait
    if (fd < 0) {
        if (errno == ENOENT) return false;
        fail(PI_ERR_IO, path + ": cannot open the tier plan (" + std::strerror(errno) + ")");
    }
    std::vector<uint8_t> raw;
    struct stat st;
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    const int64_t largest = int64_t(kHeaderBytes) + 8 * kMaxLayers + 8;
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
    if (std::memcmp(raw.data(), names::kTierPlanMagic, 4) != 0 || u32_at(raw, 4) != kTierPlanVersion)
        fail(PI_ERR_FORMAT, path + ": not a version " + std::to_string(kTierPlanVersion) + " tier plan");
    if (int64_t(u32_at(raw, 8)) != n_layer || int64_t(u32_at(raw, 12)) != n_ff)
        fail(PI_ERR_FORMAT, path + ": made for " + std::to_string(u32_at(raw, 8)) + " layers of " +
                                std::to_string(u32_at(raw, 12)) + " neurons, not this model's " + std::to_string(n_layer) +
                                " of " + std::to_string(n_ff) + " (pi-tools plan --memory-budget writes it anew)");
    if (raw.size() != kHeaderBytes + 8 * size_t(n_layer) + 8)
        fail(PI_ERR_FORMAT, path + ": its size does not match its " + std::to_string(n_layer) + " layers");
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
    return true;
}

}  // namespace pi
