// The cold tier read from disk (docs/engine.md, "Models larger than memory"): a model whose FFN does not fit the
// memory budget keeps a resident share of its cold neurons (a three-tier plan's, else the most frequently active by
// the profile's counts) and
// reads the rest, when a decode step selects them, from the neuron bundles `convert --neuron-bundles` writes beside
// the GGUF (powerinfer_tools/formats/neuron_bundles.py): one page-aligned bundle a neuron, its gate, up and down_t
// rows together, so a neuron is one read. Recently read neurons stay in a cache of bundle slots inside the budget.
#pragma once

#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/model.h"
#include "model/tier_plan.h"
#include "pi_names.h"
#include "runtime/derived_file.h"
#include "runtime/page_memory.h"

namespace pi {

// The sidecar's header (little-endian, the file's first bytes; neuron_bundles.py's HEADER mirrors it).
struct BundleHeader {
    char magic[4];  // "PINB"
    uint32_t version;
    // the GGUF it was written from: its size and bundle_checksum of its first MiB (another model is refused at
    // once); that the bundles are its FFN rows is the stamp at kStampOffset, or their checksums (derived_file.h)
    uint64_t gguf_size, gguf_identity;
    uint32_t n_layer, n_ff, n_embd, gated;
    uint32_t types[3];      // gate, up, down_t weight types
    uint32_t row_bytes[3];  // their row sizes (up's 0 where ungated)
    uint32_t bundle_bytes;  // a bundle: the three rows, zero-padded to a multiple of the page
    uint32_t reserved;
    uint64_t index_offset, index_bytes, data_offset, file_size;
    uint64_t index_checksum;
    uint64_t header_checksum;  // of the bytes above
};
static_assert(sizeof(BundleHeader) == 120, "the sidecar's header is 120 bytes");

constexpr uint32_t kBundleVersion = 2;
constexpr uint64_t kBundleAlign = 4096;
// The GGUF's SourceStamp (runtime/derived_file.h): outside the header, so that the engine can record it anew
// without rewriting the header's checksum.
constexpr uint64_t kStampOffset = 128;

// The checksum of a bundle and of the header and index: sum of w_i * (2i + 1) over the little-endian 64-bit words w_i
// (mod 2^64; the odd weights keep any one flipped bit and any swap of two words visible), plus `seed` times the
// golden ratio's 64-bit fraction (a bundle's seed is layer << 32 | neuron: a bundle in another's place is damaged).
uint64_t bundle_checksum(const uint8_t *p, size_t bytes, uint64_t seed);

// Reads `bytes` at `offset` of fd into dst, through short reads; false at an error (in errno) or the end of the
// file (errno 0).
bool pread_all(int fd, uint8_t *dst, size_t bytes, uint64_t offset);

// What the disk tier counted over decode steps (pi_stats_json's "disk"): a hit is a neuron a step needed that was in
// memory (resident or cached), a miss one it read; `reads` counts the reads issued (neighbours on disk merge).
// The expert tier (model/expert_tier.h) counts the same in experts, and the experts its lookahead read ahead
// (prefetched) and how many of those a step then used before they left the cache, and the hits on experts a plan
// pinned (among cache_hits).
struct DiskCounts {
    double tokens = 0, bytes = 0, reads = 0, cache_hits = 0, cache_misses = 0, io_wait_seconds = 0;
    double prefetched = 0, prefetch_used = 0, pinned_hits = 0;
};

class DiskTier {
public:
    // Opens the sidecar at `path` for `model` (its cold tiers hold the neurons not in a hot tier), checks it against
    // the model and the GGUF it names, and fills the resident share within `budget - fixed_bytes` less the cache:
    // with a `plan`, each layer's cold neurons among its plan.gpu + plan.memory hottest (the sidecar's order), the
    // least frequent dropped where they do not fit and the room they leave topped up by the most frequently active
    // others; without one, the most frequently active cold neurons of all layers. Fails in one line where the sidecar is missing, damaged, truncated or
    // another model's, or where the budget does not hold `fixed_bytes` and the cache.
    // `budget_source` says where the budget came from, in the one-line refusal.
    DiskTier(const std::string &path, Model &model, double budget, const std::string &budget_source, double fixed_bytes,
             int io_threads, const TierPlan *plan = nullptr);
    ~DiskTier();
    DiskTier(const DiskTier &) = delete;
    DiskTier &operator=(const DiskTier &) = delete;

