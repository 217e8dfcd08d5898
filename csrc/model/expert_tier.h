// A mixture of experts under a memory budget (docs/engine.md, "The expert tier"): the experts stay in the model file
// and a cache of whole experts holds those recently used. A missing expert is read from the GGUF itself: expert e's
// rows of ffn_{gate,up,down}_exps are one contiguous run of each 3-D tensor, three reads of hundreds of KiB at the
// shapes that need the tier, so no sidecar is written. The reads run on threads of their own (an expert's three runs
// side by side, each through O_DIRECT where the file system takes it, so that the page cache holds no second copy),
// and each arrived run is packed into its cache slot in the 8-row groups the in-memory engine packs at load, so that
// its rows go through the same kernels and the logits are the same bits. A step hands its experts to the compute side
// as they arrive (begin, ready, done); prefetch reads a later layer's guessed experts into free or old slots without
// waiting. A three-tier plan beside the model (model/tier_plan.h) pins each layer's hottest experts, read at open and
// never evicted, and gives each layer a cache of its own for the rest; without one every expert competes in one cache.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/disk_tier.h"
#include "model/model.h"
#include "model/tier_plan.h"
#include "runtime/page_memory.h"

namespace pi {

class ExpertTier {
public:
    // The cache takes what `budget` leaves after `fixed_bytes` (what the engine holds whatever the cache: the
    // matrices copied at open, the KV cache, buffers, margin), in whole experts, no more than all of them. Fails in one
    // line where that is fewer than one token's experts of a layer (n_expert_used), or where the experts cannot be
    // read from the file (ReLU experts' down is transposed at load; types decoded at load are copies). With a `plan`
    // (its expert section): each layer's pinned experts, read here, and plan->expert_slots[layer] slots for the rest,
    // no more (fewer from the largest caches where the budget leaves a little less than the plan was made for); fails
    // in one line where the pinned experts and a token's experts of each layer do not fit, or where a layer's planned
    // cache is below a token's experts.
    ExpertTier(Model &model, double budget, const std::string &budget_source, double fixed_bytes, int io_threads,
               const TierPlan *plan = nullptr);
    ~ExpertTier();
    ExpertTier(const ExpertTier &) = delete;
    ExpertTier &operator=(const ExpertTier &) = delete;

    // Layer il's distinct experts[0, n) are wanted now: those in memory (or on their way, prefetched) are held, the
    // rest read as slots come free. `decode`: counted in counts().
    void begin(int64_t il, const int32_t *experts, int64_t n, bool decode);
    // Waits for wanted experts that have arrived and were not handed out yet, writes them to out (room for n of
    // begin), returns how many; 0 once all were handed out. Fails in one line where a read failed.
    int64_t ready(int32_t *out);
    // The handed-out experts[0, n) were computed: their slots may be taken again (a batch that wants more experts
    // than the cache holds reads the rest into them).
    void done(const int32_t *experts, int64_t n);
    // Starts reading layer il's experts[0, n) that are not in memory into slots no step holds, while free slots or
    // old ones last and the step in flight waits for none; returns at once.
    void prefetch(int64_t il, const int32_t *experts, int64_t n, bool decode);
    // Expert e of the layer in flight (handed out by ready, not yet done): its gate, up (which 0, 1) or down (2).
    const Matrix &matrix(int32_t e, int which) const {
        return mats_[size_t(slot_of_[size_t(il_)][size_t(e)]) * 3 + size_t(which)];
    }

