// The CUDA device library (pi_device.h): each layer's hot rows, attention block and KV cache, and the output head in
// device memory, each matrix in DeviceRows' layout (tier_math.h); per job a few kernels on a stream of the tier's
// own, so that a hot job runs while the engine's threads compute the cold tier. The kernels are the GPU's own
// arithmetic (docs/engine.md, "The GPU tier"):
//   quantize: a warp per 32 elements: the operand's q8_0 quants and scales (the CPU kernels' quantizer).
//   matvec:   a warp per output row and up to kTokensPerPass tokens, the lanes over the row's blocks (a q4_0
//             block's quants one 16-byte load, summed with dp4a against the operand's int8 quants), the lanes'
//             sums added by shuffles; q, k and v in one launch.
//   gate_up:  matvec's warp on a neuron's gate and up rows, lane t applies the rule for token t and writes the
//             coefficient h; where the predictor selects (a split layer), the warp first scores the neuron's fc2
//             row against the hidden layer and reads its gate and up rows only where a token of the pass selects it.
//   down:     only the neurons with h != 0 are read: a block per 1024 output columns, split of the neurons and
//             token; its warps take the split's neurons in turn, lane l adding block l of each row into 32
//             registers; the warps' sums added in shared memory, the splits' partials by down_sum, in order.
//   norm:     a block per token, its sums in double reduced in a fixed order, then the token's q8_0 form (and, for a
//             split layer, a copy of the stream's row beside the norm's, so that both go down in one copy).
//   rope:     a block per head and token: RoPE's pairs on q and k, then k and v into the layer's cache.
//   heads:    a block per head and token: a warp per position for the scores (lanes over d_head), the softmax,
//             then a thread per element of d_head summing the values position by position (coalesced reads).
//   experts:  a mixture's device experts (expert_math.h): the pairs' rows gathered (a block a pair) and quantized,
//             each expert's gate and up by matvec over its pairs' rows (one launch an expert), SiLU's products (a
//             thread an element) and their quantization, each expert's down by matvec, then a thread per output
//             element summing its token's pairs' outputs, weighted, in pair order.
// The operands go up and the outputs come back through pinned host buffers, asynchronously on the stream.
// Built with static cudart (nvcc's default): the library loads where no driver is, and says there is no device.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device/attention_math.h"
#include "device/expert_math.h"
#include "device/tier_math.h"
#include "pi_device.h"

using namespace pi;
using device::DeviceRows;
using device::kTokensPerPass;
using device::quant_bytes;

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kRowWarps = 8;        // matvec, gate_up: warps (rows) per block
constexpr int kDownWarps = 8;       // down: warps per block
constexpr int kDownTile = kWarp;    // down: blocks of 32 columns per CUDA block (a lane each)
constexpr int kNormThreads = 256;   // norm: threads per block (a power of two: the sums' tree)
constexpr int kHeadThreads = 128;   // heads: threads per block (a power of two)
constexpr int kRopeThreads = 64;
constexpr int kQuantizeWarps = 8;

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

// Tokens' operand on the device: f32 rows (read by f32 and f16 weights) and, for quantized weights, their q8_0
// form as int8 quants (row after row, 16-byte aligned) and f16 scales (a block's).
struct Operand {
    const float *x = nullptr;     // [n_tok][n]
    const int8_t *q = nullptr;    // [n_tok][n]
    const uint16_t *d = nullptr;  // [n_tok][n / QK]
    int n = 0;
};

// An operand's device memory for up to B tokens of n elements: the rows, then the quants and the scales in the
// 34 bytes a q8_0 block takes.
struct OperandBuffers {
    float *x = nullptr;
    int8_t *q = nullptr;
    uint16_t *d = nullptr;
    int n = 0;
    Operand operand() const { return Operand{x, q, d, n}; }
};

struct Counters {
    unsigned long long active, computed, read;  // neurons passing the rule, computed, rows whose gate/up were read
};
static_assert(sizeof(Counters) == device::kJobCountersBytes, "the counters' bytes the traffic counts");

// A layer's hot rows on the device.
struct LayerRows {
    bool uploaded = false;
    DeviceRows gate, up, down;
    const float *gate_b = nullptr, *up_b = nullptr;
    float threshold = 0;
    uint8_t *block = nullptr;  // one allocation: gate, up, down_t rows, then the biases
    device::LayerLayout layout{pi_device_layer{}, 0, false};
};

__device__ inline float warp_sum(float v) {
    for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(kFull, v, off);
    return v;
}

// The 8 nibbles of a 4-byte word of q4_0 quants, less 8, as two words of signed bytes: the low nibbles (elements
// j..j+3 of the block) and the high ones (elements j+16..j+19).
__device__ inline int q4_low(int w) { return __vsub4(w & 0x0f0f0f0f, 0x08080808); }
__device__ inline int q4_high(int w) { return __vsub4((w >> 4) & 0x0f0f0f0f, 0x08080808); }

// An f16 value (its bits) as a float: the device's conversion instruction (exact, as format/types.h's).
__device__ inline float half_bits(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
__device__ inline float scale_of(const DeviceRows &m, int64_t r, int64_t k) {
    return half_bits(__ldg(reinterpret_cast<const unsigned short *>(m.data + m.rows * m.blocks() * quant_bytes(m.type)) +
                           r * m.blocks() + k));
}

// Blocks a lane loads before it computes with them: the loads of a row in flight together.
constexpr int kLoadsAhead = 4;

// Lane `lane`'s share of row r of m times tokens t0 .. t0 + n_t - 1 (n_t <= NT) into sum[], the warp's lanes' shares
// then added (every lane receives the sums). NT: 1 for a decode step (fewer registers, more warps in flight),
// kTokensPerPass for a batch.
template <int NT>
__device__ inline void row_dots(const DeviceRows &m, int64_t r, const Operand &in, int t0, int n_t, int lane,
                                float (&sum)[NT]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) sum[t] = 0.0f;
    const int nb = int(m.blocks());
    if (m.type == TYPE_Q4_0 || m.type == TYPE_Q8_0) {
        const bool q4 = m.type == TYPE_Q4_0;
        for (int k0 = lane; k0 < nb; k0 += kWarp * kLoadsAhead) {
            int4 lo[kLoadsAhead], hi[kLoadsAhead];
            float dw[kLoadsAhead];
#pragma unroll
            for (int u = 0; u < kLoadsAhead; ++u) {
                const int k = k0 + u * kWarp;
                if (k >= nb) break;
                const int4 *q = reinterpret_cast<const int4 *>(m.quants(r, k));
                lo[u] = __ldg(q);
                if (!q4) hi[u] = __ldg(q + 1);
                dw[u] = scale_of(m, r, k);
            }
#pragma unroll
            for (int u = 0; u < kLoadsAhead; ++u) {
                const int k = k0 + u * kWarp;
                if (k >= nb) break;
                int w[8];
                if (q4) {
                    w[0] = q4_low(lo[u].x), w[1] = q4_low(lo[u].y), w[2] = q4_low(lo[u].z), w[3] = q4_low(lo[u].w);
                    w[4] = q4_high(lo[u].x), w[5] = q4_high(lo[u].y), w[6] = q4_high(lo[u].z), w[7] = q4_high(lo[u].w);
                } else {
                    w[0] = lo[u].x, w[1] = lo[u].y, w[2] = lo[u].z, w[3] = lo[u].w;
                    w[4] = hi[u].x, w[5] = hi[u].y, w[6] = hi[u].z, w[7] = hi[u].w;
                }
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t >= n_t) break;
                    const size_t row = size_t(t0 + t);
                    const int4 *xv = reinterpret_cast<const int4 *>(in.q + row * in.n + size_t(k) * QK);
                    const int4 a = xv[0], b = xv[1];
                    int s = __dp4a(w[0], a.x, 0);
                    s = __dp4a(w[1], a.y, s), s = __dp4a(w[2], a.z, s), s = __dp4a(w[3], a.w, s);
                    s = __dp4a(w[4], b.x, s), s = __dp4a(w[5], b.y, s), s = __dp4a(w[6], b.z, s), s = __dp4a(w[7], b.w, s);
                    sum[t] += dw[u] * half_bits(in.d[row * (in.n / QK) + k]) * float(s);
                }
            }
        }
    } else if (m.type == TYPE_F16) {
        const uint16_t *w_row = reinterpret_cast<const uint16_t *>(m.row(r));
        for (int i = lane * 8; i < m.cols; i += kWarp * 8) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4 *>(w_row + i));
            const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
            float w[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                w[2 * j] = half_bits(uint16_t(words[j] & 0xffff));
                w[2 * j + 1] = half_bits(uint16_t(words[j] >> 16));
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t >= n_t) break;
                const float4 *xv = reinterpret_cast<const float4 *>(in.x + size_t(t0 + t) * in.n + i);
                const float4 a = xv[0], b = xv[1];
                sum[t] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
            }
        }
    } else {  // f32
        const float *w_row = reinterpret_cast<const float *>(m.row(r));
        for (int i = lane * 4; i < m.cols; i += kWarp * 4) {
            const float4 w = __ldg(reinterpret_cast<const float4 *>(w_row + i));
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t >= n_t) break;
                const float4 a = *reinterpret_cast<const float4 *>(in.x + size_t(t0 + t) * in.n + i);
                sum[t] += w.x * a.x + w.y * a.y + w.z * a.z + w.w * a.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) sum[t] = warp_sum(sum[t]);
}

