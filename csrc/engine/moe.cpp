#include "engine/moe.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "backend/activation_rule.h"
#include "engine/work.h"
#include "runtime/common.h"

namespace pi {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const int64_t kDotRows = 64;  // rows per dot_rows call (their pointers on the stack)

enum Which { kGate, kUp, kDown };

const float kTaken = -2.0f;  // an expert's probability once chosen: below every probability

}  // namespace

MoeFfn::MoeFfn(const HParams &hp, const KernelSet &ks, ThreadPool &pool, int64_t n_batch, ExpertTier *tier,
               bool lookahead, DeviceTierBackend *device)
    : hp_(hp), ks_(ks), pool_(pool), n_batch_(n_batch), n_expert_(hp.n_expert), k_(hp.n_expert_used),
      E_(hp.n_embd), F_(hp.n_ff_exp), tier_(tier), lookahead_(lookahead), device_(device) {
    const int64_t B = n_batch, P = n_batch * k_;
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
    in_ops_.resize(size_t(n_expert_));
    h_ops_.resize(size_t(n_expert_));
    mats_.reserve(size_t(3 * n_expert_));
    targets_.reserve(size_t(2 * n_expert_));
    wanted_.assign(size_t(n_expert_), 0);
    arrived_.assign(size_t(n_expert_), 0);
    sel_pairs_.assign(size_t(P), 0);
    look_p_.assign(size_t(n_expert_), 0.0f);
    look_w_.assign(size_t(k_), 0.0f);
    look_chosen_.assign(size_t(k_), 0);
    if (device_) {
        dev_experts_.assign(size_t(n_expert_), 0);
        dev_token_.assign(size_t(P), 0);
        dev_expert_.assign(size_t(P), 0);
        dev_weight_.assign(size_t(P), 0.0f);
        dev_y_.assign(size_t(B * E_), 0.0f);
    }
    if (hp.activation == Activation::Relu) {
        used_rows_.assign(size_t(P * F_), nullptr);
        used_coef_.assign(size_t(P * F_), 0.0f);
        n_used_.assign(size_t(P), 0);
        n_computed_.assign(size_t(P), 0);
        partials_.assign(size_t(kRowsTargets * rows_partial_floats(F_, E_)), 0.0f);
    }
}

double MoeFfn::scratch_bytes(const HParams &hp, int64_t n_batch, int64_t) {
    const double B = double(n_batch), P = B * double(hp.n_expert_used), E = double(hp.n_embd), F = double(hp.n_ff_exp);
    const double N = double(hp.n_expert);
    // (with the device experts' pairs and sum, which a device adds)
    double bytes = 4 * (B * N + 2 * P + P * (2 * E + 2 * F)) + 16 * (N + 1) + 12 * P + 12 * N + 8 * P + 8 * double(hp.n_expert_used) +
                   4 * N + 12 * P + 4 * B * E +
                   P * (E + F) / QK * double(sizeof(BlockQ8_0)) +
                   N * (2 * double(sizeof(Operand)) + 3 * double(sizeof(Matrix)) + 2 * double(sizeof(MatmulTarget)));
    if (hp.activation == Activation::Relu)
        bytes += P * F * (sizeof(void *) + 4) + 16 * P + 4 * double(kRowsTargets * rows_partial_floats(hp.n_ff_exp, hp.n_embd));
    return bytes;
}

void MoeFfn::top_k(float *p, int32_t *chosen, float *w) const {
    // each expert once, NaNs or not (a group holds a token once: the scratch is sized so)
    for (int64_t i = 0; i < k_; ++i) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_expert_; ++e)
            if (p[e] != kTaken && (best < 0 || p[e] > p[best])) best = e;
        chosen[i] = int32_t(best);
        w[i] = p[best];
        p[best] = kTaken;
    }
}

