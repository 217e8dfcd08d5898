#include "runtime/threadpool.h"

#include <chrono>

namespace pi {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

constexpr int kWorkerSpins = 100;  // a few microseconds of pause before sleeping on the condition variable:
                                   // spinning longer burns the CPU share a shared machine gives us
constexpr auto kWorkerYield = std::chrono::microseconds(200);  // then sched_yield for this long, then sleep
constexpr int kMainSpins = 100;    // before yielding while a worker finishes a claimed chunk

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
        if (state_gen(s) != gen) return;  // a later job: this one is finished
        // The chunk count travels in the same word as the claim counter, so a claim is checked against
        // its own job's count. fn/ctx are read before claiming: a successful claim of a chunk of job
        // `gen` proves the job was still open, so the caller had not yet published the next one.
        const Fn fn = fn_.load(std::memory_order_acquire);
        void *ctx = ctx_.load(std::memory_order_acquire);
        const int nc = state_chunks(s), chunk = state_next(s);
        if (chunk >= nc) return;
        if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
        fn(ctx, chunk, nc, thread);
        done_.fetch_add(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::run_raw(int n_chunks, Fn fn, void *ctx) {
    if (n_chunks <= 0) return;
    if (n_ == 1 || n_chunks == 1) {
        for (int c = 0; c < n_chunks; ++c) fn(ctx, c, n_chunks, 0);
        return;
    }
    if (n_chunks > kMaxChunks) n_chunks = kMaxChunks;
    const uint32_t gen = state_gen(state_.load(std::memory_order_relaxed)) + 1;
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(mu_);  // pairs with the sleepers' predicate check
        state_.store(make_state(gen, n_chunks), std::memory_order_release);
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
        uint32_t gen = state_gen(state_.load(std::memory_order_acquire));
        for (int spins = 0; gen == seen && spins < kWorkerSpins && !stop_.load(std::memory_order_relaxed); ++spins) {
            cpu_relax();
            gen = state_gen(state_.load(std::memory_order_acquire));
        }
        // Then yield for a while: on an idle machine yield returns at once (as fast as spinning, and the
        // next job finds the worker awake), on a busy one it hands the core to whoever is waiting.
        const auto yield_until = std::chrono::steady_clock::now() + kWorkerYield;
        for (int i = 0; gen == seen && !stop_.load(std::memory_order_relaxed); ++i) {
            if ((i & 7) == 7 && std::chrono::steady_clock::now() > yield_until) break;
            std::this_thread::yield();
            gen = state_gen(state_.load(std::memory_order_acquire));
        }
        if (gen == seen) {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return stop_.load() || state_gen(state_.load()) != seen; });
            gen = state_gen(state_.load());
        }
        if (stop_.load()) return;
        seen = gen;
        drain(gen, thread);
    }
}

}  // namespace pi
