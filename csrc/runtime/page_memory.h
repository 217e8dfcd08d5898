// Memory mapped straight from the kernel, outside the allocator, for weights-sized buffers: on 2 MiB pages where
// the kernel grants them (transparent huge pages in "madvise" mode), the KV cache (every decode step's heads read
// the whole of it, and on 4 KiB pages they miss the TLB every 4 KiB; docs/engine.md, "The KV cache, by kv head")
// and the packed matrices every token streams ("Two layouts of a weight row"); on 4 KiB pages, the cold tier's
// 8-row groups, built and freed as a layer's kernels change (unmapped, their pages leave the process at once,
// where the allocator may keep freed memory for later).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pi {

class PageMemory {
public:
    PageMemory() = default;
    // n_bytes zeroed bytes; huge_pages: 2 MiB-aligned and advised onto 2 MiB pages. `populate`: touched now (no
    // step waits for a page: the packed weights), else each page comes in (zeroed, by the kernel) when first
    // written (the KV cache, as positions fill it). Fails with PI_ERR_MEMORY, naming `what`, when the system
    // refuses the mapping.
    PageMemory(size_t n_bytes, bool huge_pages, const char *what, bool populate = true);
    ~PageMemory();
    PageMemory(const PageMemory &) = delete;
    PageMemory &operator=(const PageMemory &) = delete;
    PageMemory(PageMemory &&other) noexcept;
    PageMemory &operator=(PageMemory &&other) noexcept;

    uint8_t *data() { return bytes_; }
    const uint8_t *data() const { return bytes_; }
    size_t size() const { return n_bytes_; }
    bool empty() const { return n_bytes_ == 0; }

private:
    void *map_ = nullptr;  // the mapping, with up to 2 MiB of slack in front for the alignment of huge pages
    size_t map_bytes_ = 0;
    uint8_t *bytes_ = nullptr;
    size_t n_bytes_ = 0;
};

}  // namespace pi
