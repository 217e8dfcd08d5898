#include "model/disk_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "runtime/common.h"

namespace pi {
namespace {

const uint64_t kGolden = 0x9E3779B97F4A7C15ull;
const uint64_t kIdentityBytes = 1 << 20;  // the GGUF's first MiB: its header and tensor table, for a model of any size
// Two missing bundles at most this many bytes of other bundles apart are one read, the bundles between read too (and
// dropped, or kept in the cache where missing): a read costs a fixed time plus a time per byte, and a gap pays while
// its bytes cost less than the read it saves. Chosen from this disk kind's curve of time against read size and from
// decode runs with wider gaps (docs/history.md, "Fewer, larger reads"): a page, so a model whose bundles are one page
// merges across one; 8 KiB bundles merge only as neighbours.
const uint64_t kMergeGapBytes = 4 << 10;

std::string mib(double b) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f MiB", b / double(1 << 20));
    return text;
}

}  // namespace

// Reads `bytes` at `offset` of fd into dst, through short reads; false at an error (in errno) or the end of the
// file (errno 0).
bool pread_all(int fd, uint8_t *dst, size_t bytes, uint64_t offset) {
    for (size_t done = 0; done < bytes;) {
        const ssize_t n = ::pread(fd, dst + done, bytes - done, off_t(offset + done));
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) errno = 0;  // the end of the file, not an error (an EINTR before would still be in errno)
        if (n <= 0) return false;
        done += size_t(n);
    }
    return true;
}

uint64_t bundle_checksum(const uint8_t *p, size_t bytes, uint64_t seed) {
    uint64_t sum = seed * kGolden;
    const size_t words = bytes / 8;
    for (size_t i = 0; i < words; ++i) {
        uint64_t w;
        std::memcpy(&w, p + i * 8, 8);
        sum += w * (2 * uint64_t(i) + 1);
    }
    if (bytes % 8) {  // the last partial word, zero-padded
        uint64_t w = 0;
        std::memcpy(&w, p + words * 8, bytes % 8);
        sum += w * (2 * uint64_t(words) + 1);
    }
    return sum;
}

double DiskTier::bundle_bytes_of(const Model &model) {
    const HParams &hp = model.hp();
    const Layer &L = model.layers()[0];
    const double rows = double(L.gate.row_bytes + (hp.gated ? L.up.row_bytes : 0) + L.down_t.row_bytes);
    const double bundle = std::ceil(rows / double(kBundleAlign)) * double(kBundleAlign);
    return bundle * double(hp.n_ff) * double(hp.n_layer);
}

void DiskTier::read_exact(uint8_t *dst, size_t bytes, uint64_t offset, const char *what) const {
    if (!pread_all(fd_, dst, bytes, offset))
        fail(PI_ERR_IO, path_ + ": cannot read its " + what + " (" + (errno ? std::strerror(errno) : "end of file") + ")");
}

