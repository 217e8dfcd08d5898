// The CUDA device library (pi_device.h): each layer's hot rows in device memory, and per job two kernels on a
// stream of the tier's own, so that the job runs while the engine's threads compute the cold tier.
//   gate_up: one warp per neuron and token, the row's blocks split between the lanes (tier_math.h's block_dot),
//            summed by shuffles; lane 0 applies the rule and writes the neuron's coefficient h.
//   down:    one block per 32 output columns and token; its warps take the neurons in turn (skipping h = 0, as
//            the rule leaves most of a ReLU model's), lane c adding column c of each row; the warps' sums are
//            added in a fixed order, so a job's output does not depend on scheduling.
// The operands go up and the output comes back through pinned host buffers, asynchronously on the stream.
// Built with static cudart (nvcc's default): the library loads where no driver is, and says there is no device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "device/tier_math.h"
#include "pi_device.h"

using namespace pi;

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // gate_up: warps (neurons) per block
constexpr int kDownWarps = 8;     // down: warps per block

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

    void release() {
        for (LayerRows &L : layers)
            if (L.block) cudaFree(L.block);
        for (void *p : {static_cast<void *>(d_x), static_cast<void *>(d_y), static_cast<void *>(d_h),
                        static_cast<void *>(d_xq), static_cast<void *>(d_counts)})
            if (p) cudaFree(p);
        for (void *p : {static_cast<void *>(p_x), static_cast<void *>(p_y), static_cast<void *>(p_xq),
                        static_cast<void *>(p_counts)})
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

uint64_t tier_bytes(const pi_device_tier *t) { return t ? t->bytes : 0; }

void tier_destroy(pi_device_tier *t) {
    if (!t) return;
    cudaSetDevice(t->desc.device);
    if (t->pending) cudaStreamSynchronize(t->stream);
    t->release();
    delete t;
}

const pi_device_api kApi = {PI_DEVICE_API_VERSION, "cuda", device_count, device_memory, tier_create,
                            tier_upload, tier_submit, tier_wait, tier_bytes, tier_destroy};

}  // namespace

extern "C" __attribute__((visibility("default"))) const pi_device_api *pi_device_api_get(void) { return &kApi; }
