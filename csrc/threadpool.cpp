#include "threadpool.h"

namespace pi {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

constexpr int kWorkerSpins = 4000;  // ~0.1 ms of pause before sleeping on the condition variable
constexpr int kMainSpins = 2000;    // before yielding while a worker finishes a claimed chunk

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_(n_threads < 1 ? 1 : n_threads) {
    threads_.reserve(size_t(n_ - 1));
    for (int i = 1; i < n_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_.store(true);
    }
    cv_.notify_all();
    for (std::thread &t : threads_) t.join();
}

void ThreadPool::drain(uint32_t gen, int thread) {
    for (;;) {
        uint64_t s = state_.load(std::memory_order_acquire);
        if (uint32_t(s >> 32) != gen) return;  // a later job: this one is finished
        // Read the job before claiming: a successful claim proves these belong to generation `gen`.
        const Fn fn = fn_.load(std::memory_order_acquire);
        void *ctx = ctx_.load(std::memory_order_acquire);
        const int nc = n_chunks_.load(std::memory_order_acquire);
        const uint32_t chunk = uint32_t(s);
        if (int(chunk) >= nc) return;
        if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
        fn(ctx, int(chunk), nc, thread);
        done_.fetch_add(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::run_raw(int n_chunks, Fn fn, void *ctx) {
    if (n_chunks <= 0) return;
    if (n_ == 1 || n_chunks == 1) {
        for (int c = 0; c < n_chunks; ++c) fn(ctx, c, n_chunks, 0);
        return;
    }
    const uint32_t gen = uint32_t(state_.load(std::memory_order_relaxed) >> 32) + 1;
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_chunks_.store(n_chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(mu_);  // pairs with the sleepers' predicate check
        state_.store(uint64_t(gen) << 32, std::memory_order_release);
    }
    cv_.notify_all();
    drain(gen, 0);
    for (int spins = 0; done_.load(std::memory_order_acquire) != n_chunks; ++spins) {
        if (spins < kMainSpins) cpu_relax();
        else std::this_thread::yield();
    }
}

void ThreadPool::worker(int thread) {
    uint32_t seen = 0;
    for (;;) {
        uint32_t gen = uint32_t(state_.load(std::memory_order_acquire) >> 32);
        for (int spins = 0; gen == seen && spins < kWorkerSpins && !stop_.load(std::memory_order_relaxed); ++spins) {
            cpu_relax();
            gen = uint32_t(state_.load(std::memory_order_acquire) >> 32);
        }
        if (gen == seen) {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return stop_.load() || uint32_t(state_.load() >> 32) != seen; });
            gen = uint32_t(state_.load() >> 32);
        }
        if (stop_.load()) return;
        seen = gen;
        drain(gen, thread);
    }
}

}  // namespace pi