void MoeFfn::route(const Experts &X, Operand &x, int64_t n_tok) {
    const int64_t N = n_expert_, K = k_;
    matmul(ks_, pool_, X.router, x, n_tok, logits_.data(), N);
    std::fill(first_.begin(), first_.end(), 0);
    for (int64_t t = 0; t < n_tok; ++t) {
        float *p = logits_.data() + t * N;
        ks_.softmax(int(N), 1.0f, p);
        // the K largest probabilities
        int32_t *chosen = tok_expert_.data() + t * K;
        float *w = tok_weight_.data() + t * K;
        top_k(p, chosen, w);
        float sum = 0.0f;
        for (int64_t i = 0; i < K; ++i) {
            sum += w[i];
            first_[size_t(chosen[i]) + 1] += 1;
        }
        if (hp_.expert_weights_norm)
            for (int64_t i = 0; i < K; ++i) w[i] /= sum;
    }
    for (int64_t e = 0; e < N; ++e) first_[size_t(e) + 1] += first_[size_t(e)];
    std::copy(first_.begin(), first_.end(), cursor_.begin());
    // the pairs by expert, each expert's tokens in order; in a batch, each pair's copy of its token's input (floats,
    // and the q8_0 blocks where the gate or up reads them); a decode step's experts all read x
    const bool q8 = act_is_q8(X.gate.type) || act_is_q8(X.up.type);
    if (q8) prepare(ks_, x, n_tok, act_is_q8(X.gate.type) ? X.gate.type : X.up.type);
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t i = 0; i < K; ++i) {
            const int32_t e = tok_expert_[size_t(t * K + i)];
            const int64_t p = cursor_[size_t(e)]++;
            pair_expert_[size_t(p)] = e;
            pair_token_[size_t(p)] = int32_t(t);
            pair_weight_[size_t(p)] = tok_weight_[size_t(t * K + i)];
            if (n_tok == 1) continue;
            std::memcpy(xg_.data() + p * E_, x.f + t * E_, size_t(E_) * sizeof(float));
            if (q8) std::memcpy(xq_.data() + p * (E_ / QK), x.q + t * (E_ / QK), size_t(E_ / QK) * sizeof(BlockQ8_0));
        }
}

const void *MoeFfn::pair_x(int64_t p, uint32_t type) const {
    if (n_tok_ == 1) return x_->at(0, type);
    return act_is_q8(type) ? static_cast<const void *>(xq_.data() + p * (E_ / QK))
                           : static_cast<const void *>(xg_.data() + p * E_);
}

void MoeFfn::gate_up_operands(Operand &x, int64_t n_tok) {
    for (int64_t e = 0; e < n_expert_; ++e) {
        const int64_t p0 = first_[size_t(e)];
        in_ops_[size_t(e)] = n_tok == 1 ? x : Operand{xg_.data() + p0 * E_, E_, xq_.data() + p0 * (E_ / QK), x.q_ready};
    }
}

void MoeFfn::down_operands() {
    for (int64_t e = 0; e < n_expert_; ++e) {
        const int64_t p0 = first_[size_t(e)];
        h_ops_[size_t(e)] = Operand{g_.data() + p0 * F_, F_, hq_.data() + p0 * (F_ / QK), true};
    }
}

Matrix MoeFfn::matrix(const Experts &X, int32_t e, int which) const {
    if (tier_) return tier_->matrix(e, which);
    return which == kGate ? X.gate_of(e) : which == kUp ? X.up_of(e) : X.down_of(e);
}

void MoeFfn::add_targets(const Experts &X, const int32_t *experts, int64_t n_experts, int which, Operand *ops,
                         float *out, int64_t ldo) {
    for (int64_t i = 0; i < n_experts; ++i) {
        const int32_t e = experts[i];
        const int64_t p0 = first_[size_t(e)], n = first_[size_t(e) + 1] - p0;
        if (n == 0) continue;
        mats_.push_back(matrix(X, e, which));
        targets_.push_back(MatmulTarget{&mats_.back(), out + p0 * ldo, ldo, &ops[size_t(e)], n});
    }
}

