// Activations times whole weight matrices (attention's projections, the output head, the predictor's fc1):
// the operand, its q8_0 form made once, and the rows of one or several matrices split between the pool's
// threads as one range.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"
#include "model/model.h"
#include "runtime/threadpool.h"

namespace pi {

// A row-major [tokens, n] activation matrix plus, on demand, its q8_0 quantization: the operand of
// dot products against rows of any weight type.
struct Operand {
    const float *f = nullptr;
    int64_t n = 0;
    BlockQ8_0 *q = nullptr;  // capacity for the batch, allocated by its owner
    bool q_ready = false;
    const void *at(int64_t t, uint32_t type) const {
        return act_is_q8(type) ? static_cast<const void *>(q + t * (n / QK)) : static_cast<const void *>(f + t * n);
    }
    // bytes from one token's operand to the next
    size_t stride(uint32_t type) const {
        return act_is_q8(type) ? size_t(n / QK) * sizeof(BlockQ8_0) : size_t(n) * sizeof(float);
    }
};

// x's q8_0 form for its first n_tok tokens, where weights of `type` read it and it is not made yet.
void prepare(const KernelSet &ks, Operand &x, int64_t n_tok, uint32_t type);

struct MatmulTarget {
    const Matrix *W;
    float *out;
    int64_t ldo;
};

// out[t * ldo + r] = row r of W . token t of x, for every target, in one pool job.
void matmul(const KernelSet &ks, ThreadPool &pool, const MatmulTarget *targets, int n_targets, Operand &x,
            int64_t n_tok);
void matmul(const KernelSet &ks, ThreadPool &pool, const Matrix &W, Operand &x, int64_t n_tok, float *out,
            int64_t ldo);

// Rows read by index and scaled (the down projection's ffn_down_t rows, input sparsity's transposed matrices):
// y[0, n) = the sum over k < n_rows of coef[k] times columns [col0, col0 + n) of rows[k].
struct RowsTarget {
    uint32_t type;
    int64_t n, col0;
    const void *const *rows;
    const float *coef;
    int64_t n_rows;
    float *y;
};

const int64_t kRowsPerRun = 256;  // rows per run of rows_product

// Floats of partial sums rows_product needs for targets of up to n_rows rows and n columns each.
inline int64_t rows_partial_floats(int64_t n_rows, int64_t n) { return ((n_rows + kRowsPerRun - 1) / kRowsPerRun + 1) * n; }

// Every target in one pool job: its rows in fixed runs of kRowsPerRun, each run added whole by the type's
// axpy_rows (rows stream in order, y's blocks held in registers) into its own partial, then the partials summed in
// run order: the same sums whatever the thread count or which thread ran which run. partials: room for
// rows_partial_floats of every target, one after the other.
void rows_product(const KernelSet &ks, ThreadPool &pool, const RowsTarget *targets, int n_targets, float *partials);

}  // namespace pi
