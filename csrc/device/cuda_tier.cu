// The CUDA device library (pi_device.h): each layer's hot rows in device memory, and per job two kernels on a
// stream of the tier's own, so that the job runs while the engine's threads compute the cold tier. The layers'
// attention blocks and KV caches too: per attention job the norm, the q/k/v projections, RoPE and the cache's
// store, the heads and the output projection, one kernel each (attention_math.h's arithmetic), on the same stream.
//   gate_up: one warp per neuron and token, the row's blocks split between the lanes (tier_math.h's block_dot),
//            summed by shuffles; lane 0 applies the rule and writes the neuron's coefficient h.
//   down:    one block per 32 output columns and token; its warps take the neurons in turn (skipping h = 0, as
//            the rule leaves most of a ReLU model's), lane c adding column c of each row; the warps' sums are
//            added in a fixed order, so a job's output does not depend on scheduling.
//   norm:    one block per token, its sums in double reduced in a fixed order, then the token's q8_0 blocks.
//   project: a warp per output row and token, as gate_up (q, k, v and o).
//   rope:    a thread per head and token: RoPE on q and k, then k and v into the layer's cache.
//   heads:   one block per head and token: its scores over the positions it sees, the softmax and the value sum.
// The operands go up and the output comes back through pinned host buffers, asynchronously on the stream.
// Built with static cudart (nvcc's default): the library loads where no driver is, and says there is no device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "device/attention_math.h"
#include "device/tier_math.h"
#include "pi_device.h"

using namespace pi;

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // gate_up: warps (neurons) per block
constexpr int kDownWarps = 8;     // down: warps per block
constexpr int kNormThreads = 256;  // norm: threads per block (a power of two: the sums' tree)
constexpr int kHeadThreads = 128;  // heads: threads per block (a power of two)

int32_t say(char *err, size_t len, const std::string &message) {
    if (err && len) std::snprintf(err, len, "%s", message.c_str());
    return 1;
}

// A failed CUDA call as one line: what was being done and the runtime's words.
bool failed(cudaError_t status, const char *what, char *err, size_t len) {
    if (status == cudaSuccess) return false;
    say(err, len, std::string("CUDA: ") + what + ": " + cudaGetErrorString(status));
    cudaGetLastError();  // clear a sticky launch error's record for the next call
    return true;
}

struct LayerRows {
    bool uploaded = false;
    int32_t n_rows = 0;
    uint32_t gate_type = 0, up_type = 0, down_type = 0;
    float threshold = 0;
    uint8_t *block = nullptr;  // one allocation: gate, up, down_t rows, then the biases
    const uint8_t *gate = nullptr, *up = nullptr, *down_t = nullptr;
    const float *gate_b = nullptr, *up_b = nullptr;
    bool quantized = false;  // some weight reads the q8_0 operand
};

struct Counters {
    unsigned long long active, computed;
};

__global__ void gate_up_kernel(LayerRows L, device::Rule rule, int n_embd, int dense, const float *x,
                               const BlockQ8_0 *xq, float *h, int ld_h, Counters *counts) {
    __shared__ unsigned int block_active, block_computed;
    if (threadIdx.x == 0) block_active = block_computed = 0;
    __syncthreads();
    const int lane = threadIdx.x % kWarp, r = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp, t = blockIdx.y;
    const int nb = n_embd / QK;
    if (r < L.n_rows) {
        const float *xt = x + size_t(t) * n_embd;
        const BlockQ8_0 *xqt = xq ? xq + size_t(t) * nb : nullptr;
        const uint8_t *g_row = L.gate + size_t(r) * device::row_bytes(L.gate_type, n_embd);
        const uint8_t *u_row = rule.gated ? L.up + size_t(r) * device::row_bytes(L.up_type, n_embd) : nullptr;
        float g = 0, u = 0;
        for (int k = lane; k < nb; k += kWarp) {
            g += device::block_dot(L.gate_type, g_row, k, xt, xqt);
            if (u_row) u += device::block_dot(L.up_type, u_row, k, xt, xqt);
        }
        for (int off = kWarp / 2; off > 0; off /= 2) {
            g += __shfl_down_sync(0xffffffffu, g, off);
            u += __shfl_down_sync(0xffffffffu, u, off);
        }
        if (lane == 0) {
            bool pass;
            const float c = rule.coefficient(g, u, L.gate_b ? L.gate_b[r] : 0.0f, L.up_b ? L.up_b[r] : 0.0f,
                                             dense != 0, &pass);
            h[size_t(t) * ld_h + r] = c;
            if (pass) atomicAdd(&block_active, 1u);
            if (dense || pass) atomicAdd(&block_computed, 1u);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(&counts->active, (unsigned long long)block_active);
        atomicAdd(&counts->computed, (unsigned long long)block_computed);
    }
}

__global__ void down_kernel(LayerRows L, int n_embd, const float *h, int ld_h, float *y) {
    __shared__ float partial[kDownWarps][kWarp];
    const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp, t = blockIdx.y;
    const int col = blockIdx.x * kWarp + lane;
    const uint32_t rb = device::row_bytes(L.down_type, n_embd);
    const float *ht = h + size_t(t) * ld_h;
    if (gridDim.y == 1 && L.down_type == TYPE_Q4_0) {  // a decode step: the CPU's integer sums (tier_math.h)
        if (w == 0) y[col] = device::down_element_q4_0(L.down_t, rb, ht, L.n_rows, col);
        return;
    }
    float acc = 0;
    for (int r = w; r < L.n_rows; r += kDownWarps) {
        const float c = ht[r];
        if (c == 0.0f) continue;  // the same for the whole warp: no divergence
        acc += c * device::element(L.down_type, L.down_t + size_t(r) * rb, col);
    }
    partial[w][lane] = acc;
    __syncthreads();
    if (w == 0) {
        float sum = 0;
        for (int j = 0; j < kDownWarps; ++j) sum += partial[j][lane];
        y[size_t(t) * n_embd + col] = sum;
    }
}


// The token's sum of v over [0, n) by the block's threads, in double, reduced in a fixed order (n a multiple of
// nothing: each thread strides the row).
template <class F>
__device__ double block_sum(int n, F v, double *shared) {
    double acc = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += v(i);
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) shared[threadIdx.x] += shared[threadIdx.x + w];
        __syncthreads();
    }
    const double sum = shared[0];
    __syncthreads();
    return sum;
}