void MoeFfn::silu_products(const Experts &X, const int32_t *experts, int64_t n_experts) {
    const bool q8 = act_is_q8(X.down.type);
    int64_t n_pairs = 0;
    for (int64_t i = 0; i < n_experts; ++i)
        for (int64_t p = first_[size_t(experts[i])]; p < first_[size_t(experts[i]) + 1]; ++p) sel_pairs_[size_t(n_pairs++)] = p;
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t i0, i1;
        split_range(n_pairs, chunk, n_chunks, &i0, &i1);
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t p = sel_pairs_[size_t(i)];
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
    // the ups a gate lets through (every_up: every up, dense mode's reading), each neuron's by dot_rows in both
    // modes, so that they agree
    auto ups = [&](int chunk, int n_chunks, int) {
        int64_t a, b;
        split_range(n_pairs * F_, chunk, n_chunks, &a, &b);
        while (a < b) {
            const int64_t p = a / F_, j1 = std::min(b - p * F_, F_);
            const Matrix up = X.up_of(pair_expert_[size_t(p)]);
            const TypeKernels &k = ks_.for_type(up.type);
            const void *x = pair_x(p, up.type);
            const float *g = g_.data() + p * F_;
            float *h = u_.data() + p * F_;
            for (int64_t j = a - p * F_; j < j1;) {
                const void *ptrs[kDotRows];
                int64_t slot[kDotRows], n = 0;
                for (; j < j1 && n < kDotRows; ++j) {
                    h[j] = 0.0f;
                    if (every_up || g[j] > 0.0f) {
                        slot[n] = j;
                        ptrs[n++] = up.row(j);
                    }
                }
                if (n == 0) continue;
                float u[kDotRows];
                k.dot_rows(int(up.cols), int(n), ptrs, x, u);
                for (int64_t i = 0; i < n; ++i) h[slot[i]] = g[slot[i]] > 0.0f ? g[slot[i]] * u[i] : 0.0f;
            }
            a = p * F_ + j1;
        }
    };
    pool_.run(pool_.chunks_for(n_pairs * F_ * E_ / 2, kGrain), ups);
    // each pair's used down_t rows (h != 0), in neuron order: the rows of its down projection
    auto list = [&](int chunk, int n_chunks, int) {
        int64_t p0, p1;
        split_range(n_pairs, chunk, n_chunks, &p0, &p1);
        for (int64_t p = p0; p < p1; ++p) {
            const Matrix down_t = X.down_t_of(pair_expert_[size_t(p)]);
            const float *g = g_.data() + p * F_, *h = u_.data() + p * F_;
            const void **rows = used_rows_.data() + p * F_;
            float *coef = used_coef_.data() + p * F_;
            int64_t n = 0, computed = 0;
            for (int64_t j = 0; j < F_; ++j) {
                computed += every_up || g[j] > 0.0f;
                if (h[j] == 0.0f) continue;
                rows[n] = down_t.row(j);
                coef[n++] = h[j];
            }
            n_used_[size_t(p)] = n;
            n_computed_[size_t(p)] = computed;
        }
    };
    pool_.run(int(std::min<int64_t>(n_pairs, pool_.size())), list);
    int64_t computed = 0;
    for (int64_t p = 0; p < n_pairs; ++p) computed += n_computed_[size_t(p)];
    return computed;
}

void MoeFfn::relu_down(const Experts &X, int64_t n_pairs) {
    for (int64_t w0 = 0; w0 < n_pairs; w0 += kRowsTargets) {
        RowsTarget targets[kRowsTargets];
        const int n = int(std::min<int64_t>(kRowsTargets, n_pairs - w0));
        for (int i = 0; i < n; ++i) {
            const int64_t p = w0 + i;
            targets[i] = RowsTarget{X.down_t.type, E_, used_rows_.data() + p * F_, used_coef_.data() + p * F_,
                                    n_used_[size_t(p)], o_.data() + p * E_};
        }
        rows_product(ks_, pool_, targets, n, partials_.data());
    }
}

void MoeFfn::weighted_sum(int64_t n_tok, float *y, const uint8_t *on_device) {
    const int64_t P = n_tok * k_;
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t c0, c1;
        split_range(E_, chunk, n_chunks, &c0, &c1, 16);
        for (int64_t t = 0; t < n_tok; ++t) std::fill(y + t * E_ + c0, y + t * E_ + c1, 0.0f);
        for (int64_t p = 0; p < P; ++p) {
            if (on_device && on_device[pair_expert_[size_t(p)]]) continue;
            float *yt = y + int64_t(pair_token_[size_t(p)]) * E_;
            const float w = pair_weight_[size_t(p)], *o = o_.data() + p * E_;
            for (int64_t i = c0; i < c1; ++i) yt[i] += w * o[i];
        }
    };
    pool_.run(int(std::min<int64_t>(pool_.size(), pool_.chunks_for(P * E_ * kRowDotCost, kGrain))), job);
}

void MoeFfn::compute(const Experts &X, const int32_t *experts, int64_t n, TierCounts &c) {
    auto t0 = Clock::now();
    mats_.clear();
    targets_.clear();
    add_targets(X, experts, n, kGate, in_ops_.data(), g_.data(), F_);
    add_targets(X, experts, n, kUp, in_ops_.data(), u_.data(), F_);  // in the same job (one split over the threads)
    matmul(ks_, pool_, targets_.data(), int(targets_.size()));
    silu_products(X, experts, n);
    c.gate_up_seconds += seconds_since(t0);
    t0 = Clock::now();
    mats_.clear();
    targets_.clear();
    add_targets(X, experts, n, kDown, h_ops_.data(), o_.data(), E_);
    matmul(ks_, pool_, targets_.data(), int(targets_.size()));
    c.down_seconds += seconds_since(t0);
}

