#include "backend/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/down_runs.h"
#include "engine/matmul.h"
#include "engine/work.h"
#include "runtime/common.h"

namespace pi {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Asks for the first rows of a list gathered by index a little before dot_rows reads them (the kernel
// prefetches further rows itself as it goes): into L2 (prefetch_row), as the kernel does.
const int kListAhead = 32;
const int64_t kPanelRows = 128;     // down_t rows widened per panel of a batch's down projection
const int64_t kPanelTokens = 64;    // tokens per gemm_f32 call over a panel
// A quantized batch's down projection in integers: tiles of kDownTileCols columns by kDownPanelRows rows, the
// tile's transpose requantized once (pack_columns8) and multiplied by gemm8 for every token while it stays in L2
// (about 140 KB, and the tokens' coefficients for those rows beside it)
const int64_t kDownTileCols = 128;
const int64_t kDownPanelRows = 1024;
static_assert(kDownTileCols % QK == 0 && kDownPanelRows % QK == 0, "tiles are whole blocks");
const int64_t kGatherRows = 64;     // selected rows per pass of the gathered gate/up path
const int64_t kDecodeGatherRows = 256;  // the same for one token: longer lists
static_assert(kDecodeGatherRows >= kGatherRows, "gate_up_gathered's lists are sized for the longer pass");
static_assert(kDecodeGatherRows >= DiskTier::kMaxRunBundles, "a list of arrived neurons holds a whole read's");

// A thread's scratch for a batch pass's gate and up groups packed from rows (q8_0, the widest type that packs).
double pack_scratch_bytes(double n_embd) {
    return 2 * double(kGroupsPerPass) * (n_embd / QK) * double(packed_block_bytes(TYPE_Q8_0));
}

// Columns per thread in axpy work: a multiple of the block so slices start on block boundaries.
int64_t column_align(uint32_t type) { return type_size(type).block == 1 ? 16 : QK; }

const uint8_t *column_slice(const uint8_t *row, uint32_t type, int64_t c0) {
    const TypeSize ts = type_size(type);
    return row + size_t(c0 / ts.block) * ts.bytes;
}

}  // namespace

// One job's settings, fixed before its parts run.
struct CpuTierBackend::Pass {
    const Layer &L;
    const FfnTier &T;
    const TierJob &job;
    const ActivationRule rule;
    const TypeKernels &kg, &ku;
    const int64_t n, n_tok, E;
    const TierMode mode;
    const bool dense, all_up;
    // A decode step in predictor mode without the recall check scores the predictor, lists the selected neurons
    // and computes their gates and ups in one pool job: each thread takes a range of the predictor's units and
    // computes the neurons it selected, so no listing on one thread and no wait in between (a sparse step's
    // fixed per-layer costs, docs/engine.md "Decode steps").
    const bool fused;
    bool stream_selected = false;
    Operand hid;  // fused: the predictor's hidden layer