DiskTier::DiskTier(const std::string &path, Model &model, double budget, const std::string &budget_source,
                   double fixed_bytes, int io_threads, const TierPlan *plan)
    : path_(path), model_(model), budget_(budget), fixed_(fixed_bytes), follows_plan_(plan != nullptr) {
    const HParams &hp = model.hp();
    // O_NONBLOCK: open(2) of a FIFO would wait for a writer (reads of a regular file ignore it)
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0)
        fail(PI_ERR_IO, path + ": cannot open the neuron bundles (" + std::strerror(errno) +
                            "; `pi-tools convert --neuron-bundles` writes them beside the model)");
    try {
        struct stat st;
        if (fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) fail(PI_ERR_IO, path + ": not a regular file");
        if (uint64_t(st.st_size) < sizeof(BundleHeader))
            fail(PI_ERR_FORMAT, path + ": truncated (" + std::to_string(st.st_size) + " bytes, shorter than its header)");
        read_exact(reinterpret_cast<uint8_t *>(&hdr_), sizeof hdr_, 0, "header");
        if (std::memcmp(hdr_.magic, names::kNeuronBundlesMagic, 4) != 0) fail(PI_ERR_FORMAT, path + ": not a neuron bundle file (bad magic)");
        if (hdr_.version != kBundleVersion)
            fail(PI_ERR_FORMAT, path + ": neuron bundle version " + std::to_string(hdr_.version) + ", this engine reads " +
                                    std::to_string(kBundleVersion) + " (convert it again with --neuron-bundles)");
        if (bundle_checksum(reinterpret_cast<const uint8_t *>(&hdr_), offsetof(BundleHeader, header_checksum), 0) !=
            hdr_.header_checksum)
            fail(PI_ERR_FORMAT, path + ": its header is damaged (checksum mismatch)");
        if (hdr_.file_size != uint64_t(st.st_size))
            fail(PI_ERR_FORMAT, path + ": truncated or extended (" + std::to_string(st.st_size) + " bytes, its header says " +
                                    std::to_string(hdr_.file_size) + ")");
        // the GGUF it was written from
        struct stat gs;
        if (::stat(model.path().c_str(), &gs) != 0) fail(PI_ERR_IO, model.path() + ": cannot stat");
        std::vector<uint8_t> head(size_t(std::min<uint64_t>(uint64_t(gs.st_size), kIdentityBytes)));
        {
            const int g = ::open(model.path().c_str(), O_RDONLY | O_CLOEXEC);
            if (g < 0) fail(PI_ERR_IO, model.path() + ": cannot open");
            const bool read = pread_all(g, head.data(), head.size(), 0);
            ::close(g);
            if (!read) fail(PI_ERR_IO, model.path() + ": cannot read its header");
        }
        if (hdr_.gguf_size != uint64_t(gs.st_size) || hdr_.gguf_identity != bundle_checksum(head.data(), head.size(), 0))
            fail(PI_ERR_FORMAT, path + ": written from another model file than " + model.path() +
                                    " (convert it again with --neuron-bundles)");
        const Layer &L0 = model.layers()[0];
        const Matrix *mats[3] = {&L0.gate, &L0.up, &L0.down_t};
        bool same = hdr_.n_layer == uint64_t(hp.n_layer) && hdr_.n_ff == uint64_t(hp.n_ff) &&
                    hdr_.n_embd == uint64_t(hp.n_embd) && hdr_.gated == uint32_t(hp.gated);
        for (int m = 0; m < 3; ++m)
            same = same && hdr_.types[m] == ((m == 1 && !hp.gated) ? 0 : mats[m]->type) &&
                   hdr_.row_bytes[m] == ((m == 1 && !hp.gated) ? 0 : mats[m]->row_bytes);
        if (!same) fail(PI_ERR_FORMAT, path + ": its shapes or weight types differ from " + model.path() + "'s");
        const uint64_t rows = uint64_t(hdr_.row_bytes[0]) + hdr_.row_bytes[1] + hdr_.row_bytes[2];
        const uint64_t n_bundles = uint64_t(hdr_.n_layer) * hdr_.n_ff;
        const uint64_t index_bytes = uint64_t(hdr_.n_layer) * hdr_.n_ff * (4 + 4 + 8);
        if (hdr_.bundle_bytes % kBundleAlign || hdr_.bundle_bytes < rows || hdr_.bundle_bytes >= rows + kBundleAlign ||
            hdr_.index_bytes != index_bytes || hdr_.index_offset < kStampOffset + sizeof(SourceStamp) ||
            hdr_.data_offset % kBundleAlign ||
            hdr_.data_offset < hdr_.index_offset + index_bytes ||
            hdr_.file_size != hdr_.data_offset + n_bundles * hdr_.bundle_bytes)
            fail(PI_ERR_FORMAT, path + ": its layout fields are inconsistent");
        // the index: per layer, the neuron at each file position, its activation frequency, the bundle's checksum
        std::vector<uint8_t> index(static_cast<size_t>(index_bytes));
        read_exact(index.data(), index.size(), hdr_.index_offset, "index");
        if (bundle_checksum(index.data(), index.size(), 0) != hdr_.index_checksum)
            fail(PI_ERR_FORMAT, path + ": its index is damaged (checksum mismatch)");
        const int64_t NL = hp.n_layer, F = hp.n_ff;
        const uint8_t *neuron_at = index.data(), *freq_at = neuron_at + NL * F * 4, *sum_at = freq_at + NL * F * 4;
        pos_of_.assign(size_t(NL), {});
        slot_at_.assign(size_t(NL), {});
        checksum_.assign(size_t(NL), {});
        table_.assign(size_t(NL), {});
        cached_.assign(size_t(NL), {});
        struct Candidate {
            bool planned;  // among its layer's plan.gpu + plan.memory hottest (all are, without a plan)
            float freq;
            int32_t il, slot;
        };
        std::vector<Candidate> candidates;
        int64_t n_cold = 0;  // the neurons not in a hot tier: those the tier reads
        resident_per_layer_.assign(size_t(NL), 0);
        for (int64_t il = 0; il < NL; ++il) {
            const FfnTier &cold = model.layers()[size_t(il)].cold;
            const int64_t n_layer_cold = cold.size();
            n_cold += n_layer_cold;
            std::vector<int32_t> pos_of_neuron(static_cast<size_t>(F), -1);
            std::vector<float> freq(static_cast<size_t>(F));
            checksum_[size_t(il)].resize(size_t(F));
            for (int64_t j = 0; j < F; ++j) {
                uint32_t neuron;
                std::memcpy(&neuron, neuron_at + (il * F + j) * 4, 4);
                if (neuron >= uint64_t(F) || pos_of_neuron[neuron] >= 0)
                    fail(PI_ERR_FORMAT, path + ": layer " + std::to_string(il) + "'s index is not a permutation of its neurons");
                pos_of_neuron[neuron] = int32_t(j);
                std::memcpy(&freq[size_t(neuron)], freq_at + (il * F + j) * 4, 4);
                std::memcpy(&checksum_[size_t(il)][size_t(j)], sum_at + (il * F + j) * 8, 8);
            }
            pos_of_[size_t(il)].resize(size_t(F));
            slot_at_[size_t(il)].assign(size_t(F), -1);
            for (int64_t r = 0; r < n_layer_cold; ++r) {
                const int32_t neuron = cold.ids[size_t(r)];
                pos_of_[size_t(il)][size_t(r)] = pos_of_neuron[size_t(neuron)];
                if (pos_of_neuron[size_t(neuron)] < 0)
                    fail(PI_ERR_FORMAT, path + ": layer " + std::to_string(il) + "'s index does not hold neuron " + std::to_string(neuron));
                slot_at_[size_t(il)][size_t(pos_of_neuron[size_t(neuron)])] = int32_t(r);
                const float f = freq[size_t(neuron)];
                // a plan's: the layer's gpu + memory hottest (file positions are hottest first) not held hot
                const bool planned = !plan || pos_of_neuron[size_t(neuron)] < plan->gpu[size_t(il)] + plan->memory[size_t(il)];
                candidates.push_back({planned, f == f ? f : 0.0f, int32_t(il), int32_t(r)});
            }
            table_[size_t(il)].assign(size_t(F), nullptr);
            cached_[size_t(il)].assign(size_t(F), -1);
        }
        SourceStamp recorded;
        read_exact(reinterpret_cast<uint8_t *>(&recorded), sizeof recorded, kStampOffset, "stamp");
        const SourceMatch match = match_source(recorded, model.file_stamp(), [&] { return rows_match(neuron_at, sum_at); });
        if (match == SourceMatch::Changed)
            fail(PI_ERR_FORMAT, path + ": its bundles' FFN rows differ from " + model.path() +
                                    "'s (the model changed since they were written; convert it again with --neuron-bundles)");
        if (match == SourceMatch::Bytes) record_stamp(path, kStampOffset, model.file_stamp());
        // The cache holds at least one whole layer (a batch, or a dense step, reads every neuron of a layer), and a
        // quarter of what the budget leaves; the resident share takes the rest.
        const double B = double(hdr_.bundle_bytes), min_cache = double(F) * B;
        const double left = budget - fixed_bytes;
        if (left < min_cache)
            fail(PI_ERR_MEMORY, "memory budget of " + mib(budget) + " (" + budget_source + ") is below what the engine must hold: " + mib(fixed_bytes) +
                                    " (the weights copied at open, the KV cache, buffers) + " + mib(min_cache) +
                                    " (a cache of one layer's neuron bundles) = " + mib(fixed_bytes + min_cache));
        n_cache_ = std::min<int64_t>(n_cold, std::max<int64_t>(F, int64_t(left / 4 / B)));
        const int64_t n_resident = std::max<int64_t>(0, std::min<int64_t>(n_cold - n_cache_, int64_t((left - double(n_cache_) * B) / B)));
        resident_room_ = double(n_resident) * B;
        // the plan's neurons, then the others, each the most frequently active first (ties: layer, then slot order),
        // as plan chooses a GPU's hot set: a plan made for a smaller room is topped up by frequency, one made for a
        // larger room loses its least frequent
        std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate &a, const Candidate &b) {
            return a.planned != b.planned ? a.planned : a.freq > b.freq;
        });
        candidates.resize(size_t(std::min<int64_t>(n_resident, int64_t(candidates.size()))));
        std::sort(candidates.begin(), candidates.end(), [&](const Candidate &a, const Candidate &b) {
            return a.il != b.il ? a.il < b.il : pos_of_[size_t(a.il)][size_t(a.slot)] < pos_of_[size_t(b.il)][size_t(b.slot)];
        });
        if (!candidates.empty()) resident_ = PageMemory(candidates.size() * size_t(B), false, "the resident neuron bundles");
        // touched now: a slot's first read would otherwise fault its pages in, under the limit's reclaim
        cache_ = PageMemory(size_t(n_cache_) * size_t(B), false, "the neuron bundle cache");
        discard_ = PageMemory(size_t(B), false, "the neuron bundle reader's scratch");
        owner_.assign(size_t(n_cache_), -1);
        used_in_.assign(size_t(n_cache_), 0);
        referenced_.assign(size_t(n_cache_), 0);
        for (int64_t il = 0; il < NL; ++il) {
            const Layer &L = model.layers()[size_t(il)];
            model.attach_bundles(il, table_[size_t(il)].data(), L.gate.row_bytes, L.gate.row_bytes + (hp.gated ? L.up.row_bytes : 0));
        }
        fd_direct_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT | O_NONBLOCK);  // -1: buffered (tmpfs)
        for (int t = 0; t < io_threads; ++t) io_threads_.emplace_back([this] { io_loop(); });
        // the resident share, read through the same runs (each bundle checked)
        for (size_t i = 0; i < candidates.size(); ++i) {
            const Candidate &c = candidates[i];
            const int64_t pos = pos_of_[size_t(c.il)][size_t(c.slot)];
            uint8_t *dst = resident_.data() + i * size_t(B);
            table_[size_t(c.il)][size_t(c.slot)] = dst;
            ++resident_per_layer_[size_t(c.il)];
            add_read(c.il, pos, -1 - int64_t(i));  // negative: resident bundle i
        }
        read_runs();
    } catch (...) {
        shutdown();
        throw;
    }
}