// The q8_0 form of n_blocks blocks of 32 floats (a warp a block); block 0's first thread clears `zero` (the job's
// counters) on the way.
__global__ void quantize_kernel(const float *x, int64_t n_blocks, int8_t *q, uint16_t *d, Counters *zero) {
    if (zero && blockIdx.x == 0 && threadIdx.x == 0) *zero = Counters{0, 0, 0};
    const int lane = threadIdx.x % kWarp;
    const int64_t b = int64_t(blockIdx.x) * kQuantizeWarps + threadIdx.x / kWarp;
    if (b >= n_blocks) return;
    const float v = x[b * QK + lane];
    float amax = fabsf(v);
    for (int off = kWarp / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
    const float scale = amax / 127.0f;  // as attention_math.h's quantize_block, element by element
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const float r = roundf(v * inv);
    q[b * QK + lane] = (r >= -127.0f && r <= 127.0f) ? int8_t(r) : int8_t(0);
    if (lane == 0) d[b] = f32_to_f16(scale);
}

// Up to three projections in one launch (q, k and v): y_i[t][r] = m_i's row r . x[t] + bias_i[r].
struct Projection {
    DeviceRows m;
    const float *bias;
    float *y;
    bool accumulate = false;  // y += the projection (the residual stream), instead of y =
    bool relu = false;        // max(0, the projection) (the predictor's hidden layer)
};
struct Projections {
    Projection p[3];
    int count;
    int first_block[4];  // the launch's blocks: projection i takes [first_block[i], first_block[i + 1])
};

template <int NT>
__global__ void matvec_kernel(Projections P, Operand in, int n_tok) {
    int i = 0;
    while (i + 1 < P.count && int(blockIdx.x) >= P.first_block[i + 1]) ++i;
    const Projection &pr = P.p[i];
    const int lane = threadIdx.x % kWarp;
    const int64_t r = int64_t(blockIdx.x - P.first_block[i]) * kRowWarps + threadIdx.x / kWarp;
    if (r >= pr.m.rows) return;
    const int t0 = blockIdx.y * NT, n_t = min(NT, n_tok - t0);
    float sum[NT];
    row_dots<NT>(pr.m, r, in, t0, n_t, lane, sum);
    if (lane < n_t) {  // lane t writes token t0 + t's
        float v = sum[0];
#pragma unroll
        for (int t = 1; t < NT; ++t)
            if (lane == t) v = sum[t];
        float &y = pr.y[size_t(t0 + lane) * pr.m.rows + r];
        const float p = v + (pr.bias ? pr.bias[r] : 0.0f);
        y = (pr.accumulate ? y : 0.0f) + (pr.relu ? fmaxf(p, 0.0f) : p);
    }
}

// A split layer's selection of its hot rows by the layer's predictor (PI_DEVICE_HOT_PREDICTOR): fc2's hot rows and
// the hidden layer relu(fc1 x) as their operand; `on` 0 selects every row.
struct HotSelect {
    DeviceRows fc2;
    Operand hid;
    float threshold = 0;
    int on = 0;
};

template <int NT>
__global__ void gate_up_kernel(LayerRows L, device::Rule rule, Operand in, int n_tok, int dense, HotSelect sel,
                               float *h, int ld_h, Counters *counts) {
    __shared__ unsigned int block_active, block_computed, block_read;
    if (threadIdx.x == 0) block_active = block_computed = block_read = 0;
    __syncthreads();
    const int lane = threadIdx.x % kWarp;
    const int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
    const int t0 = blockIdx.y * NT, n_t = min(NT, n_tok - t0);
    if (r < L.gate.rows) {
        bool chosen[NT];
        bool any = true;
        if (sel.on) {  // every lane holds the same sums (warp_sum's butterfly): `any` is the warp's
            float logit[NT];
            row_dots<NT>(sel.fc2, r, sel.hid, t0, n_t, lane, logit);
            any = false;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                chosen[t] = t < n_t && logit[t] > sel.threshold;
                any = any || chosen[t];
            }
        } else {
#pragma unroll
            for (int t = 0; t < NT; ++t) chosen[t] = true;
        }
        float g[NT], u[NT];
        if (any) {
            row_dots<NT>(L.gate, r, in, t0, n_t, lane, g);
            if (rule.gated) row_dots<NT>(L.up, r, in, t0, n_t, lane, u);
            if (lane == 0) atomicAdd(&block_read, 1u);
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t >= n_t || lane != t) continue;  // lane t applies the rule for token t0 + t
            if (!any || !chosen[t]) {
                h[size_t(t0 + t) * ld_h + r] = 0.0f;
                continue;
            }
            bool pass;
            const float c = rule.coefficient(g[t], rule.gated ? u[t] : 0.0f, L.gate_b ? L.gate_b[r] : 0.0f,
                                             L.up_b ? L.up_b[r] : 0.0f, dense != 0, &pass);
            h[size_t(t0 + t) * ld_h + r] = c;
            if (pass) atomicAdd(&block_active, 1u);
            if (dense || pass) atomicAdd(&block_computed, 1u);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(&counts->active, (unsigned long long)block_active);
        atomicAdd(&counts->computed, (unsigned long long)block_computed);
        atomicAdd(&counts->read, (unsigned long long)block_read);
    }
}

// Block k of row r's 32 values into w (raw words: 4 for q4_0, 8 for q8_0, 16 for f16, 32 for f32) and its scale.
struct BlockWords {
    int w[QK];
    float d;
};
__device__ inline void load_block(const DeviceRows &m, int64_t r, int64_t k, BlockWords &b) {
    if (m.type == TYPE_Q4_0 || m.type == TYPE_Q8_0) {
        const int4 *q = reinterpret_cast<const int4 *>(m.quants(r, k));
        const int4 a = __ldg(q);
        b.w[0] = a.x, b.w[1] = a.y, b.w[2] = a.z, b.w[3] = a.w;
        if (m.type == TYPE_Q8_0) {
            const int4 c = __ldg(q + 1);
            b.w[4] = c.x, b.w[5] = c.y, b.w[6] = c.z, b.w[7] = c.w;
        }
        b.d = scale_of(m, r, k);
    } else {
        const int words = m.type == TYPE_F16 ? 16 : 32;
        const int4 *p = reinterpret_cast<const int4 *>(m.row(r) + k * QK * (m.type == TYPE_F16 ? 2 : 4));
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            if (v * 4 >= words) break;
            const int4 a = __ldg(p + v);
            b.w[4 * v] = a.x, b.w[4 * v + 1] = a.y, b.w[4 * v + 2] = a.z, b.w[4 * v + 3] = a.w;
        }
        b.d = 1.0f;
    }
}

// acc[j] += c * element j of a loaded block.
__device__ inline void add_block(uint32_t type, const BlockWords &b, float c, float (&acc)[QK]) {
    const float cd = c * b.d;
    if (type == TYPE_Q4_0) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int byte = (b.w[j / 4] >> (8 * (j % 4))) & 0xff;
            acc[j] += cd * float((byte & 0x0f) - 8);
            acc[j + 16] += cd * float((byte >> 4) - 8);
        }
    } else if (type == TYPE_Q8_0) {
#pragma unroll
        for (int j = 0; j < QK; ++j) acc[j] += cd * float(int8_t((b.w[j / 4] >> (8 * (j % 4))) & 0xff));
    } else if (type == TYPE_F16) {
#pragma unroll
        for (int j = 0; j < QK; ++j) acc[j] += c * half_bits(uint16_t(uint32_t(b.w[j / 2]) >> (16 * (j % 2))));
    } else {
#pragma unroll
        for (int j = 0; j < QK; ++j) acc[j] += c * __int_as_float(b.w[j]);
    }
}

// Neurons a down warp loads before it adds them.
constexpr int kDownAhead = 2;

// Token blockIdx.z's down projection over split blockIdx.y of the neurons (every splits-th group of kDownWarps
// rows), for the 32 blocks of columns of tile blockIdx.x: into out[(t * splits + split) * n_embd + column]. A
// warp reads the coefficients of 32 of its rows at once (a lane each), and takes the nonzero ones in order,
// kDownAhead rows' blocks loaded before they are added.
__global__ void down_kernel(DeviceRows down, const float *h, int ld_h, int splits, float *out) {
    __shared__ float part[kDownWarps][kWarp][QK + 1];
    const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp, split = blockIdx.y, t = blockIdx.z;
    const int64_t nb = down.blocks(), k = int64_t(blockIdx.x) * kDownTile + lane, E = down.cols;
    const bool has_block = k < nb;
    const float *ht = h + size_t(t) * ld_h;
    const int64_t stride = int64_t(splits) * kDownWarps;
    float acc[QK];
#pragma unroll
    for (int j = 0; j < QK; ++j) acc[j] = 0.0f;
    for (int64_t base = int64_t(split) * kDownWarps + w; base < down.rows; base += stride * kWarp) {
        const int64_t mine = base + lane * stride;  // lane j: the chunk's j-th row of this warp
        const float c_mine = mine < down.rows ? ht[mine] : 0.0f;
        unsigned live = __ballot_sync(kFull, c_mine != 0.0f);
        while (live) {
            int src[kDownAhead];
            int n = 0;
            for (; n < kDownAhead && live; ++n) {
                src[n] = __ffs(live) - 1;
                live &= live - 1;
            }
            BlockWords blocks[kDownAhead];
            float c[kDownAhead];
#pragma unroll
            for (int u = 0; u < kDownAhead; ++u) {
                if (u >= n) break;
                c[u] = __shfl_sync(kFull, c_mine, src[u]);
                if (has_block) load_block(down, base + src[u] * stride, k, blocks[u]);
            }
#pragma unroll
            for (int u = 0; u < kDownAhead; ++u) {
                if (u >= n) break;
                if (has_block) add_block(down.type, blocks[u], c[u], acc);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < QK; ++j) part[w][lane][j] = acc[j];
    __syncthreads();
    float *o = out + (size_t(t) * splits + split) * E;
    for (int c = threadIdx.x; c < kDownTile * QK; c += blockDim.x) {
        const int l = c / QK, j = c % QK;
        const int64_t col = (int64_t(blockIdx.x) * kDownTile + l) * QK + j;
        if (col >= E) continue;
        float s = 0.0f;
        for (int v = 0; v < kDownWarps; ++v) s += part[v][l][j];
        o[col] = s;
    }
}

// y[t][c] = the splits' partials of token t summed in order (accumulate: y[t][c] += that sum, the residual stream;
// add: plus add[t][c], a split layer's cold tier's output).
__global__ void down_sum_kernel(const float *partial, int n_tok, int splits, int n_embd, float *y, bool accumulate,
                                const float *add) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= int64_t(n_tok) * n_embd) return;
    const int64_t t = i / n_embd, c = i % n_embd;
    float s = 0.0f;
    for (int v = 0; v < splits; ++v) s += partial[(t * splits + v) * n_embd + c];
    y[i] = (accumulate ? y[i] : 0.0f) + (add ? s + add[i] : s);
}

