#include "engine/moe.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "backend/activation_rule.h"
#include "backend/down_runs.h"
#include "engine/work.h"
#include "kernels/packed.h"
#include "runtime/common.h"

namespace pi {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const int64_t kPassRows = kGroupsPerPass * kPackRows;  // a group's rows packed and multiplied at a time
const int64_t kDotRows = 64;                           // rows per dot_rows call (their pointers on the stack)

enum Which { kGate, kUp, kDown };

const float kTaken = -2.0f;  // an expert's probability once chosen: below every probability

}  // namespace

MoeFfn::MoeFfn(const HParams &hp, const KernelSet &ks, ThreadPool &pool, int64_t n_batch)
    : hp_(hp), ks_(ks), pool_(pool), n_batch_(n_batch), n_expert_(hp.n_expert), k_(hp.n_expert_used),
      E_(hp.n_embd), F_(hp.n_ff_exp), wave_(std::max<int64_t>(hp.n_expert_used, pool.size())) {
    const int64_t B = n_batch, P = n_batch * k_, threads = pool.size();
    logits_.assign(size_t(B * n_expert_), 0.0f);
    tok_expert_.assign(size_t(P), 0);
    tok_weight_.assign(size_t(P), 0.0f);
    first_.assign(size_t(n_expert_ + 1), 0);
    cursor_.assign(size_t(n_expert_ + 1), 0);
    pair_token_.assign(size_t(P), 0);
    pair_expert_.assign(size_t(P), 0);
    pair_weight_.assign(size_t(P), 0.0f);
    xg_.assign(size_t(P * E_), 0.0f);
    xq_.resize(size_t(P * (E_ / QK)));
    g_.assign(size_t(P * F_), 0.0f);
    u_.assign(size_t(P * F_), 0.0f);
    hq_.resize(size_t(P * (F_ / QK)));
    o_.assign(size_t(P * E_), 0.0f);
    pack_bytes_ = size_t(kGroupsPerPass) * size_t(std::max(E_, F_) / QK) * packed_block_bytes(TYPE_Q8_0);
    pack_.assign(size_t(threads) * pack_bytes_, 0);
    pass_out_.assign(size_t(threads * B * kPassRows), 0.0f);
    zero_row_.assign(size_t(std::max(E_, F_) / QK) * sizeof(BlockQ8_0), 0);  // the widest row that packs
    items_.reserve(size_t(2 * n_expert_));
    if (hp.activation == Activation::Relu) {
        used_rows_.assign(size_t(P * F_), nullptr);
        used_coef_.assign(size_t(P * F_), 0.0f);
        n_used_.assign(size_t(P), 0);
        partials_.assign(size_t(wave_ * down_run_count(F_) * E_), 0.0f);
    }
}

double MoeFfn::scratch_bytes(const HParams &hp, int64_t n_batch, int64_t threads) {
    const double B = double(n_batch), P = B * double(hp.n_expert_used), E = double(hp.n_embd), F = double(hp.n_ff_exp);
    const double N = double(hp.n_expert), W = double(std::max<int64_t>(hp.n_expert_used, threads));
    const double widest = std::max(E, F);
    double bytes = 4 * (B * N + 2 * P + P * (2 * E + 2 * F)) + 16 * (N + 1) + 12 * P +
                   P * (E + F) / QK * double(sizeof(BlockQ8_0)) +
                   double(threads) * (double(kGroupsPerPass) * widest / QK * double(packed_block_bytes(TYPE_Q8_0)) +
                                      4 * B * double(kPassRows)) +
                   widest / QK * double(sizeof(BlockQ8_0)) + 2 * N * double(sizeof(ExpertRows));
    if (hp.activation == Activation::Relu)
        bytes += P * F * (sizeof(void *) + 4) + 8 * P + 4 * W * double(down_run_count(hp.n_ff_exp)) * E;
    return bytes;
}