bool DiskTier::rows_match(const uint8_t *neuron_at, const uint8_t *sum_at) const {
    const HParams &hp = model_.hp();
    const int64_t NL = hp.n_layer, F = hp.n_ff;
    std::vector<uint8_t> bundle(hdr_.bundle_bytes);  // zero past the rows, as written
    for (int64_t il = 0; il < NL; ++il) {
        const Layer &L = model_.layers()[size_t(il)];
        // as written: gate (up where ungated: the model's gate is its up), up where gated, down_t
        const Matrix *parts[3] = {&L.gate, hp.gated ? &L.up : nullptr, &L.down_t};
        for (const Matrix *m : parts)
            if (m && (!m->data || m->rows != F)) return false;
        for (int64_t j = 0; j < F; ++j) {
            uint32_t neuron;
            uint64_t sum;
            std::memcpy(&neuron, neuron_at + (il * F + j) * 4, 4);  // < F: checked with the index
            std::memcpy(&sum, sum_at + (il * F + j) * 8, 8);
            size_t at = 0;
            for (int m = 0; m < 3; ++m) {
                if (!parts[m]) continue;
                std::memcpy(bundle.data() + at, parts[m]->data + size_t(neuron) * hdr_.row_bytes[m], hdr_.row_bytes[m]);
                at += hdr_.row_bytes[m];
            }
            if (bundle_checksum(bundle.data(), bundle.size(), (uint64_t(il) << 32) | uint64_t(j)) != sum) return false;
        }
        for (const Matrix *m : parts)  // read once here, never again: a model larger than memory drops the pages
            if (m) model_.release_mapped(*m);
    }
    return true;
}