// The token's sum of v over [0, n) by the block's threads, in double, reduced in a fixed order: each warp's by
// shuffles, then the warps' sums in order by every thread (two barriers, not one per level of a tree).
template <class F>
__device__ double block_sum(int n, F v, double *shared) {
    double acc = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += v(i);
    for (int off = kWarp / 2; off > 0; off /= 2) acc += __shfl_xor_sync(kFull, acc, off);
    if (threadIdx.x % kWarp == 0) shared[threadIdx.x / kWarp] = acc;
    __syncthreads();
    double sum = 0;
    for (int w = 0; w < int(blockDim.x) / kWarp; ++w) sum += shared[w];
    __syncthreads();
    return sum;
}

// Token blockIdx.x's norm into out.x, and its q8_0 form where out.q is set; `zero` (a job's counters) cleared; the
// token's row of x copied into `copy` where set.
__global__ void norm_kernel(const float *x, const float *w, const float *b, int kind, float eps, OperandBuffers out,
                            Counters *zero, float *copy) {
    __shared__ double shared[kNormThreads / kWarp];
    if (zero && blockIdx.x == 0 && threadIdx.x == 0) *zero = Counters{0, 0, 0};
    const int n = out.n;
    const float *xt = x + size_t(blockIdx.x) * n;
    float *ot = out.x + size_t(blockIdx.x) * n;
    if (copy)
        for (int i = threadIdx.x; i < n; i += blockDim.x) copy[size_t(blockIdx.x) * n + i] = xt[i];
    const double mean =
        kind == PI_DEVICE_NORM_LAYER ? block_sum(n, [&](int i) { return double(xt[i]); }, shared) / double(n) : 0.0;
    const double ss = block_sum(n, [&](int i) { return (double(xt[i]) - mean) * (double(xt[i]) - mean); }, shared);
    const float scale = device::norm_scale(ss, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) ot[i] = device::norm_element(kind, xt[i], mean, scale, w[i], b ? b[i] : 0.0f);
    __syncthreads();  // the row's elements written, and seen by the block's threads, before its blocks are made
    if (!out.q) return;
    // a warp a block, a lane an element: quantize_kernel's (attention_math.h's quantize_block, element by element)
    const int lane = threadIdx.x % kWarp;
    for (int k = threadIdx.x / kWarp; k < n / QK; k += int(blockDim.x) / kWarp) {
        const float v = ot[k * QK + lane];
        float amax = fabsf(v);
        for (int off = kWarp / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
        const float scale = amax / 127.0f;
        const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        const float r = roundf(v * inv);
        out.q[size_t(blockIdx.x) * n + size_t(k) * QK + lane] = (r >= -127.0f && r <= 127.0f) ? int8_t(r) : int8_t(0);
        if (lane == 0) out.d[size_t(blockIdx.x) * (n / QK) + k] = f32_to_f16(scale);
    }
}

// Head blockIdx.x of token blockIdx.y (query heads, then key heads): RoPE's pairs, then for a key head its key and
// value into the layer's cache at position n_past + t.
__global__ void rope_store_kernel(pi_device_tier_desc d, int n_past, float *q, float *k, const float *v,
                                  const float *rope_cos, const float *rope_sin, uint8_t *k_cache, uint8_t *v_cache) {
    const int j = blockIdx.x, t = blockIdx.y, D = d.d_head, half = d.n_rot / 2;
    const int64_t pos = n_past + t;
    const bool is_key = j >= d.n_head;
    const int h = is_key ? j - d.n_head : j;
    float *vec = is_key ? k + (size_t(t) * d.n_head_kv + h) * D : q + (size_t(t) * d.n_head + h) * D;
    if (d.rope != PI_DEVICE_ROPE_NONE)
        for (int i = threadIdx.x; i < half; i += blockDim.x) {  // the pairs are disjoint
            int64_t i0, i1;
            device::rope_pair(d.rope, i, half, &i0, &i1);
            device::rotate(vec, i0, i1, rope_cos[pos * half + i], rope_sin[pos * half + i]);
        }
    if (!is_key) return;
    __syncthreads();
    const float *vt = v + (size_t(t) * d.n_head_kv + h) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        device::kv_put(k_cache, d.kv_f16 != 0, device::kv_index(d, pos, h, i), vec[i]);
        device::kv_put(v_cache, d.kv_f16 != 0, device::kv_index(d, pos, h, i), vt[i]);
    }
}

// The block's max (op fmaxf) or sum of v, every thread receiving it.
template <bool kMax>
__device__ float block_reduce(float v, float *shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w)
            shared[threadIdx.x] = kMax ? fmaxf(shared[threadIdx.x], shared[threadIdx.x + w]) : shared[threadIdx.x] + shared[threadIdx.x + w];
        __syncthreads();
    }
    const float r = shared[0];
    __syncthreads();
    return r;
}

// Head blockIdx.x of token blockIdx.y over positions 0 .. n_past + t: scores into its row of `scores` (a warp per
// position, its lanes over d_head), the softmax (max, e^(s - max) by exp_ref, their sum), then each output element
// as the weighted sum of the values (a thread per element, positions in order).
__global__ void heads_kernel(pi_device_tier_desc d, int n_past, const float *q, const uint8_t *k_cache,
                             const uint8_t *v_cache, float *scores, float *att) {
    __shared__ float reduce[kHeadThreads];
    const int h = blockIdx.x, t = blockIdx.y, D = d.d_head, kvh = h / (d.n_head / d.n_head_kv);
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
    const int n_keys = n_past + t + 1;
    const bool f16 = d.kv_f16 != 0;
    const float *qh = q + (size_t(t) * d.n_head + h) * D;
    float *sc = scores + (size_t(t) * d.n_head + h) * d.n_ctx;
    const float inv_sqrt_d = 1.0f / sqrtf(float(D));
    for (int p = warp; p < n_keys; p += n_warps) {
        float s = 0;
        for (int i = lane; i < D; i += kWarp) s += qh[i] * device::kv_get(k_cache, f16, device::kv_index(d, p, kvh, i));
        s = warp_sum(s);
        if (lane == 0) sc[p] = s * inv_sqrt_d;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int p = threadIdx.x; p < n_keys; p += blockDim.x) mx = fmaxf(mx, sc[p]);
    mx = block_reduce<true>(mx, reduce);
    float sum = 0;
    for (int p = threadIdx.x; p < n_keys; p += blockDim.x) sum += (sc[p] = exp_ref(sc[p] - mx));
    sum = block_reduce<false>(sum, reduce);  // its barriers also order the exponentials' stores before the reads
    const float inv_sum = 1.0f / sum;
    float *out = att + (size_t(t) * d.n_head + h) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float acc = 0;
#pragma unroll 8
        for (int p = 0; p < n_keys; ++p) acc += sc[p] * device::kv_get(v_cache, f16, device::kv_index(d, p, kvh, i));
        out[i] = acc * inv_sum;
    }
}

// The pairs' rows: row p of xg = row token[p] of x (n floats a row), a block a pair.
__global__ void gather_kernel(const float *x, const int32_t *token, int n, float *xg) {
    const int64_t p = blockIdx.x;
    const float *src = x + int64_t(token[p]) * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) xg[p * n + i] = src[i];
}

// SiLU's gated products h = silu(g) * u over n elements (exp_ref.h's silu, as the CPU's kernels).
__global__ void silu_mul_kernel(const float *g, const float *u, int64_t n, float *h) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) h[i] = silu_ref(g[i]) * u[i];
}

// y[t][c] = the sum over token t's pairs (list[first[t]] .. list[first[t + 1] - 1], in pair order) of weight * o.
__global__ void weighted_sum_kernel(const float *o, const int32_t *first, const int32_t *list, const float *weight,
                                    int n_tok, int n_embd, float *y) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= int64_t(n_tok) * n_embd) return;
    const int64_t t = i / n_embd, c = i % n_embd;
    float s = 0.0f;
    for (int q = first[t]; q < first[t + 1]; ++q) s += weight[list[q]] * o[int64_t(list[q]) * n_embd + c];
    y[i] = s;
}

// Where jobs' device time goes, step by step, when the environment's PI_CUDA_STEP_TIMES names a file: an event
// after each step (a copy, a kernel) on the stream, the intervals added per step once the job is waited for, and
// appended to that file as one line per step when the tier is destroyed. Unset, it records nothing.
struct StepTimes {
    std::string path;
    cudaEvent_t start = nullptr;
    std::vector<cudaEvent_t> events;
    std::vector<const char *> names;
    size_t used = 0;
    std::vector<std::pair<std::string, std::pair<double, long>>> totals;  // step: milliseconds, times
    bool batch = false;  // the job's steps are a batch's ("batch " before their names), not a decode step's

    // A job's first step follows: timed from here, unless an unfinished chain of layer jobs is being timed.
    void begin(cudaStream_t s, int n_tok) {
        if (path.empty() || used > 0) return;
        if (!start && cudaEventCreate(&start) != cudaSuccess) return;
        batch = n_tok > 1;
        cudaEventRecord(start, s);
    }

    void mark(cudaStream_t s, const char *name) {
        if (path.empty()) return;
        if (used == events.size()) {
            cudaEvent_t e;
            if (cudaEventCreate(&e) != cudaSuccess) return;
            events.push_back(e);
            names.push_back(name);
        }
        names[used] = name;
        cudaEventRecord(events[used++], s);
    }
    // After the job's last event: each step's interval from the one before (the first's from begin's).
    void collect() {
        cudaEvent_t prev = start;
        for (size_t i = 0; i < used; ++i) {
            float ms = 0;
            if (cudaEventElapsedTime(&ms, prev, events[i]) == cudaSuccess) add((batch ? "batch " : "") + std::string(names[i]), ms);
            prev = events[i];
        }
        used = 0;
    }
    void add(const std::string &name, double ms) {
        for (auto &entry : totals)
            if (entry.first == name) {
                entry.second.first += ms;
                entry.second.second += 1;
                return;
            }
        totals.push_back({name, {ms, 1}});
    }
    void write_and_release() {
        if (!path.empty() && !totals.empty())
            if (FILE *f = std::fopen(path.c_str(), "a")) {
                for (const auto &entry : totals)
                    std::fprintf(f, "%s\t%ld\t%.3f\n", entry.first.c_str(), entry.second.second, entry.second.first * 1e3);
                std::fclose(f);
            }
        for (cudaEvent_t e : events) cudaEventDestroy(e);
        events.clear();
        if (start) cudaEventDestroy(start);
    }
};

