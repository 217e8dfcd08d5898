#include "threadpool.h"

namespace pi {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

constexpr int kSpins = 20000;

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_(n_threads < 1 ? 1 : n_threads) {
    threads_.reserve(size_t(n_ - 1));
    for (int i = 1; i < n_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_.store(true);
        generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (std::thread &t : threads_) t.join();
}

void ThreadPool::run_raw(Fn fn, void *ctx) {
    if (n_ == 1) {
        fn(ctx, 0, 1);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        fn_ = fn;
        ctx_ = ctx;
        pending_.store(n_ - 1);
        generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(ctx, 0, n_);
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
        if (spins < kSpins) cpu_relax();
        else std::this_thread::yield();
    }
}

void ThreadPool::worker(int ith) {
    uint64_t seen = 0;
    for (;;) {
        uint64_t gen = generation_.load(std::memory_order_acquire);
        for (int spins = 0; gen == seen && spins < kSpins; ++spins) {
            cpu_relax();
            gen = generation_.load(std::memory_order_acquire);
        }
        if (gen == seen) {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return generation_.load() != seen; });
            gen = generation_.load();
        }
        seen = gen;
        if (stop_.load()) return;
        Fn fn;
        void *ctx;
        {
            std::lock_guard<std::mutex> lock(mu_);
            fn = fn_;
            ctx = ctx_;
        }
        fn(ctx, ith, n_);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

}  // namespace pi