DiskTier::~DiskTier() { shutdown(); }

void DiskTier::shutdown() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    for (std::thread &t : io_threads_) t.join();
    io_threads_.clear();
    if (fd_ >= 0) ::close(fd_);
    if (fd_direct_ >= 0) ::close(fd_direct_);
    fd_ = fd_direct_ = -1;
}

int64_t DiskTier::take_victim() {
    // CLOCK over the cache's slots: a slot used since the hand last passed gets another turn; a slot this fetch uses
    // is never taken (the cache holds a whole layer, so one is always free of this fetch)
    for (int64_t tries = 0; tries < 3 * n_cache_ + 1; ++tries) {
        const int64_t s = hand_;
        hand_ = (hand_ + 1) % n_cache_;
        if (used_in_[size_t(s)] == fetch_id_) continue;
        if (referenced_[size_t(s)]) {
            referenced_[size_t(s)] = 0;
            continue;
        }
        if (owner_[size_t(s)] >= 0) {
            const int64_t il = owner_[size_t(s)] >> 32, r = owner_[size_t(s)] & 0xffffffff;
            table_[size_t(il)][size_t(r)] = nullptr;
            cached_[size_t(il)][size_t(r)] = -1;
        }
        return s;
    }
    fail(PI_ERR_INTERNAL, path_ + ": the neuron cache has no free slot");
}

