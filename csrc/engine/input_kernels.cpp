// Input sparsity's copies in either layout, their product with a decode step's operand, and the probe that picks
// the layout per site (input_kernels.h; docs/engine.md, "Input sparsity").
#include "engine/input_kernels.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "engine/matmul.h"
#include "kernels/packed.h"

namespace pi {
namespace {

using Clock = std::chrono::steady_clock;

// Enough copies that the probe streams them from memory, as a decode step streams the layers'.
constexpr size_t kProbeBytes = size_t(32) << 20;
constexpr int kProbeRounds = 5;

// c's groups as the matrix gemm8 reads (every row in a group: n_out is a multiple of 8)
Matrix groups_view(const InputColumns &c, const uint8_t *w) {
    Matrix m;
    m.type = c.type;
    m.rows = c.n_out;
    m.cols = c.n_in;
    m.groups = w;
    m.n_groups = c.n_out / kPackRows;
    return m;
}

}  // namespace

size_t InputColumns::bytes() const { return column_matrix_bytes(type, n_in, n_out); }  // 8-row groups: the same

void pack_input_copy(const InputColumns &c, int n_rows, const void *const *rows, uint8_t *out) {
    if (c.columns) return pack_columns(c.type, int(c.n_in), n_rows, rows, int(c.n_out), int(c.tile), out);
    const bool q4 = c.type == TYPE_Q4_0;
    const size_t row_block = q4 ? sizeof(BlockQ4_0) : sizeof(BlockQ8_0), nb = size_t(c.n_in / QK);
    std::vector<uint8_t> zero(nb * row_block, 0);  // a padding output: scale 0, quants 0 (q4_0: nibble 8)
    for (size_t k = 0; q4 && k < nb; ++k) std::memset(zero.data() + k * row_block + 2, 0x88, QK / 2);
    const size_t group = nb * packed_block_bytes(c.type);
    for (int64_t g = 0; g < c.n_out / kPackRows; ++g) {
        const void *eight[kPackRows];
        for (int r = 0; r < kPackRows; ++r) {
            const int64_t o = g * kPackRows + r;
            eight[r] = o < n_rows ? rows[o] : zero.data();
        }
        pack_rows8(c.type, int(c.n_in), eight, out + size_t(g) * group);
    }
}

void input_copy_product(const KernelSet &ks, ThreadPool &pool, const InputColumns &c, const uint8_t *w,
                        const BlockQ8_0 *x, float *out) {
    if (!c.columns) {
        const Matrix m = groups_view(c, w);
        Operand in{nullptr, c.n_in, const_cast<BlockQ8_0 *>(x), true};  // made: matmul only reads it
        const MatmulTarget target[1] = {{&m, out, c.n_out}};
        return matmul(ks, pool, target, 1, in, 1);
    }
    const int n_tiles = int((c.n_out + c.tile - 1) / c.tile);
    const TypeKernels &k = ks.for_type(c.type);
    auto run = [&](int chunk, int n_chunks, int) {  // a thread's tiles: one ascending stretch of the copy
        const int64_t t0 = int64_t(chunk) * n_tiles / n_chunks, t1 = int64_t(chunk + 1) * n_tiles / n_chunks;
        if (t0 < t1)
            k.gemv_columns(int(c.n_in), int(c.n_out), int(c.tile), w, x, int(t0 * c.tile),
                           int(std::min<int64_t>(t1 * c.tile, c.n_out)), out);
    };
    pool.run(std::min(n_tiles, pool.size()), run);
}

void choose_input_kernels(const KernelSet &ks, ThreadPool &pool, const InputColumns *shapes, int64_t n_layers,
                          float share, InputKernelChoice *choice) {
    constexpr int S = InputKernelChoice::kSites;
    size_t offset[S] = {}, layer_bytes = 0;
    int64_t n_in = 0, n_out = 0;
    bool any = false;
    for (int s = 0; s < S; ++s) {
        if (!shapes[s].type || choice->decided[s]) continue;
        offset[s] = layer_bytes;
        layer_bytes += shapes[s].bytes();
        n_in = std::max(n_in, shapes[s].n_in);
        n_out = std::max(n_out, shapes[s].n_out);
        any = true;
    }
    if (!any) return;
    const size_t copies = std::clamp<size_t>((kProbeBytes + layer_bytes - 1) / layer_bytes, 1, size_t(n_layers));
    // 0x3c in every byte is valid in both layouts: f16 scales of about 1.06, quants of 60 (q4_0: nibbles 12, 3)
    PageMemory w(copies * layer_bytes, true, "input sparsity's kernel probe");  // on 2 MiB pages, as the copies
    std::memset(w.data(), 0x3c, copies * layer_bytes);
    // the operand: scale 1, a share `share` of its quants zeroed, spread as a hash spreads them
    std::vector<BlockQ8_0> x(size_t(n_in / QK));
    for (size_t k = 0; k < x.size(); ++k) {
        x[k].d = 0x3c00;
        for (int i = 0; i < QK; ++i) {
            const uint32_t h = uint32_t(k * QK + size_t(i)) * 2654435761u;
            x[k].qs[i] = int8_t(double(h >> 8) < double(share) * double(1 << 24) ? 0 : 1 + (k * QK + size_t(i)) % 100);
        }
    }
    std::vector<float> out(static_cast<size_t>(n_out));
    std::vector<double> ms[S][2];
    for (int round = 0; round <= kProbeRounds; ++round)  // round 0 warms up
        for (int j = 0; j < 2; ++j) {
            const bool columns = (round + j) % 2 == 0;  // the layouts in turn, each first every other round
            for (int s = 0; s < S; ++s) {
                if (!shapes[s].type || choice->decided[s]) continue;
                InputColumns c;
                c.type = shapes[s].type;
                c.n_in = shapes[s].n_in;
                c.n_out = shapes[s].n_out;
                c.tile = shapes[s].tile;
                c.columns = columns;
                const auto t0 = Clock::now();
                for (size_t r = 0; r < copies; ++r)
                    input_copy_product(ks, pool, c, w.data() + r * layer_bytes + offset[s], x.data(), out.data());
                const double t = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / double(copies);
                if (round > 0) ms[s][columns].push_back(t);
            }
        }
    for (int s = 0; s < S; ++s) {
        if (!shapes[s].type || choice->decided[s]) continue;
        // the fastest round of each: on a shared machine, being descheduled only adds time
        choice->columns_ms[s] = *std::min_element(ms[s][1].begin(), ms[s][1].end());
        choice->groups_ms[s] = *std::min_element(ms[s][0].begin(), ms[s][0].end());
        choice->columns[s] = choice->columns_ms[s] < choice->groups_ms[s];
        choice->decided[s] = true;
    }
    choice->why = "probe";
}

}  // namespace pi