// A whole or split layer's job whose counts come down with its chain's end (pi_device_layer_job,
// pi_device_split_job), and the event after its kernels.
struct ChainLayer {
    int32_t layer, n_tok, n_past;
    bool x_in, x_out;
    bool split, predicted;  // a split layer's; its hot rows selected by its predictor
    pi_device_counts *counts;
    cudaEvent_t done;
};

// A layer's predictor on the device (pi_device_predictor): fc1 and the hot rows' fc2 in one allocation with the
// hidden layer's scratch (attention_math.h's PredictorLayout).
struct PredictorLayer {
    bool uploaded = false;
    uint8_t *block = nullptr;
    pi_device_predictor view{};
    OperandBuffers hid;
};

// A mixture's expert on the device: its gate, up and down in one allocation (expert_math.h's ExpertLayout).
struct ExpertBlock {
    bool uploaded = false;
    uint8_t *block = nullptr;
    pi_device_expert view{};
};

struct AttentionLayer {
    bool uploaded = false;
    uint8_t *block = nullptr;  // one allocation: the norm, the matrices and biases, the KV cache
    pi_device_attention view{};
    uint8_t *k_cache = nullptr, *v_cache = nullptr;
};

// The launch of up to three projections over n_tok tokens of `in`.
void launch_matvec(cudaStream_t s, std::initializer_list<Projection> list, const Operand &in, int n_tok) {
    Projections P{};
    P.count = 0;
    P.first_block[0] = 0;
    for (const Projection &p : list) {
        P.p[P.count] = p;
        P.first_block[P.count + 1] = P.first_block[P.count] + int((p.m.rows + kRowWarps - 1) / kRowWarps);
        ++P.count;
    }
    const dim3 grid(unsigned(P.first_block[P.count]), unsigned(device::passes(n_tok)));
    if (n_tok == 1) matvec_kernel<1><<<grid, kRowWarps * kWarp, 0, s>>>(P, in, n_tok);
    else matvec_kernel<kTokensPerPass><<<grid, kRowWarps * kWarp, 0, s>>>(P, in, n_tok);
}

// The q8_0 form of n_tok rows of b's f32 rows (and the counters cleared, where given).
void launch_quantize(cudaStream_t s, const OperandBuffers &b, int n_tok, Counters *zero) {
    const int64_t n_blocks = int64_t(n_tok) * (b.n / QK);
    const unsigned grid = unsigned((n_blocks + kQuantizeWarps - 1) / kQuantizeWarps);
    quantize_kernel<<<grid, kQuantizeWarps * kWarp, 0, s>>>(b.x, n_blocks, b.q, b.d, zero);
}

}  // namespace

struct pi_device_tier {
    pi_device_tier_desc desc{};
    std::vector<LayerRows> layers;
    cudaStream_t stream = nullptr;
    cudaEvent_t started = nullptr, finished = nullptr;
    uint64_t bytes = 0;
    int32_t max_rows = 0;
    // the hot tier's scratch: the operand (whose rows take the down projection's partials once read), the
    // counters then the output rows in one allocation (one copy back), the coefficients
    OperandBuffers hot_in;
    uint8_t *d_out = nullptr;
    float *d_h = nullptr;
    // pinned host staging
    float *p_x = nullptr;
    uint8_t *p_out = nullptr;
    // attention: the layers' blocks, RoPE's tables (on the host until the first layer's upload), the scratch
    // (attention_math.h's attention_scratch_bytes) and its pinned staging, allocated with the first layer
    std::vector<AttentionLayer> attention;
    std::vector<float> rope_cos, rope_sin;
    float *d_rope_cos = nullptr, *d_rope_sin = nullptr;
    float *d_ax = nullptr, *d_q = nullptr, *d_k = nullptr, *d_v = nullptr, *d_aout = nullptr, *d_scores = nullptr;
    OperandBuffers axn, att;
    float *p_ax = nullptr, *p_aout = nullptr;
    // a split layer's: its FFN norm's rows then the stream's (the one copy down), the cold tier's output (the one
    // copy up), their pinned staging; its predictors; the split begun and not yet ended
    float *d_split = nullptr, *d_cold = nullptr, *p_split = nullptr, *p_cold = nullptr;
    std::vector<PredictorLayer> predictors;
    bool split_pending = false;
    pi_device_split_job split{};
    int split_parts = 1;  // the begun split's down partials, summed by split_end
    cudaEvent_t split_down = nullptr;
    bool attention_ready = false;
    // the output head: its block, its view, its scratch (attention_math.h's head_scratch_bytes) and staging
    uint8_t *head_block = nullptr;
    pi_device_head head_view{};
    float *d_hx = nullptr, *d_logits = nullptr, *p_hx = nullptr, *p_logits = nullptr;
    OperandBuffers hxn;
    std::vector<void *> device_allocations;
    StepTimes steps;
    // layer_run's stream (d_ax holds it once a layer job ran, until an attention job takes d_ax), and the chain of
    // layer jobs since the last whose stream came back (their counters in d_out's rows, a slot a layer)
    bool stream_ready = false;
    std::vector<ChainLayer> chain;
    std::vector<cudaEvent_t> chain_events;
    cudaEvent_t chain_start = nullptr;
    // a mixture's device experts ([layer * n_expert + expert]) and their scratch (expert_math.h's
    // experts_scratch_bytes), allocated with the first: the tokens' rows then the pairs' arrays (one copy up), the
    // gathered rows, gate's and up's outputs, h, the pairs' outputs, y; pinned staging for the copy up and y
    std::vector<ExpertBlock> experts;
    uint8_t *d_ex_in = nullptr, *p_ex_in = nullptr;
    OperandBuffers ex_xg, ex_h;
    float *d_ex_g = nullptr, *d_ex_u = nullptr, *d_ex_o = nullptr, *d_ex_y = nullptr, *p_ex_y = nullptr;
    bool experts_pending = false;
    pi_device_experts_job experts_job{};
    // the job in flight
    bool pending = false;
    pi_device_job job{};
    double h2d = 0, d2h = 0;

    size_t x_bytes() const { return size_t(desc.n_batch) * desc.n_embd * sizeof(float); }

    int32_t allocate(void **p, size_t n, const char *what, char *err, size_t len) {
        if (failed(cudaMalloc(p, n), what, err, len)) return 1;
        device_allocations.push_back(*p);
        bytes += n;
        return 0;
    }
    // The experts' scratch (expert_math.h's experts_scratch_bytes) and its pinned staging.
    int32_t experts_scratch(char *err, size_t len) {
        const size_t B = size_t(desc.n_batch), P = B * size_t(desc.n_expert_used), E = size_t(desc.n_embd),
                     F = size_t(desc.n_ff_expert), in = B * E * 4 + 4 * (3 * P + B + 1);
        return allocate(reinterpret_cast<void **>(&d_ex_in), in, "allocating the experts' input", err, len) ||
               allocate_operand(&ex_xg, int(E), "allocating the experts' rows", err, len, P) ||
               allocate(reinterpret_cast<void **>(&d_ex_g), P * F * 4, "allocating the experts' gates", err, len) ||
               allocate(reinterpret_cast<void **>(&d_ex_u), P * F * 4, "allocating the experts' ups", err, len) ||
               allocate_operand(&ex_h, int(F), "allocating the experts' products", err, len, P) ||
               allocate(reinterpret_cast<void **>(&d_ex_o), P * E * 4, "allocating the experts' outputs", err, len) ||
               allocate(reinterpret_cast<void **>(&d_ex_y), B * E * 4, "allocating the experts' sums", err, len) ||
               failed(cudaMallocHost(&p_ex_in, in), "allocating pinned memory", err, len) ||
               failed(cudaMallocHost(&p_ex_y, B * E * 4), "allocating pinned memory", err, len);
    }
    // An operand's buffers for n_batch rows of n elements: the rows, their quants and scales in one allocation.
    int32_t allocate_operand(OperandBuffers *b, int n, const char *what, char *err, size_t len, size_t n_rows = 0) {
        const size_t B = n_rows ? n_rows : size_t(desc.n_batch), rows = B * n * sizeof(float), quants = B * n, scales = B * (n / QK) * 2;
        uint8_t *p = nullptr;
        if (allocate(reinterpret_cast<void **>(&p), rows + quants + scales, what, err, len)) return 1;
        *b = OperandBuffers{reinterpret_cast<float *>(p), reinterpret_cast<int8_t *>(p + rows),
                            reinterpret_cast<uint16_t *>(p + rows + quants), n};
        return 0;
    }