__global__ void norm_kernel(const float *x, const float *w, const float *b, int n_embd, int kind, float eps, float *xn,
                            BlockQ8_0 *xq) {
    __shared__ double shared[kNormThreads];
    const float *xt = x + size_t(blockIdx.x) * n_embd;
    float *ot = xn + size_t(blockIdx.x) * n_embd;
    const double mean = kind == PI_DEVICE_NORM_LAYER
                            ? block_sum(n_embd, [&](int i) { return double(xt[i]); }, shared) / double(n_embd)
                            : 0.0;
    const double ss = block_sum(n_embd, [&](int i) { return (double(xt[i]) - mean) * (double(xt[i]) - mean); }, shared);
    const float scale = device::norm_scale(ss, n_embd, eps);
    for (int i = threadIdx.x; i < n_embd; i += blockDim.x) ot[i] = device::norm_element(kind, xt[i], mean, scale, w[i], b ? b[i] : 0.0f);
    __syncthreads();  // the row's elements written, and seen by the block's threads, before its blocks are made
    if (xq)
        for (int k = threadIdx.x; k < n_embd / QK; k += blockDim.x)
            device::quantize_block(ot + k * QK, xq + size_t(blockIdx.x) * (n_embd / QK) + k);
}

__global__ void quantize_kernel(const float *x, int n, int n_tok, BlockQ8_0 *xq) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x, nb = n / QK;
    if (k < nb * n_tok) device::quantize_block(x + size_t(k) * QK, xq + k);
}

// y[t][r] = m's row r . x[t] + bias, a warp per row.
__global__ void project_kernel(pi_device_matrix m, const float *x, const BlockQ8_0 *xq, float *y, int ldy) {
    const int lane = threadIdx.x % kWarp, r = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp, t = blockIdx.y;
    if (r >= m.rows) return;
    const float *xt = x + size_t(t) * m.cols;
    const BlockQ8_0 *xqt = xq ? xq + size_t(t) * (m.cols / QK) : nullptr;
    float sum = device::row_dot(m, r, xt, xqt, lane, kWarp);
    for (int off = kWarp / 2; off > 0; off /= 2) sum += __shfl_down_sync(0xffffffffu, sum, off);
    if (lane == 0) y[size_t(t) * ldy + r] = sum + (m.bias ? m.bias[r] : 0.0f);
}

// Thread j of token t: RoPE on query head j (j < n_head), or on key head j - n_head, whose key and value it then
// stores at position n_past + t.
__global__ void rope_store_kernel(pi_device_tier_desc d, int n_past, float *q, float *k, const float *v,
                                  const float *rope_cos, const float *rope_sin, uint8_t *k_cache, uint8_t *v_cache) {
    const int t = blockIdx.x, j = threadIdx.x, D = d.d_head, half = d.n_rot / 2;
    if (j >= d.n_head + d.n_head_kv) return;
    const int64_t pos = n_past + t;
    const bool is_key = j >= d.n_head;
    const int h = is_key ? j - d.n_head : j;
    float *vec = is_key ? k + (size_t(t) * d.n_head_kv + h) * D : q + (size_t(t) * d.n_head + h) * D;
    if (d.rope != PI_DEVICE_ROPE_NONE)
        for (int i = 0; i < half; ++i) {
            int64_t i0, i1;
            device::rope_pair(d.rope, i, half, &i0, &i1);
            device::rotate(vec, i0, i1, rope_cos[pos * half + i], rope_sin[pos * half + i]);
        }
    if (!is_key) return;
    const float *vt = v + (size_t(t) * d.n_head_kv + h) * D;
    for (int i = 0; i < D; ++i) {
        device::kv_put(k_cache, d.kv_f16 != 0, device::kv_index(d, pos, h, i), vec[i]);
        device::kv_put(v_cache, d.kv_f16 != 0, device::kv_index(d, pos, h, i), vt[i]);
    }
}

