// What a row read by index costs on this machine, without the engine: DRAM latency, how many misses
// one core keeps in flight, and the read bandwidth of rows picked by index against rows read in order.
// docs/perf-notes.md §19 quotes its output.
//
//   g++ -O2 -mavx2 scripts/memory_probe.cpp -o /tmp/memory_probe && /tmp/memory_probe [row_bytes]
//
// row_bytes defaults to 324 (a q4_0 row of 576 values, SmolLM2's FFN rows). One thread.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// K independent random pointer chains through a 256 MiB buffer (2 MiB pages where the kernel grants
// them): ns per load with K misses in flight.
void latency() {
    const size_t bytes = size_t(256) << 20, lines = bytes / 64;
    auto *buf = static_cast<uint64_t *>(aligned_alloc(2 << 20, bytes));
    madvise(buf, bytes, MADV_HUGEPAGE);
    std::vector<size_t> perm(lines);
    std::mt19937_64 rng(1);
    std::printf("random cache lines, K chains in flight (one thread):\n");
    for (int k : {1, 4, 8, 16, 32, 48}) {
        for (size_t i = 0; i < lines; ++i) perm[i] = i;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (size_t i = 0; i < lines; ++i) buf[perm[i] * 8] = perm[(i + 1) % lines] * 8;
        std::vector<size_t> p(static_cast<size_t>(k));
        for (int c = 0; c < k; ++c) p[size_t(c)] = perm[size_t(c) * (lines / size_t(k))] * 8;
        const size_t steps = 2000000 / size_t(k);
        const auto t0 = Clock::now();
        for (size_t s = 0; s < steps; ++s)
            for (int c = 0; c < k; ++c) p[size_t(c)] = buf[p[size_t(c)]];
        const double dt = seconds_since(t0);
        size_t sink = 0;
        for (size_t v : p) sink += v;
        std::printf("  K=%2d  %6.1f ns per line  %5.1f GB/s%s\n", k, dt / double(steps * size_t(k)) * 1e9,
                    double(steps * size_t(k) * 64) / dt / 1e9, sink == 1 ? " " : "");
    }
    free(buf);
}

// Rows of row_bytes from 120 matrices of 1536 rows (more than the last-level cache), read whole with
// 32-byte loads: all rows in order, or a random half in ascending order with (or without) each row's lines
// prefetched `ahead` rows before it is read. Best of 8 passes, caches flushed between passes.
void gathered_rows(int row_bytes) {
    const int n_rows = 1536, n_mat = 120;
    std::vector<uint8_t> buf(size_t(n_mat) * n_rows * size_t(row_bytes) + 64, 1), flush(size_t(64) << 20, 1);
    std::mt19937 rng(2);
    std::printf("rows of %d bytes from %d MiB (one thread):\n", row_bytes, int(buf.size() >> 20));
    for (double density : {1.0, 0.5, 0.25}) {
        std::vector<const uint8_t *> rows;
        for (int m = 0; m < n_mat; ++m)
            for (int r = 0; r < n_rows; ++r)
                if (density >= 1.0 || std::uniform_real_distribution<double>()(rng) < density)
                    rows.push_back(buf.data() + (size_t(m) * n_rows + size_t(r)) * size_t(row_bytes));
        for (int ahead : {0, 16}) {
            if (density >= 1.0 && ahead) continue;
            double best = 1e9;
            uint64_t sink = 0;
            for (int pass = 0; pass < 8; ++pass) {
                for (size_t i = 0; i < flush.size(); i += 64) sink += flush[i];
                const auto t0 = Clock::now();
                __m256i s = _mm256_setzero_si256();
                for (size_t i = 0; i < rows.size(); ++i) {
                    if (ahead && i + size_t(ahead) < rows.size())
                        for (int o = 0; o < row_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char *>(rows[i + size_t(ahead)]) + o, _MM_HINT_T0);
                    for (int o = 0; o + 32 <= row_bytes; o += 32)
                        s = _mm256_add_epi8(s, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(rows[i] + o)));
                }
                sink += uint64_t(_mm256_extract_epi64(s, 0));
                best = std::min(best, seconds_since(t0));
            }
            std::printf("  %3.0f%% of the rows%s  %5.1f ns per row  %5.1f GB/s%s\n", density * 100,
                        density >= 1.0 ? ", in order            " : ahead ? ", by index, prefetched " : ", by index             ",
                        best / double(rows.size()) * 1e9, double(rows.size()) * row_bytes / best / 1e9,
                        sink == 1 ? " " : "");
        }
    }
}

}  // namespace

int main(int argc, char **argv) {
    const int row_bytes = argc > 1 ? std::atoi(argv[1]) : 324;
    if (row_bytes < 32 || row_bytes > 65536) {
        std::fprintf(stderr, "row_bytes must be in [32, 65536]\n");
        return 2;
    }
    latency();
    gathered_rows(row_bytes);
    return 0;
}
