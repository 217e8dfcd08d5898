// A decode step's down projection over a tier's used rows (ffn_down_t rows scaled by their neurons' values):
// the rows in runs of kDownRunRows, each run summed whole by axpy_rows into a partial of its own, the partials
// then added in run order. The CPU backend runs the runs on its threads, the reference backend one after another:
// the same runs, so the same bits whatever computed them (the integer axpy_rows rounds per group of rows,
// kernels/axpy_int.h, so the grouping is part of the result).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/packed.h"

namespace pi {

constexpr int64_t kDownRunRows = 256;
static_assert(kDownRunRows % kAxpyGroup == 0, "runs hold whole groups of the integer axpy_rows");
static_assert(kAxpyGroup % kQuadRows == 0, "groups hold whole quads");

inline int64_t down_run_count(int64_t n_used) { return (n_used + kDownRunRows - 1) / kDownRunRows; }

// Run `run` of n_used rows into partial (E floats, overwritten). `quads`: the rows are every row of the tier, in
// order, also held as quads (kernels/packed.h), read there by axpy_quads (the same bits); null: read by axpy_rows.
inline void down_run(const TypeKernels &kd, int64_t E, int64_t n_used, const void *const *rows, const float *coef,
                     int64_t run, float *partial, const uint8_t *quads = nullptr) {
    const int64_t i0 = run * kDownRunRows, i1 = std::min(n_used, i0 + kDownRunRows);
    std::fill(partial, partial + E, 0.0f);
    if (quads) kd.axpy_quads(int(E), int(i1 - i0), quads + size_t(i0 / kQuadRows) * quad_bytes(int(E)), coef + i0, partial);
    else kd.axpy_rows(int(E), int(i1 - i0), rows + i0, 0, coef + i0, partial);
}

// y (E floats, overwritten) = the n_runs partials added in run order.
inline void sum_down_runs(int64_t E, int64_t n_runs, const float *partials, float *y) {
    std::fill(y, y + E, 0.0f);
    for (int64_t c = 0; c < n_runs; ++c)
        for (int64_t i = 0; i < E; ++i) y[i] += partials[c * E + i];
}

}  // namespace pi