    const DiskCounts &counts() const { return counts_; }
    void reset_counts() { counts_ = DiskCounts{}; }
    double budget_bytes() const { return budget_; }
    double resident_bytes() const { return fixed_ + double(cache_.size()); }
    int64_t slots() const { return n_slots_; }  // pinned ones included
    int64_t pinned() const { return n_pinned_; }
    bool planned() const { return planned_; }
    double slot_bytes() const { return double(slot_bytes_); }
    double fixed_bytes() const { return fixed_; }
    // The bytes a slot takes for `model`'s experts (packed where the engine packs them), and all experts'.
    static int64_t slot_bytes_of(const Model &model);
    static double all_expert_bytes(const Model &model) {
        return double(slot_bytes_of(model)) * double(model.hp().n_layer * model.hp().n_expert);
    }

private:
    enum class State : uint8_t { Free, Loading, Ready };
    struct Slot {
        int64_t il = -1;
        int32_t e = -1;
        State state = State::Free;
        int32_t pins = 0;         // steps holding it (a wanted expert until done)
        bool wanted = false;      // in the step in flight, not handed out yet
        bool prefetched = false;  // read by prefetch and not used yet
        bool referenced = false;  // the clock's bit
        int8_t parts_left = 0;    // of gate, up, down still being read
        bool failed = false;      // a part's read failed
        bool counted = false;     // read for (or ahead of) a decode step: its bytes in counts_
        bool pinned = false;      // the plan's: read at open, never taken by the clock
    };
    // The slots [lo, hi) that a layer's experts share with the clock's hand: one pool for all layers without a plan,
    // one per layer with one.
    struct Pool {
        int64_t lo = 0, hi = 0, hand = 0;
    };
    // Where a matrix of one expert is in the file and in a slot.
    struct Part {
        uint64_t file_offset = 0, expert_stride = 0;  // expert 0's rows in the file, and the next expert's distance
        size_t raw_bytes = 0, slot_offset = 0;
        bool packed = false;
        Matrix shape;  // type, rows, cols, row_bytes of one expert's matrix
    };

    void schedule();             // reads the step's pending experts into slots while some come free (under mu_)
    // A free slot of layer il's pool, else the clock's next one no step holds, or -1 (under mu_); gentle: see the
    // definition.
    int64_t take_victim(int64_t il, bool gentle);
    void load_pinned(const TierPlan &plan);  // reads the plan's pinned experts into their slots and waits for them
    void stop();  // joins the reading threads, closes the file
    void claim(int64_t s, int64_t il, int32_t e, bool prefetched);  // slot s now holds (il, e), on its way (under mu_)
    void io_loop(int thread);
    // Reads and packs part `part` (gate, up, down) of expert e of layer il into slot s (outside mu_).
    void load(int64_t s, int part, int64_t il, int32_t e, int thread);
    void read_range(uint8_t *staging, size_t staging_bytes, uint64_t offset, size_t bytes, const uint8_t **at);

    Model &model_;
    double budget_ = 0, fixed_ = 0;
    int64_t n_expert_ = 0, n_slots_ = 0, n_pinned_ = 0;
    bool planned_ = false;
    std::vector<Pool> pools_;
    std::vector<int32_t> pool_of_;                // [layer] its pool
    size_t slot_bytes_ = 0;
    std::vector<std::vector<Part>> parts_;        // [layer][gate, up, down]
    std::vector<std::vector<int32_t>> slot_of_;   // [layer][expert] its slot, or -1
    std::vector<Slot> slots_;
    std::vector<Matrix> mats_;                    // [slot][gate, up, down] views into cache_
    PageMemory cache_;
    int fd_ = -1, fd_direct_ = -1;
    DiskCounts counts_;

    // the step in flight, shared with the I/O threads under mu_
    int64_t il_ = 0;
    bool decode_ = false;
    std::deque<int32_t> pending_;   // wanted experts with no slot yet
    std::vector<int32_t> arrived_;  // wanted experts in memory, not handed out
    int64_t to_hand_ = 0;           // wanted experts not handed out yet
    std::deque<int64_t> queue_;     // parts to read: slot * 3 + part
    std::string io_error_;
    std::mutex mu_;
    std::condition_variable io_cv_, ready_cv_;
    bool stop_ = false;
    std::vector<std::vector<uint8_t>> staging_;  // [thread] an aligned buffer for one read
    std::vector<std::thread> io_threads_;
};

}  // namespace pi