void MoeFfn::route(const Experts &X, Operand &x, int64_t n_tok) {
    const int64_t N = n_expert_, K = k_;
    matmul(ks_, pool_, X.router, x, n_tok, logits_.data(), N);
    std::fill(first_.begin(), first_.end(), 0);
    for (int64_t t = 0; t < n_tok; ++t) {
        float *p = logits_.data() + t * N;
        ks_.softmax(int(N), 1.0f, p);
        // the K largest probabilities, the lower expert first among equal ones; each expert once, NaNs or not (a
        // group holds a token once: the scratch is sized so)
        int32_t *chosen = tok_expert_.data() + t * K;
        float *w = tok_weight_.data() + t * K;
        float sum = 0.0f;
        for (int64_t i = 0; i < K; ++i) {
            int64_t best = -1;
            for (int64_t e = 0; e < N; ++e)
                if (p[e] != kTaken && (best < 0 || p[e] > p[best])) best = e;
            chosen[i] = int32_t(best);
            w[i] = p[best];
            sum += w[i];
            p[best] = kTaken;
            first_[size_t(best) + 1] += 1;
        }
        if (hp_.expert_weights_norm)
            for (int64_t i = 0; i < K; ++i) w[i] /= sum;
    }
    for (int64_t e = 0; e < N; ++e) first_[size_t(e) + 1] += first_[size_t(e)];
    std::copy(first_.begin(), first_.end(), cursor_.begin());
    // the pairs by expert, each expert's tokens in order; each pair's copy of its token's input (floats, and the
    // q8_0 blocks where the gate or up reads them)
    const bool q8 = act_is_q8(X.gate.type) || act_is_q8(X.up.type);
    if (q8) prepare(ks_, x, n_tok, act_is_q8(X.gate.type) ? X.gate.type : X.up.type);
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t i = 0; i < K; ++i) {
            const int32_t e = tok_expert_[size_t(t * K + i)];
            const int64_t p = cursor_[size_t(e)]++;
            pair_expert_[size_t(p)] = e;
            pair_token_[size_t(p)] = int32_t(t);
            pair_weight_[size_t(p)] = tok_weight_[size_t(t * K + i)];
            std::memcpy(xg_.data() + p * E_, x.f + t * E_, size_t(E_) * sizeof(float));
            if (q8) std::memcpy(xq_.data() + p * (E_ / QK), x.q + t * (E_ / QK), size_t(E_ / QK) * sizeof(BlockQ8_0));
        }
}

void MoeFfn::add_items(const Experts &X, int which, const uint8_t *xq, const uint8_t *xf, size_t q_stride,
                       size_t f_stride, float *out, int64_t ldo) {
    for (int64_t e = 0; e < n_expert_; ++e) {
        const int64_t p0 = first_[size_t(e)], n = first_[size_t(e) + 1] - p0;
        if (n == 0) continue;
        ExpertRows it;
        it.W = which == kGate ? X.gate_of(e) : which == kUp ? X.up_of(e) : X.down_of(e);
        const bool q8 = act_is_q8(it.W.type);
        it.x_stride = q8 ? q_stride : f_stride;
        it.x = (q8 ? xq : xf) + size_t(p0) * it.x_stride;
        it.n_tok = n;
        it.out = out + p0 * ldo;
        it.ldo = ldo;
        items_.push_back(it);
    }
}

void MoeFfn::item_rows(const ExpertRows &it, int64_t r0, int64_t r1, int thread) {
    const Matrix &W = it.W;
    const TypeKernels &k = ks_.for_type(W.type);
    const int n = int(W.cols);
    if (it.n_tok > 1 && packed_block_bytes(W.type) != 0 && W.cols <= kGemv8MaxCols) {
        // a group: each pass's rows packed in 8-row groups (the last padded with zero rows) and multiplied by gemm8
        // for every token while they are in cache; the same bits as dot_rows gives one token
        uint8_t *packed = pack_.data() + size_t(thread) * pack_bytes_;
        float *tmp = pass_out_.data() + int64_t(thread) * n_batch_ * kPassRows;
        const int64_t group_bytes = W.group_bytes();
        for (int64_t r = r0; r < r1; r += kPassRows) {
            const int64_t rows = std::min(kPassRows, r1 - r), groups = (rows + kPackRows - 1) / kPackRows;
            for (int64_t g = 0; g < groups; ++g) {
                const void *group[kPackRows];
                for (int j = 0; j < kPackRows; ++j) {
                    const int64_t row = r + g * kPackRows + j;
                    group[j] = row < r + rows ? static_cast<const void *>(W.row(row)) : zero_row_.data();
                }
                pack_rows8(W.type, n, group, packed + g * group_bytes);
            }
            k.gemm8(n, int(groups), packed, int(it.n_tok), it.x, it.x_stride, tmp, kPassRows);
            for (int64_t t = 0; t < it.n_tok; ++t)
                std::memcpy(it.out + t * it.ldo + r, tmp + t * kPassRows, size_t(rows) * sizeof(float));
        }
        return;
    }
    for (int64_t r = r0; r < r1; r += kDotRows) {
        const int64_t rows = std::min(kDotRows, r1 - r);
        const void *ptrs[kDotRows];
        for (int64_t j = 0; j < rows; ++j) ptrs[j] = W.row(r + j);
        for (int64_t t = 0; t < it.n_tok; ++t)
            k.dot_rows(n, int(rows), ptrs, it.x + size_t(t) * it.x_stride, it.out + t * it.ldo + r);
    }
}