// Head blockIdx.x of token blockIdx.y over positions 0 .. n_past + t: scores into its row of `scores`, the softmax
// (max, e^(s - max) by exp_ref, their sum), then each output element as the weighted sum of the values.
__global__ void heads_kernel(pi_device_tier_desc d, int n_past, const float *q, const uint8_t *k_cache,
                             const uint8_t *v_cache, float *scores, float *att) {
    __shared__ float reduce[kHeadThreads];
    const int h = blockIdx.x, t = blockIdx.y, D = d.d_head, kvh = h / (d.n_head / d.n_head_kv);
    const int n_keys = n_past + t + 1;
    const bool f16 = d.kv_f16 != 0;
    const float *qh = q + (size_t(t) * d.n_head + h) * D;
    float *sc = scores + (size_t(t) * d.n_head + h) * d.n_ctx;
    const float inv_sqrt_d = 1.0f / sqrtf(float(D));
    float mx = -INFINITY;
    for (int p = threadIdx.x; p < n_keys; p += blockDim.x) {
        float s = 0;
        for (int i = 0; i < D; ++i) s += qh[i] * device::kv_get(k_cache, f16, device::kv_index(d, p, kvh, i));
        sc[p] = s * inv_sqrt_d;
        mx = fmaxf(mx, sc[p]);
    }
    reduce[threadIdx.x] = mx;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) reduce[threadIdx.x] = fmaxf(reduce[threadIdx.x], reduce[threadIdx.x + w]);
        __syncthreads();
    }
    mx = reduce[0];
    __syncthreads();
    float sum = 0;
    for (int p = threadIdx.x; p < n_keys; p += blockDim.x) sum += (sc[p] = exp_ref(sc[p] - mx));
    reduce[threadIdx.x] = sum;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) reduce[threadIdx.x] += reduce[threadIdx.x + w];
        __syncthreads();
    }
    sum = reduce[0];
    float *out = att + (size_t(t) * d.n_head + h) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float acc = 0;
        for (int p = 0; p < n_keys; ++p) acc += sc[p] / sum * device::kv_get(v_cache, f16, device::kv_index(d, p, kvh, i));
        out[i] = acc;
    }
}

struct AttentionLayer {
    bool uploaded = false;
    uint8_t *block = nullptr;  // one allocation: the norm, the matrices and biases, the KV cache
    pi_device_attention view{};
    uint8_t *k_cache = nullptr, *v_cache = nullptr;
};

}  // namespace

struct pi_device_tier {
    pi_device_tier_desc desc{};
    std::vector<LayerRows> layers;
    cudaStream_t stream = nullptr;
    cudaEvent_t started = nullptr, finished = nullptr;
    uint64_t bytes = 0;
    int32_t max_rows = 0;
    // device scratch
    float *d_x = nullptr, *d_y = nullptr, *d_h = nullptr;
    BlockQ8_0 *d_xq = nullptr;
    Counters *d_counts = nullptr;
    // pinned host staging
    float *p_x = nullptr, *p_y = nullptr;
    BlockQ8_0 *p_xq = nullptr;
    Counters *p_counts = nullptr;
    // attention: the layers' blocks, RoPE's tables (on the host until the first layer's upload), the scratch
    // (attention_math.h's attention_scratch_bytes) and its pinned staging, allocated with the first layer
    std::vector<AttentionLayer> attention;
    std::vector<float> rope_cos, rope_sin;
    float *d_rope_cos = nullptr, *d_rope_sin = nullptr;
    float *d_ax = nullptr, *d_axn = nullptr, *d_q = nullptr, *d_k = nullptr, *d_v = nullptr, *d_att = nullptr,
          *d_aout = nullptr, *d_scores = nullptr;
    BlockQ8_0 *d_axq = nullptr, *d_attq = nullptr;
    float *p_ax = nullptr, *p_aout = nullptr;
    bool attention_ready = false;
    // the output head: its block, its view, its scratch (attention_math.h's head_scratch_bytes) and staging
    uint8_t *head_block = nullptr;
    pi_device_head head_view{};
    float *d_hx = nullptr, *d_hxn = nullptr, *d_logits = nullptr, *p_hx = nullptr, *p_logits = nullptr;
    BlockQ8_0 *d_hxq = nullptr;
    // the job in flight
    bool pending = false;
    pi_device_job job{};
    double h2d = 0, d2h = 0;

    size_t x_bytes() const { return size_t(desc.n_batch) * desc.n_embd * sizeof(float); }
    size_t xq_bytes() const { return size_t(desc.n_batch) * (desc.n_embd / QK) * sizeof(BlockQ8_0); }

    int32_t allocate(void **p, size_t n, const char *what, char *err, size_t len) {
        if (failed(cudaMalloc(p, n), what, err, len)) return 1;
        bytes += n;
        return 0;
    }

