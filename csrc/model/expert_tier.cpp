#include "model/expert_tier.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <fcntl.h>
#include <unistd.h>

#include "kernels/packed.h"
#include "pi_names.h"
#include "runtime/common.h"

namespace pi {
namespace {

const uint64_t kDirectAlign = 4096;  // O_DIRECT's offsets, lengths and buffers: whole pages
const size_t kSlotAlign = 64;

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

std::string mib(double b) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f MiB", b / double(1 << 20));
    return text;
}

// Expert 0's matrix `which` (gate, up, down) of layer L, as the in-memory engine views it (Experts::gate_of ...).
Matrix expert_matrix(const Experts &X, int which) {
    return which == 0 ? X.gate_of(0) : which == 1 ? X.up_of(0) : X.down_of(0);
}

}  // namespace

int64_t ExpertTier::slot_bytes_of(const Model &model) {
    const Experts &X = model.layers()[0].experts;
    size_t bytes = 0;
    for (int which = 0; which < 3; ++which) {
        const Matrix m = expert_matrix(X, which);
        const int64_t packed = Model::packed_bytes(m);
        bytes += align_up(packed > 0 ? size_t(packed) : m.bytes(), kSlotAlign);
    }
    return int64_t(bytes);
}

ExpertTier::ExpertTier(Model &model, double budget, const std::string &budget_source, double fixed_bytes,
                       int io_threads, const TierPlan *plan)
    : model_(model), budget_(budget), fixed_(fixed_bytes), planned_(plan != nullptr && !plan->expert_slots.empty()) {
    const HParams &hp = model.hp();
    const GgufFile &file = model.file();
    n_expert_ = hp.n_expert;
    if (hp.activation == Activation::Relu)
        fail(PI_ERR_UNSUPPORTED, "memory_budget: ReLU experts' down projection is transposed at load (a copy in "
                                 "memory), so their experts are not read from the file; run them without a budget");
    // Each expert's matrices as the in-memory engine packs them: an expert's rows are whole 8-row groups of the
    // stacked tensor where its widths are multiples of 8 (else the groups would straddle experts)
    if (hp.n_ff_exp % kPackRows != 0 || hp.n_embd % kPackRows != 0)
        fail(PI_ERR_UNSUPPORTED, "memory_budget: the expert tier reads experts whose widths are multiples of 8; this "
                                 "model's are " + std::to_string(hp.n_ff_exp) + " and " + std::to_string(hp.n_embd));
    slot_bytes_ = size_t(slot_bytes_of(model));
    parts_.assign(size_t(hp.n_layer), std::vector<Part>(3));
    size_t largest = 0;
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        const Experts &X = model.layers()[size_t(il)].experts;
        size_t at = 0;
        for (int which = 0; which < 3; ++which) {
            const Matrix m = expert_matrix(X, which);
            const Matrix &all = which == 0 ? X.gate : which == 1 ? X.up : X.down;
            const int64_t off = file.offset_of(all.data, all.bytes());
            if (off < 0)
                fail(PI_ERR_UNSUPPORTED, "memory_budget: layer " + std::to_string(il) + "'s experts are decoded into "
                                         "memory at load (their type is not read in place), so the expert tier cannot read them "
                                         "from the file; convert to f32, q8_0 or q4_0");
            Part &p = parts_[size_t(il)][size_t(which)];
            p.shape = m;
            p.file_offset = uint64_t(off);
            p.expert_stride = uint64_t(m.bytes());
            p.raw_bytes = m.bytes();
            p.packed = Model::packed_bytes(m) > 0;
            p.slot_offset = at;
            at += align_up(p.packed ? size_t(Model::packed_bytes(m)) : m.bytes(), kSlotAlign);
            largest = std::max(largest, p.raw_bytes);
        }
        if (at != slot_bytes_) fail(PI_ERR_FORMAT, file.path() + ": layer " + std::to_string(il) + "'s experts differ in shape from layer 0's");
    }
    // the reading threads' buffers count as fixed
    const int n_io = std::max(1, io_threads);
    fixed_ += double(n_io) * double(largest + 3 * kDirectAlign);
    const double all = all_expert_bytes(model), left = budget - fixed_;
    const int64_t fit = std::min<int64_t>(hp.n_layer * n_expert_, int64_t(std::max(0.0, left) / double(slot_bytes_)));
    n_slots_ = fit;
    std::vector<int64_t> cached;  // [layer] with a plan: its cache slots
    if (planned_) {
        n_slots_ = 0;
        std::vector<int64_t> least(size_t(hp.n_layer));
        for (int64_t il = 0; il < hp.n_layer; ++il) {
            const int64_t pinned = int64_t(plan->pinned[size_t(il)].size());
            const int64_t on_device = plan->device.empty() ? 0 : int64_t(plan->device[size_t(il)].size());
            least[size_t(il)] = std::min(hp.n_expert_used, n_expert_ - pinned - on_device);
            cached.push_back(plan->expert_slots[size_t(il)]);
            if (cached.back() < least[size_t(il)])
                fail(PI_ERR_FORMAT, model.path() + names::kTierPlanSuffix + ": layer " + std::to_string(il) + " caches " +
                                        std::to_string(cached.back()) + " experts, fewer than a token's " + std::to_string(hp.n_expert_used) +
                                        " of those it does not pin (pi-tools plan --memory-budget writes it anew)");
            n_pinned_ += pinned;
            n_slots_ += pinned + cached.back();
        }
        // A plan made where the engine held a little less (other threads, batch or context) is trimmed to fit: a slot
        // at a time from the largest cache, none below a token's experts; refused only where the pinned experts and
        // those least caches do not fit.
        for (; n_slots_ > fit; --n_slots_) {
            int64_t widest = -1;
            for (int64_t il = 0; il < hp.n_layer; ++il)
                if (cached[size_t(il)] > least[size_t(il)] && (widest < 0 || cached[size_t(il)] > cached[size_t(widest)])) widest = il;
            if (widest < 0)
                fail(PI_ERR_MEMORY, "the tier plan beside the model pins " + std::to_string(n_pinned_) + " experts and needs at least " +
                                        std::to_string(n_slots_) + " in memory (" + mib(double(n_slots_) * double(slot_bytes_)) +
                                        "), more than the memory budget of " + mib(budget) + " (" + budget_source + ") leaves after the " +
                                        mib(fixed_) + " the engine must hold; plan again at this budget (pi-tools plan --memory-budget)");
            cached[size_t(widest)] -= 1;
        }
    }
    if (n_slots_ < hp.n_expert_used)
        fail(PI_ERR_MEMORY, "memory budget of " + mib(budget) + " (" + budget_source + ") is below what the engine must hold: " +
                                mib(fixed_) + " (the weights copied at open, the KV cache, buffers) + " +
                                mib(double(hp.n_expert_used) * double(slot_bytes_)) + " (a token's " +
                                std::to_string(hp.n_expert_used) + " experts of a layer, of " + mib(all) + " in all)");
    // on 2 MiB pages where the kernel grants them, as the packed weights are (a step reads its experts whole)
    cache_ = PageMemory(size_t(n_slots_) * slot_bytes_, true, "the expert cache", false);
    slots_.assign(size_t(n_slots_), Slot{});
    slot_of_.assign(size_t(hp.n_layer), std::vector<int32_t>(size_t(n_expert_), -1));
    // without a plan one pool of every slot; with one, per layer its pinned slots and then its own pool
    pool_of_.assign(size_t(hp.n_layer), 0);
    if (!planned_) pools_.push_back(Pool{0, n_slots_, 0});
    for (int64_t il = 0, at = 0; planned_ && il < hp.n_layer; ++il) {
        at += int64_t(plan->pinned[size_t(il)].size());
        pools_.push_back(Pool{at, at + cached[size_t(il)], at});
        pool_of_[size_t(il)] = int32_t(il);
        at += cached[size_t(il)];
    }
    mats_.resize(size_t(n_slots_) * 3);
    for (int64_t s = 0; s < n_slots_; ++s)
        for (int which = 0; which < 3; ++which) {
            const Part &p = parts_[0][size_t(which)];
            Matrix m = p.shape;
            uint8_t *at = cache_.data() + size_t(s) * slot_bytes_ + p.slot_offset;
            m.data = p.packed ? nullptr : at;
            m.groups = p.packed ? at : nullptr;
            m.n_groups = p.packed ? m.rows / kPackRows : 0;
            mats_[size_t(s) * 3 + size_t(which)] = m;
        }
    // O_NONBLOCK: open(2) of a FIFO would wait for a writer (reads of a regular file ignore it)
    fd_ = ::open(file.path().c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) fail(PI_ERR_IO, file.path() + ": cannot open it to read experts (" + std::strerror(errno) + ")");
    fd_direct_ = ::open(file.path().c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT | O_NONBLOCK);  // -1: buffered (tmpfs)
    staging_.assign(size_t(n_io), std::vector<uint8_t>(largest + 3 * kDirectAlign));
    for (int t = 0; t < n_io; ++t) io_threads_.emplace_back([this, t] { io_loop(t); });
    if (planned_) load_pinned(*plan);
}