void MoeFfn::rows_job() {
    int64_t total = 0, work = 0;
    for (const ExpertRows &it : items_) {
        total += it.W.rows;
        work += it.W.rows * it.W.cols * it.n_tok;
    }
    auto job = [&](int chunk, int n_chunks, int thread) {
        int64_t a, b;
        split_range(total, chunk, n_chunks, &a, &b, kPackRows);
        int64_t base = 0;
        for (const ExpertRows &it : items_) {
            const int64_t r0 = std::max<int64_t>(a - base, 0), r1 = std::min<int64_t>(b - base, it.W.rows);
            if (r0 < r1) item_rows(it, r0, r1, thread);
            base += it.W.rows;
        }
    };
    pool_.run(pool_.chunks_for(work, kGrain), job);
}

void MoeFfn::silu_products(const Experts &X, int64_t n_pairs) {
    const bool q8 = act_is_q8(X.down.type);
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t p0, p1;
        split_range(n_pairs, chunk, n_chunks, &p0, &p1);
        for (int64_t p = p0; p < p1; ++p) {
            float *h = g_.data() + p * F_;
            const float *u = u_.data() + p * F_;
            activate_thresholded(ks_, Activation::Silu, F_, h);
            for (int64_t j = 0; j < F_; ++j) h[j] *= u[j];
            if (q8) ks_.quantize_q8_0(int(F_), h, hq_.data() + p * (F_ / QK));
        }
    };
    pool_.run(int(std::min<int64_t>(n_pairs, pool_.chunks_for(n_pairs * F_ * kRowDotCost, kGrain))), job);
}

int64_t MoeFfn::relu_products(const Experts &X, int64_t n_pairs, bool every_up) {
    // the ups a gate lets through: each neuron's by dot_rows, which gives the bits a group's gemm8 gives (every_up),
    // so that the modes agree
    auto ups = [&](int chunk, int n_chunks, int) {
        int64_t a, b;
        split_range(n_pairs * F_, chunk, n_chunks, &a, &b);
        while (a < b) {
            const int64_t p = a / F_, j1 = std::min(b - p * F_, F_);
            const Matrix up = X.up_of(pair_expert_[size_t(p)]);
            const TypeKernels &k = ks_.for_type(up.type);
            const void *x = act_is_q8(up.type) ? static_cast<const void *>(xq_.data() + p * (E_ / QK))
                                               : static_cast<const void *>(xg_.data() + p * E_);
            const float *g = g_.data() + p * F_;
            float *h = u_.data() + p * F_;
            for (int64_t j = a - p * F_; j < j1;) {
                const void *ptrs[kDotRows];
                int64_t slot[kDotRows], n = 0;
                for (; j < j1 && n < kDotRows; ++j) {
                    h[j] = every_up && g[j] > 0.0f ? g[j] * h[j] : 0.0f;
                    if (!every_up && g[j] > 0.0f) {
                        slot[n] = j;
                        ptrs[n++] = up.row(j);
                    }
                }
                if (n == 0) continue;
                float u[kDotRows];
                k.dot_rows(int(up.cols), int(n), ptrs, x, u);
                for (int64_t i = 0; i < n; ++i) h[slot[i]] = g[slot[i]] * u[i];
            }
            a = p * F_ + j1;
        }
    };
    pool_.run(pool_.chunks_for(n_pairs * F_ * E_ / 2, kGrain), ups);
    // each pair's used down_t rows (h != 0), in neuron order: the runs of its down projection
    int64_t computed = 0;
    for (int64_t p = 0; p < n_pairs; ++p) {
        const Matrix down_t = X.down_t_of(pair_expert_[size_t(p)]);
        const float *g = g_.data() + p * F_, *h = u_.data() + p * F_;
        const void **rows = used_rows_.data() + p * F_;
        float *coef = used_coef_.data() + p * F_;
        int64_t n = 0;
        for (int64_t j = 0; j < F_; ++j) {
            computed += every_up || g[j] > 0.0f;
            if (h[j] == 0.0f) continue;
            rows[n] = down_t.row(j);
            coef[n++] = h[j];
        }
        n_used_[size_t(p)] = n;
    }
    return computed;
}