    // A synchronous job's start (attention's, the head's): the started event, n_tok rows x up through the pinned
    // p_x into d_x, and their norm (w, b) into d_xn, with its q8_0 blocks into d_xq where not null.
    int32_t normed_input(const float *x, int n_tok, const float *w, const float *b, float *p_x, float *d_x, float *d_xn,
                         BlockQ8_0 *d_xq, char *err, size_t len) {
        const size_t x_bytes = size_t(n_tok) * desc.n_embd * sizeof(float);
        std::memcpy(p_x, x, x_bytes);
        if (failed(cudaEventRecord(started, stream), "recording an event", err, len) ||
            failed(cudaMemcpyAsync(d_x, p_x, x_bytes, cudaMemcpyHostToDevice, stream), "copying the input", err, len))
            return 1;
        norm_kernel<<<n_tok, kNormThreads, 0, stream>>>(d_x, w, b, desc.n_embd, desc.norm, desc.norm_eps, d_xn, d_xq);
        return 0;
    }

    // A synchronous job's counts (attention's, the head's): its traffic, and its time between the two events.
    void synchronous_counts(pi_device_counts *counts, double h2d_bytes, double d2h_bytes) const {
        if (!counts) return;
        float ms = 0;
        cudaEventElapsedTime(&ms, started, finished);
        *counts = pi_device_counts{};
        counts->h2d_bytes = h2d_bytes;
        counts->d2h_bytes = d2h_bytes;
        counts->seconds = ms / 1e3;
    }

    void release() {
        for (LayerRows &L : layers)
            if (L.block) cudaFree(L.block);
        for (AttentionLayer &A : attention)
            if (A.block) cudaFree(A.block);
        for (void *p : {static_cast<void *>(d_rope_cos), static_cast<void *>(d_rope_sin), static_cast<void *>(d_ax),
                        static_cast<void *>(d_axn), static_cast<void *>(d_q), static_cast<void *>(d_k),
                        static_cast<void *>(d_v), static_cast<void *>(d_att), static_cast<void *>(d_aout),
                        static_cast<void *>(d_scores), static_cast<void *>(d_axq), static_cast<void *>(d_attq),
                        static_cast<void *>(head_block), static_cast<void *>(d_hx), static_cast<void *>(d_hxn),
                        static_cast<void *>(d_logits), static_cast<void *>(d_hxq), static_cast<void *>(d_x),
                        static_cast<void *>(d_y), static_cast<void *>(d_h), static_cast<void *>(d_xq),
                        static_cast<void *>(d_counts)})
            if (p) cudaFree(p);
        for (void *p : {static_cast<void *>(p_ax), static_cast<void *>(p_aout), static_cast<void *>(p_hx),
                        static_cast<void *>(p_logits), static_cast<void *>(p_x), static_cast<void *>(p_y),
                        static_cast<void *>(p_xq), static_cast<void *>(p_counts)})
            if (p) cudaFreeHost(p);
        if (started) cudaEventDestroy(started);
        if (finished) cudaEventDestroy(finished);
        if (stream) cudaStreamDestroy(stream);
    }
};

namespace {

int32_t device_count(char *err, size_t len) {
    int n = 0;
    const cudaError_t status = cudaGetDeviceCount(&n);
    if (status == cudaErrorNoDevice || (status == cudaSuccess && n == 0)) {
        say(err, len, "no CUDA device");
        return 0;
    }
    if (status == cudaErrorInsufficientDriver) {
        cudaGetLastError();
        say(err, len, "no CUDA device: no NVIDIA driver, or one older than this build's CUDA " +
                          std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10));
        return 0;
    }
    if (failed(status, "looking for devices", err, len)) return 0;
    return n;
}

int32_t device_memory(int32_t device, uint64_t *free_bytes, uint64_t *total_bytes, char *name, size_t name_len,
                      char *err, size_t len) {
    if (failed(cudaSetDevice(device), "selecting the device", err, len)) return 1;
    size_t free = 0, total = 0;
    if (failed(cudaMemGetInfo(&free, &total), "reading its free memory", err, len)) return 1;
    cudaDeviceProp prop;
    if (failed(cudaGetDeviceProperties(&prop, device), "reading its properties", err, len)) return 1;
    if (free_bytes) *free_bytes = free;
    if (total_bytes) *total_bytes = total;
    if (name && name_len) std::snprintf(name, name_len, "%s", prop.name);
    return 0;
}

