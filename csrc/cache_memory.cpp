#include "cache_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "common.h"

namespace pi {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
}

CacheMemory::CacheMemory(size_t n_bytes) {
    const size_t bytes = (n_bytes + kHugePage - 1) / kHugePage * kHugePage;
    map_bytes_ = bytes + kHugePage;  // room to start on a 2 MiB boundary
    map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map_ == MAP_FAILED) {
        map_ = nullptr;
        fail(PI_ERR_MEMORY, "cannot allocate " + std::to_string(bytes >> 20) + " MiB for the KV cache");
    }
    const uintptr_t at = (reinterpret_cast<uintptr_t>(map_) + kHugePage - 1) / kHugePage * kHugePage;
    bytes_ = reinterpret_cast<uint8_t *>(at);
    madvise(bytes_, bytes, MADV_HUGEPAGE);  // advice only: 4 KiB pages where the kernel declines
    std::memset(bytes_, 0, bytes);          // touched now, so that no decode step waits for a page
}

CacheMemory::~CacheMemory() {
    if (map_) munmap(map_, map_bytes_);
}

CacheMemory::CacheMemory(CacheMemory &&other) noexcept
    : map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      bytes_(std::exchange(other.bytes_, nullptr)) {}

CacheMemory &CacheMemory::operator=(CacheMemory &&other) noexcept {
    if (this != &other) {
        if (map_) munmap(map_, map_bytes_);
        map_ = std::exchange(other.map_, nullptr);
        map_bytes_ = std::exchange(other.map_bytes_, 0);
        bytes_ = std::exchange(other.bytes_, nullptr);
    }
    return *this;
}

}  // namespace pi