    // A synchronous job's start (attention's, the head's, a chain of layer jobs'): the started event, and n_tok rows
    // x up through the pinned p_x into d_x where x is given.
    int32_t start_job(const float *x, int n_tok, float *p_x, float *d_x, char *err, size_t len) {
        steps.begin(stream, n_tok);
        if (failed(cudaEventRecord(started, stream), "recording an event", err, len)) return 1;
        if (!x) return 0;
        const size_t x_bytes = size_t(n_tok) * desc.n_embd * sizeof(float);
        std::memcpy(p_x, x, x_bytes);
        if (failed(cudaMemcpyAsync(d_x, p_x, x_bytes, cudaMemcpyHostToDevice, stream), "copying the input", err, len))
            return 1;
        steps.mark(stream, "h2d");
        return 0;
    }
    // n_tok rows of d_x normed (w, b) into out, with their q8_0 form where q8; `zero` cleared on the way.
    void normalize(const float *d_x, int n_tok, const float *w, const float *b, OperandBuffers out, bool q8,
                   Counters *zero, const char *step, float *copy = nullptr) {
        if (!q8) out.q = nullptr;
        norm_kernel<<<n_tok, kNormThreads, 0, stream>>>(d_x, w, b, desc.norm, desc.norm_eps, out, zero, copy);
        steps.mark(stream, step);
    }
    // A layer's attention block over n_tok rows of the stream d_x at positions n_past..: its output into y (or
    // added to it: the stream itself).
    void attend(const AttentionLayer &A, int n_tok, int n_past, const float *d_x, float *y, bool accumulate) {
        const pi_device_tier_desc &d = desc;
        const pi_device_attention &a = A.view;
        const bool q8_in = device::quantized(a.q) || device::quantized(a.k) || device::quantized(a.v);
        cudaStream_t s = stream;
        normalize(d_x, n_tok, a.norm_w, a.norm_b, axn, q8_in, nullptr, "norm");
        launch_matvec(s,
                      {Projection{device::device_rows(a.q), a.q.bias, d_q}, Projection{device::device_rows(a.k), a.k.bias, d_k},
                       Projection{device::device_rows(a.v), a.v.bias, d_v}},
                      axn.operand(), n_tok);
        steps.mark(s, "qkv");
        rope_store_kernel<<<dim3(d.n_head + d.n_head_kv, n_tok), kRopeThreads, 0, s>>>(
            d, n_past, d_q, d_k, d_v, d_rope_cos, d_rope_sin, A.k_cache, A.v_cache);
        steps.mark(s, "rope");
        heads_kernel<<<dim3(d.n_head, n_tok), kHeadThreads, 0, s>>>(d, n_past, d_q, A.k_cache, A.v_cache, d_scores, att.x);
        steps.mark(s, "heads");
        if (device::quantized(a.o)) {
            launch_quantize(s, att, n_tok, nullptr);
            steps.mark(s, "quantize_att");
        }
        launch_matvec(s, {Projection{device::device_rows(a.o), a.o.bias, y, accumulate}}, att.operand(), n_tok);
        steps.mark(s, "o");
    }

    Counters *layer_counters() const { return reinterpret_cast<Counters *>(d_out + sizeof(Counters)); }

    // The hot rows over the operand `in` (made by now, with `counts` cleared): gate_up (the rows `sel` selects),
    // then down over the neurons with h != 0 into `out`, in `splits` partials (down_splits).
    void hot_rows(const LayerRows &L, const Operand &in, int n_tok, int dense, const HotSelect &sel, Counters *counts,
                  int splits, float *out) {
        const device::Rule rule{desc.activation, desc.gated, L.threshold};
        cudaStream_t s = stream;
        const dim3 gate_grid(unsigned((L.gate.rows + kRowWarps - 1) / kRowWarps), unsigned(device::passes(n_tok)));
        if (n_tok == 1)
            gate_up_kernel<1><<<gate_grid, kRowWarps * kWarp, 0, s>>>(L, rule, in, n_tok, dense, sel, d_h, max_rows, counts);
        else
            gate_up_kernel<kTokensPerPass><<<gate_grid, kRowWarps * kWarp, 0, s>>>(L, rule, in, n_tok, dense, sel, d_h,
                                                                                    max_rows, counts);
        steps.mark(s, "gate_up");
        const dim3 down_grid(unsigned((L.down.blocks() + kDownTile - 1) / kDownTile), unsigned(splits), unsigned(n_tok));
        down_kernel<<<down_grid, kDownWarps * kWarp, 0, s>>>(L.down, d_h, max_rows, splits, out);
        steps.mark(s, "down");
    }
    // The down partials summed into y (accumulate: added to it, the stream; add: with a split layer's cold output).
    void sum_partials(const float *partial, int n_tok, int splits, float *y, bool accumulate, const float *add) {
        const int64_t n = int64_t(n_tok) * desc.n_embd;
        down_sum_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(partial, n_tok, splits, desc.n_embd, y, accumulate, add);
        steps.mark(stream, "down_sum");
    }
    // The hot rows' FFN over the operand hot_in (made by now, with `counts` cleared): hot_rows, then the splits' sum
    // into y (or added to it: the stream), the sum skipped where the down kernel can write y itself.
    void hot_ffn(const LayerRows &L, int n_tok, int dense, Counters *counts, float *y, bool accumulate) {
        const int splits = int(device::down_splits(desc.n_batch, n_tok));
        const bool sum = splits > 1 || accumulate;
        float *partial = sum ? hot_in.x : y;  // the operand's rows are read by now
        hot_rows(L, hot_in.operand(), n_tok, dense, HotSelect{}, counts, splits, partial);
        if (sum) sum_partials(partial, n_tok, splits, y, accumulate, nullptr);
    }

    // The chain's layers' counters into p_out's slots (on the stream, before the copy that ends the chain).
    int32_t chain_counts_down(char *err, size_t len) {
        if (chain.empty()) return 0;
        int lo = chain[0].layer, hi = lo;
        for (const ChainLayer &c : chain) lo = std::min(lo, c.layer), hi = std::max(hi, c.layer);
        const size_t at = sizeof(Counters) * (1 + size_t(lo)), bytes = sizeof(Counters) * size_t(hi - lo + 1);
        return failed(cudaMemcpyAsync(p_out + at, d_out + at, bytes, cudaMemcpyDeviceToHost, stream),
                      "copying the layers' counts", err, len);
    }
    // After the chain's last copy was waited for: each layer job's counts.
    void end_chain() {
        cudaEvent_t prev = chain_start;
        for (const ChainLayer &c : chain) {
            const Counters k = reinterpret_cast<const Counters *>(p_out + sizeof(Counters))[c.layer];
            const AttentionLayer &A = attention[size_t(c.layer)];
            const LayerRows &L = layers[size_t(c.layer)];
            const pi_device_predictor *P = c.predicted ? &predictors[size_t(c.layer)].view : nullptr;
            const double x_bytes = double(c.n_tok) * desc.n_embd * 4;
            float ms = 0;
            cudaEventElapsedTime(&ms, prev, c.done);
            prev = c.done;
            pi_device_counts &out = *c.counts;
            out = pi_device_counts{};
            out.active = double(k.active);
            out.computed = double(k.computed);
            // a split layer: its cold output up and the stream and its norm down, besides the chain's ends
            out.h2d_bytes = (c.x_in ? x_bytes : 0.0) + (c.split ? x_bytes : 0.0);
            out.d2h_bytes = (c.x_out ? x_bytes : 0.0) + (c.split ? 2 * x_bytes : 0.0) + sizeof(Counters);
            out.seconds = ms / 1e3;
            out.launches = c.split ? device::split_launches(A.view, P) : device::attention_launches(A.view) + device::fused_ffn_launches();
            out.device_bytes = device::attention_bytes(A.view, desc, c.n_tok, c.n_past) +
                               device::hot_bytes(L.layout, double(k.read), out.computed) +
                               (P ? device::predictor_bytes(*P, c.n_tok) : 0.0);
        }
        chain.clear();
    }

    // A synchronous job's end: the output copied back, waited for, and its counts (traffic, time between the two
    // events, launches and bytes read).
    int32_t finish(void *host, const void *device_out, size_t out_bytes, pi_device_counts *counts, double h2d_bytes,
                   double launches, double device_bytes, char *err, size_t len) {
        if (failed(cudaGetLastError(), "launching the kernels", err, len) ||
            failed(cudaMemcpyAsync(host, device_out, out_bytes, cudaMemcpyDeviceToHost, stream), "copying the output",
                   err, len))
            return 1;
        steps.mark(stream, "d2h");
        if (failed(cudaEventRecord(finished, stream), "recording an event", err, len) ||
            failed(cudaEventSynchronize(finished), "running the job", err, len))
            return 1;
        steps.collect();
        if (counts) {
            float ms = 0;
            cudaEventElapsedTime(&ms, started, finished);
            *counts = pi_device_counts{};
            counts->h2d_bytes = h2d_bytes;
            counts->d2h_bytes = double(out_bytes);
            counts->seconds = ms / 1e3;
            counts->launches = launches;
            counts->device_bytes = device_bytes;
        }
        return 0;
    }