pi_device_tier *tier_create(const pi_device_tier_desc *desc, char *err, size_t len) {
    if (!desc || desc->n_embd <= 0 || desc->n_embd % QK || desc->n_layer <= 0 || desc->n_batch <= 0) {
        say(err, len, "bad tier description");
        return nullptr;
    }
    if (failed(cudaSetDevice(desc->device), "selecting the device", err, len)) return nullptr;
    pi_device_tier *t = new pi_device_tier;
    t->desc = *desc;
    t->layers.resize(size_t(desc->n_layer));
    t->attention.resize(size_t(desc->n_layer));
    if (desc->rope_cos && desc->rope_sin && desc->n_ctx > 0 && desc->n_rot > 0) {
        const size_t n = size_t(desc->n_ctx) * size_t(desc->n_rot / 2);
        t->rope_cos.assign(desc->rope_cos, desc->rope_cos + n);
        t->rope_sin.assign(desc->rope_sin, desc->rope_sin + n);
    }
    t->desc.rope_cos = t->desc.rope_sin = nullptr;  // the host's, read here only
    bool ok = !failed(cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking), "creating a stream", err, len) &&
              !failed(cudaEventCreate(&t->started), "creating an event", err, len) &&
              !failed(cudaEventCreate(&t->finished), "creating an event", err, len) &&
              !t->allocate(reinterpret_cast<void **>(&t->d_x), t->x_bytes(), "allocating the input", err, len) &&
              !t->allocate(reinterpret_cast<void **>(&t->d_xq), t->xq_bytes(), "allocating the input", err, len) &&
              !t->allocate(reinterpret_cast<void **>(&t->d_y), t->x_bytes(), "allocating the output", err, len) &&
              !t->allocate(reinterpret_cast<void **>(&t->d_counts), sizeof(Counters), "allocating counters", err, len) &&
              !failed(cudaMallocHost(&t->p_x, t->x_bytes()), "allocating pinned memory", err, len) &&
              !failed(cudaMallocHost(&t->p_xq, t->xq_bytes()), "allocating pinned memory", err, len) &&
              !failed(cudaMallocHost(&t->p_y, t->x_bytes()), "allocating pinned memory", err, len) &&
              !failed(cudaMallocHost(&t->p_counts, sizeof(Counters)), "allocating pinned memory", err, len);
    if (!ok) {
        t->release();
        delete t;
        return nullptr;
    }
    return t;
}

