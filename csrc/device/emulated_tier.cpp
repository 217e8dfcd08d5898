// A device library that emulates one in host memory: the tests' stand-in for the CUDA library (pi_device.h), so
// that everything on the engine's side of the boundary (loading the library, the VRAM budget, which layers go to
// the device, the traffic counted, concurrency with the cold tier, the KV cache held on the device) runs on a
// machine without a GPU. It computes the same definitions as the CUDA kernels (tier_math.h, attention_math.h:
// the layouts, the operands' q8_0 form, integer block sums) in its own order, one token, neuron and head at a time; the hot tier's jobs on a thread of its own. Its device's memory is PI_EMULATED_DEVICE_MIB MiB (default 1024) and PI_EMULATED_DEVICES=0 makes it
// report none.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "device/attention_math.h"
#include "device/expert_math.h"
#include "device/tier_math.h"
#include "pi_device.h"

using namespace pi;

namespace {

int32_t say(char *err, size_t len, const std::string &message) {
    if (err && len) std::snprintf(err, len, "%s", message.c_str());
    return 1;
}

uint64_t env_u64(const char *name, uint64_t fallback) {
    const char *v = std::getenv(name);
    return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

uint64_t capacity() { return env_u64("PI_EMULATED_DEVICE_MIB", 1024) << 20; }

// What all emulated tiers of this process hold: the emulated device's used memory, as a real device's is
// shared by every engine of the process.
std::atomic<uint64_t> g_used{0};

}  // namespace

struct pi_device_tier {
    struct Rows {
        device::DeviceRows gate, up, down;  // pointing into `block`
        const float *gate_b = nullptr, *up_b = nullptr;
        float threshold = 0;
        device::LayerLayout layout{pi_device_layer{}, 0, false};
        bool uploaded = false;
        std::vector<uint8_t> block;
    };
    struct Attention {
        pi_device_attention view{};  // its pointers into `block`
        bool uploaded = false;
        std::vector<uint8_t> block;
        uint8_t *k_cache = nullptr, *v_cache = nullptr;
    };
    struct Predictor {
        pi_device_predictor view{};  // its matrices pointing into `block`
        bool uploaded = false;
        std::vector<uint8_t> block;
    };
    struct Expert {
        pi_device_expert view{};  // its matrices pointing into `block`
        bool uploaded = false;
        std::vector<uint8_t> block;
    };
    pi_device_tier_desc desc;
    std::vector<Rows> layers;
    std::vector<Expert> experts;  // [layer * n_expert + expert], where the tier has experts
    uint64_t bytes_expert_scratch = 0;
    bool experts_pending = false;  // an experts job submitted and not waited for
    pi_device_experts_job experts_job{};
    std::vector<Predictor> predictors;
    std::vector<Attention> attention;
    std::vector<float> rope_cos, rope_sin;
    std::vector<uint8_t> head_block;  // the output head, where uploaded
    std::vector<float> stream;        // layer_run's residual stream, [n_batch][n_embd], once a layer job ran
    bool stream_ready = false;
    pi_device_head head_view{};
    uint64_t bytes = 0, bytes_attention_scratch = 0;
    std::thread worker;
    pi_device_job job{};
    int32_t hot_mode = PI_DEVICE_HOT_RULE;  // the job's (pi_device_hot_mode)
    const float *predictor_x = nullptr;     // the predictor's input rows, for PI_DEVICE_HOT_PREDICTOR
    pi_device_counts counts{};
    double rows_read = 0;  // the job's gate (and up) rows read, the kernels' passes over them
    std::chrono::steady_clock::time_point submitted;
    // a split layer begun (split_begin) and not yet ended: the job, its FFN input and predictor input, the hot rows'
    // output, and when it began
    bool split_pending = false;
    pi_device_split_job split{};
    std::vector<float> split_x, split_xn, split_y;
    std::chrono::steady_clock::time_point split_started;