    // (a tier on disk reads its selected rows before it computes them: not fused)
    Pass(const HParams &hp, const KernelSet &ks, const Uploaded &u, const TierJob &j)
        : L(*u.layer), T(*u.tier), job(j), rule(hp, L, T, ks), kg(ks.for_type(L.gate.type)),
          ku(ks.for_type(L.up.type)), n(T.size()), n_tok(j.n_tok), E(hp.n_embd), mode(j.mode),
          dense(j.mode == TierMode::Dense), all_up(reads_up_whole(j.mode)),
          fused(j.mode == TierMode::Predictor && j.n_tok == 1 && !j.recall_check && !T.on_disk()) {}
    const void *xn_at(int64_t t, uint32_t type) const { return job.xn->at(t, type); }
};

size_t CpuTierBackend::down_tile_bytes() {
    return size_t(kDownTileCols / kPackRows) * size_t(kDownPanelRows / QK) * packed_block_bytes(TYPE_Q8_0);
}

CpuTierBackend::CpuTierBackend(const HParams &hp, const KernelSet &ks, ThreadPool &pool, int64_t n_batch,
                               int64_t max_rank, bool copies_tiers, DiskTier *disk)
    : hp_(hp), ks_(ks), pool_(pool), n_batch_(n_batch), max_rank_(std::max<int64_t>(max_rank, 1)),
      copies_tiers_(copies_tiers), disk_(disk) {
    tiers_.assign(size_t(hp.n_layer), Uploaded{nullptr, nullptr});
    if (copies_tiers) copies_.resize(size_t(hp.n_layer));
}

double CpuTierBackend::weight_bytes() const {
    double bytes = 0;
    for (const FfnTier &t : copies_) bytes += double(t.storage.size() + t.gate_groups.size() + t.up_groups.size());
    return bytes;
}

double CpuTierBackend::scratch_bytes(const HParams &hp, int64_t rows, int64_t n_batch, int64_t threads,
                                     int64_t max_rank) {
    const double F = double(rows), E = double(hp.n_embd), B = double(n_batch), T = double(threads);
    const double R = double(std::max<int64_t>(max_rank, 1));
    const double floats = B * (3 * F + 2 * kPackRows + R) + F + (F / double(kDownRunRows) + 1) * E +
                          T * double(kPanelRows) * (E + double(kPanelTokens)) + T * B * double(kDownTileCols);
    return 4 * floats + B * F * 3 + F * (1 + 4 + 4 + 8) + T * (pack_scratch_bytes(E) + sizeof(ChunkList)) +
           (B * R / QK + E / QK + B * (F / QK + 1)) * double(sizeof(BlockQ8_0)) + T * double(down_tile_bytes()) +
           (F / QK + F / double(kDownPanelRows) + 3) * 8;
}

void CpuTierBackend::upload(int64_t il, const Layer &layer, const FfnTier &tier) {
    if (copies_tiers_) copies_[size_t(il)] = packed_copy(tier, hp_.gated);
    tiers_[size_t(il)] = {&layer, copies_tiers_ ? &copies_[size_t(il)] : &tier};
    if (tier.size() <= ld_) return;
    ld_ = tier.size();
    const int64_t E = hp_.n_embd, B = n_batch_, F = ld_, threads = pool_.size();
    g_.assign(size_t(B * (F + kPackRows)), 0.0f);
    u_.assign(size_t(B * (F + kPackRows)), 0.0f);
    h_.assign(size_t(B * F), 0.0f);
    hid_.assign(size_t(B * max_rank_), 0.0f);
    q_hid_.resize(size_t(B * (max_rank_ / QK)));
    mask_.assign(size_t(B * F), 0);
    truth_.assign(size_t(B * F), 0);
    selected_.assign(size_t(B * F), 0);
    every_neuron_.assign(size_t(F), 1);
    rows_.assign(size_t(F), 0);
    hits_.assign(size_t(F), 0);
    down_rows_.assign(size_t(F), nullptr);
    down_coef_.assign(size_t(F), 0.0f);
    down_partial_.assign(size_t(down_run_count(F) * E), 0.0f);
    chunk_lists_.assign(size_t(threads), ChunkList{});
    panel_w_.assign(size_t(threads * kPanelRows * E), 0.0f);
    panel_h_.assign(size_t(threads * kPanelTokens * kPanelRows), 0.0f);
    down_q_.resize(size_t(B * (F / QK + 1)));
    down_blocks_.assign(size_t(F / QK + 1), 0);
    down_panel_first_.assign(size_t(F / kDownPanelRows + 2), 0);
    down_tile_.assign(size_t(threads) * size_t(down_tile_bytes()), 0);
    down_out_.assign(size_t(threads * B * kDownTileCols), 0.0f);
    zero_row_.assign(size_t(E / QK) * sizeof(BlockQ8_0), 0);  // the widest row that packs
    pack_scratch_bytes_ = size_t(pack_scratch_bytes(double(E)));
    pack_scratch_.assign(size_t(threads) * pack_scratch_bytes_, 0);
}

void CpuTierBackend::submit(const TierJob &job) {
    counts_ = TierCounts{};
    Pass p(hp_, ks_, tiers_[size_t(job.layer)], job);
    if (job.n_probe > 0) probe_select(p);
    const FfnTier &T = p.T;
    // A tier on disk: a predictor-mode decode step reads in the neurons it selected, once selected; the other steps
    // every neuron (the modes that read every gate, the true mask, and batches, whose down projection reads the
    // 32-row blocks its tokens use whole), before any of its rows is read.
    const bool disk = disk_ && T.on_disk();
    const bool fetch_selected = p.mode == TierMode::Predictor && !job.recall_check && p.n_tok == 1;
    if (disk && !fetch_selected) disk_->fetch(job.layer, nullptr, p.n, p.n_tok == 1);
    auto t0 = Clock::now();
    select(p);
    const bool selects = p.mode == TierMode::Predictor || p.mode == TierMode::Oracle;
    (selects ? counts_.predictor_seconds : counts_.gate_up_seconds) += seconds_since(t0);

    // gate (and up) for the selected rows; mask_ becomes 2 where up/down are used
    n_rows_ = list_rows(p);
    // a decode step's selected neurons: the reads issued now, each computed as it arrives
    const bool arriving = disk && fetch_selected;
    const int64_t n_hits = arriving ? disk_->begin(job.layer, rows_.data(), n_rows_, true, hits_.data()) : 0;
    t0 = Clock::now();
    // The gates (ups) in 8-row groups for gemm8: the tier's own, or for a batch each pass's groups packed from
    // the rows as it goes (cheap next to the batch's arithmetic on them, and no second copy of the weights).
    const bool gate_groups = !disk && (!T.gate_groups.empty() || (p.n_tok > 1 && T.groups_fit(T.gate)));
    const bool up_groups = !disk && (!T.up_groups.empty() || (p.n_tok > 1 && T.groups_fit(T.up)));
    // A batch whose tokens together select most of the tier reads every gate in order (the 8-row groups, as
    // gate mode does) and keeps each token's selected neurons: rows by index cost more here than all rows in
    // order from about half of them on (docs/engine.md, "Sparse batches"). The same bits either way.
    p.stream_selected = p.mode == TierMode::Predictor && p.n_tok > 1 && gate_groups && n_rows_ * 2 > p.n;
    if (p.stream_selected) std::memcpy(selected_.data(), mask_.data(), size_t(p.n_tok * ld_));
    n_active_ = n_computed_ = 0;
    if ((reads_gate_whole(p.mode) || p.stream_selected) && gate_groups && (!hp_.gated || !p.all_up || up_groups)) {
        gate_up_grouped(p);
    } else if (p.fused) {
        fused_predictor_step(p);
    } else if (arriving) {
        gate_up_arriving(p, n_hits);
    } else {
        auto job_fn = [&](int chunk, int n_chunks, int) {
            int64_t i0, i1;
            split_range(n_rows_, chunk, n_chunks, &i0, &i1);
            const Tally c = gate_up_gathered(p, rows_.data() + i0, i1 - i0);
            n_active_ += c.active;
            n_computed_ += c.computed;
        };
        pool_.run(pool_.chunks_for(n_rows_ * p.E * p.n_tok * 2, kGrain), job_fn);
    }
    counts_.active = double(n_active_.load());
    counts_.computed = double(n_computed_.load());
    counts_.gate_up_seconds += seconds_since(t0);

    t0 = Clock::now();
    if (job.down_zero_at >= 0.0f) zero_small_h(p, job.down_zero_at);
    if (p.dense && p.L.down.data) down_stored(p);
    else if (p.n_tok == 1) down_decode(p, 0);
    else if (job.steps)
        for (int64_t t = 0; t < p.n_tok; ++t) down_decode(p, t);  // each token's rows read back from cache
    else down_batch(p);
    counts_.down_seconds += seconds_since(t0);
    if (job.n_probe > 0) probe_count(p);
}

// A decode step on disk: each thread computes its share of the selected neurons in memory, then the neurons of the
// reads as they arrive (DiskTier::arrived: all that arrived since it last looked, one pass), so the computing hides
// part of the reads' wait. A neuron's gate, up and
// value do not depend on the list it came in; the down projection runs after, over rows_ in order: the same bits as
// with every bundle in memory.
void CpuTierBackend::gate_up_arriving(const Pass &p, int64_t n_hits) {
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t i0, i1;
        split_range(n_hits, chunk, n_chunks, &i0, &i1);
        Tally c = gate_up_gathered(p, hits_.data() + i0, i1 - i0);
        int32_t list[kDecodeGatherRows];  // the neurons of the reads that arrived since this thread last looked
        for (int64_t n; (n = disk_->arrived(list, kDecodeGatherRows)) > 0;) c += gate_up_gathered(p, list, n);
        n_active_ += c.active;
        n_computed_ += c.computed;
    };
    pool_.run(pool_.size(), job);
    disk_->finish();  // the last read's wait, and a damaged bundle's one-line failure
}