void MoeFfn::lookahead(const Experts &next, Operand &x, int64_t il_next) {
    matmul(ks_, pool_, next.router, x, 1, look_p_.data(), n_expert_);
    ks_.softmax(int(n_expert_), 1.0f, look_p_.data());
    top_k(look_p_.data(), look_chosen_.data(), look_w_.data());
    // the device's experts are never read from the file
    const uint8_t *on_device = device_ ? device_->expert_mask(il_next) : nullptr;
    int64_t n = 0;
    for (int64_t i = 0; i < k_; ++i)
        if (!on_device || !on_device[look_chosen_[size_t(i)]]) look_chosen_[size_t(n++)] = look_chosen_[size_t(i)];
    if (n > 0) tier_->prefetch(il_next, look_chosen_.data(), n, true);
}

void MoeFfn::submit_device(int64_t il, const Operand &x, int64_t n_tok, const int32_t *experts, int64_t n) {
    int64_t n_pairs = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t p = first_[size_t(experts[i])]; p < first_[size_t(experts[i]) + 1]; ++p, ++n_pairs) {
            dev_token_[size_t(n_pairs)] = pair_token_[size_t(p)];
            dev_expert_[size_t(n_pairs)] = pair_expert_[size_t(p)];
            dev_weight_[size_t(n_pairs)] = pair_weight_[size_t(p)];
        }
    const pi_device_experts_job job{int32_t(il), int32_t(n_tok), int32_t(n_pairs), x.f, dev_token_.data(),
                                    dev_expert_.data(), dev_weight_.data(), dev_y_.data()};
    device_->experts_submit(job);
}

TierCounts MoeFfn::run(const Experts &X, Operand &x, int64_t n_tok, bool every_up, float *y, int64_t il,
                       const Experts *next) {
    TierCounts c;
    auto t0 = Clock::now();
    x_ = &x;
    n_tok_ = n_tok;
    route(X, x, n_tok);
    const int64_t P = n_tok * k_;
    gate_up_operands(x, n_tok);
    down_operands();
    // the experts with tokens: the device's (its job started first, running while the CPU computes) and the CPU's
    const uint8_t *on_device = device_ ? device_->expert_mask(il) : nullptr;
    int64_t n_wanted = 0, n_device = 0;
    for (int64_t e = 0; e < n_expert_; ++e) {
        if (first_[size_t(e) + 1] == first_[size_t(e)]) continue;
        if (on_device && on_device[e]) dev_experts_[size_t(n_device++)] = int32_t(e);
        else wanted_[size_t(n_wanted++)] = int32_t(e);
    }
    if (n_device > 0) submit_device(il, x, n_tok, dev_experts_.data(), n_device);
    c.computed = c.active = double(P * F_);
    if (hp_.activation == Activation::Relu) {  // gate first (never with a tier or a device: both refuse them)
        mats_.clear();
        targets_.clear();
        add_targets(X, wanted_.data(), n_wanted, kGate, in_ops_.data(), g_.data(), F_);
        matmul(ks_, pool_, targets_.data(), int(targets_.size()));
        c.computed = double(relu_products(X, P, every_up));
        c.gate_up_seconds = seconds_since(t0);
        t0 = Clock::now();
        relu_down(X, P);
        c.active = 0;
        for (int64_t p = 0; p < P; ++p) c.active += double(n_used_[size_t(p)]);
        c.down_seconds = seconds_since(t0);
    } else if (n_wanted == 0) {
        if (tier_ && lookahead_ && next && n_tok == 1) lookahead(*next, x, il + 1);
    } else if (!tier_) {
        compute(X, wanted_.data(), n_wanted, c);
    } else {
        // the experts as the tier hands them out (those in memory first), while the lookahead's reads go on behind
        tier_->begin(il, wanted_.data(), n_wanted, n_tok == 1);
        if (lookahead_ && next && n_tok == 1) lookahead(*next, x, il + 1);
        for (int64_t n; (n = tier_->ready(arrived_.data())) > 0;) {
            compute(X, arrived_.data(), n, c);
            tier_->done(arrived_.data(), n);
        }
    }
    t0 = Clock::now();
    weighted_sum(n_tok, y, n_device > 0 ? on_device : nullptr);
    if (n_device > 0) {  // the device's sum, added to the CPU's
        device_->experts_wait();
        const float *d = dev_y_.data();
        for (int64_t i = 0; i < n_tok * E_; ++i) y[i] += d[i];
    }
    c.down_seconds += seconds_since(t0);
    x_ = nullptr;
    return c;
}

}  // namespace pi