void MoeFfn::relu_down(const Experts &X, int64_t n_pairs) {
    const TypeKernels &kd = ks_.for_type(X.down_t.type);
    const int64_t max_runs = down_run_count(F_);
    for (int64_t w0 = 0; w0 < n_pairs; w0 += wave_) {
        const int64_t w1 = std::min(n_pairs, w0 + wave_);
        int64_t runs = 0;
        for (int64_t p = w0; p < w1; ++p) runs += down_run_count(n_used_[size_t(p)]);
        auto job = [&](int chunk, int, int) {
            int64_t p = w0, run = chunk;  // the chunk's pair and run
            while (run >= down_run_count(n_used_[size_t(p)])) run -= down_run_count(n_used_[size_t(p++)]);
            down_run(kd, E_, n_used_[size_t(p)], used_rows_.data() + p * F_, used_coef_.data() + p * F_, run,
                     partials_.data() + ((p - w0) * max_runs + run) * E_);
        };
        if (runs > 0) pool_.run(int(runs), job);
        for (int64_t p = w0; p < w1; ++p)
            sum_down_runs(E_, down_run_count(n_used_[size_t(p)]), partials_.data() + (p - w0) * max_runs * E_,
                          o_.data() + p * E_);
    }
}

TierCounts MoeFfn::run(const Experts &X, Operand &x, int64_t n_tok, bool every_up, float *y) {
    TierCounts c;
    auto t0 = Clock::now();
    route(X, x, n_tok);
    const int64_t P = n_tok * k_;
    const auto *xq = reinterpret_cast<const uint8_t *>(xq_.data());
    const auto *xf = reinterpret_cast<const uint8_t *>(xg_.data());
    const size_t xq_stride = size_t(E_ / QK) * sizeof(BlockQ8_0), xf_stride = size_t(E_) * sizeof(float);
    const bool relu = hp_.activation == Activation::Relu;
    items_.clear();
    add_items(X, kGate, xq, xf, xq_stride, xf_stride, g_.data(), F_);
    // the ups in the same job (one split over the threads), but where ReLU experts go gate first
    if (!relu || every_up) add_items(X, kUp, xq, xf, xq_stride, xf_stride, u_.data(), F_);
    rows_job();
    if (relu) {
        c.computed = double(relu_products(X, P, every_up));
    } else {
        silu_products(X, P);
        c.computed = double(P * F_);
    }
    c.gate_up_seconds = seconds_since(t0);
    t0 = Clock::now();
    if (relu) {
        relu_down(X, P);
        for (int64_t p = 0; p < P; ++p) c.active += double(n_used_[size_t(p)]);
    } else {
        items_.clear();
        add_items(X, kDown, reinterpret_cast<const uint8_t *>(hq_.data()), reinterpret_cast<const uint8_t *>(g_.data()),
                  size_t(F_ / QK) * sizeof(BlockQ8_0), size_t(F_) * sizeof(float), o_.data(), E_);
        rows_job();
        c.active = double(P * F_);
    }
    // each token's experts' outputs, weighted, added in the experts' order
    std::fill(y, y + n_tok * E_, 0.0f);
    for (int64_t p = 0; p < P; ++p) {
        float *yt = y + int64_t(pair_token_[size_t(p)]) * E_;
        const float w = pair_weight_[size_t(p)], *o = o_.data() + p * E_;
        for (int64_t i = 0; i < E_; ++i) yt[i] += w * o[i];
    }
    c.down_seconds = seconds_since(t0);
    return c;
}

}  // namespace pi