int64_t DiskTier::claim_slot(int64_t il, int32_t r) {
    const int64_t s = take_victim();
    owner_[size_t(s)] = (il << 32) | int64_t(r);
    used_in_[size_t(s)] = fetch_id_;
    referenced_[size_t(s)] = 0;
    cached_[size_t(il)][size_t(r)] = int32_t(s);
    table_[size_t(il)][size_t(r)] = slot_data(s);
    return s;
}

int64_t DiskTier::begin(int64_t il, const int32_t *slots, int64_t count, bool decode, int32_t *hits) {
    fetch_start_ = std::chrono::steady_clock::now();
    decode_ = decode;
    fetch_il_ = il;
    ++fetch_id_;
    runs_.clear();
    run_slots_.clear();
    need_.clear();
    std::vector<const uint8_t *> &table = table_[size_t(il)];
    const std::vector<int32_t> &cached = cached_[size_t(il)], &pos_of = pos_of_[size_t(il)], &slot_at = slot_at_[size_t(il)];
    // the missing slots, in file order, so that neighbours on disk are one read
    std::vector<std::pair<int32_t, int32_t>> &missing = missing_;  // (position, slot)
    missing.clear();
    int64_t n_hits = 0;
    for (int64_t i = 0; i < count; ++i) {
        const int32_t r = slots ? slots[i] : int32_t(i);
        if (table[size_t(r)]) {  // resident, or in the cache
            const int32_t s = cached[size_t(r)];
            if (s >= 0) {
                used_in_[size_t(s)] = fetch_id_;
                referenced_[size_t(s)] = 1;
            }
            if (hits) hits[n_hits] = r;
            ++n_hits;
            continue;
        }
        missing.push_back({pos_of[size_t(r)], r});
    }
    std::sort(missing.begin(), missing.end());
    const int64_t max_gap = int64_t(kMergeGapBytes / hdr_.bundle_bytes);
    for (const auto &[pos, r] : missing) {
        if (!runs_.empty()) {  // across a short gap: the bundles between are read too (into the cache where missing)
            const Run &last = runs_.back();
            const int64_t end = last.pos + last.n;
            if (last.il == il && pos > end && pos - end <= max_gap && pos + 1 - last.pos <= kMaxRunBundles)
                for (int64_t q = end; q < pos; ++q) {
                    const int32_t rq = slot_at[size_t(q)];  // -1: a neuron of the hot tier
                    add_read(il, q, rq < 0 || table[size_t(rq)] ? kDiscard : claim_slot(il, rq));
                }
        }
        add_read(il, pos, claim_slot(il, r));
        ++runs_.back().need_n;
        need_.push_back(r);
    }
    fetch_hits_ = n_hits;
    start_runs();
    return n_hits;
}