    // Which hot rows each token computes: every one, or (PI_DEVICE_HOT_PREDICTOR) those whose fc2 row scores
    // relu(fc1 x) above the threshold; and the rows read, pass by pass of kTokensPerPass tokens (a row once a pass
    // where a token of the pass selects it).
    std::vector<uint8_t> selection(int64_t n_rows) {
        std::vector<uint8_t> sel(size_t(job.n_tok * n_rows), 1);
        if (hot_mode == PI_DEVICE_HOT_PREDICTOR) {
            const pi_device_predictor &P = predictors[size_t(job.layer)].view;
            std::vector<float> hid(static_cast<size_t>(P.fc1.rows)), logit(static_cast<size_t>(n_rows));
            for (int64_t t = 0; t < job.n_tok; ++t) {
                project(P.fc1, predictor_x + t * desc.n_embd, hid.data());
                for (float &h : hid) h = std::max(h, 0.0f);
                project(P.fc2, hid.data(), logit.data());
                for (int64_t r = 0; r < n_rows; ++r) sel[size_t(t * n_rows + r)] = logit[size_t(r)] > P.threshold;
            }
        }
        for (int64_t t0 = 0; t0 < job.n_tok; t0 += device::kTokensPerPass)
            for (int64_t r = 0; r < n_rows; ++r) {
                bool any = false;
                for (int64_t t = t0; t < std::min<int64_t>(job.n_tok, t0 + device::kTokensPerPass); ++t)
                    any = any || sel[size_t(t * n_rows + r)];
                rows_read += any;
            }
        return sel;
    }

    void compute() {
        const Rows &R = layers[size_t(job.layer)];
        const device::Rule rule{desc.activation, desc.gated, R.threshold};
        const int64_t E = desc.n_embd, nb = E / QK;
        const bool dense = hot_mode == PI_DEVICE_HOT_DENSE;
        rows_read = 0;
        const std::vector<uint8_t> sel = selection(R.gate.rows);
        std::vector<BlockQ8_0> xq(static_cast<size_t>(nb));
        for (int64_t t = 0; t < job.n_tok; ++t) {
            const float *x = job.x + t * E;
            for (int64_t k = 0; k < nb; ++k) device::quantize_block(x + k * QK, &xq[size_t(k)]);
            float *y = job.y + t * E;
            std::fill(y, y + E, 0.0f);
            for (int64_t r = 0; r < R.gate.rows; ++r) {
                if (!sel[size_t(t * R.gate.rows + r)]) continue;
                float g = 0, u = 0;
                for (int64_t k = 0; k < nb; ++k) {
                    g += device::block_dot(R.gate, r, k, x, xq.data());
                    if (desc.gated) u += device::block_dot(R.up, r, k, x, xq.data());
                }
                bool pass;
                const float h = rule.coefficient(g, u, R.gate_b ? R.gate_b[r] : 0.0f, R.up_b ? R.up_b[r] : 0.0f,
                                                 dense, &pass);
                counts.active += pass;
                if (!(dense || pass)) continue;
                counts.computed += 1;
                if (h != 0.0f)
                    for (int64_t e = 0; e < E; ++e) y[e] += h * device::element(R.down, r, e);
            }
        }
        counts.launches = device::hot_launches(desc.n_batch, job.n_tok);
        counts.device_bytes = device::hot_bytes(R.layout, rows_read, counts.computed);
    }

    // A layer's device experts over their pairs (pi_device_experts_job), pair by pair: each expert's output on its
    // token's row, weighted, added into the token's y in pair order.
    void compute_experts() {
        const pi_device_experts_job &j = experts_job;
        const int64_t E = desc.n_embd, F = desc.n_ff_expert;
        std::fill(j.y, j.y + int64_t(j.n_tok) * E, 0.0f);
        std::vector<float> g(static_cast<size_t>(F)), u(static_cast<size_t>(F)), o(static_cast<size_t>(E));
        for (int32_t p = 0; p < j.n_pairs; ++p) {
            const pi_device_expert &X = experts[size_t(int64_t(j.layer) * desc.n_expert + j.pair_expert[p])].view;
            const float *x = j.x + int64_t(j.pair_token[p]) * E;
            project(X.gate, x, g.data());
            project(X.up, x, u.data());
            for (int64_t i = 0; i < F; ++i) g[size_t(i)] = silu_ref(g[size_t(i)]) * u[size_t(i)];
            project(X.down, g.data(), o.data());
            float *y = j.y + int64_t(j.pair_token[p]) * E;
            const float w = j.pair_weight[p];
            for (int64_t i = 0; i < E; ++i) y[i] += w * o[size_t(i)];
        }
    }

    // y[r] = m's row r . x (+ its bias) for one token, x's q8_0 blocks made where m's type reads them
    static void project(const pi_device_matrix &m, const float *x, float *y) {
        std::vector<BlockQ8_0> xq;
        if (device::quantized(m)) {
            xq.resize(size_t(m.cols / QK));
            for (int64_t k = 0; k < m.cols / QK; ++k) device::quantize_block(x + k * QK, &xq[size_t(k)]);
        }
        const device::DeviceRows rows = device::device_rows(m);
        for (int64_t r = 0; r < m.rows; ++r) {
            float sum = 0.0f;
            for (int64_t k = 0; k < m.cols / QK; ++k) sum += device::block_dot(rows, r, k, x, xq.data());
            y[r] = sum + (m.bias ? m.bias[r] : 0.0f);
        }
    }