// ---- select ----------------------------------------------------------------------------------------------

void CpuTierBackend::select(Pass &p) {
    const int64_t n_tok = p.n_tok;
    if (p.fused) {
        p.hid = predictor_hidden(p.L, *p.job.x, n_tok);
        return;  // the fused step scores, lists and counts
    }
    if (p.mode == TierMode::Predictor) {
        predictor_select(p.L, p.T, *p.job.x, n_tok);
        if (p.job.recall_check) true_mask(p, truth_.data());
    } else if (p.mode == TierMode::Oracle) {
        true_mask(p, truth_.data());
        std::memcpy(mask_.data(), truth_.data(), size_t(n_tok * ld_));
    } else {
        for (int64_t t = 0; t < n_tok; ++t) std::fill(mask_.begin() + t * ld_, mask_.begin() + t * ld_ + p.n, 1);
        return;
    }
    count_selection(p);
}

void CpuTierBackend::count_selection(const Pass &p) {
    int64_t selected = 0, tp = 0, pos = 0;  // integer counts: a double sum is a latency chain
    const bool have_truth = p.mode == TierMode::Oracle || p.job.recall_check;
    for (int64_t t = 0; t < p.n_tok; ++t) {
        const uint8_t *mt = mask_.data() + t * ld_;
        for (int64_t r = 0; r < p.n; ++r) selected += mt[r];
        if (!have_truth) continue;
        const uint8_t *tt = truth_.data() + t * ld_;
        for (int64_t r = 0; r < p.n; ++r) {
            pos += tt[r];
            tp += tt[r] & mt[r];
        }
    }
    counts_.predicted += double(selected);
    counts_.scored_tokens += double(p.n_tok);
    counts_.true_pos += double(tp);
    counts_.positives += double(pos);
}

int64_t CpuTierBackend::list_rows(const Pass &p) {
    if (p.fused) return 0;  // listed by the fused job
    if (p.mode != TierMode::Predictor && p.mode != TierMode::Oracle) {
        std::iota(rows_.begin(), rows_.begin() + p.n, 0);  // every row
        return p.n;
    }
    int64_t n_listed = 0;
    for (int64_t r = 0; r < p.n; ++r) {  // listed without branches (whether a row is selected is a coin flip)
        uint8_t any = 0;
        for (int64_t t = 0; t < p.n_tok; ++t) any |= mask_[size_t(t * ld_ + r)];
        rows_[size_t(n_listed)] = int32_t(r);
        n_listed += any != 0;
    }
    return n_listed;
}

Operand CpuTierBackend::predictor_hidden(const Layer &L, Operand &x, int64_t n_tok) {
    const int64_t R = L.fc1.rows;
    matmul(ks_, pool_, L.fc1, x, n_tok, hid_.data(), R);
    for (int64_t i = 0; i < n_tok * R; ++i) hid_[size_t(i)] = std::max(hid_[size_t(i)], 0.0f);
    Operand hid{hid_.data(), R, q_hid_.data(), false};
    prepare(ks_, hid, n_tok, L.fc2.type);
    return hid;
}

void CpuTierBackend::predictor_score(const Layer &L, const FfnTier &T, const Operand &hid, int64_t n_tok, int64_t u0,
                                     int64_t u1) {
    const int64_t Fp = ld_ + kPackRows, R = L.fc1.rows, unit = T.fc2_unit_rows();
    const Matrix &fc2 = T.fc2;
    const TypeKernels &k = ks_.for_type(fc2.type);
    const int64_t r0 = u0 * unit, r1 = std::min(T.size(), u1 * unit);
    if (r0 >= r1) return;
    if (T.fc2_transposed) {
        // logits of token t = sum over k of hidden[t][k] * weight k of the tile's neurons, tile by tile, row by
        // row (each streams in order; axpy_rows would interleave R streams at once)
        for (int64_t b = u0; b < u1; ++b) {
            const int64_t c0 = b * FfnTier::kFc2Tile, c1 = std::min(T.size(), c0 + FfnTier::kFc2Tile);
            for (int64_t t = 0; t < n_tok; ++t) {
                float *logit = g_.data() + t * Fp;
                std::fill(logit + c0, logit + c1, 0.0f);
                for (int64_t j = 0; j < R; ++j) k.axpy(int(c1 - c0), hid_[size_t(t * R + j)], T.fc2_tile_row(b, j), logit + c0);
            }
        }
    } else {  // quantized: 8-row groups, every token's logits by gemm8 (integer dots)
        k.gemm8(int(R), int(u1 - u0), fc2.groups + u0 * fc2.group_bytes(), int(n_tok), hid.at(0, fc2.type),
                hid.stride(fc2.type), g_.data() + r0, Fp);
    }
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = r0; r < r1; ++r) mask_[size_t(t * ld_ + r)] = g_[size_t(t * Fp + r)] > L.pred_threshold;
}