void ExpertTier::load_pinned(const TierPlan &plan) {
    std::unique_lock<std::mutex> lock(mu_);
    for (size_t il = 0; il < plan.pinned.size(); ++il) {
        int64_t s = pools_[size_t(pool_of_[il])].lo - int64_t(plan.pinned[il].size());  // just before the layer's pool
        for (const int32_t e : plan.pinned[il]) {
            claim(s, int64_t(il), e, false);
            slots_[size_t(s++)].pinned = true;
        }
    }
    const auto loaded = [&] {
        for (const Slot &slot : slots_)
            if (slot.pinned && slot.state != State::Ready) return false;
        return true;
    };
    ready_cv_.wait(lock, [&] { return !io_error_.empty() || loaded(); });
    if (!io_error_.empty()) {
        const std::string error = io_error_;
        lock.unlock();
        stop();  // the constructor fails: no destructor runs to join the reading threads
        fail(PI_ERR_IO, error);
    }
}

ExpertTier::~ExpertTier() { stop(); }

void ExpertTier::stop() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    io_cv_.notify_all();
    for (std::thread &t : io_threads_) t.join();
    io_threads_.clear();
    if (fd_direct_ >= 0) ::close(fd_direct_);
    if (fd_ >= 0) ::close(fd_);
    fd_direct_ = fd_ = -1;
}

