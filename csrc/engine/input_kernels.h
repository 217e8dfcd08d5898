// The copies input sparsity's decode steps read a site's q4_0/q8_0 matrices from, the two kernels that read them,
// and the choice between the two on the CPU at hand (docs/engine.md, "Input sparsity"). A copy holds the site's
// matrices stacked over their outputs, in one of two layouts of the same blocks (kernels/packed.h):
//   columns: the column layout, read by gemv_columns, which reads only the kept inputs' pieces;
//   groups:  the 8-row groups, read by gemm8 over the zeroed operand, every weight.
// gemv_columns is gemm8's arithmetic on the zeroed operand (tests/engine/test_engine_kernels.py): the layouts give
// the same bits, and the choice is one of speed alone, made by timing both on copies of the model's shapes.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/kernels.h"
#include "model/model.h"
#include "runtime/page_memory.h"
#include "runtime/threadpool.h"

namespace pi {

// A layer's q4_0/q8_0 matrices of one input sparsity site stacked over their outputs (q, k, v; up, gate; the
// attention output projection; the down projection requantized from down_t), made when input sparsity is turned on.
struct InputColumns {
    uint32_t type = 0;
    int64_t n_in = 0, n_out = 0;  // n_out: the stacked rows rounded up to column_span (a multiple of 8)
    int64_t tile = 0;             // outputs a tile of the column layout (Engine::column_tile)
    bool columns = true;          // the column layout; else 8-row groups
    PageMemory data;  // on 2 MiB pages, as the packed weights every token streams; as many bytes in either layout
    bool present() const { return !data.empty(); }
    size_t bytes() const;
};

// Lays rows[0, n_rows) (n_in elements each, stored as c.type) out in c's layout at out (c.bytes() bytes); the
// outputs past n_rows are zero rows.
void pack_input_copy(const InputColumns &c, int n_rows, const void *const *rows, uint8_t *out);

// out[0, c.n_out) = c's matrices (laid out at w) times one token's q8_0 operand x, on the pool's threads.
void input_copy_product(const KernelSet &ks, ThreadPool &pool, const InputColumns &c, const uint8_t *w,
                        const BlockQ8_0 *x, float *out);

// Per site, the layout its copies take and why: set by PI_INPUT_KERNEL ("columns" or "groups"), or measured.
struct InputKernelChoice {
    static constexpr int kSites = int(Model::kInputSiteCount);
    bool decided[kSites] = {}, columns[kSites] = {};
    double columns_ms[kSites] = {}, groups_ms[kSites] = {};  // the probe's best times, a layer's copy (0: not probed)
    std::string why;                                        // "probe", or the setting that forced the layouts
};

// Decides the sites of `shapes` (one layer's copies, indexed by site; those not present are skipped) not decided
// yet: both layouts timed over enough copies of those shapes to stream from memory as a decode step does (up to
// n_layers of them), the operand's quants zeroed at the given share, in interleaved rounds; the layout of the
// faster best round wins.
void choose_input_kernels(const KernelSet &ks, ThreadPool &pool, const InputColumns *shapes, int64_t n_layers,
                          float share, InputKernelChoice *choice);

}  // namespace pi