void CpuTierBackend::predictor_select(const Layer &L, const FfnTier &T, Operand &x, int64_t n_tok) {
    // hidden = relu(fc1 x); neuron j selected when fc2_j . hidden > threshold
    const Operand hid = predictor_hidden(L, x, n_tok);
    const int64_t units = T.fc2_units();
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t u0, u1;
        split_range(units, chunk, n_chunks, &u0, &u1);
        predictor_score(L, T, hid, n_tok, u0, u1);
    };
    // few multiply-adds per byte, and the bytes come from DRAM each step: counted as float rows are, so
    // that both threads take a share (one thread alone waited on memory)
    pool_.run(int(std::min<int64_t>(units, pool_.chunks_for(T.size() * L.fc1.rows * n_tok * kRowDotCost, kGrain))), job);
}

void CpuTierBackend::true_mask(const Pass &p, uint8_t *out) {
    const FfnTier &T = p.T;
    const int64_t E = p.E, n = p.n, n_tok = p.n_tok;
    const bool drelu = p.rule.act == Activation::DRelu;
    // the gate (and up) values of every path: dot_rows, in passes of kGatherRows rows per token
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t r0, r1;
        split_range(n, chunk, n_chunks, &r0, &r1);
        const void *gate_rows[kGatherRows], *up_rows[kGatherRows];
        float g[kGatherRows], u[kGatherRows];
        for (int64_t p0 = r0; p0 < r1; p0 += kGatherRows) {
            const int m = int(std::min(r1, p0 + kGatherRows) - p0);
            for (int j = 0; j < m; ++j) {
                gate_rows[j] = T.row(T.gate, p0 + j);
                if (drelu) up_rows[j] = T.row(T.up, p0 + j);
            }
            for (int64_t t = 0; t < n_tok; ++t) {
                p.kg.dot_rows(int(E), m, gate_rows, p.xn_at(t, p.L.gate.type), g);
                if (drelu) p.ku.dot_rows(int(E), m, up_rows, p.xn_at(t, p.L.up.type), u);
                p.rule.activate(g, m, [&](int64_t j) { return p0 + j; });
                for (int j = 0; j < m; ++j) {
                    float a, h;
                    bool on = p.rule.gate_rule(g[j], p0 + j, &a);
                    if (drelu) on = p.rule.finish(on, a, p.rule.up_value(u[j], p0 + j), &h);
                    out[size_t(t * ld_ + p0 + j)] = on;
                }
            }
        }
    };
    pool_.run(pool_.chunks_for(n * E * n_tok, kGrain), job);
}

void CpuTierBackend::probe_select(const Pass &p) {
    const auto t0 = Clock::now();
    const int64_t k = p.job.n_probe, first = p.n_tok - k, E = p.E;
    Operand last{p.job.x->f + first * E, E, p.job.x->q + first * (E / QK), false};
    predictor_select(p.L, p.T, last, k);
    std::memcpy(selected_.data(), mask_.data(), size_t(k * ld_));
    counts_.predictor_seconds += seconds_since(t0);
}

void CpuTierBackend::probe_count(const Pass &p) {
    const int64_t n_probe = p.job.n_probe;
    int64_t selected = 0, computed = 0;  // integer counts, without branches
    for (int64_t t = 0; t < n_probe; ++t) {
        const uint8_t *sel = selected_.data() + t * ld_, *used = mask_.data() + (p.n_tok - n_probe + t) * ld_;
        for (int64_t r = 0; r < p.n; ++r) {
            selected += sel[r];
            computed += sel[r] & (used[r] == 2);
        }
    }
    counts_.probe_selected = double(selected);
    counts_.probe_computed = double(computed);
}

// ---- gate and up -----------------------------------------------------------------------------------------

void CpuTierBackend::settle(const Pass &p, int64_t t, int64_t r, bool pass, float h, Tally &c) {
    // (branch-free: at moderate sparsity whether a neuron passes is a coin flip the predictor cannot learn)
    const bool used = p.dense || pass;
    c.active += pass;
    c.computed += used;
    mask_[size_t(t * ld_ + r)] = uint8_t(1 + used);
    h_[size_t(t * ld_ + r)] = keep_if(used, h);
}

CpuTierBackend::Tally CpuTierBackend::listed_ups(const Pass &p, int64_t t, int n_up, const int64_t *slot,
                                                 const void *const *rows, const float *a, const bool *first_pass) {
    Tally c;
    float u[kDecodeGroupsPerPass * kPackRows];
    static_assert(kDecodeGroupsPerPass * kPackRows >= kDecodeGatherRows, "listed_ups holds the longer list");
    p.ku.dot_rows(int(p.E), n_up, rows, p.xn_at(t, p.L.up.type), u);
    for (int i = 0; i < n_up; ++i) {
        float h;
        const bool pass = p.rule.finish(first_pass ? first_pass[i] : true, a[i], p.rule.up_value(u[i], slot[i]), &h);
        settle(p, t, slot[i], pass, h, c);
        if (p.n_tok == 1) prefetch_row(pass ? p.T.row(p.T.down_t, slot[i]) : rows[i], p.T.down_t.row_bytes);
    }
    return c;
}

