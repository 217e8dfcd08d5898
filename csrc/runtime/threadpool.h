// A persistent pool: n-1 workers plus the calling thread run one job at a time. A job is cut into
// chunks that threads claim from a shared counter, so a worker the OS has descheduled never holds
// the others up: whoever is running takes the remaining chunks. Starting a job allocates nothing;
// workers spin briefly for the next job, then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pi {

class ThreadPool {
public:
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool &) = delete;
    ThreadPool &operator=(const ThreadPool &) = delete;

    int size() const { return n_; }

    // Calls f(chunk, n_chunks, thread) once for each chunk in [0, n_chunks) and returns when all are
    // done; `thread` in [0, size()) identifies the caller's per-thread scratch.
    template <class F>
    void run(int n_chunks, F &f) {
        run_raw(n_chunks, [](void *ctx, int c, int nc, int t) { (*static_cast<F *>(ctx))(c, nc, t); }, &f);
    }

    // Chunks for `work` units of at least `grain` units each. Small work: fewer chunks than threads (1 at
    // least). Otherwise a multiple of the thread count, up to 4 per thread, each at least 8 grains where the
    // work allows: a thread that streams one long range keeps its prefetchers running, while several short
    // ranges each start cold (decode steps are ~20% faster with one chunk per thread than with four).
    int chunks_for(int64_t work, int64_t grain) const {
        const int64_t c = grain > 0 ? work / grain : work;
        if (c < n_) return int(c < 1 ? 1 : c);
        const int64_t per_thread = c / (8 * int64_t(n_));
        return n_ * int(per_thread < 1 ? 1 : (per_thread > 4 ? 4 : per_thread));
    }

private:
    using Fn = void (*)(void *, int, int, int);
    void run_raw(int n_chunks, Fn fn, void *ctx);
    void worker(int thread);
    // Claims and runs chunks of the job of generation `gen` until none are left.
    void drain(uint32_t gen, int thread);

    int n_;
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_;
    // bits 63..32: job generation; 31..16: the job's chunk count; 15..0: next unclaimed chunk
    static constexpr int kMaxChunks = 0xffff;
    static uint64_t make_state(uint32_t gen, int n_chunks) { return uint64_t(gen) << 32 | uint64_t(n_chunks) << 16; }
    static uint32_t state_gen(uint64_t s) { return uint32_t(s >> 32); }
    static int state_chunks(uint64_t s) { return int((s >> 16) & 0xffff); }
    static int state_next(uint64_t s) { return int(s & 0xffff); }
    std::atomic<uint64_t> state_{0};
    std::atomic<Fn> fn_{nullptr};
    std::atomic<void *> ctx_{nullptr};
    std::atomic<int> done_{0};
    std::atomic<bool> stop_{false};
};

// [begin, end) of the ith of nth near-equal parts of [0, n), optionally aligned to `align`.
inline void split_range(int64_t n, int ith, int nth, int64_t *begin, int64_t *end, int64_t align = 1) {
    const int64_t units = (n + align - 1) / align;
    const int64_t b = units * ith / nth, e = units * (ith + 1) / nth;
    *begin = b * align < n ? b * align : n;
    *end = e * align < n ? e * align : n;
}

}  // namespace pi
