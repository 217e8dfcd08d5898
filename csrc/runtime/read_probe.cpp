#include "runtime/read_probe.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "runtime/common.h"
#include "runtime/page_memory.h"
#include "engine/sampler.h"
#include "runtime/threadpool.h"

namespace pi {

namespace {

const int kProbeAhead = 16;  // rows asked for ahead of the one read (the engine's dot_rows: 3 groups of 4-8 rows)

uint64_t load_word(const uint8_t *at) {  // rows start anywhere (324-byte q4_0 rows): an unaligned load
    uint64_t v;
    std::memcpy(&v, at, sizeof v);
    return v;
}

// One load from every line a row covers (its last word too): what it costs to bring the row in, without the
// arithmetic a kernel would do on it. The sums land in the caller's sink, so no load can be dropped.
uint64_t touch_row(const uint8_t *row, size_t row_bytes) {
    uint64_t sum = 0;
    for (size_t o = 0; o + 8 <= row_bytes; o += 64) sum += load_word(row + o);
    return sum + load_word(row + row_bytes - 8);
}

}  // namespace

double read_rows_rate(ThreadPool &pool, size_t row_bytes, size_t buffer_bytes, double density, int passes,
                      uint64_t seed) {
    PageMemory buffer(buffer_bytes, false, "the read probe");  // 4 KiB pages, as the mapped weights
    const size_t region_rows = buffer_bytes / size_t(passes) / row_bytes;
    const bool in_order = density >= 1.0;
    // Every pass's list first, so that the passes run back to back: a pass over 10 % of a region lasts ~0.3 ms,
    // and a worker that fell asleep while a list was drawn would add its wake-up to it.
    Rng rng(seed);
    std::vector<std::vector<const uint8_t *>> lists(static_cast<size_t>(passes));
    for (int p = 0; p < passes; ++p) {
        const uint8_t *region = buffer.data() + size_t(p) * region_rows * row_bytes;
        for (size_t r = 0; r < region_rows; ++r)
            if (in_order || rng.uniform() < density) lists[size_t(p)].push_back(region + r * row_bytes);
    }
    std::vector<uint64_t> sinks(size_t(pool.size()), 0);
    const std::vector<const uint8_t *> *rows = nullptr;
    auto job = [&](int chunk, int n_chunks, int thread) {
        int64_t i0, i1;
        split_range(int64_t(rows->size()), chunk, n_chunks, &i0, &i1);
        uint64_t sum = 0;
        for (int64_t i = i0; i < i1; ++i) {
            if (!in_order && i + kProbeAhead < i1) prefetch_row((*rows)[size_t(i + kProbeAhead)], row_bytes);
            sum += touch_row((*rows)[size_t(i)], row_bytes);
        }
        sinks[size_t(thread)] += sum;
    };
    const std::vector<const uint8_t *> nothing;
    rows = &nothing;
    pool.run(pool.size(), job);  // wakes the workers
    double best = 0.0;
    for (const auto &list : lists) {
        if (list.empty()) continue;
        rows = &list;
        const auto t0 = std::chrono::steady_clock::now();
        pool.run(pool.size(), job);
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::max(best, double(list.size()) * double(row_bytes) / dt);
    }
    return best;
}

}  // namespace pi