// Rows read by index (predictor mode, or a tier without 8-row groups), in passes of kGatherRows selected
// rows (they stay in cache across a batch's tokens). Per token, the pass's rows its mask selects go
// through dot_rows for their gates, then the ones whose rule needs the up projection for their ups.
CpuTierBackend::Tally CpuTierBackend::gate_up_gathered(const Pass &p, const int32_t *list, int64_t count) {
    Tally c;
    const FfnTier &T = p.T;
    const bool gated = hp_.gated, all_up = p.all_up;
    const void *gate_rows[kDecodeGatherRows], *up_rows[kDecodeGatherRows];
    int64_t gate_slot[kDecodeGatherRows], up_slot[kDecodeGatherRows];
    float g[kDecodeGatherRows], up_a[kDecodeGatherRows];
    bool up_first[kDecodeGatherRows];
    const int64_t per_pass = p.n_tok == 1 ? kDecodeGatherRows : kGatherRows;
    for (int64_t p0 = 0; p0 < count; p0 += per_pass) {
        const int64_t p1 = std::min(count, p0 + per_pass);
        for (int64_t t = 0; t < p.n_tok; ++t) {
            const uint8_t *mt = mask_.data() + t * ld_;
            int n_gate = 0, n_up = 0;
            for (int64_t i = p0; i < p1; ++i) {  // listed without branches
                const int64_t r = list[i];
                gate_slot[n_gate] = r;
                gate_rows[n_gate] = T.row(T.gate, r);
                n_gate += mt[r] != 0;
            }
            p.kg.dot_rows(int(p.E), n_gate, gate_rows, p.xn_at(t, p.L.gate.type), g);
            p.rule.activate(g, n_gate, [&](int64_t j) { return gate_slot[j]; });
            for (int j = 0; j < n_gate; ++j) {
                const int64_t r = gate_slot[j];
                float a;
                const bool first_pass = p.rule.gate_rule(g[j], r, &a);
                if (!gated) {
                    settle(p, t, r, first_pass, a, c);  // ungated: the activation is the output
                    continue;
                }
                up_slot[n_up] = r;
                up_rows[n_up] = T.row(T.up, r);
                up_a[n_up] = a;
                up_first[n_up] = first_pass;
                if (n_up < kListAhead) prefetch_row(up_rows[n_up], T.up.row_bytes);
                n_up += first_pass || all_up;
                if (!all_up) settle(p, t, r, false, 0.0f, c);  // for now: h is 0 unless listed
            }
            if (t + 1 == p.n_tok)  // the next pass's first gate rows arrive while this pass's ups are computed
                for (int64_t i = p1; i < std::min(count, p1 + kListAhead); ++i)
                    prefetch_row(T.row(T.gate, list[i]), T.gate.row_bytes);
            if (gated) c += listed_ups(p, t, n_up, up_slot, up_rows, up_a, up_first);
        }
    }
    return c;
}

// The fused decode step: chunk c scores the predictor's units of range c, lists the neurons selected there
// at the start of the same range of rows_ (so chunks never overlap), computes them and lists the down_t
// rows they used from the same start in down_rows_ / down_coef_.
void CpuTierBackend::fused_predictor_step(Pass &p) {
    const FfnTier &T = p.T;
    double score_seconds = 0;  // the main thread's share of the scoring, reported as the predictor's time
    auto job = [&](int chunk, int n_chunks, int thread) {
        const auto ts = Clock::now();
        int64_t u0, u1;
        split_range(T.fc2_units(), chunk, n_chunks, &u0, &u1);
        const int64_t r0 = u0 * T.fc2_unit_rows(), r1 = std::min(p.n, u1 * T.fc2_unit_rows());
        predictor_score(p.L, T, p.hid, 1, u0, u1);
        int32_t *list = rows_.data() + r0;
        int64_t listed = 0;
        for (int64_t r = r0; r < r1; ++r) {  // listed without branches
            list[listed] = int32_t(r);
            listed += mask_[size_t(r)];
        }
        if (thread == 0) score_seconds += seconds_since(ts);  // the main thread may take more than one chunk
        const Tally c = gate_up_gathered(p, list, listed);
        n_active_ += c.active;
        n_computed_ += c.computed;
        chunk_lists_[size_t(chunk)] = {r0, listed, list_used_rows(T, list, listed, r0)};
    };
    const int n_chunks = int(std::min<int64_t>(pool_.size(), T.fc2_units()));
    pool_.run(n_chunks, job);
    // the chunks' lists moved together in chunk order: slot order, as one pass over rows_ would list them
    n_rows_ = n_used_ = 0;
    for (int c = 0; c < n_chunks; ++c) {
        const ChunkList &cl = chunk_lists_[size_t(c)];
        std::memmove(rows_.data() + n_rows_, rows_.data() + cl.at, size_t(cl.listed) * sizeof(int32_t));
        std::memmove(down_rows_.data() + n_used_, down_rows_.data() + cl.at, size_t(cl.used) * sizeof(const void *));
        std::memmove(down_coef_.data() + n_used_, down_coef_.data() + cl.at, size_t(cl.used) * sizeof(float));
        n_rows_ += cl.listed;
        n_used_ += cl.used;
    }
    counts_.predicted += double(n_rows_);  // one token: the neurons listed are the ones selected
    counts_.scored_tokens += 1.0;
    counts_.predictor_seconds += score_seconds;
    counts_.gate_up_seconds -= score_seconds;
}

// Grouped tiers in the modes that read every gate: the gates (and, when every up is read, the ups) of
// a few 8-row groups by gemm8 for all tokens, then each neuron's rule; in gate mode the ups of the
// neurons the gate lets through come from their own rows.
void CpuTierBackend::gate_up_grouped(Pass &p) {
    const FfnTier &T = p.T;
    const int64_t Fp = ld_ + kPackRows, E = p.E, n_tok = p.n_tok;
    auto job = [&](int chunk, int n_chunks, int thread) {
        int64_t g0, g1;
        Tally c;
        split_range(T.n_groups(), chunk, n_chunks, &g0, &g1);
        const int64_t gate_group = T.gate.group_bytes();
        const int64_t per_pass = n_tok == 1 ? kDecodeGroupsPerPass : kGroupsPerPass;
        uint8_t *scratch = pack_scratch_.data() + size_t(thread) * pack_scratch_bytes_;
        // groups [g, g + ng) of m: the tier's own, or packed now into this thread's scratch (at `at`)
        auto groups_of = [&](const Matrix &m, const PageMemory &kept, int64_t g, int ng, size_t at) {
            if (!kept.empty()) return kept.data() + g * m.group_bytes();
            T.pack_groups(m, g, g + ng, zero_row_.data(), scratch + at);
            return static_cast<const uint8_t *>(scratch + at);
        };
        for (int64_t g = g0; g < g1; g += per_pass) {
            const int ng = int(std::min<int64_t>(per_pass, g1 - g));
            const int64_t r0 = g * kPackRows, r1 = std::min(p.n, (g + ng) * kPackRows);
            p.kg.gemm8(int(E), ng, groups_of(T.gate, T.gate_groups, g, ng, 0), int(n_tok), p.xn_at(0, p.L.gate.type),
                       p.job.xn->stride(p.L.gate.type), g_.data() + r0, Fp);
            if (hp_.gated && p.all_up)
                p.ku.gemm8(int(E), ng, groups_of(T.up, T.up_groups, g, ng, size_t(ng * gate_group)), int(n_tok),
                           p.xn_at(0, p.L.up.type), p.job.xn->stride(p.L.up.type), u_.data() + r0, Fp);
            for (int64_t t = 0; t < n_tok; ++t) c += grouped_token(p, t, r0, r1);
        }
        n_active_ += c.active;
        n_computed_ += c.computed;
    };
    pool_.run(pool_.chunks_for(p.n * E * n_tok * 2, kGrain), job);
}

