// Memory of the KV cache: every decode step's heads read the whole of it (tens of MB at a long context), so
// it is asked for in 2 MiB pages where the kernel grants them (transparent huge pages in "madvise" mode):
// on 4 KiB pages the heads miss the TLB every 4 KiB (docs/perf-notes.md §29).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pi {

class CacheMemory {
public:
    CacheMemory() = default;
    // n_bytes zeroed bytes, 2 MiB-aligned; fails with PI_ERR_MEMORY when the system has no memory for them
    explicit CacheMemory(size_t n_bytes);
    ~CacheMemory();
    CacheMemory(const CacheMemory &) = delete;
    CacheMemory &operator=(const CacheMemory &) = delete;
    CacheMemory(CacheMemory &&other) noexcept;
    CacheMemory &operator=(CacheMemory &&other) noexcept;

    uint8_t *data() { return bytes_; }
    const uint8_t *data() const { return bytes_; }

private:
    void *map_ = nullptr;  // the mapping, with up to 2 MiB of slack in front for the alignment
    size_t map_bytes_ = 0;
    uint8_t *bytes_ = nullptr;
};

}  // namespace pi
