// Activations times whole weight matrices (attention's projections, the output head, the predictor's fc1):
// the operand, its q8_0 form made once, and the rows of one or several matrices split between the pool's
// threads as one range.
#pragma once

#include <cstdint>

#include "backend/down_runs.h"
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
    Operand *x = nullptr;  // the target's own operand (a mixture's expert against its tokens), else the call's
    int64_t n_tok = 0;     // its tokens, with x
};

// out[t * ldo + r] = row r of W . token t of x, for every target, in one pool job.
void matmul(const KernelSet &ks, ThreadPool &pool, const MatmulTarget *targets, int n_targets, Operand &x,
            int64_t n_tok);
// The same, each target against its own x and n_tok.
void matmul(const KernelSet &ks, ThreadPool &pool, const MatmulTarget *targets, int n_targets);
void matmul(const KernelSet &ks, ThreadPool &pool, const Matrix &W, Operand &x, int64_t n_tok, float *out,
            int64_t ldo);

// Rows read by index and scaled (input sparsity's transposed matrices): y[0, n) = the sum over k < n_rows of
// coef[k] times rows[k]'s first n values.
struct RowsTarget {
    uint32_t type;
    int64_t n;
    const void *const *rows;
    const float *coef;
    int64_t n_rows;
    float *y;
};

// Floats of partial sums rows_product needs for a target of up to n_rows rows of n values.
inline int64_t rows_partial_floats(int64_t n_rows, int64_t n) { return (down_run_count(n_rows) + 1) * n; }

// Every target in one pool job, each as the down projection's decode step sums its rows (backend/down_runs.h:
// runs of kDownRunRows by the type's axpy_rows, the partials added in run order), so these products get what that
// kernel gets, and the same sums whatever the thread count. partials: room for rows_partial_floats of every
// target, one after the other.
const int kRowsTargets = 8;  // the most targets one rows_product takes
void rows_product(const KernelSet &ks, ThreadPool &pool, const RowsTarget *targets, int n_targets, float *partials);

}  // namespace pi
