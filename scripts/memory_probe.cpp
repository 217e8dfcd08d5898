// What a row read by index costs on this machine, without the engine: DRAM latency, how many misses
// one core keeps in flight, and the read bandwidth of rows picked by index against rows read in order.
// docs/log/perf-notes.md §19 and §25 quote its output.
//
//   g++ -O2 -mavx2 -pthread scripts/memory_probe.cpp -o /tmp/memory_probe && /tmp/memory_probe [row_bytes] [threads]
//
// row_bytes defaults to 324 (a q4_0 row of 576 values, SmolLM2's FFN rows), threads to 1 (the latency
// chains run only then).
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
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

// One thread's share of a gathered read: rows[begin, end) read whole with 32-byte loads, each row's lines
// prefetched `ahead` rows before it is read (0: none).
uint64_t read_rows(const std::vector<const uint8_t *> &rows, size_t begin, size_t end, int row_bytes, int ahead) {
    __m256i s = _mm256_setzero_si256();
    for (size_t i = begin; i < end; ++i) {
        if (ahead && i + size_t(ahead) < end)
            for (int o = 0; o < row_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char *>(rows[i + size_t(ahead)]) + o, _MM_HINT_T0);
        for (int o = 0; o + 32 <= row_bytes; o += 32)
            s = _mm256_add_epi8(s, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(rows[i] + o)));
    }
    return uint64_t(_mm256_extract_epi64(s, 0));
}

// Rows of row_bytes from 240 matrices of 1536 rows (far more than the last-level cache), read whole: all rows
// in order, or a share of them picked at random (kept in ascending order) with or without prefetching. Each of
// `threads` threads reads the rows of every `threads`-th matrix, as a decode step's threads share a layer.
// Best of 16 passes, caches flushed between passes: the first passes over fresh memory run up to 2x slower
// on this VM (the host maps it in), so only later passes measure the reads.
void gathered_rows(int row_bytes, int threads) {
    const int n_rows = 1536, n_mat = 240;
    std::vector<uint8_t> buf(size_t(n_mat) * n_rows * size_t(row_bytes) + 64, 1), flush(size_t(64) << 20, 1);
    std::mt19937 rng(2);
    std::printf("rows of %d bytes from %d MiB (%d thread%s):\n", row_bytes, int(buf.size() >> 20), threads,
                threads > 1 ? "s" : "");
    for (double density : {1.0, 0.8, 0.65, 0.5, 0.35, 0.2, 0.1}) {
        std::vector<const uint8_t *> rows;
        std::vector<size_t> mat_start;
        for (int m = 0; m < n_mat; ++m) {
            mat_start.push_back(rows.size());
            for (int r = 0; r < n_rows; ++r)
                if (density >= 1.0 || std::uniform_real_distribution<double>()(rng) < density)
                    rows.push_back(buf.data() + (size_t(m) * n_rows + size_t(r)) * size_t(row_bytes));
        }
        mat_start.push_back(rows.size());
        for (int ahead : {0, 16}) {
            if (density >= 1.0 && ahead) continue;
            double best = 1e9;
            std::vector<uint64_t> sinks(size_t(threads), 0);
            for (int pass = 0; pass < 16; ++pass) {
                for (size_t i = 0; i < flush.size(); i += 64) sinks[0] += flush[i];
                const auto t0 = Clock::now();
                auto work = [&](int t) {
                    for (int m = t; m < n_mat; m += threads)
                        sinks[size_t(t)] += read_rows(rows, mat_start[size_t(m)], mat_start[size_t(m) + 1], row_bytes, ahead);
                };
                std::vector<std::thread> pool;
                for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
                work(0);
                for (std::thread &th : pool) th.join();
                best = std::min(best, seconds_since(t0));
            }
            uint64_t sink = 0;
            for (uint64_t v : sinks) sink += v;
            std::printf("  %5.1f%% of the rows%s  %5.1f ns per row  %5.1f GB/s%s\n", density * 100,
                        density >= 1.0 ? ", in order            " : ahead ? ", by index, prefetched " : ", by index             ",
                        best / double(rows.size()) * 1e9, double(rows.size()) * row_bytes / best / 1e9,
                        sink == 1 ? " " : "");
        }
    }
}

}  // namespace

int main(int argc, char **argv) {
    const int row_bytes = argc > 1 ? std::atoi(argv[1]) : 324, threads = argc > 2 ? std::atoi(argv[2]) : 1;
    if (row_bytes < 32 || row_bytes > 65536 || threads < 1 || threads > 64) {
        std::fprintf(stderr, "usage: memory_probe [row_bytes in 32..65536] [threads in 1..64]\n");
        return 2;
    }
    if (threads == 1) latency();
    gathered_rows(row_bytes, threads);
    return 0;
}