    // Makes the cold-tier slots [0, count) of layer il (all of them where slots is nullptr) readable through the
    // tier's bundle table, reading the missing ones at once; `decode`: counted in counts().
    void fetch(int64_t il, const int32_t *slots, int64_t count, bool decode) {
        begin(il, slots, count, decode, nullptr);
        finish();
    }
    // The same in steps, so that a decode step computes its neurons as their bundles arrive: begin issues the reads
    // and returns at once, writing the slots already in memory to hits[0, returned) (where hits is not null);
    // arrived(out, max) then waits for reads whose bundles are in and checked and not yet handed out, and copies
    // their selected slots to out (whole reads, at most max slots unless one read alone has more: max >=
    // kMaxRunBundles), to any number of threads; it returns how many, 0 when no more will come (all arrived, or a
    // read failed). finish waits for the last read and fails in one line where a bundle was damaged or short.
    int64_t begin(int64_t il, const int32_t *slots, int64_t count, bool decode, int32_t *hits);
    int64_t arrived(int32_t *out, int64_t max);
    void finish();
    static constexpr int64_t kMaxRunBundles = 32;  // bundles per read at most (one preadv of up to 32 iovecs)
    const DiskCounts &counts() const { return counts_; }
    void reset_counts() { counts_ = DiskCounts{}; }
    double budget_bytes() const { return budget_; }
    // What the engine holds under the budget: the fixed part, the resident bundles and the cache.
    double resident_bytes() const { return fixed_ + double(resident_.size() + cache_.size()); }
    const std::string &path() const { return path_; }
    // Per layer, the cold neurons held resident; the bytes the resident share could take at this budget.
    const std::vector<int64_t> &resident_per_layer() const { return resident_per_layer_; }
    double resident_room_bytes() const { return resident_room_; }
    bool follows_plan() const { return follows_plan_; }
    // The bundles' bytes of all cold neurons: what the tier keeps out of memory at most.
    double all_bundle_bytes() const { return double(hdr_.n_layer) * double(hdr_.n_ff) * double(hdr_.bundle_bytes); }

    // The sidecar beside a model file (the name convert writes).
    static std::string path_for(const std::string &model_path) { return model_path + names::kNeuronBundlesSuffix; }
    // The bytes the cold tiers' bundles of `model` would take (to decide whether the tier is needed).
    static double bundle_bytes_of(const Model &model);

private:
    // One contiguous run of bundles to read: file positions [pos, pos + n) of layer il into its cache slots.
    struct Run {
        int64_t il, pos, n;
        int64_t first;         // index into run_slots_ of its first destination slot
        int64_t need0, need_n;  // need_[need0, need0 + need_n): the selected cold slots it brings
    };
    // A destination that is read and dropped: a bundle between two missing ones that is in memory already.
    static constexpr int64_t kDiscard = INT64_MIN;
    // Adds bundle `pos` of layer il, bound for `slot` (a cache slot, -1 - i: resident bundle i, or kDiscard), to
    // runs_, extending the last run where it is the next bundle on disk.
    void add_read(int64_t il, int64_t pos, int64_t slot);
    // Hands runs_ to the I/O threads; read_runs also reads on the caller and waits (finish's wait and failure).
    void start_runs();
    void read_runs();
    void wait_runs();
    int64_t take_run();  // the next run's index, or -1
    // A cache slot for cold slot r of layer il, taken from the clock and kept through this fetch.
    int64_t claim_slot(int64_t il, int32_t r);
    void do_run(const Run &r);
    void io_loop();
    void shutdown();
    uint8_t *slot_data(int64_t s) { return cache_.data() + size_t(s) * hdr_.bundle_bytes; }
    int64_t take_victim();
    void read_exact(uint8_t *dst, size_t bytes, uint64_t offset, const char *what) const;
    // Whether every bundle's checksum in the index (neuron_at, sum_at: its neurons and checksums, checked) is that of
    // the rows the model maps now: that the sidecar was written from these FFN bytes.
    bool rows_match(const uint8_t *neuron_at, const uint8_t *sum_at) const;

    std::string path_;
    BundleHeader hdr_{};
    int fd_ = -1, fd_direct_ = -1;
    Model &model_;
    double budget_ = 0, fixed_ = 0, resident_room_ = 0;
    std::vector<int64_t> resident_per_layer_;
    bool follows_plan_ = false;
    std::vector<std::vector<int32_t>> pos_of_;     // [layer][cold slot] the bundle's position in the file
    std::vector<std::vector<int32_t>> slot_at_;    // [layer][position] the cold slot stored there
    std::vector<std::vector<uint64_t>> checksum_;  // [layer][position]
    std::vector<std::vector<const uint8_t *>> table_;  // [layer][cold slot] where its bundle is now, or null
    std::vector<std::vector<int32_t>> cached_;     // [layer][cold slot] its cache slot, -1 if none (or resident)
    PageMemory resident_, cache_, discard_;
    int64_t n_cache_ = 0, hand_ = 0;
    std::vector<int64_t> owner_;     // [cache slot] layer << 32 | cold slot, -1 if free
    std::vector<uint64_t> used_in_;  // [cache slot] the fetch that last used it
    std::vector<uint8_t> referenced_;
    uint64_t fetch_id_ = 0;
    DiskCounts counts_;

    // a fetch's reads, shared with the I/O threads
    std::vector<std::pair<int32_t, int32_t>> missing_;  // fetch's scratch (kept: a decode step allocates nothing)
    std::vector<Run> runs_;
    std::vector<int64_t> run_slots_;
    std::vector<int32_t> need_;
    std::chrono::steady_clock::time_point fetch_start_;
    bool decode_ = false;
    int64_t fetch_il_ = 0;
    int64_t fetch_hits_ = 0;
    // under mu_: runs handed out to readers, finished, and in the order they finished without error (arrived_),
    // of which the first `handed_` went to compute threads
    int64_t next_run_ = 0, n_runs_ = 0, runs_done_ = 0, handed_ = 0;
    std::vector<int64_t> arrived_;
    std::chrono::steady_clock::time_point last_arrival_;
    std::string io_error_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    bool stop_ = false;
    std::vector<std::thread> io_threads_;
};

}  // namespace pi