    void release() {
        steps.write_and_release();
        for (void *p : device_allocations) cudaFree(p);
        for (void *p : {static_cast<void *>(p_ax), static_cast<void *>(p_aout), static_cast<void *>(p_hx),
                        static_cast<void *>(p_logits), static_cast<void *>(p_x), static_cast<void *>(p_out),
                        static_cast<void *>(p_split), static_cast<void *>(p_cold), static_cast<void *>(p_ex_in),
                        static_cast<void *>(p_ex_y)})
            if (p) cudaFreeHost(p);
        if (started) cudaEventDestroy(started);
        if (finished) cudaEventDestroy(finished);
        if (chain_start) cudaEventDestroy(chain_start);
        if (split_down) cudaEventDestroy(split_down);
        for (cudaEvent_t e : chain_events) cudaEventDestroy(e);
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

// A device-to-device copy of 256 MiB, the best of five after a warm-up: bytes read plus written per second.
int32_t copy_rate(int32_t device, double *bytes_per_second, char *err, size_t len) {
    if (failed(cudaSetDevice(device), "selecting the device", err, len)) return 1;
    const size_t n = size_t(256) << 20;
    void *a = nullptr, *b = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    float best = 0;
    bool ok = !failed(cudaMalloc(&a, n), "allocating the copy probe", err, len) &&
              !failed(cudaMalloc(&b, n), "allocating the copy probe", err, len) &&
              !failed(cudaEventCreate(&e0), "creating an event", err, len) &&
              !failed(cudaEventCreate(&e1), "creating an event", err, len) &&
              !failed(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice), "copying", err, len);
    for (int i = 0; ok && i < 5; ++i) {
        float ms = 0;
        ok = !failed(cudaEventRecord(e0), "recording an event", err, len) &&
             !failed(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice), "copying", err, len) &&
             !failed(cudaEventRecord(e1), "recording an event", err, len) &&
             !failed(cudaEventSynchronize(e1), "copying", err, len) &&
             !failed(cudaEventElapsedTime(&ms, e0, e1), "timing the copy", err, len);
        if (ok && (best == 0 || ms < best)) best = ms;
    }
    for (void *p : {a, b})
        if (p) cudaFree(p);
    for (cudaEvent_t e : {e0, e1})
        if (e) cudaEventDestroy(e);
    if (!ok) return 1;
    *bytes_per_second = best > 0 ? 2.0 * double(n) / (best / 1e3) : 0.0;
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
    t->predictors.resize(size_t(desc->n_layer));
    if (desc->rope_cos && desc->rope_sin && desc->n_ctx > 0 && desc->n_rot > 0) {
        const size_t n = size_t(desc->n_ctx) * size_t(desc->n_rot / 2);
        t->rope_cos.assign(desc->rope_cos, desc->rope_cos + n);
        t->rope_sin.assign(desc->rope_sin, desc->rope_sin + n);
    }
    t->desc.rope_cos = t->desc.rope_sin = nullptr;  // the host's, read here only
    if (const char *path = std::getenv("PI_CUDA_STEP_TIMES")) t->steps.path = path;
    const size_t out_bytes = sizeof(Counters) + t->x_bytes();
    if (size_t(desc->n_layer) * sizeof(Counters) > t->x_bytes()) {  // the layers' counters share the output rows
        say(err, len, "a batch too small to hold every layer's counters (n_batch * n_embd * 4 < n_layer * 24)");
        delete t;
        return nullptr;
    }
    bool ok = !failed(cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking), "creating a stream", err, len) &&
              !failed(cudaEventCreate(&t->started), "creating an event", err, len) &&
              !failed(cudaEventCreate(&t->finished), "creating an event", err, len) &&
              !t->allocate_operand(&t->hot_in, desc->n_embd, "allocating the input", err, len) &&
              !t->allocate(reinterpret_cast<void **>(&t->d_out), out_bytes, "allocating the output", err, len) &&
              !failed(cudaMallocHost(&t->p_x, t->x_bytes()), "allocating pinned memory", err, len) &&
              !failed(cudaMallocHost(&t->p_out, out_bytes), "allocating pinned memory", err, len);
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
    const int64_t E = t->desc.n_embd, n = rows->n_rows;
    const device::LayerLayout layout(*rows, E, gated);
    if (t->allocate(reinterpret_cast<void **>(&L.block), layout.bytes,
                    ("allocating layer " + std::to_string(layer)).c_str(), err, len))
        return 1;
    const bool copied = layout.fill(*rows, E, gated, [&](size_t at, const void *src, size_t n_bytes) {
        return !failed(cudaMemcpy(L.block + at, src, n_bytes, cudaMemcpyHostToDevice), "copying rows", err, len);
    });
    if (!copied) return 1;
    L.gate = DeviceRows{rows->gate_type, n, E, L.block + layout.gate};
    L.up = gated ? DeviceRows{rows->up_type, n, E, L.block + layout.up} : DeviceRows{};
    L.down = DeviceRows{rows->down_type, n, E, L.block + layout.down_t};
    L.gate_b = rows->gate_b ? reinterpret_cast<const float *>(L.block + layout.gate_b) : nullptr;
    L.up_b = rows->up_b ? reinterpret_cast<const float *>(L.block + layout.up_b) : nullptr;
    L.threshold = rows->threshold;
    L.layout = layout;
    L.uploaded = true;
    if (rows->n_rows > t->max_rows) {  // the coefficients' scratch, for the largest layer
        if (t->d_h) {
            cudaFree(t->d_h);
            t->device_allocations.erase(std::find(t->device_allocations.begin(), t->device_allocations.end(), t->d_h));
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
    if (t->split_pending) return say(err, len, "a split layer was begun and not ended");
    if (t->pending && cudaStreamSynchronize(t->stream) != cudaSuccess) cudaGetLastError();  // a job left unwaited
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const int E = t->desc.n_embd, n_tok = job->n_tok;
    const size_t x_bytes = size_t(n_tok) * E * sizeof(float);
    std::memcpy(t->p_x, job->x, x_bytes);
    cudaStream_t s = t->stream;
    Counters *counts = reinterpret_cast<Counters *>(t->d_out);
    float *y = reinterpret_cast<float *>(t->d_out + sizeof(Counters));
    t->steps.begin(s, n_tok);
    if (failed(cudaEventRecord(t->started, s), "recording an event", err, len) ||
        failed(cudaMemcpyAsync(t->hot_in.x, t->p_x, x_bytes, cudaMemcpyHostToDevice, s), "copying the input", err, len))
        return 1;
    t->steps.mark(s, "h2d");
    launch_quantize(s, t->hot_in, n_tok, counts);
    t->steps.mark(s, "quantize");
    t->hot_ffn(L, n_tok, job->dense, counts, y, false);
    if (failed(cudaGetLastError(), "launching the tier's kernels", err, len) ||
        failed(cudaMemcpyAsync(t->p_out, t->d_out, sizeof(Counters) + x_bytes, cudaMemcpyDeviceToHost, s),
               "copying the output", err, len))
        return 1;
    t->steps.mark(s, "d2h");
    if (failed(cudaEventRecord(t->finished, s), "recording an event", err, len)) return 1;
    t->job = *job;
    t->pending = true;
    t->h2d = double(x_bytes);
    t->d2h = double(x_bytes + sizeof(Counters));
    return 0;
}

int32_t tier_wait(pi_device_tier *t, pi_device_counts *counts, char *err, size_t len) {
    if (!t || !t->pending) return say(err, len, "no job to wait for");
    t->pending = false;
    if (failed(cudaEventSynchronize(t->finished), "running the tier's job", err, len)) return 1;
    float ms = 0;
    cudaEventElapsedTime(&ms, t->started, t->finished);
    t->steps.collect();
    std::memcpy(t->job.y, t->p_out + sizeof(Counters), size_t(t->job.n_tok) * t->desc.n_embd * sizeof(float));
    if (counts) {
        const Counters c = *reinterpret_cast<const Counters *>(t->p_out);
        const LayerRows &L = t->layers[size_t(t->job.layer)];
        *counts = pi_device_counts{};
        counts->active = double(c.active);
        counts->computed = double(c.computed);
        counts->h2d_bytes = t->h2d;
        counts->d2h_bytes = t->d2h;
        counts->seconds = ms / 1e3;
        counts->launches = device::hot_launches(t->desc.n_batch, t->job.n_tok);
        counts->device_bytes = device::hot_bytes(L.layout, double(c.read), counts->computed);
    }
    return 0;
}

// The attention scratch, as attention_math.h's attention_scratch_bytes counts it, and RoPE's tables on the device.
int32_t attention_scratch(pi_device_tier *t, char *err, size_t len) {
    const pi_device_tier_desc &d = t->desc;
    const size_t B = size_t(d.n_batch), E = size_t(d.n_embd), KV = size_t(d.n_head_kv) * d.d_head,
                 table = size_t(d.n_ctx) * size_t(d.n_rot / 2) * sizeof(float);
    const int Q = d.n_head * d.d_head;
    const struct {
        float **p;
        size_t bytes;
    } parts[] = {{&t->d_ax, B * E * 4},       {&t->d_aout, B * E * 4},   {&t->d_q, B * size_t(Q) * 4},
                 {&t->d_split, B * E * 4 * 2}, {&t->d_cold, B * E * 4},
                 {&t->d_k, B * KV * 4},       {&t->d_v, B * KV * 4},
                 {&t->d_scores, B * size_t(d.n_head) * size_t(d.n_ctx) * 4},
                 {&t->d_rope_cos, table},     {&t->d_rope_sin, table}};
    for (const auto &part : parts)
        if (part.bytes && t->allocate(reinterpret_cast<void **>(part.p), part.bytes, "allocating attention's scratch", err, len))
            return 1;
    if (t->allocate_operand(&t->axn, d.n_embd, "allocating attention's scratch", err, len) ||
        t->allocate_operand(&t->att, Q, "allocating attention's scratch", err, len))
        return 1;
    if (table && (failed(cudaMemcpy(t->d_rope_cos, t->rope_cos.data(), table, cudaMemcpyHostToDevice), "copying RoPE's tables", err, len) ||
                  failed(cudaMemcpy(t->d_rope_sin, t->rope_sin.data(), table, cudaMemcpyHostToDevice), "copying RoPE's tables", err, len)))
        return 1;
    if (failed(cudaMallocHost(&t->p_ax, B * E * 4), "allocating pinned memory", err, len) ||
        failed(cudaMallocHost(&t->p_aout, B * E * 4), "allocating pinned memory", err, len) ||
        failed(cudaMallocHost(&t->p_split, B * E * 4 * 2), "allocating pinned memory", err, len) ||
        failed(cudaMallocHost(&t->p_cold, B * E * 4), "allocating pinned memory", err, len) ||
        failed(cudaEventCreate(&t->split_down), "creating an event", err, len))
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
    if (t->split_pending) return say(err, len, "a split layer was begun and not ended");
    // a hot job left unwaited runs first (the stream's order) and stays to be waited for
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const size_t x_bytes = size_t(job->n_tok) * t->desc.n_embd * sizeof(float);
    t->stream_ready = false;  // d_ax takes this job's input
    if (t->start_job(job->x, job->n_tok, t->p_ax, t->d_ax, err, len)) return 1;
    t->attend(A, job->n_tok, job->n_past, t->d_ax, t->d_aout, false);
    if (t->finish(t->p_aout, t->d_aout, x_bytes, counts, double(x_bytes), device::attention_launches(A.view),
                  device::attention_bytes(A.view, t->desc, job->n_tok, job->n_past), err, len))
        return 1;
    std::memcpy(job->out, t->p_aout, x_bytes);
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
        t->allocate_operand(&t->hxn, d.n_embd, "allocating the head's scratch", err, len) ||
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
    if (!job->x && !t->stream_ready) return say(err, len, "no stream on the device for the head to read");
    if (t->split_pending) return say(err, len, "a split layer was begun and not ended");
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const pi_device_tier_desc &d = t->desc;
    const pi_device_head &h = t->head_view;
    const int n_tok = job->n_tok, V = d.n_vocab;
    const size_t x_bytes = size_t(n_tok) * d.n_embd * 4, logit_bytes = size_t(n_tok) * V * 4;
    cudaStream_t s = t->stream;
    if (t->start_job(job->x, n_tok, t->p_hx, t->d_hx, err, len)) return 1;
    const float *rows = job->x ? t->d_hx : t->d_ax + size_t(job->first) * d.n_embd;
    t->normalize(rows, n_tok, h.norm_w, h.norm_b, t->hxn, device::quantized(h.out), nullptr, "head_norm");
    launch_matvec(s, {Projection{device::device_rows(h.out), nullptr, t->d_logits}}, t->hxn.operand(), n_tok);
    t->steps.mark(s, "head");
    if (t->chain_counts_down(err, len) ||
        t->finish(t->p_logits, t->d_logits, logit_bytes, counts, job->x ? double(x_bytes) : 0.0, device::head_launches(),
                  device::head_bytes(h, n_tok), err, len))
        return 1;
    t->end_chain();
    for (int tk = 0; tk < n_tok; ++tk)
        std::memcpy(job->logits + size_t(tk) * size_t(job->ld_logits), t->p_logits + size_t(tk) * V, size_t(V) * 4);
    return 0;
}

// A whole or split layer's start on the stream: a new chain's (its start event, the input up where given), or a new
// input up in the middle of one.
int32_t chain_layer_start(pi_device_tier *t, const float *x_in, int n_tok, char *err, size_t len) {
    cudaStream_t s = t->stream;
    if (t->chain.empty()) {
        if (t->start_job(x_in, n_tok, t->p_ax, t->d_ax, err, len)) return 1;
        if (!t->chain_start && failed(cudaEventCreate(&t->chain_start), "creating an event", err, len)) return 1;
        return failed(cudaEventRecord(t->chain_start, s), "recording an event", err, len);
    }
    if (!x_in) return 0;  // a new stream in the middle of a chain
    const size_t x_bytes = size_t(n_tok) * t->desc.n_embd * sizeof(float);
    std::memcpy(t->p_ax, x_in, x_bytes);
    return failed(cudaMemcpyAsync(t->d_ax, t->p_ax, x_bytes, cudaMemcpyHostToDevice, s), "copying the input", err, len);
}

// A whole or split layer's kernels queued: the event after them, the layer into the chain, and where x_out is
// given the stream down into it, waited for, and the chain's counts.
int32_t chain_layer_end(pi_device_tier *t, ChainLayer c, float *x_out, char *err, size_t len) {
    cudaStream_t s = t->stream;
    if (failed(cudaGetLastError(), "launching the layer's kernels", err, len)) return 1;
    if (t->chain_events.size() <= t->chain.size()) {
        cudaEvent_t e;
        if (failed(cudaEventCreate(&e), "creating an event", err, len)) return 1;
        t->chain_events.push_back(e);
    }
    c.done = t->chain_events[t->chain.size()];
    if (failed(cudaEventRecord(c.done, s), "recording an event", err, len)) return 1;
    t->chain.push_back(c);
    t->stream_ready = true;
    if (!x_out) return 0;
    const size_t x_bytes = size_t(c.n_tok) * t->desc.n_embd * sizeof(float);
    if (t->chain_counts_down(err, len) ||
        failed(cudaMemcpyAsync(t->p_ax, t->d_ax, x_bytes, cudaMemcpyDeviceToHost, s), "copying the output", err, len))
        return 1;
    t->steps.mark(s, "d2h");
    if (failed(cudaEventRecord(t->finished, s), "recording an event", err, len) ||
        failed(cudaEventSynchronize(t->finished), "running the layers", err, len))
        return 1;
    t->steps.collect();
    std::memcpy(x_out, t->p_ax, x_bytes);
    t->end_chain();
    return 0;
}

int32_t layer_run(pi_device_tier *t, const pi_device_layer_job *job, char *err, size_t len) {
    const std::string why = device::refuse_stream_job(t, job, device::refuse_layer_job);
    if (!why.empty()) return say(err, len, why);
    const AttentionLayer &A = t->attention[size_t(job->layer)];
    const LayerRows &L = t->layers[size_t(job->layer)];
    if (t->pending && cudaStreamSynchronize(t->stream) != cudaSuccess) cudaGetLastError();  // a job left unwaited
    t->pending = false;
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const int n_tok = job->n_tok;
    if (chain_layer_start(t, job->x_in, n_tok, err, len)) return 1;
    t->attend(A, n_tok, job->n_past, t->d_ax, t->d_ax, true);
    Counters *slot = t->layer_counters() + job->layer;
    t->normalize(t->d_ax, n_tok, A.view.ffn_norm_w, A.view.ffn_norm_b, t->hot_in, L.layout.quantized, slot, "ffn_norm");
    t->hot_ffn(L, n_tok, job->dense, slot, t->d_ax, true);
    return chain_layer_end(t, ChainLayer{job->layer, n_tok, job->n_past, job->x_in != nullptr, job->x_out != nullptr,
                                         false, false, job->counts, nullptr},
                           job->x_out, err, len);
}

int32_t predictor_upload(pi_device_tier *t, const pi_device_predictor *p, int32_t layer, char *err, size_t len) {
    if (!t || !p || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad predictor upload");
    const LayerRows &L = t->layers[size_t(layer)];
    if (!L.uploaded) return say(err, len, "layer " + std::to_string(layer) + "'s hot rows were not uploaded");
    if (const char *why = device::refuse_predictor(*p, t->desc, L.gate.rows))
        return say(err, len, std::string("cannot upload ") + why);
    PredictorLayer &P = t->predictors[size_t(layer)];
    if (P.uploaded) return say(err, len, "layer " + std::to_string(layer) + "'s predictor was uploaded already");
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const device::PredictorLayout layout(*p, t->desc);
    if (t->allocate(reinterpret_cast<void **>(&P.block), layout.bytes,
                    ("allocating layer " + std::to_string(layer) + "'s predictor").c_str(), err, len))
        return 1;
    const bool copied = layout.fill(*p, [&](size_t at, const void *src, size_t n_bytes) {
        return !failed(cudaMemcpy(P.block + at, src, n_bytes, cudaMemcpyHostToDevice), "copying the predictor", err, len);
    });
    if (!copied) return 1;
    P.view = layout.view(*p, P.block);
    P.hid = OperandBuffers{reinterpret_cast<float *>(P.block + layout.hid), reinterpret_cast<int8_t *>(P.block + layout.hid_q),
                           reinterpret_cast<uint16_t *>(P.block + layout.hid_d), p->fc1.rows};
    P.uploaded = true;
    return 0;
}

int32_t split_begin(pi_device_tier *t, const pi_device_split_job *job, char *err, size_t len) {
    const std::string why = device::refuse_stream_job(t, job, device::refuse_split_job);
    if (!why.empty()) return say(err, len, why);
    const AttentionLayer &A = t->attention[size_t(job->layer)];
    const LayerRows &L = t->layers[size_t(job->layer)];
    const PredictorLayer &P = t->predictors[size_t(job->layer)];
    const bool predicted = job->hot_mode == PI_DEVICE_HOT_PREDICTOR;
    if (predicted && !P.uploaded) return say(err, len, "layer " + std::to_string(job->layer) + "'s predictor was not uploaded");
    if (t->pending && cudaStreamSynchronize(t->stream) != cudaSuccess) cudaGetLastError();  // a job left unwaited
    t->pending = false;
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const int E = t->desc.n_embd, n_tok = job->n_tok;
    const size_t x_bytes = size_t(n_tok) * E * sizeof(float);
    cudaStream_t s = t->stream;
    if (chain_layer_start(t, job->x_in, n_tok, err, len)) return 1;
    t->attend(A, n_tok, job->n_past, t->d_ax, t->d_ax, true);
    // the FFN's norm (its q8_0 form where the hot rows read it) and the stream's copy beside it: one copy down
    Counters *slot = t->layer_counters() + job->layer;
    const OperandBuffers xn{t->d_split, t->hot_in.q, t->hot_in.d, E};
    t->normalize(t->d_ax, n_tok, A.view.ffn_norm_w, A.view.ffn_norm_b, xn, L.layout.quantized, slot, "ffn_norm",
                 t->d_split + size_t(n_tok) * E);
    if (failed(cudaMemcpyAsync(t->p_split, t->d_split, 2 * x_bytes, cudaMemcpyDeviceToHost, s), "copying the norm down", err, len) ||
        failed(cudaEventRecord(t->split_down, s), "recording an event", err, len))
        return 1;
    t->steps.mark(s, "d2h");
    // the hot rows meanwhile: the predictor's hidden layer relu(fc1 x) where it selects them, gate_up, down
    HotSelect sel;
    if (predicted) {
        const pi_device_predictor &pv = P.view;
        const OperandBuffers x{t->d_ax, t->axn.q, t->axn.d, E};
        if (device::quantized(pv.fc1)) launch_quantize(s, x, n_tok, nullptr);
        launch_matvec(s, {Projection{device::device_rows(pv.fc1), nullptr, P.hid.x, false, true}}, x.operand(), n_tok);
        if (device::quantized(pv.fc2)) launch_quantize(s, P.hid, n_tok, nullptr);
        t->steps.mark(s, "predictor");
        sel = HotSelect{device::device_rows(pv.fc2), P.hid.operand(), pv.threshold, 1};
    }
    t->split_parts = int(device::down_splits(t->desc.n_batch, n_tok));
    t->hot_rows(L, xn.operand(), n_tok, job->hot_mode == PI_DEVICE_HOT_DENSE, sel, slot, t->split_parts, t->hot_in.x);
    if (failed(cudaGetLastError(), "launching the layer's kernels", err, len) ||
        failed(cudaEventSynchronize(t->split_down), "running the layer's attention", err, len))
        return 1;
    std::memcpy(job->xn, t->p_split, x_bytes);
    std::memcpy(job->x_mid, t->p_split + size_t(n_tok) * E, x_bytes);
    t->split = *job;
    t->split_pending = true;
    return 0;
}

int32_t split_end(pi_device_tier *t, const float *y_cold, float *x_out, char *err, size_t len) {
    if (!t || !t->split_pending) return say(err, len, "no split layer to end");
    if (!y_cold) return say(err, len, "a split layer ended without its cold output");
    t->split_pending = false;
    const pi_device_split_job &j = t->split;
    const size_t x_bytes = size_t(j.n_tok) * t->desc.n_embd * sizeof(float);
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    std::memcpy(t->p_cold, y_cold, x_bytes);  // the one copy up
    if (failed(cudaMemcpyAsync(t->d_cold, t->p_cold, x_bytes, cudaMemcpyHostToDevice, t->stream), "copying the cold output",
               err, len))
        return 1;
    t->steps.mark(t->stream, "h2d_cold");  // from the hot rows' end: the host's cold tier, then the copy
    t->sum_partials(t->hot_in.x, j.n_tok, t->split_parts, t->d_ax, true, t->d_cold);
    return chain_layer_end(t, ChainLayer{j.layer, j.n_tok, j.n_past, j.x_in != nullptr, x_out != nullptr, true,
                                         j.hot_mode == PI_DEVICE_HOT_PREDICTOR, j.counts, nullptr},
                           x_out, err, len);
}

int32_t expert_upload(pi_device_tier *t, const pi_device_expert *x, int32_t layer, int32_t expert, char *err, size_t len) {
    if (!t || !x || layer < 0 || layer >= t->desc.n_layer) return say(err, len, "bad expert upload");
    if (const char *why = device::refuse_expert(*x, t->desc)) return say(err, len, std::string("cannot upload ") + why);
    if (expert < 0 || expert >= t->desc.n_expert) return say(err, len, "no expert " + std::to_string(expert));
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    if (t->experts.empty()) {
        if (t->experts_scratch(err, len)) return 1;
        t->experts.resize(size_t(t->desc.n_layer) * size_t(t->desc.n_expert));
    }
    ExpertBlock &X = t->experts[size_t(int64_t(layer) * t->desc.n_expert + expert)];
    const std::string name = "layer " + std::to_string(layer) + "'s expert " + std::to_string(expert);
    if (X.uploaded) return say(err, len, name + " was uploaded already");
    const device::ExpertLayout layout(*x);
    if (t->allocate(reinterpret_cast<void **>(&X.block), layout.bytes, ("allocating " + name).c_str(), err, len)) return 1;
    const bool copied = layout.fill(*x, [&](size_t at, const void *src, size_t n_bytes) {
        return !failed(cudaMemcpy(X.block + at, src, n_bytes, cudaMemcpyHostToDevice), "copying an expert", err, len);
    });
    if (!copied) return 1;
    X.view = layout.view(*x, X.block);
    X.uploaded = true;
    return 0;
}

int32_t experts_submit(pi_device_tier *t, const pi_device_experts_job *job, char *err, size_t len) {
    if (!t) return say(err, len, "bad experts job");
    const std::string why = device::experts_job_refusal(job, t->desc, t->experts);
    if (!why.empty()) return say(err, len, why);
    if (t->split_pending) return say(err, len, "a split layer was begun and not ended");
    if ((t->pending || t->experts_pending) && cudaStreamSynchronize(t->stream) != cudaSuccess) cudaGetLastError();
    t->pending = t->experts_pending = false;
    if (failed(cudaSetDevice(t->desc.device), "selecting the device", err, len)) return 1;
    const int E = t->desc.n_embd, F = t->desc.n_ff_expert, B = job->n_tok, P = job->n_pairs;
    // staged: the tokens' rows, then the pairs' tokens and weights, each token's first pair and its pairs in order
    const size_t x_bytes = size_t(B) * E * sizeof(float), in_bytes = x_bytes + 4 * (3 * size_t(P) + B + 1);
    std::memcpy(t->p_ex_in, job->x, x_bytes);
    int32_t *tok = reinterpret_cast<int32_t *>(t->p_ex_in + x_bytes), *first = tok + 2 * P, *list = first + B + 1;
    float *weight = reinterpret_cast<float *>(tok + P);
    std::fill(first, first + B + 1, 0);
    for (int p = 0; p < P; ++p) {
        tok[p] = job->pair_token[p];
        weight[p] = job->pair_weight[p];
        first[tok[p] + 1] += 1;
    }
    for (int b = 0; b < B; ++b) first[b + 1] += first[b];
    std::vector<int32_t> cursor(first, first + B);
    for (int p = 0; p < P; ++p) list[cursor[size_t(tok[p])]++] = p;
    const float *d_x = reinterpret_cast<const float *>(t->d_ex_in);
    const int32_t *d_tok = reinterpret_cast<const int32_t *>(t->d_ex_in + x_bytes), *d_first = d_tok + 2 * P,
                  *d_list = d_first + B + 1;
    const float *d_weight = reinterpret_cast<const float *>(d_tok + P);
    const pi_device_expert &first_expert = t->experts[size_t(int64_t(job->layer) * t->desc.n_expert + job->pair_expert[0])].view;
    const bool q8_in = device::quantized(first_expert.gate) || device::quantized(first_expert.up),
               q8_h = device::quantized(first_expert.down);
    cudaStream_t s = t->stream;
    t->steps.begin(s, B);
    if (failed(cudaEventRecord(t->started, s), "recording an event", err, len) ||
        failed(cudaMemcpyAsync(t->d_ex_in, t->p_ex_in, in_bytes, cudaMemcpyHostToDevice, s), "copying the experts' input",
               err, len))
        return 1;
    t->steps.mark(s, "experts h2d");
    gather_kernel<<<unsigned(P), 256, 0, s>>>(d_x, d_tok, E, t->ex_xg.x);
    if (q8_in) launch_quantize(s, t->ex_xg, P, nullptr);
    t->steps.mark(s, "experts gather");
    // each expert over its pairs' rows: gate and up, then (after every expert's products) down
    std::vector<std::pair<int, int>> groups;  // (first pair, pairs)
    for (int p = 0; p < P; ++p)
        if (p == 0 || job->pair_expert[p] != job->pair_expert[p - 1]) groups.push_back({p, 1});
        else groups.back().second += 1;
    const auto expert_of = [&](int p0) -> const pi_device_expert & {
        return t->experts[size_t(int64_t(job->layer) * t->desc.n_expert + job->pair_expert[p0])].view;
    };
    for (const auto &[p0, n] : groups) {
        const pi_device_expert &X = expert_of(p0);
        const Operand in{t->ex_xg.x + size_t(p0) * E, t->ex_xg.q + size_t(p0) * E, t->ex_xg.d + size_t(p0) * (E / QK), E};
        launch_matvec(s, {Projection{device::device_rows(X.gate), nullptr, t->d_ex_g + size_t(p0) * F},
                          Projection{device::device_rows(X.up), nullptr, t->d_ex_u + size_t(p0) * F}},
                      in, n);
    }
    t->steps.mark(s, "experts gate_up");
    const int64_t n_h = int64_t(P) * F;
    silu_mul_kernel<<<unsigned((n_h + 255) / 256), 256, 0, s>>>(t->d_ex_g, t->d_ex_u, n_h, t->ex_h.x);
    if (q8_h) launch_quantize(s, t->ex_h, P, nullptr);
    t->steps.mark(s, "experts silu");
    for (const auto &[p0, n] : groups) {
        const Operand h{t->ex_h.x + size_t(p0) * F, t->ex_h.q + size_t(p0) * F, t->ex_h.d + size_t(p0) * (F / QK), F};
        launch_matvec(s, {Projection{device::device_rows(expert_of(p0).down), nullptr, t->d_ex_o + size_t(p0) * E}}, h, n);
    }
    t->steps.mark(s, "experts down");
    const int64_t n_y = int64_t(B) * E;
    weighted_sum_kernel<<<unsigned((n_y + 255) / 256), 256, 0, s>>>(t->d_ex_o, d_first, d_list, d_weight, B, E, t->d_ex_y);
    t->steps.mark(s, "experts sum");
    if (failed(cudaGetLastError(), "launching the experts' kernels", err, len) ||
        failed(cudaMemcpyAsync(t->p_ex_y, t->d_ex_y, x_bytes, cudaMemcpyDeviceToHost, s), "copying the experts' sum", err,
               len))
        return 1;
    t->steps.mark(s, "experts d2h");
    if (failed(cudaEventRecord(t->finished, s), "recording an event", err, len)) return 1;
    t->experts_job = *job;
    t->experts_pending = true;
    return 0;
}

int32_t experts_wait(pi_device_tier *t, pi_device_counts *counts, char *err, size_t len) {
    if (!t || !t->experts_pending) return say(err, len, "no experts job to wait for");
    t->experts_pending = false;
    if (failed(cudaEventSynchronize(t->finished), "running the experts' job", err, len)) return 1;
    float ms = 0;
    cudaEventElapsedTime(&ms, t->started, t->finished);
    t->steps.collect();
    const pi_device_experts_job &j = t->experts_job;
    std::memcpy(j.y, t->p_ex_y, size_t(j.n_tok) * t->desc.n_embd * sizeof(float));
    if (counts) {
        const pi_device_expert &x = t->experts[size_t(int64_t(j.layer) * t->desc.n_expert + j.pair_expert[0])].view;
        *counts = pi_device_counts{};
        counts->active = counts->computed = double(j.n_pairs) * double(t->desc.n_ff_expert);
        counts->h2d_bytes = device::experts_h2d_bytes(j, t->desc.n_embd);
        counts->d2h_bytes = device::experts_d2h_bytes(j, t->desc.n_embd);
        counts->seconds = ms / 1e3;
        counts->launches = device::experts_launches(x, device::expert_groups(j));
        counts->device_bytes = device::experts_read_bytes(x, j);
    }
    return 0;
}

uint64_t tier_bytes(const pi_device_tier *t) { return t ? t->bytes : 0; }

void tier_destroy(pi_device_tier *t) {
    if (!t) return;
    cudaSetDevice(t->desc.device);
    if (t->pending || t->experts_pending) cudaStreamSynchronize(t->stream);
    t->release();
    delete t;
}

const pi_device_api kApi = {PI_DEVICE_API_VERSION, "cuda",           device_count,  device_memory,
                            tier_create,           tier_upload,      tier_submit,   tier_wait,
                            attention_upload,      attention_run,    head_upload,   head_run,
                            layer_run,             predictor_upload, split_begin,   split_end,
                            copy_rate,             tier_bytes,       tier_destroy,  expert_upload,
                            experts_submit,        experts_wait};

}  // namespace

extern "C" __attribute__((visibility("default"))) const pi_device_api *pi_device_api_get(void) { return &kApi; }