void DiskTier::finish() {
    wait_runs();
    if (!decode_) return;
    counts_.cache_hits += double(fetch_hits_);
    double bytes = 0;
    for (const Run &r : runs_) bytes += double(r.n) * double(hdr_.bundle_bytes);
    counts_.cache_misses += double(need_.size());  // the selected slots that were read
    counts_.reads += double(runs_.size());
    counts_.bytes += bytes;
    const auto last = runs_.empty() ? fetch_start_ : last_arrival_;
    counts_.io_wait_seconds += std::chrono::duration<double>(last - fetch_start_).count();
    if (fetch_il_ == 0) counts_.tokens += 1;
}

void DiskTier::add_read(int64_t il, int64_t pos, int64_t slot) {
    Run *last = runs_.empty() ? nullptr : &runs_.back();
    if (last && last->il == il && last->pos + last->n == pos && last->n < kMaxRunBundles)
        ++last->n;
    else
        runs_.push_back({il, pos, 1, int64_t(run_slots_.size()), int64_t(need_.size()), 0});
    run_slots_.push_back(slot);
}

void DiskTier::start_runs() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        io_error_.clear();
        runs_done_ = 0;
        next_run_ = 0;
        handed_ = 0;
        arrived_.clear();
        arrived_.reserve(runs_.size());
        n_runs_ = int64_t(runs_.size());
    }
    if (!runs_.empty()) cv_.notify_all();
}

void DiskTier::read_runs() {
    start_runs();
    for (int64_t i; (i = take_run()) >= 0;) do_run(runs_[size_t(i)]);
    wait_runs();
}

int64_t DiskTier::arrived(int32_t *out, int64_t max) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        done_cv_.wait(lock, [&] { return handed_ < int64_t(arrived_.size()) || runs_done_ == n_runs_; });
        int64_t n = 0;
        while (handed_ < int64_t(arrived_.size())) {
            const Run &r = runs_[size_t(arrived_[size_t(handed_)])];
            if (n > 0 && n + r.need_n > max) break;
            std::copy(need_.begin() + r.need0, need_.begin() + r.need0 + r.need_n, out + n);
            n += r.need_n;
            ++handed_;
        }
        if (n > 0) return n;
        if (runs_done_ == n_runs_ && handed_ == int64_t(arrived_.size())) return 0;  // all arrived (or a read failed)
    }
}