// Each neuron's rule for token t over slots [r0, r1) of a grouped pass (SiLU: the pass's activations by the silu
// kernel first); in gate mode the neurons the gate lets through are listed, then their ups computed by dot_rows
// (gemm8's arithmetic: the values dense mode's grouped ups would have).
CpuTierBackend::Tally CpuTierBackend::grouped_token(const Pass &p, int64_t t, int64_t r0, int64_t r1) {
    Tally c;
    const FfnTier &T = p.T;
    const ActivationRule &rule = p.rule;
    const int64_t Fp = ld_ + kPackRows;
    int64_t up_list[kDecodeGroupsPerPass * kPackRows];
    const void *up_rows[kDecodeGroupsPerPass * kPackRows];
    float up_a[kDecodeGroupsPerPass * kPackRows];
    float *gt = g_.data() + t * Fp;
    const uint8_t *sel = p.stream_selected ? selected_.data() + t * ld_ : every_neuron_.data();
    rule.activate(gt + r0, r1 - r0, [&](int64_t j) { return r0 + j; });
    int n_up = 0;
    if (rule.plain() && p.all_up) {
        // the dense modes, in one straight loop the compiler vectorizes (everything it reads in locals: the
        // byte stores to mt could alias any other memory)
        const ActivationRule local = rule;
        const bool silu_act = thresholded(rule.act), dense = p.dense;
        const float *ut = u_.data() + t * Fp;
        float *ht = h_.data() + t * ld_;
        uint8_t *mt = mask_.data() + t * ld_;
        int64_t active = 0, computed = 0;
        for (int64_t r = r0; r < r1; ++r) {
            const bool pass = local.gate_passes(gt[r]);
            const float a = silu_act ? gt[r] : keep_if(pass, gt[r]);
            const bool used = dense || pass;
            active += pass;
            computed += used;
            mt[r] = uint8_t(1 + used);
            ht[r] = keep_if(used, a * ut[r]);
        }
        return {active, computed};
    }
    if (rule.plain()) {
        // gate mode: every neuron settled as not passing at once, the ones the gate lets through listed without
        // branches
        std::fill(mask_.begin() + t * ld_ + r0, mask_.begin() + t * ld_ + r1, uint8_t(1));
        std::fill(h_.begin() + t * ld_ + r0, h_.begin() + t * ld_ + r1, 0.0f);
        for (int64_t r = r0; r < r1; ++r) {
            up_list[n_up] = r;
            n_up += rule.gate_passes(gt[r]) & (sel[r] != 0);
        }
        for (int i = 0; i < n_up; ++i) {
            up_rows[i] = T.row(T.up, up_list[i]);
            up_a[i] = gt[up_list[i]];
            if (i < kListAhead) prefetch_row(up_rows[i], T.up.row_bytes);
        }
    } else {
        for (int64_t r = r0; r < r1; ++r) {
            float a;
            const bool first_pass = rule.gate_rule(gt[r], r, &a) & (sel[r] != 0);
            if (!hp_.gated) {
                settle(p, t, r, first_pass, a, c);
            } else if (p.all_up) {
                float h;
                const bool pass = rule.finish(first_pass, a, rule.up_value(u_[size_t(t * Fp + r)], r), &h);
                settle(p, t, r, pass, h, c);
            } else {  // listed when it passes (branch-free); settled for now as not passing
                up_list[n_up] = r;
                up_rows[n_up] = T.row(T.up, r);
                up_a[n_up] = a;
                if (n_up < kListAhead) prefetch_row(up_rows[n_up], T.up.row_bytes);
                n_up += first_pass;
                settle(p, t, r, false, 0.0f, c);
            }
        }
    }
    if (n_up > 0) c += listed_ups(p, t, n_up, up_list, up_rows, up_a, nullptr);
    return c;
}

// ---- down ------------------------------------------------------------------------------------------------

// The rows used with a nonzero coefficient: the integer axpy_rows rounds each group of rows against its largest
// (kernels/axpy_int.h), so leaving exact zeros out gives every mode that computes the same neurons (dense, gate,
// oracle) the same groups, and the same bits.
int64_t CpuTierBackend::list_used_rows(const FfnTier &T, const int32_t *list, int64_t count, int64_t at, int64_t t) {
    int64_t used = 0;
    const float *h = h_.data() + t * ld_;
    const uint8_t *mask = mask_.data() + t * ld_;
    for (int64_t i = 0; i < count; ++i) {  // without branches
        const int64_t r = list[i];
        down_rows_[size_t(at + used)] = T.row(T.down_t, r);
        down_coef_[size_t(at + used)] = h[r];
        used += (mask[r] == 2) & (h[r] != 0.0f);
    }
    return used;
}