int32_t tier_upload(pi_device_tier *t, const pi_device_layer *rows, int32_t layer, char *err, size_t len) {
    if (!t || !rows || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad upload");
    const bool gated = t->desc.gated != 0;
    if (const char *why = device::refuse_layer(*rows, gated)) return say(err, len, std::string("cannot upload ") + why);
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    LayerRows &L = t->layers[size_t(layer)];
    if (L.uploaded) return say(err, len, "layer " + std::to_string(layer) + " was uploaded already");
    const device::LayerLayout layout(*rows, t->desc.n_embd, gated);
    if (t->allocate(reinterpret_cast<void **>(&L.block), layout.bytes,
                    ("allocating layer " + std::to_string(layer)).c_str(), err, len))
        return 1;
    const bool copied = layout.fill(*rows, gated, [&](size_t at, const void *src, size_t n_bytes) {
        return !failed(cudaMemcpy(L.block + at, src, n_bytes, cudaMemcpyHostToDevice), "copying rows", err, len);
    });
    if (!copied) return 1;
    L.gate = L.block + layout.gate;
    L.up = gated ? L.block + layout.up : nullptr;
    L.down_t = L.block + layout.down_t;
    L.gate_b = rows->gate_b ? reinterpret_cast<const float *>(L.block + layout.gate_b) : nullptr;
    L.up_b = rows->up_b ? reinterpret_cast<const float *>(L.block + layout.up_b) : nullptr;
    L.n_rows = rows->n_rows;
    L.gate_type = rows->gate_type;
    L.up_type = rows->up_type;
    L.down_type = rows->down_type;
    L.threshold = rows->threshold;
    L.quantized = layout.quantized;
    L.uploaded = true;
    if (rows->n_rows > t->max_rows) {  // the coefficients' scratch, for the largest layer
        if (t->d_h) {
            cudaFree(t->d_h);
            t->bytes -= size_t(t->desc.n_batch) * t->max_rows * sizeof(float);
            t->d_h = nullptr;
        }
        t->max_rows = rows->n_rows;
        if (t->allocate(reinterpret_cast<void **>(&t->d_h), size_t(t->desc.n_batch) * t->max_rows * sizeof(float),
                        "allocating the coefficients", err, len))
            return 1;
    }
    return 0;
}

int32_t tier_submit(pi_device_tier *t, const pi_device_job *job, char *err, size_t len) {
    if (!t || !job || job->layer < 0 || job->layer >= t->desc.n_layer || job->n_tok <= 0 || job->n_tok > t->desc.n_batch)
        return say(err, len, "bad job");
    const LayerRows &L = t->layers[size_t(job->layer)];
    if (!L.uploaded) return say(err, len, "layer " + std::to_string(job->layer) + " was not uploaded");
    if (L.quantized && !job->x_q8) return say(err, len, "the layer's weights are quantized: the job needs x_q8");
    if (t->pending && cudaStreamSynchronize(t->stream) != cudaSuccess) cudaGetLastError();  // a job left unwaited
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const int E = t->desc.n_embd, n_tok = job->n_tok;
    const size_t x_bytes = size_t(n_tok) * E * sizeof(float), xq_bytes = size_t(n_tok) * (E / QK) * sizeof(BlockQ8_0);
    std::memcpy(t->p_x, job->x, x_bytes);
    if (L.quantized) std::memcpy(t->p_xq, job->x_q8, xq_bytes);
    const device::Rule rule{t->desc.activation, t->desc.gated, L.threshold};
    cudaStream_t s = t->stream;
    if (failed(cudaEventRecord(t->started, s), "recording an event", err, len) ||
        failed(cudaMemcpyAsync(t->d_x, t->p_x, x_bytes, cudaMemcpyHostToDevice, s), "copying the input", err, len) ||
        (L.quantized &&
         failed(cudaMemcpyAsync(t->d_xq, t->p_xq, xq_bytes, cudaMemcpyHostToDevice, s), "copying the input", err, len)) ||
        failed(cudaMemsetAsync(t->d_counts, 0, sizeof(Counters), s), "clearing counters", err, len))
        return 1;
    const dim3 gate_grid((L.n_rows + kRowsPerBlock - 1) / kRowsPerBlock, n_tok);
    gate_up_kernel<<<gate_grid, kRowsPerBlock * kWarp, 0, s>>>(L, rule, E, job->dense, t->d_x,
                                                                L.quantized ? t->d_xq : nullptr, t->d_h, t->max_rows,
                                                                t->d_counts);
    down_kernel<<<dim3(E / kWarp, n_tok), kDownWarps * kWarp, 0, s>>>(L, E, t->d_h, t->max_rows, t->d_y);
    if (failed(cudaGetLastError(), "launching the tier's kernels", err, len) ||
        failed(cudaMemcpyAsync(t->p_y, t->d_y, x_bytes, cudaMemcpyDeviceToHost, s), "copying the output", err, len) ||
        failed(cudaMemcpyAsync(t->p_counts, t->d_counts, sizeof(Counters), cudaMemcpyDeviceToHost, s),
               "copying counters", err, len) ||
        failed(cudaEventRecord(t->finished, s), "recording an event", err, len))
        return 1;
    t->job = *job;
    t->pending = true;
    t->h2d = double(x_bytes + (L.quantized ? xq_bytes : 0));
    t->d2h = double(x_bytes + sizeof(Counters));
    return 0;
}

int32_t tier_wait(pi_device_tier *t, pi_device_counts *counts, char *err, size_t len) {
    if (!t || !t->pending) return say(err, len, "no job to wait for");
    t->pending = false;
    if (failed(cudaEventSynchronize(t->finished), "running the tier's job", err, len)) return 1;
    float ms = 0;
    cudaEventElapsedTime(&ms, t->started, t->finished);
    std::memcpy(t->job.y, t->p_y, size_t(t->job.n_tok) * t->desc.n_embd * sizeof(float));
    if (counts) {
        counts->active = double(t->p_counts->active);
        counts->computed = double(t->p_counts->computed);
        counts->h2d_bytes = t->h2d;
        counts->d2h_bytes = t->d2h;
        counts->seconds = ms / 1e3;
    }
    return 0;
}

// The attention scratch, as attention_math.h's attention_scratch_bytes counts it, and RoPE's tables on the device.
int32_t attention_scratch(pi_device_tier *t, char *err, size_t len) {
    const pi_device_tier_desc &d = t->desc;
    const size_t B = size_t(d.n_batch), E = size_t(d.n_embd), Q = size_t(d.n_head) * d.d_head,
                 KV = size_t(d.n_head_kv) * d.d_head, table = size_t(d.n_ctx) * size_t(d.n_rot / 2) * sizeof(float);
    const struct {
        void **p;
        size_t bytes;
    } parts[] = {{reinterpret_cast<void **>(&t->d_ax), B * E * 4},
                 {reinterpret_cast<void **>(&t->d_axn), B * E * 4},
                 {reinterpret_cast<void **>(&t->d_aout), B * E * 4},
                 {reinterpret_cast<void **>(&t->d_axq), B * (E / QK) * sizeof(BlockQ8_0)},
                 {reinterpret_cast<void **>(&t->d_q), B * Q * 4},
                 {reinterpret_cast<void **>(&t->d_att), B * Q * 4},
                 {reinterpret_cast<void **>(&t->d_k), B * KV * 4},
                 {reinterpret_cast<void **>(&t->d_v), B * KV * 4},
                 {reinterpret_cast<void **>(&t->d_attq), B * (Q / QK) * sizeof(BlockQ8_0)},
                 {reinterpret_cast<void **>(&t->d_scores), B * size_t(d.n_head) * size_t(d.n_ctx) * 4},
                 {reinterpret_cast<void **>(&t->d_rope_cos), table},
                 {reinterpret_cast<void **>(&t->d_rope_sin), table}};
    for (const auto &part : parts)
        if (part.bytes && t->allocate(part.p, part.bytes, "allocating attention's scratch", err, len)) return 1;
    if (table && (failed(cudaMemcpy(t->d_rope_cos, t->rope_cos.data(), table, cudaMemcpyHostToDevice), "copying RoPE's tables", err, len) ||
                  failed(cudaMemcpy(t->d_rope_sin, t->rope_sin.data(), table, cudaMemcpyHostToDevice), "copying RoPE's tables", err, len)))
        return 1;
    if (failed(cudaMallocHost(&t->p_ax, B * E * 4), "allocating pinned memory", err, len) ||
        failed(cudaMallocHost(&t->p_aout, B * E * 4), "allocating pinned memory", err, len))
        return 1;
    t->attention_ready = true;
    return 0;
}

int32_t attention_upload(pi_device_tier *t, const pi_device_attention *a, int32_t layer, char *err, size_t len) {
    if (!t || !a || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad attention upload");
    if (const char *why = device::refuse_attention(*a, t->desc)) return say(err, len, std::string("cannot upload ") + why);
    if (t->desc.rope != PI_DEVICE_ROPE_NONE && t->rope_cos.empty()) return say(err, len, "a tier made without RoPE's tables");
    AttentionLayer &A = t->attention[size_t(layer)];
    if (A.uploaded) return say(err, len, "layer " + std::to_string(layer) + "'s attention was uploaded already");
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    if (!t->attention_ready && attention_scratch(t, err, len)) return 1;
    const device::AttentionLayout layout(*a, t->desc);
    if (t->allocate(reinterpret_cast<void **>(&A.block), layout.bytes,
                    ("allocating layer " + std::to_string(layer) + "'s attention").c_str(), err, len))
        return 1;
    const bool copied = layout.fill(*a, t->desc, [&](size_t at, const void *src, size_t n_bytes) {
        return !failed(cudaMemcpy(A.block + at, src, n_bytes, cudaMemcpyHostToDevice), "copying attention", err, len);
    });
    if (!copied) return 1;
    A.view = layout.view(*a, A.block);
    A.k_cache = A.block + layout.k_cache;
    A.v_cache = A.block + layout.v_cache;
    A.uploaded = true;
    return 0;
}

int32_t attention_run(pi_device_tier *t, const pi_device_attention_job *job, pi_device_counts *counts, char *err,
                      size_t len) {
    if (!t) return say(err, len, "bad attention job");
    if (const char *why = device::refuse_attention_job(job, t->desc)) return say(err, len, why);
    const AttentionLayer &A = t->attention[size_t(job->layer)];
    if (!A.uploaded) return say(err, len, "layer " + std::to_string(job->layer) + "'s attention was not uploaded");
    // a hot job left unwaited runs first (the stream's order) and stays to be waited for
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const pi_device_tier_desc &d = t->desc;
    const pi_device_attention &a = A.view;
    const int n_tok = job->n_tok, E = d.n_embd, Q = d.n_head * d.d_head;
    const size_t x_bytes = size_t(n_tok) * E * sizeof(float);
    const bool q8_in = device::quantized(a.q) || device::quantized(a.k) || device::quantized(a.v);
    const bool q8_att = device::quantized(a.o);
    cudaStream_t s = t->stream;
    if (t->normed_input(job->x, n_tok, a.norm_w, a.norm_b, t->p_ax, t->d_ax, t->d_axn, q8_in ? t->d_axq : nullptr, err, len))
        return 1;
    const pi_device_matrix *qkv[3] = {&a.q, &a.k, &a.v};
    float *outs[3] = {t->d_q, t->d_k, t->d_v};
    for (int i = 0; i < 3; ++i)
        project_kernel<<<dim3((qkv[i]->rows + kRowsPerBlock - 1) / kRowsPerBlock, n_tok), kRowsPerBlock * kWarp, 0, s>>>(
            *qkv[i], t->d_axn, device::quantized(*qkv[i]) ? t->d_axq : nullptr, outs[i], qkv[i]->rows);
    rope_store_kernel<<<n_tok, d.n_head + d.n_head_kv, 0, s>>>(d, job->n_past, t->d_q, t->d_k, t->d_v, t->d_rope_cos,
                                                              t->d_rope_sin, A.k_cache, A.v_cache);
    heads_kernel<<<dim3(d.n_head, n_tok), kHeadThreads, 0, s>>>(d, job->n_past, t->d_q, A.k_cache, A.v_cache,
                                                               t->d_scores, t->d_att);
    if (q8_att) {
        const int blocks = n_tok * (Q / QK);
        quantize_kernel<<<(blocks + 255) / 256, 256, 0, s>>>(t->d_att, Q, n_tok, t->d_attq);
    }
    project_kernel<<<dim3((E + kRowsPerBlock - 1) / kRowsPerBlock, n_tok), kRowsPerBlock * kWarp, 0, s>>>(
        a.o, t->d_att, q8_att ? t->d_attq : nullptr, t->d_aout, E);
    if (failed(cudaGetLastError(), "launching attention's kernels", err, len) ||
        failed(cudaMemcpyAsync(t->p_aout, t->d_aout, x_bytes, cudaMemcpyDeviceToHost, s), "copying the output", err, len) ||
        failed(cudaEventRecord(t->finished, s), "recording an event", err, len) ||
        failed(cudaEventSynchronize(t->finished), "running attention", err, len))
        return 1;
    std::memcpy(job->out, t->p_aout, x_bytes);
    t->synchronous_counts(counts, double(x_bytes), double(x_bytes));
    return 0;
}

int32_t head_upload(pi_device_tier *t, const pi_device_head *h, char *err, size_t len) {
    if (!t || !h) return say(err, len, "bad head upload");
    if (const char *why = device::refuse_head(*h, t->desc)) return say(err, len, std::string("cannot upload ") + why);
    if (t->head_block) return say(err, len, "the output head was uploaded already");
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const pi_device_tier_desc &d = t->desc;
    const size_t B = size_t(d.n_batch), E = size_t(d.n_embd), V = size_t(d.n_vocab);
    const device::HeadLayout layout(*h, d);
    if (t->allocate(reinterpret_cast<void **>(&t->head_block), layout.bytes, "allocating the output head", err, len) ||
        t->allocate(reinterpret_cast<void **>(&t->d_hx), B * E * 4, "allocating the head's scratch", err, len) ||
        t->allocate(reinterpret_cast<void **>(&t->d_hxn), B * E * 4, "allocating the head's scratch", err, len) ||
        t->allocate(reinterpret_cast<void **>(&t->d_hxq), B * (E / QK) * sizeof(BlockQ8_0), "allocating the head's scratch",
                    err, len) ||
        t->allocate(reinterpret_cast<void **>(&t->d_logits), B * V * 4, "allocating the head's scratch", err, len) ||
        failed(cudaMallocHost(&t->p_hx, B * E * 4), "allocating pinned memory", err, len) ||
        failed(cudaMallocHost(&t->p_logits, B * V * 4), "allocating pinned memory", err, len))
        return 1;
    const bool copied = layout.fill(*h, d, [&](size_t at, const void *src, size_t n_bytes) {
        return !failed(cudaMemcpy(t->head_block + at, src, n_bytes, cudaMemcpyHostToDevice), "copying the head", err, len);
    });
    if (!copied) return 1;
    t->head_view = layout.view(*h, t->head_block);
    return 0;
}

int32_t head_run(pi_device_tier *t, const pi_device_head_job *job, pi_device_counts *counts, char *err, size_t len) {
    if (!t) return say(err, len, "bad head job");
    if (const char *why = device::refuse_head_job(job, t->desc)) return say(err, len, why);
    if (!t->head_block) return say(err, len, "the output head was not uploaded");
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const pi_device_tier_desc &d = t->desc;
    const pi_device_head &h = t->head_view;
    const int n_tok = job->n_tok, E = d.n_embd, V = d.n_vocab;
    const size_t x_bytes = size_t(n_tok) * E * 4, logit_bytes = size_t(n_tok) * V * 4;
    const bool q8 = device::quantized(h.out);
    cudaStream_t s = t->stream;
    if (t->normed_input(job->x, n_tok, h.norm_w, h.norm_b, t->p_hx, t->d_hx, t->d_hxn, q8 ? t->d_hxq : nullptr, err, len))
        return 1;
    project_kernel<<<dim3((V + kRowsPerBlock - 1) / kRowsPerBlock, n_tok), kRowsPerBlock * kWarp, 0, s>>>(
        h.out, t->d_hxn, q8 ? t->d_hxq : nullptr, t->d_logits, V);
    if (failed(cudaGetLastError(), "launching the head's kernels", err, len) ||
        failed(cudaMemcpyAsync(t->p_logits, t->d_logits, logit_bytes, cudaMemcpyDeviceToHost, s), "copying the logits",
               err, len) ||
        failed(cudaEventRecord(t->finished, s), "recording an event", err, len) ||
        failed(cudaEventSynchronize(t->finished), "running the head", err, len))
        return 1;
    for (int tk = 0; tk < n_tok; ++tk)
        std::memcpy(job->logits + size_t(tk) * size_t(job->ld_logits), t->p_logits + size_t(tk) * V, size_t(V) * 4);
    t->synchronous_counts(counts, double(x_bytes), double(logit_bytes));
    return 0;
}

uint64_t tier_bytes(const pi_device_tier *t) { return t ? t->bytes : 0; }

void tier_destroy(pi_device_tier *t) {
    if (!t) return;
    cudaSetDevice(t->desc.device);
    if (t->pending) cudaStreamSynchronize(t->stream);
    t->release();
    delete t;
}

const pi_device_api kApi = {PI_DEVICE_API_VERSION, "cuda",         device_count,  device_memory,
                            tier_create,           tier_upload,    tier_submit,   tier_wait,
                            attention_upload,      attention_run,  head_upload,   head_run,
                            tier_bytes,            tier_destroy};

}  // namespace

extern "C" __attribute__((visibility("default"))) const pi_device_api *pi_device_api_get(void) { return &kApi; }