void DiskTier::wait_runs() {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return runs_done_ == n_runs_; });
    n_runs_ = 0;
    if (!io_error_.empty()) {
        // the slots just filled are not valid: forget them
        for (const Run &r : runs_)
            for (int64_t k = 0; k < r.n; ++k) {
                const int64_t s = run_slots_[size_t(r.first + k)];
                if (s < 0) continue;
                const int64_t cil = owner_[size_t(s)] >> 32, cr = owner_[size_t(s)] & 0xffffffff;
                table_[size_t(cil)][size_t(cr)] = nullptr;
                cached_[size_t(cil)][size_t(cr)] = -1;
                owner_[size_t(s)] = -1;
            }
        fail(PI_ERR_FORMAT, io_error_);
    }
}

int64_t DiskTier::take_run() {
    std::lock_guard<std::mutex> lock(mu_);
    return next_run_ < n_runs_ ? next_run_++ : -1;
}

void DiskTier::do_run(const Run &r) {
    const size_t B = hdr_.bundle_bytes;
    iovec iov[kMaxRunBundles];
    uint8_t *dst[kMaxRunBundles];
    for (int64_t k = 0; k < r.n; ++k) {
        const int64_t s = run_slots_[size_t(r.first + k)];
        dst[k] = s >= 0 ? slot_data(s) : s == kDiscard ? discard_.data() : resident_.data() + size_t(-1 - s) * B;
        iov[k] = {dst[k], B};
    }
    const uint64_t offset = hdr_.data_offset + (uint64_t(r.il) * hdr_.n_ff + uint64_t(r.pos)) * B;
    std::string err;
    size_t done = 0, want = size_t(r.n) * B;
    while (done < want) {  // a short read continues where it stopped
        const int k0 = int(done / B);
        const size_t skip = done % B;
        iovec rest[kMaxRunBundles];
        int n = 0;
        for (int k = k0; k < r.n; ++k) rest[n++] = k == k0 ? iovec{dst[k] + skip, B - skip} : iov[k];
        // O_DIRECT needs aligned buffers and offsets: whole pages, unless a short read left us mid-page
        const int fd = fd_direct_ >= 0 && done % kBundleAlign == 0 ? fd_direct_ : fd_;
        const ssize_t got = ::preadv(fd, rest, n, off_t(offset + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && fd == fd_direct_ && errno == EINVAL) {  // a file system without O_DIRECT
            const ssize_t g2 = ::preadv(fd_, rest, n, off_t(offset + done));
            if (g2 > 0) {
                done += size_t(g2);
                continue;
            }
        }
        if (got <= 0) {
            err = path_ + ": cannot read layer " + std::to_string(r.il) + "'s bundles (" +
                  (got < 0 ? std::strerror(errno) : "truncated") + ")";
            break;
        }
        done += size_t(got);
    }
    if (err.empty())
        for (int64_t k = 0; k < r.n; ++k) {
            if (run_slots_[size_t(r.first + k)] == kDiscard) continue;  // dropped (and shared by concurrent reads)
            const int64_t pos = r.pos + k;
            const uint64_t seed = (uint64_t(r.il) << 32) | uint64_t(pos);  // a bundle in another's place fails
            if (bundle_checksum(dst[k], B, seed) != checksum_[size_t(r.il)][size_t(pos)]) {
                err = path_ + ": the bundle at position " + std::to_string(pos) + " of layer " + std::to_string(r.il) +
                      " is damaged (checksum mismatch)";
                break;
            }
        }
    std::lock_guard<std::mutex> lock(mu_);
    if (!err.empty() && io_error_.empty()) io_error_ = err;
    if (err.empty()) {
        arrived_.push_back(&r - runs_.data());
        last_arrival_ = std::chrono::steady_clock::now();
    }
    ++runs_done_;
    done_cv_.notify_all();  // the compute threads wait for each arrival, finish for the last
}

void DiskTier::io_loop() {
    for (;;) {
        int64_t i;
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return stop_ || next_run_ < n_runs_; });
            if (stop_) return;
            i = next_run_++;
        }
        do_run(runs_[size_t(i)]);
    }
}

}  // namespace pi