// One token: the used rows (listed by the fused chunks, else in one pass) in the runs of down_runs.h, each on a
// thread: the same sums whatever the thread count or which thread ran which run. Where the tier holds its rows in
// quads and every row is used (rows_ is then every slot in order), a run reads its quads instead: the same bits.
void CpuTierBackend::down_decode(const Pass &p, int64_t t) {
    const TypeKernels &kd = ks_.for_type(p.T.down_t.type);
    const int64_t n_used = p.fused ? n_used_ : list_used_rows(p.T, rows_.data(), n_rows_, 0, t);
    const int64_t n_runs = down_run_count(n_used);
    const bool quads = !p.T.down_quads.empty() && kd.axpy_quads && n_used == p.n;
    auto run_rows = [&](int run, int, int) {
        down_run(kd, p.E, n_used, down_rows_.data(), down_coef_.data(), run, down_partial_.data() + run * p.E,
                 quads ? p.T.down_quads.data() : nullptr);
    };
    pool_.run(int(n_runs), run_rows);
    sum_down_runs(p.E, n_runs, down_partial_.data(), p.job.y + t * p.E);
}

// A dense step or batch of a layer holding llama.cpp's ffn_down as stored (Layer::down, a row per output): y = down . h
// as every other matrix is multiplied, h quantized to q8_0 per 32 neurons and gemm8 over down's 8-row groups, the
// outputs split over the threads (engine/matmul.h). Every neuron is the cold tier's, in order (no hot tier: Engine's
// down_as_stored), so h_'s rows are the operand; a neuron a token leaves out has h = 0 (settle).
void CpuTierBackend::down_stored(const Pass &p) {
    if (p.n != p.L.down.cols || p.n != ld_ || p.T.packed)
        fail(PI_ERR_INTERNAL, "the down projection as stored needs every neuron in the cold tier, in order");
    Operand h{h_.data(), ld_, down_q_.data()};
    matmul(ks_, pool_, p.L.down, h, p.n_tok, p.job.y, p.E);
}

// Input sparsity's down site: every used activation at or below t in magnitude zeroed (as a decode step's kept
// inputs, Engine::input_ffn), counted.
void CpuTierBackend::zero_small_h(const Pass &p, float t) {
    std::atomic<int64_t> seen{0}, zeroed{0};
    auto zero = [&](int chunk, int n_chunks, int) {
        int64_t t0, t1;
        split_range(p.n_tok, chunk, n_chunks, &t0, &t1);
        int64_t s = 0, z = 0;
        for (int64_t tk = t0; tk < t1; ++tk) {  // every slot, in order, without branches
            const uint8_t *m = mask_.data() + tk * ld_;
            float *h = h_.data() + tk * ld_;
            for (int64_t r = 0; r < p.n; ++r) {
                const bool used = m[r] == 2, small = used & (std::fabs(h[r]) <= t);
                s += used;
                z += small;
                h[r] = small ? 0.0f : h[r];
            }
        }
        seen += s;
        zeroed += z;
    };
    pool_.run(int(std::min<int64_t>(p.n_tok, pool_.chunks_for(p.n_tok * p.n, kGrain))), zero);
    counts_.down_inputs += double(seen.load());
    counts_.down_zeroed += double(zeroed.load());
}

// A batch: each thread owns a slice of the columns. The used rows go in panels of kPanelRows, widened to floats
// once, and the tokens' coefficients (0 where a token leaves a row out) in chunks of kPanelTokens, through
// gemm_f32 (tokens x columns tiles held in registers). Where every token's every row was settled (h_ is 0 where
// a token leaves a row out), all of the tier's rows stay in order when nearly all are used: the coefficients are
// then h_ itself, read in place by gemm_f32, instead of a copy gathered per panel and thread.
void CpuTierBackend::down_batch(const Pass &p) {
    const FfnTier &T = p.T;
    const int64_t E = p.E, n = p.n, n_tok = p.n_tok, F = ld_;
    const uint32_t dtype = T.down_t.type;
    const TypeKernels &kd = ks_.for_type(dtype);
    float *y = p.job.y;
    int64_t n_used = 0;
    for (int64_t i = 0; i < n_rows_; ++i) {  // counted (and compacted) without branches
        const int64_t r = rows_[size_t(i)];
        int32_t users = 0;
        for (int64_t t = 0; t < n_tok; ++t) users += mask_[size_t(t * F + r)] == 2;
        rows_[size_t(n_used)] = int32_t(r);
        n_used += users > 0;
    }
    if (kd.pack_columns8 && ks_.q8_0.gemm8) return down_batch_int(p, n_used);
    // every token's every row settled: the modes that list every row, and a predictor batch that read every
    // gate in order (its unselected neurons settled as not used)
    const bool settled_all = (p.mode != TierMode::Predictor && p.mode != TierMode::Oracle) || p.stream_selected;
    const bool in_place = settled_all && n_used * 10 >= n * 9;
    if (in_place) {
        for (int64_t i = 0; i < n; ++i) rows_[size_t(i)] = int32_t(i);
        n_used = n;
    }
    const int64_t align = column_align(dtype);
    auto down = [&](int chunk, int n_chunks, int thread) {
        int64_t c0, c1;
        split_range(E, chunk, n_chunks, &c0, &c1, align);
        if (c0 >= c1) return;
        const int cn = int(c1 - c0);
        for (int64_t t = 0; t < n_tok; ++t) std::fill(y + t * E + c0, y + t * E + c1, 0.0f);
        float *wp = panel_w_.data() + int64_t(thread) * kPanelRows * E;
        float *hp = panel_h_.data() + int64_t(thread) * kPanelTokens * kPanelRows;
        for (int64_t p0 = 0; p0 < n_used; p0 += kPanelRows) {
            const int np = int(std::min<int64_t>(kPanelRows, n_used - p0));
            for (int i = 0; i < np; ++i)
                kd.to_float(cn, column_slice(T.row(T.down_t, rows_[size_t(p0 + i)]), dtype, c0), wp + int64_t(i) * cn);
            for (int64_t t0 = 0; t0 < n_tok; t0 += kPanelTokens) {
                const int nt = int(std::min<int64_t>(kPanelTokens, n_tok - t0));
                if (in_place) {
                    ks_.gemm_f32(nt, np, cn, h_.data() + t0 * F + p0, int(F), wp, cn, y + t0 * E + c0, int(E));
                    continue;
                }
                for (int t = 0; t < nt; ++t)
                    for (int i = 0; i < np; ++i) {
                        const size_t at = size_t((t0 + t) * F + rows_[size_t(p0 + i)]);
                        hp[t * np + i] = keep_if(mask_[at] == 2, h_[at]);
                    }
                ks_.gemm_f32(nt, np, cn, hp, np, wp, cn, y + t0 * E + c0, int(E));
            }
        }
    };
    const int64_t column_units = (E + align - 1) / align;
    pool_.run(int(std::min<int64_t>(column_units, pool_.chunks_for(n_used * E * n_tok, kGrain))), down);
}