int64_t ExpertTier::take_victim(int64_t il, bool gentle) {
    // a free slot, else CLOCK: a referenced slot gets a second chance; slots a step holds or a read fills are passed.
    // gentle (a prefetch): one sweep that takes only a slot no step has used since its last chance, clearing no bit,
    // so that a guess never pushes out an expert the clock would keep
    Pool &pool = pools_[size_t(pool_of_[size_t(il)])];
    const int64_t sweeps = gentle ? 1 : 2, n = pool.hi - pool.lo;
    for (int64_t tries = 0; n > 0 && tries < sweeps * n + 1; ++tries) {
        const int64_t s = pool.hand;
        pool.hand = s + 1 < pool.hi ? s + 1 : pool.lo;
        Slot &slot = slots_[size_t(s)];
        if (slot.state == State::Free) return s;
        if (slot.pins > 0 || slot.state == State::Loading) continue;
        if (slot.referenced) {
            if (!gentle) slot.referenced = false;
            continue;
        }
        return s;
    }
    return -1;
}

void ExpertTier::claim(int64_t s, int64_t il, int32_t e, bool prefetched) {
    Slot &slot = slots_[size_t(s)];
    if (slot.il >= 0) slot_of_[size_t(slot.il)][size_t(slot.e)] = -1;
    // a prefetched expert has no reference until a step uses it: the first to go if none does
    slot = Slot{il, e, State::Loading, 0, false, prefetched, !prefetched};
    slot.parts_left = 3;
    slot.counted = decode_;
    slot_of_[size_t(il)][size_t(e)] = int32_t(s);
    for (int part = 0; part < 3; ++part) queue_.push_back(s * 3 + part);  // its three runs read side by side
    io_cv_.notify_all();
}

void ExpertTier::schedule() {
    while (!pending_.empty()) {
        const int64_t s = take_victim(il_, false);
        if (s < 0) return;
        const int32_t e = pending_.front();
        pending_.pop_front();
        claim(s, il_, e, false);
        slots_[size_t(s)].pins = 1;
        slots_[size_t(s)].wanted = true;
    }
}

void ExpertTier::begin(int64_t il, const int32_t *experts, int64_t n, bool decode) {
    std::lock_guard<std::mutex> lock(mu_);
    il_ = il;
    decode_ = decode;
    pending_.clear();
    arrived_.clear();
    to_hand_ = n;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t e = experts[i], s = slot_of_[size_t(il)][size_t(e)];
        if (s < 0) {
            pending_.push_back(e);
            continue;
        }
        Slot &slot = slots_[size_t(s)];
        slot.pins += 1;
        slot.wanted = true;
        slot.referenced = true;
        if (decode && slot.prefetched) counts_.prefetch_used += 1;
        if (decode && slot.pinned) counts_.pinned_hits += 1;
        slot.prefetched = false;
        if (slot.state == State::Ready) arrived_.push_back(e);
    }
    if (decode) {
        counts_.tokens += il == 0 ? 1 : 0;
        counts_.cache_hits += double(n - int64_t(pending_.size()));
        counts_.cache_misses += double(pending_.size());
    }
    schedule();
}

int64_t ExpertTier::ready(int32_t *out) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    ready_cv_.wait(lock, [&] { return !arrived_.empty() || to_hand_ == 0 || !io_error_.empty(); });
    if (!io_error_.empty()) fail(PI_ERR_IO, io_error_);
    const int64_t n = int64_t(arrived_.size());
    for (int64_t i = 0; i < n; ++i) {
        out[i] = arrived_[size_t(i)];
        slots_[size_t(slot_of_[size_t(il_)][size_t(out[i])])].wanted = false;
    }
    arrived_.clear();
    to_hand_ -= n;
    if (decode_) counts_.io_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return n;
}

