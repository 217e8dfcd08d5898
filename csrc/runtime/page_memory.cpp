#include "runtime/page_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <utility>

#include "runtime/common.h"

namespace pi {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
#ifdef MADV_POPULATE_WRITE
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;  // <linux/mman.h>'s value, for C libraries older than the kernel
#endif
}

PageMemory::PageMemory(size_t n_bytes, bool huge_pages, const char *what, bool populate) : n_bytes_(n_bytes) {
    if (n_bytes == 0) return;
    const size_t page = huge_pages ? kHugePage : size_t(sysconf(_SC_PAGESIZE));
    const size_t bytes = (n_bytes + page - 1) / page * page;
    map_bytes_ = huge_pages ? bytes + kHugePage : bytes;  // room to start on a 2 MiB boundary
    map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (populate && !huge_pages ? MAP_POPULATE : 0), -1, 0);
    if (map_ == MAP_FAILED) {
        map_ = nullptr;
        fail(PI_ERR_MEMORY, "cannot allocate " + std::to_string(bytes >> 20) + " MiB for " + what);
    }
    const uintptr_t at = (reinterpret_cast<uintptr_t>(map_) + page - 1) / page * page;
    bytes_ = reinterpret_cast<uint8_t *>(at);
    if (huge_pages) madvise(bytes_, bytes, MADV_HUGEPAGE);  // advice only: 4 KiB pages where the kernel declines
    // 4 KiB pages come populated (MAP_POPULATE: one call, not a fault per page; a switch of FFN mode regroups
    // 17 % faster); huge pages are populated after the advice, by the kernel where it can (MADV_POPULATE_WRITE,
    // Linux 5.14), else by a write per page. The kernel hands out zeroed pages either way: a memset would
    // write a second time what a large buffer already holds. Unpopulated, a page is faulted in (2 MiB at a time
    // where the advice holds) by its first write.
    if (populate && huge_pages && madvise(bytes_, bytes, kPopulateWrite) != 0) {
        const size_t small = size_t(sysconf(_SC_PAGESIZE));
        for (size_t at = 0; at < bytes; at += small) reinterpret_cast<volatile uint8_t *>(bytes_)[at] = 0;
    }
}

PageMemory::~PageMemory() {
    if (map_) munmap(map_, map_bytes_);
}

PageMemory::PageMemory(PageMemory &&other) noexcept
    : map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      bytes_(std::exchange(other.bytes_, nullptr)),
      n_bytes_(std::exchange(other.n_bytes_, 0)) {}

PageMemory &PageMemory::operator=(PageMemory &&other) noexcept {
    if (this != &other) {
        if (map_) munmap(map_, map_bytes_);
        map_ = std::exchange(other.map_, nullptr);
        map_bytes_ = std::exchange(other.map_bytes_, 0);
        bytes_ = std::exchange(other.bytes_, nullptr);
        n_bytes_ = std::exchange(other.n_bytes_, 0);
    }
    return *this;
}

}  // namespace pi