// The same product in integers (q4_0 / q8_0 rows), on a fixed grid of the tier's slots: blocks of 32 slots, the
// operand's blocks (each token's coefficients there in q8_0, 0 where a token leaves a row out) and the weights'
// (pack_columns8: the transpose of a tile's columns requantized per column and block); panels of kDownPanelRows
// slots, whose sums gemm8 computes for every token and which are added to y in order. Blocks no token uses are
// left out: they would add exact zeros, so a token's sums do not depend on the modes or the batch it came in
// (dense, gate and oracle batches, a prompt in any batches, give the same bits). Each thread owns tiles of
// columns. The arithmetic is this tier's own (as llama.cpp multiplies its matrices): tests bound it against the
// decode step's and float64.
void CpuTierBackend::down_batch_int(const Pass &p, int64_t n_used) {
    const FfnTier &T = p.T;
    const int64_t E = p.E, n_tok = p.n_tok, F = ld_, n = p.n;
    constexpr int64_t kPanelBlocks = kDownPanelRows / QK;
    const int64_t n_panels = (n + kDownPanelRows - 1) / kDownPanelRows;
    // the used blocks in slot order (rows_ is), and where each panel's start among them
    int64_t nb = 0;
    for (int64_t i = 0; i < n_used; ++i) {
        const int32_t b = rows_[size_t(i)] / int32_t(QK);
        if (nb == 0 || down_blocks_[size_t(nb - 1)] != b) down_blocks_[size_t(nb++)] = b;
    }
    for (int64_t pn = 0, j = 0; pn <= n_panels; ++pn) {
        while (j < nb && down_blocks_[size_t(j)] < pn * kPanelBlocks) ++j;
        down_panel_first_[size_t(pn)] = j;
    }
    const size_t x_stride = size_t(nb) * sizeof(BlockQ8_0);
    auto coefficients = [&](int chunk, int n_chunks, int) {
        int64_t t0, t1;
        split_range(n_tok, chunk, n_chunks, &t0, &t1);
        for (int64_t t = t0; t < t1; ++t) {
            float c[QK];
            for (int64_t j = 0; j < nb; ++j) {
                for (int64_t i = 0; i < QK; ++i) {
                    const int64_t r = int64_t(down_blocks_[size_t(j)]) * QK + i;
                    const size_t at = size_t(t * F + std::min(r, n - 1));
                    c[i] = r < n && mask_[at] == 2 ? h_[at] : 0.0f;
                }
                ks_.quantize_q8_0(QK, c, down_q_.data() + t * nb + j);
            }
        }
    };
    pool_.run(int(std::min<int64_t>(n_tok, pool_.chunks_for(n_tok * nb * QK * 8, kGrain))), coefficients);

    const TypeKernels &kd = ks_.for_type(T.down_t.type);
    const TypeKernels &kq = ks_.q8_0;
    float *y = p.job.y;
    auto down = [&](int chunk, int n_chunks, int thread) {
        int64_t c0, c1;
        split_range(E, chunk, n_chunks, &c0, &c1, kDownTileCols);
        uint8_t *tile = down_tile_.data() + size_t(thread) * size_t(down_tile_bytes());
        float *part = down_out_.data() + int64_t(thread) * n_batch_ * kDownTileCols;
        const void *rows[kDownPanelRows];
        for (int64_t t = 0; t < n_tok; ++t) std::fill(y + t * E + c0, y + t * E + c1, 0.0f);
        for (int64_t pn = 0; pn < n_panels; ++pn) {  // a panel's coefficients stay in cache across its tiles
            const int64_t j0 = down_panel_first_[size_t(pn)], j1 = down_panel_first_[size_t(pn + 1)];
            if (j0 == j1) continue;
            const int np = int((j1 - j0) * QK);
            for (int i = 0; i < np; ++i) {
                const int64_t r = int64_t(down_blocks_[size_t(j0 + i / QK)]) * QK + i % QK;
                rows[i] = r < n ? static_cast<const void *>(T.row(T.down_t, r)) : static_cast<const void *>(zero_row_.data());
            }
            for (int64_t tc = c0; tc < c1; tc += kDownTileCols) {
                const int cn = int(std::min(kDownTileCols, c1 - tc));
                kd.pack_columns8(np, rows, int(tc), cn, tile);
                kq.gemm8(np, cn / kPackRows, tile, int(n_tok), down_q_.data() + j0, x_stride, part, kDownTileCols);
                for (int64_t t = 0; t < n_tok; ++t) {
                    float *yt = y + t * E + tc;
                    const float *pt = part + t * kDownTileCols;
                    for (int c = 0; c < cn; ++c) yt[c] += pt[c];
                }
            }
        }
    };
    const int64_t tiles = (E + kDownTileCols - 1) / kDownTileCols;
    pool_.run(int(std::min<int64_t>(tiles, pool_.chunks_for(nb * QK * E * n_tok, kGrain))), down);
}

}  // namespace pi
