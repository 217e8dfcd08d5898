#include "read_probe.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "page_memory.h"
#include "threadpool.h"

namespace pi {

namespace {

const int kProbeAhead = 16;  // rows asked for ahead of the one read (the engine's dot_rows: 3 groups of 4-8 rows)

// splitmix64: a uniform double in [0, 1) per call
struct Uniform {
    uint64_t state;
    double operator()() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return double((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
    }
};

// One load from every line a row covers (its last word too): what it costs to bring the row in, without the
// arithmetic a kernel would do on it.
uint64_t touch_row(const uint8_t *row, size_t row_bytes) {
    uint64_t sum = 0;
    for (size_t o = 0; o + 8 <= row_bytes; o += 64) sum += *reinterpret_cast<const volatile uint64_t *>(row + o);
    return sum + *reinterpret_cast<const volatile uint64_t *>(row + row_bytes - 8);
}

void ask_for_row(const uint8_t *row, size_t row_bytes) {
    for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 0, 2);
    __builtin_prefetch(row + row_bytes - 1, 0, 2);
}

}  // namespace

double read_rows_rate(ThreadPool &pool, size_t row_bytes, size_t buffer_bytes, double density, int passes,
                      uint64_t seed) {
    PageMemory buffer(buffer_bytes, false, "the read probe");  // 4 KiB pages, as the mapped weights
    const size_t region_rows = buffer_bytes / size_t(passes) / row_bytes;
    const bool in_order = density >= 1.0;
    Uniform uniform{seed};
    std::vector<const uint8_t *> rows;
    rows.reserve(in_order ? region_rows : size_t(double(region_rows) * density * 1.1) + 16);
    std::vector<uint64_t> sinks(size_t(pool.size()), 0);
    double best = 0.0;
    for (int p = 0; p < passes; ++p) {
        const uint8_t *region = buffer.data() + size_t(p) * region_rows * row_bytes;
        rows.clear();
        for (size_t r = 0; r < region_rows; ++r)
            if (in_order || uniform() < density) rows.push_back(region + r * row_bytes);
        if (rows.empty()) continue;
        const int64_t n = int64_t(rows.size());
        auto job = [&](int chunk, int n_chunks, int thread) {
            int64_t i0, i1;
            split_range(n, chunk, n_chunks, &i0, &i1);
            uint64_t sum = 0;
            for (int64_t i = i0; i < i1; ++i) {
                if (!in_order && i + kProbeAhead < i1) ask_for_row(rows[size_t(i + kProbeAhead)], row_bytes);
                sum += touch_row(rows[size_t(i)], row_bytes);
            }
            sinks[size_t(thread)] += sum;
        };
        const auto t0 = std::chrono::steady_clock::now();
        pool.run(pool.size(), job);
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::max(best, double(n) * double(row_bytes) / dt);
    }
    return best;
}

}  // namespace pi
