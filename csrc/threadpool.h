// A persistent pool: n-1 workers plus the calling thread run one job at a time, split by index.
// Starting a job allocates nothing; workers spin briefly for the next job, then sleep.
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

    // Calls f(ith, nth) once for each ith in [0, nth) across the pool and returns when all are done.
    template <class F>
    void run(F &f) {
        run_raw([](void *ctx, int ith, int nth) { (*static_cast<F *>(ctx))(ith, nth); }, &f);
    }

private:
    using Fn = void (*)(void *, int, int);
    void run_raw(Fn fn, void *ctx);
    void worker(int ith);

    int n_;
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<bool> stop_{false};
    Fn fn_ = nullptr;
    void *ctx_ = nullptr;
};

// [begin, end) of the ith of nth near-equal parts of [0, n), optionally aligned to `align`.
inline void split_range(int64_t n, int ith, int nth, int64_t *begin, int64_t *end, int64_t align = 1) {
    const int64_t units = (n + align - 1) / align;
    const int64_t b = units * ith / nth, e = units * (ith + 1) / nth;
    *begin = b * align < n ? b * align : n;
    *end = e * align < n ? e * align : n;
}

}  // namespace pi