    // one row's norm (an attention block's or the output's)
    void normalize(const float *x, const float *w, const float *b, float *out) const {
        const int64_t E = desc.n_embd;
        double mean = 0, ss = 0;
        if (desc.norm == PI_DEVICE_NORM_LAYER) {
            for (int64_t i = 0; i < E; ++i) mean += double(x[i]);
            mean /= double(E);
        }
        for (int64_t i = 0; i < E; ++i) ss += (double(x[i]) - mean) * (double(x[i]) - mean);
        const float scale = device::norm_scale(ss, E, desc.norm_eps);
        for (int64_t i = 0; i < E; ++i) out[i] = device::norm_element(desc.norm, x[i], mean, scale, w[i], b ? b[i] : 0.0f);
    }

    void head(const pi_device_head_job &j) const {
        std::vector<float> xn(static_cast<size_t>(desc.n_embd));
        const float *x = j.x ? j.x : stream.data() + int64_t(j.first) * desc.n_embd;
        for (int64_t t = 0; t < j.n_tok; ++t) {
            normalize(x + t * desc.n_embd, head_view.norm_w, head_view.norm_b, xn.data());
            project(head_view.out, xn.data(), j.logits + t * j.ld_logits);
        }
    }

    void attend(const pi_device_attention_job &j) const {
        const Attention &A = attention[size_t(j.layer)];
        const pi_device_attention &a = A.view;
        const pi_device_tier_desc &d = desc;
        const int64_t E = d.n_embd, D = d.d_head, H = d.n_head, HKV = d.n_head_kv, Q = H * D, KV = HKV * D;
        const int64_t half = d.n_rot / 2, group = H / HKV;
        const bool f16 = d.kv_f16 != 0;
        std::vector<float> xn(static_cast<size_t>(E)), q(static_cast<size_t>(j.n_tok * Q)), k(static_cast<size_t>(KV)),
            v(static_cast<size_t>(KV)), att(static_cast<size_t>(Q)), scores(static_cast<size_t>(j.n_past + j.n_tok));
        for (int64_t t = 0; t < j.n_tok; ++t) {  // norm, q/k/v, RoPE; the keys and values into the cache
            normalize(j.x + t * E, a.norm_w, a.norm_b, xn.data());
            float *qt = q.data() + t * Q;
            project(a.q, xn.data(), qt);
            project(a.k, xn.data(), k.data());
            project(a.v, xn.data(), v.data());
            const int64_t pos = j.n_past + t;
            if (d.rope != PI_DEVICE_ROPE_NONE) {
                const float *c = rope_cos.data() + pos * half, *sn = rope_sin.data() + pos * half;
                for (int64_t i = 0; i < half; ++i) {
                    int64_t i0, i1;
                    device::rope_pair(d.rope, i, half, &i0, &i1);
                    for (int64_t h = 0; h < H; ++h) device::rotate(qt + h * D, i0, i1, c[i], sn[i]);
                    for (int64_t h = 0; h < HKV; ++h) device::rotate(k.data() + h * D, i0, i1, c[i], sn[i]);
                }
            }
            for (int64_t h = 0; h < HKV; ++h)
                for (int64_t i = 0; i < D; ++i) {
                    device::kv_put(A.k_cache, f16, device::kv_index(d, pos, h, i), k[size_t(h * D + i)]);
                    device::kv_put(A.v_cache, f16, device::kv_index(d, pos, h, i), v[size_t(h * D + i)]);
                }
        }
        const float inv_sqrt_d = 1.0f / std::sqrt(float(D));
        for (int64_t t = 0; t < j.n_tok; ++t) {  // each head over positions 0 .. its token's, then o
            const int64_t n_keys = j.n_past + t + 1;
            for (int64_t h = 0; h < H; ++h) {
                const float *qh = q.data() + t * Q + h * D;
                const int64_t kvh = h / group;
                float mx = -INFINITY;
                for (int64_t p = 0; p < n_keys; ++p) {
                    float s = 0;
                    for (int64_t i = 0; i < D; ++i) s += qh[i] * device::kv_get(A.k_cache, f16, device::kv_index(d, p, kvh, i));
                    scores[size_t(p)] = s * inv_sqrt_d;
                    mx = std::max(mx, scores[size_t(p)]);
                }
                float sum = 0;
                for (int64_t p = 0; p < n_keys; ++p) sum += (scores[size_t(p)] = exp_ref(scores[size_t(p)] - mx));
                float *out = att.data() + h * D;
                std::fill(out, out + D, 0.0f);
                for (int64_t p = 0; p < n_keys; ++p) {
                    const float w = scores[size_t(p)] / sum;
                    for (int64_t i = 0; i < D; ++i) out[i] += w * device::kv_get(A.v_cache, f16, device::kv_index(d, p, kvh, i));
                }
            }
            project(a.o, att.data(), j.out + t * E);
        }
    }
};

namespace {

int32_t device_count(char *err, size_t len) {
    const int32_t n = int32_t(env_u64("PI_EMULATED_DEVICES", 1));
    if (n == 0) say(err, len, "the emulated device library reports no device (PI_EMULATED_DEVICES=0)");
    return n;
}

int32_t device_memory(int32_t device, uint64_t *free_bytes, uint64_t *total_bytes, char *name, size_t name_len,
                      char *err, size_t len) {
    if (device < 0 || device >= device_count(nullptr, 0)) return say(err, len, "no emulated device " + std::to_string(device));
    const uint64_t total = capacity();
    if (free_bytes) *free_bytes = total > g_used ? total - g_used : 0;
    if (total_bytes) *total_bytes = total;
    if (name && name_len) std::snprintf(name, name_len, "emulated device (host memory)");
    return 0;
}

pi_device_tier *tier_create(const pi_device_tier_desc *desc, char *err, size_t len) {
    if (!desc || desc->n_embd <= 0 || desc->n_embd % QK || desc->n_layer <= 0 || desc->n_batch <= 0) {
        say(err, len, "bad tier description");
        return nullptr;
    }
    if (device_memory(desc->device, nullptr, nullptr, nullptr, 0, err, len)) return nullptr;
    pi_device_tier *t = new pi_device_tier;
    t->desc = *desc;
    t->layers.resize(size_t(desc->n_layer));
    t->attention.resize(size_t(desc->n_layer));
    t->predictors.resize(size_t(desc->n_layer));
    if (desc->rope_cos && desc->rope_sin && desc->n_ctx > 0 && desc->n_rot > 0) {
        const size_t n = size_t(desc->n_ctx) * size_t(desc->n_rot / 2);
        t->rope_cos.assign(desc->rope_cos, desc->rope_cos + n);
        t->rope_sin.assign(desc->rope_sin, desc->rope_sin + n);
    }
    t->desc.rope_cos = t->rope_cos.empty() ? nullptr : t->rope_cos.data();
    t->desc.rope_sin = t->rope_sin.empty() ? nullptr : t->rope_sin.data();
    return t;
}

int32_t tier_upload(pi_device_tier *t, const pi_device_layer *rows, int32_t layer, char *err, size_t len) {
    if (!t || !rows || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad upload");
    const bool gated = t->desc.gated != 0;
    if (const char *why = device::refuse_layer(*rows, gated)) return say(err, len, std::string("cannot upload ") + why);
    pi_device_tier::Rows &R = t->layers[size_t(layer)];
    if (R.uploaded) return say(err, len, "layer " + std::to_string(layer) + " was uploaded already");
    const device::LayerLayout layout(*rows, t->desc.n_embd, gated);
    if (g_used + layout.bytes > capacity())
        return say(err, len, "out of emulated device memory uploading layer " + std::to_string(layer));
    // one block, laid out as the CUDA library lays out its allocation, read through pointers into it
    R.block.assign(layout.bytes, 0);
    uint8_t *base = R.block.data();
    const int64_t E = t->desc.n_embd, n = rows->n_rows;
    layout.fill(*rows, E, gated, [&](size_t at, const void *src, size_t n_bytes) {
        std::memcpy(base + at, src, n_bytes);
        return true;
    });
    R.gate = device::DeviceRows{rows->gate_type, n, E, base + layout.gate};
    R.up = gated ? device::DeviceRows{rows->up_type, n, E, base + layout.up} : device::DeviceRows{};
    R.down = device::DeviceRows{rows->down_type, n, E, base + layout.down_t};
    R.gate_b = rows->gate_b ? reinterpret_cast<const float *>(base + layout.gate_b) : nullptr;
    R.up_b = rows->up_b ? reinterpret_cast<const float *>(base + layout.up_b) : nullptr;
    R.threshold = rows->threshold;
    R.layout = layout;
    R.uploaded = true;
    t->bytes += layout.bytes;
    g_used += layout.bytes;
    return 0;
}

int32_t tier_submit(pi_device_tier *t, const pi_device_job *job, char *err, size_t len) {
    if (!t || !job || job->layer < 0 || job->layer >= t->desc.n_layer || job->n_tok <= 0 || job->n_tok > t->desc.n_batch)
        return say(err, len, "bad job");
    const pi_device_tier::Rows &R = t->layers[size_t(job->layer)];
    if (!R.uploaded) return say(err, len, "layer " + std::to_string(job->layer) + " was not uploaded");
    if (t->worker.joinable()) t->worker.join();  // a job left unwaited: finished first
    if (t->split_pending) return say(err, len, "a split layer was begun and not ended");
    t->job = *job;
    t->hot_mode = job->dense ? PI_DEVICE_HOT_DENSE : PI_DEVICE_HOT_RULE;
    t->counts = pi_device_counts{};
    const double E = t->desc.n_embd;
    t->counts.h2d_bytes = job->n_tok * E * 4;  // the rows up; the output rows and the CUDA library's counters down
    t->counts.d2h_bytes = job->n_tok * E * 4 + double(device::kJobCountersBytes);
    t->submitted = std::chrono::steady_clock::now();
    t->worker = std::thread([t] { t->compute(); });
    return 0;
}

int32_t tier_wait(pi_device_tier *t, pi_device_counts *counts, char *err, size_t len) {
    if (!t || !t->worker.joinable()) return say(err, len, "no job to wait for");
    t->worker.join();
    t->counts.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t->submitted).count();
    if (counts) *counts = t->counts;
    return 0;
}

int32_t attention_upload(pi_device_tier *t, const pi_device_attention *a, int32_t layer, char *err, size_t len) {
    if (!t || !a || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad attention upload");
    if (const char *why = device::refuse_attention(*a, t->desc)) return say(err, len, std::string("cannot upload ") + why);
    if (t->desc.rope != PI_DEVICE_ROPE_NONE && t->rope_cos.empty()) return say(err, len, "a tier made without RoPE's tables");
    pi_device_tier::Attention &A = t->attention[size_t(layer)];
    if (A.uploaded) return say(err, len, "layer " + std::to_string(layer) + "'s attention was uploaded already");
    const device::AttentionLayout layout(*a, t->desc);
    // the scratch (attention_math.h) with the first layer, as the CUDA library allocates it
    const uint64_t scratch = t->bytes_attention_scratch ? 0 : uint64_t(device::attention_scratch_bytes(t->desc));
    if (g_used + layout.bytes + scratch > capacity())
        return say(err, len, "out of emulated device memory uploading layer " + std::to_string(layer) + "'s attention");
    A.block.assign(layout.bytes, 0);
    uint8_t *base = A.block.data();
    layout.fill(*a, t->desc, [&](size_t at, const void *src, size_t n_bytes) {
        std::memcpy(base + at, src, n_bytes);
        return true;
    });
    A.view = layout.view(*a, base);
    A.k_cache = base + layout.k_cache;
    A.v_cache = base + layout.v_cache;
    A.uploaded = true;
    t->bytes_attention_scratch += scratch;
    t->bytes += layout.bytes + scratch;
    g_used += layout.bytes + scratch;
    return 0;
}

int32_t attention_run(pi_device_tier *t, const pi_device_attention_job *job, pi_device_counts *counts, char *err,
                      size_t len) {
    if (!t) return say(err, len, "bad attention job");
    if (const char *why = device::refuse_attention_job(job, t->desc)) return say(err, len, why);
    if (!t->attention[size_t(job->layer)].uploaded)
        return say(err, len, "layer " + std::to_string(job->layer) + "'s attention was not uploaded");
    const auto t0 = std::chrono::steady_clock::now();
    t->attend(*job);
    if (counts) {
        *counts = pi_device_counts{};
        counts->h2d_bytes = double(job->n_tok) * t->desc.n_embd * 4;  // the layer's input up, its output down
        counts->d2h_bytes = counts->h2d_bytes;
        counts->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const pi_device_attention &a = t->attention[size_t(job->layer)].view;
        counts->launches = device::attention_launches(a);
        counts->device_bytes = device::attention_bytes(a, t->desc, job->n_tok, job->n_past);
    }
    return 0;
}

int32_t head_upload(pi_device_tier *t, const pi_device_head *h, char *err, size_t len) {
    if (!t || !h) return say(err, len, "bad head upload");
    if (const char *why = device::refuse_head(*h, t->desc)) return say(err, len, std::string("cannot upload ") + why);
    if (!t->head_block.empty()) return say(err, len, "the output head was uploaded already");
    const device::HeadLayout layout(*h, t->desc);
    const uint64_t bytes = layout.bytes + uint64_t(device::head_scratch_bytes(t->desc));
    if (g_used + bytes > capacity()) return say(err, len, "out of emulated device memory uploading the output head");
    t->head_block.assign(layout.bytes, 0);
    uint8_t *base = t->head_block.data();
    layout.fill(*h, t->desc, [&](size_t at, const void *src, size_t n_bytes) {
        std::memcpy(base + at, src, n_bytes);
        return true;
    });
    t->head_view = layout.view(*h, base);
    t->bytes += bytes;
    g_used += bytes;
    return 0;
}

int32_t head_run(pi_device_tier *t, const pi_device_head_job *job, pi_device_counts *counts, char *err, size_t len) {
    if (!t) return say(err, len, "bad head job");
    if (const char *why = device::refuse_head_job(job, t->desc)) return say(err, len, why);
    if (t->head_block.empty()) return say(err, len, "the output head was not uploaded");
    if (!job->x && !t->stream_ready) return say(err, len, "no stream on the device for the head to read");
    if (t->split_pending) return say(err, len, "a split layer was begun and not ended");
    const auto t0 = std::chrono::steady_clock::now();
    t->head(*job);
    if (counts) {
        *counts = pi_device_counts{};
        counts->h2d_bytes = job->x ? double(job->n_tok) * t->desc.n_embd * 4 : 0.0;  // the rows up, their logits down
        counts->d2h_bytes = double(job->n_tok) * t->desc.n_vocab * 4;
        counts->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        counts->launches = device::head_launches();
        counts->device_bytes = device::head_bytes(t->head_view, job->n_tok);
    }
    return 0;
}

int32_t layer_run(pi_device_tier *t, const pi_device_layer_job *job, char *err, size_t len) {
    const std::string why = device::refuse_stream_job(t, job, device::refuse_layer_job);
    if (!why.empty()) return say(err, len, why);
    const pi_device_tier::Attention &A = t->attention[size_t(job->layer)];
    if (t->worker.joinable()) t->worker.join();  // a hot job left unwaited: finished first
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t E = t->desc.n_embd, n = int64_t(job->n_tok) * E;
    t->stream.resize(size_t(t->desc.n_batch) * size_t(E));
    float *x = t->stream.data();
    if (job->x_in) std::copy(job->x_in, job->x_in + n, x);
    std::vector<float> out(static_cast<size_t>(n)), xn(static_cast<size_t>(n));
    t->attend(pi_device_attention_job{job->layer, job->n_tok, job->n_past, x, out.data()});
    for (int64_t i = 0; i < n; ++i) x[i] += out[size_t(i)];
    for (int64_t k = 0; k < job->n_tok; ++k) t->normalize(x + k * E, A.view.ffn_norm_w, A.view.ffn_norm_b, xn.data() + k * E);
    t->job = pi_device_job{job->layer, job->n_tok, job->dense, xn.data(), out.data()};
    t->hot_mode = job->dense ? PI_DEVICE_HOT_DENSE : PI_DEVICE_HOT_RULE;
    t->counts = pi_device_counts{};
    t->compute();
    for (int64_t i = 0; i < n; ++i) x[i] += out[size_t(i)];
    t->stream_ready = true;
    if (job->x_out) std::copy(x, x + n, job->x_out);
    pi_device_counts &c = *job->counts;
    c = t->counts;
    c.h2d_bytes = job->x_in ? double(n) * 4 : 0.0;
    c.d2h_bytes = (job->x_out ? double(n) * 4 : 0.0) + double(device::kJobCountersBytes);  // with the stream's end
    c.launches = device::attention_launches(A.view) + device::fused_ffn_launches();
    c.device_bytes += device::attention_bytes(A.view, t->desc, job->n_tok, job->n_past);
    c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 0;
}

int32_t predictor_upload(pi_device_tier *t, const pi_device_predictor *p, int32_t layer, char *err, size_t len) {
    if (!t || !p || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad predictor upload");
    const pi_device_tier::Rows &R = t->layers[size_t(layer)];
    if (!R.uploaded) return say(err, len, "layer " + std::to_string(layer) + "'s hot rows were not uploaded");
    if (const char *why = device::refuse_predictor(*p, t->desc, R.gate.rows))
        return say(err, len, std::string("cannot upload ") + why);
    pi_device_tier::Predictor &P = t->predictors[size_t(layer)];
    if (P.uploaded) return say(err, len, "layer " + std::to_string(layer) + "'s predictor was uploaded already");
    const device::PredictorLayout layout(*p, t->desc);
    if (g_used + layout.bytes > capacity())
        return say(err, len, "out of emulated device memory uploading layer " + std::to_string(layer) + "'s predictor");
    P.block.assign(layout.bytes, 0);
    layout.fill(*p, [&](size_t at, const void *src, size_t n_bytes) {
        std::memcpy(P.block.data() + at, src, n_bytes);
        return true;
    });
    P.view = layout.view(*p, P.block.data());
    P.uploaded = true;
    t->bytes += layout.bytes;
    g_used += layout.bytes;
    return 0;
}

int32_t split_begin(pi_device_tier *t, const pi_device_split_job *job, char *err, size_t len) {
    const std::string why = device::refuse_stream_job(t, job, device::refuse_split_job);
    if (!why.empty()) return say(err, len, why);
    if (job->hot_mode == PI_DEVICE_HOT_PREDICTOR && !t->predictors[size_t(job->layer)].uploaded)
        return say(err, len, "layer " + std::to_string(job->layer) + "'s predictor was not uploaded");
    const pi_device_tier::Attention &A = t->attention[size_t(job->layer)];
    if (t->worker.joinable()) t->worker.join();  // a hot job left unwaited: finished first
    t->split_started = std::chrono::steady_clock::now();
    const int64_t E = t->desc.n_embd, n = int64_t(job->n_tok) * E;
    t->stream.resize(size_t(t->desc.n_batch) * size_t(E));
    float *x = t->stream.data();
    if (job->x_in) std::copy(job->x_in, job->x_in + n, x);
    std::vector<float> out(static_cast<size_t>(n));
    t->attend(pi_device_attention_job{job->layer, job->n_tok, job->n_past, x, out.data()});
    for (int64_t i = 0; i < n; ++i) x[i] += out[size_t(i)];
    t->split_x.assign(x, x + n);
    t->split_xn.resize(size_t(n));
    t->split_y.resize(size_t(n));
    for (int64_t k = 0; k < job->n_tok; ++k)
        t->normalize(x + k * E, A.view.ffn_norm_w, A.view.ffn_norm_b, t->split_xn.data() + k * E);
    std::copy(t->split_x.begin(), t->split_x.end(), job->x_mid);  // the one copy down: the stream and its norm
    std::copy(t->split_xn.begin(), t->split_xn.end(), job->xn);
    t->split = *job;
    t->split_pending = true;
    t->job = pi_device_job{job->layer, job->n_tok, job->hot_mode == PI_DEVICE_HOT_DENSE, t->split_xn.data(), t->split_y.data()};
    t->hot_mode = job->hot_mode;
    t->predictor_x = t->split_x.data();
    t->counts = pi_device_counts{};
    t->worker = std::thread([t] { t->compute(); });  // the hot rows, while the host computes the cold tier
    return 0;
}

int32_t split_end(pi_device_tier *t, const float *y_cold, float *x_out, char *err, size_t len) {
    if (!t || !t->split_pending) return say(err, len, "no split layer to end");
    if (!y_cold) return say(err, len, "a split layer ended without its cold output");
    t->worker.join();
    t->split_pending = false;
    const pi_device_split_job &j = t->split;
    const int64_t n = int64_t(j.n_tok) * t->desc.n_embd;
    float *x = t->stream.data();
    for (int64_t i = 0; i < n; ++i) x[i] += t->split_y[size_t(i)] + y_cold[i];  // the one copy up: y_cold
    t->stream_ready = true;
    if (x_out) std::copy(x, x + n, x_out);
    const pi_device_attention &a = t->attention[size_t(j.layer)].view;
    const pi_device_predictor *p = j.hot_mode == PI_DEVICE_HOT_PREDICTOR ? &t->predictors[size_t(j.layer)].view : nullptr;
    pi_device_counts &c = *j.counts;
    c = t->counts;
    c.h2d_bytes = (j.x_in ? double(n) * 4 : 0.0) + double(n) * 4;
    c.d2h_bytes = 2.0 * double(n) * 4 + (x_out ? double(n) * 4 : 0.0) + double(device::kJobCountersBytes);
    c.launches = device::split_launches(a, p);
    c.device_bytes += device::attention_bytes(a, t->desc, j.n_tok, j.n_past) + (p ? device::predictor_bytes(*p, j.n_tok) : 0.0);
    c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t->split_started).count();
    return 0;
}

// A host copy of 16 MiB, the best of three: bytes read plus written per second, as the CUDA library's probe.
int32_t copy_rate(int32_t device, double *bytes_per_second, char *err, size_t len) {
    if (device < 0 || device >= device_count(nullptr, 0)) return say(err, len, "no emulated device " + std::to_string(device));
    std::vector<uint8_t> a(size_t(16) << 20, 1), b(a.size());
    double best = 0;
    for (int i = 0; i < 3; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        std::memcpy(b.data(), a.data(), a.size());
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (best == 0 || s < best) best = s;
    }
    *bytes_per_second = best > 0 ? 2.0 * double(a.size()) / best : 0.0;
    return 0;
}

int32_t expert_upload(pi_device_tier *t, const pi_device_expert *x, int32_t layer, int32_t expert, char *err, size_t len) {
    if (!t || !x || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad expert upload");
    if (const char *why = device::refuse_expert(*x, t->desc)) return say(err, len, std::string("cannot upload ") + why);
    if (expert < 0 || expert >= t->desc.n_expert) return say(err, len, "no expert " + std::to_string(expert));
    if (t->experts.empty()) t->experts.resize(size_t(t->desc.n_layer) * size_t(t->desc.n_expert));
    pi_device_tier::Expert &X = t->experts[size_t(int64_t(layer) * t->desc.n_expert + expert)];
    const std::string name = "layer " + std::to_string(layer) + "'s expert " + std::to_string(expert);
    if (X.uploaded) return say(err, len, name + " was uploaded already");
    const device::ExpertLayout layout(*x);
    // the scratch with the first expert, as the CUDA library allocates it
    const uint64_t scratch = t->bytes_expert_scratch ? 0 : uint64_t(device::experts_scratch_bytes(t->desc));
    if (g_used + layout.bytes + scratch > capacity()) return say(err, len, "out of emulated device memory uploading " + name);
    X.block.assign(layout.bytes, 0);
    uint8_t *base = X.block.data();
    layout.fill(*x, [&](size_t at, const void *src, size_t n_bytes) {
        std::memcpy(base + at, src, n_bytes);
        return true;
    });
    X.view = layout.view(*x, base);
    X.uploaded = true;
    t->bytes_expert_scratch += scratch;
    t->bytes += layout.bytes + scratch;
    g_used += layout.bytes + scratch;
    return 0;
}

int32_t experts_submit(pi_device_tier *t, const pi_device_experts_job *job, char *err, size_t len) {
    if (!t) return say(err, len, "bad experts job");
    const std::string why = device::experts_job_refusal(job, t->desc, t->experts);
    if (!why.empty()) return say(err, len, why);
    if (t->worker.joinable()) t->worker.join();  // a job left unwaited: finished first
    if (t->split_pending) return say(err, len, "a split layer was begun and not ended");
    t->experts_job = *job;
    t->experts_pending = true;
    t->submitted = std::chrono::steady_clock::now();
    t->worker = std::thread([t] { t->compute_experts(); });  // while the host computes its own experts
    return 0;
}

int32_t experts_wait(pi_device_tier *t, pi_device_counts *counts, char *err, size_t len) {
    if (!t || !t->experts_pending) return say(err, len, "no experts job to wait for");
    t->worker.join();
    t->experts_pending = false;
    const pi_device_experts_job &j = t->experts_job;
    if (counts) {
        const pi_device_expert &x = t->experts[size_t(int64_t(j.layer) * t->desc.n_expert + j.pair_expert[0])].view;
        *counts = pi_device_counts{};
        counts->active = counts->computed = double(j.n_pairs) * double(t->desc.n_ff_expert);
        counts->h2d_bytes = device::experts_h2d_bytes(j, t->desc.n_embd);
        counts->d2h_bytes = device::experts_d2h_bytes(j, t->desc.n_embd);
        counts->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t->submitted).count();
        counts->launches = device::experts_launches(x, device::expert_groups(j));
        counts->device_bytes = device::experts_read_bytes(x, j);
    }
    return 0;
}

uint64_t tier_bytes(const pi_device_tier *t) { return t ? t->bytes : 0; }

void tier_destroy(pi_device_tier *t) {
    if (!t) return;
    if (t->worker.joinable()) t->worker.join();
    g_used -= t->bytes;
    delete t;
}

const pi_device_api kApi = {PI_DEVICE_API_VERSION, "emulated",       device_count,     device_memory,
                            tier_create,           tier_upload,      tier_submit,      tier_wait,
                            attention_upload,      attention_run,    head_upload,      head_run,
                            layer_run,             predictor_upload, split_begin,      split_end,
                            copy_rate,             tier_bytes,       tier_destroy,
                            expert_upload,         experts_submit,   experts_wait};

}  // namespace

extern "C" __attribute__((visibility("default"))) const pi_device_api *pi_device_api_get(void) { return &kApi; }