void ExpertTier::done(const int32_t *experts, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < n; ++i) slots_[size_t(slot_of_[size_t(il_)][size_t(experts[i])])].pins -= 1;
    schedule();
}

void ExpertTier::prefetch(int64_t il, const int32_t *experts, int64_t n, bool decode) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < n && pending_.empty(); ++i) {
        const int32_t e = experts[i];
        if (slot_of_[size_t(il)][size_t(e)] >= 0) continue;
        const int64_t s = take_victim(il, true);
        if (s < 0) return;
        claim(s, il, e, decode);
        if (decode) counts_.prefetched += 1;
    }
}

void ExpertTier::io_loop(int thread) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        io_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        const int64_t job = queue_.front(), s = job / 3;
        queue_.pop_front();
        const Slot at_start = slots_[size_t(s)];
        std::string error;
        lock.unlock();
        try {
            load(s, int(job % 3), at_start.il, at_start.e, thread);
        } catch (const EngineFailure &f) {
            error = f.what();
        }
        lock.lock();
        Slot &slot = slots_[size_t(s)];
        if (slot.counted && error.empty()) {
            counts_.bytes += double(parts_[size_t(slot.il)][size_t(job % 3)].raw_bytes);
            counts_.reads += 1;
        }
        if (!error.empty() && io_error_.empty()) io_error_ = error;
        slot.failed = slot.failed || !error.empty();
        if (--slot.parts_left > 0) continue;
        if (slot.failed) {  // fatal for the step waiting on it (ready fails); the slot is free again
            slot_of_[size_t(slot.il)][size_t(slot.e)] = -1;
            slot = Slot{};
            ready_cv_.notify_all();
            continue;
        }
        slot.state = State::Ready;
        if (slot.pinned) ready_cv_.notify_all();  // load_pinned waits for them
        if (slot.wanted && slot.il == il_) {
            arrived_.push_back(slot.e);
            ready_cv_.notify_all();
        }
    }
}

void ExpertTier::read_range(uint8_t *staging, size_t staging_bytes, uint64_t offset, size_t bytes, const uint8_t **at) {
    // O_DIRECT: the whole pages around the range into the page-aligned staging buffer; buffered where it is refused
    uint8_t *aligned = reinterpret_cast<uint8_t *>(align_up(reinterpret_cast<uintptr_t>(staging), kDirectAlign));
    const uint64_t a0 = offset / kDirectAlign * kDirectAlign;
    const size_t span = align_up(size_t(offset - a0) + bytes, kDirectAlign);
    if (fd_direct_ >= 0 && span <= staging_bytes - size_t(aligned - staging)) {
        size_t done = 0;
        while (done < span) {
            const ssize_t got = ::pread(fd_direct_, aligned + done, span - done, off_t(a0 + done));
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) break;  // the end of the file (a short last page) or a refusal: the buffered read decides
            done += size_t(got);
        }
        if (done >= size_t(offset - a0) + bytes) {
            *at = aligned + (offset - a0);
            return;
        }
    }
    if (!pread_all(fd_, staging, bytes, offset))
        fail(PI_ERR_IO, model_.path() + ": cannot read an expert's rows (" + (errno ? std::strerror(errno) : "end of file") + ")");
    *at = staging;
}

void ExpertTier::load(int64_t s, int part, int64_t il, int32_t e, int thread) {
    std::vector<uint8_t> &staging = staging_[size_t(thread)];
    const Part &p = parts_[size_t(il)][size_t(part)];
    const uint8_t *rows = nullptr;
    read_range(staging.data(), staging.size(), p.file_offset + uint64_t(e) * p.expert_stride, p.raw_bytes, &rows);
    uint8_t *out = cache_.data() + size_t(s) * slot_bytes_ + p.slot_offset;
    if (!p.packed) {
        std::memcpy(out, rows, p.raw_bytes);
        return;
    }
    // the 8-row groups Model::pack makes of the same rows
    const int64_t group_bytes = p.shape.group_bytes();
    for (int64_t g = 0; g < p.shape.rows / kPackRows; ++g) {
        const void *r8[kPackRows];
        for (int r = 0; r < kPackRows; ++r) r8[r] = rows + size_t(g * kPackRows + r) * p.shape.row_bytes;
        pack_rows8(p.shape.type, int(p.shape.cols), r8, out + g * group_bytes);
    }
}

}  // namespace pi
