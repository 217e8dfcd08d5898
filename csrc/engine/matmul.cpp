#include "engine/matmul.h"

#include <algorithm>

#include "engine/work.h"
#include "runtime/common.h"

namespace pi {

void prepare(const KernelSet &ks, Operand &x, int64_t n_tok, uint32_t type) {
    if (!act_is_q8(type) || x.q_ready) return;
    for (int64_t t = 0; t < n_tok; ++t) ks.quantize_q8_0(int(x.n), x.f + t * x.n, x.q + t * (x.n / QK));
    x.q_ready = true;
}

void matmul(const KernelSet &ks, ThreadPool &pool, const Matrix &W, Operand &x, int64_t n_tok, float *out,
            int64_t ldo) {
    const MatmulTarget one[1] = {{&W, out, ldo}};
    matmul(ks, pool, one, 1, x, n_tok);
}

namespace {

// Rows [r0, r1) of a target one at a time (4 per pass over each token's operand): rows outside the packed groups.
void single_rows(const KernelSet &ks, const MatmulTarget &tg, const Operand &x, int64_t n_tok, int64_t r0, int64_t r1) {
    const Matrix &W = *tg.W;
    const TypeKernels &k = ks.for_type(W.type);
    const int n = int(W.cols);
    float *out = tg.out;
    const int64_t ldo = tg.ldo;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const void *rows[4] = {W.row(r), W.row(r + 1), W.row(r + 2), W.row(r + 3)};
        float o[4];
        for (int64_t t = 0; t < n_tok; ++t) {
            k.dot4(n, rows, x.at(t, W.type), o);
            for (int j = 0; j < 4; ++j) out[t * ldo + r + j] = o[j];
        }
    }
    for (; r < r1; ++r) {
        const uint8_t *row = W.row(r);
        for (int64_t t = 0; t < n_tok; ++t) out[t * ldo + r] = k.dot(n, row, x.at(t, W.type));
    }
}

// Whole packed groups [g0, g1): a few at a time for every token, so a batch reuses them from cache.
void packed_groups(const KernelSet &ks, const MatmulTarget &tg, const Operand &x, int64_t n_tok, int64_t g0, int64_t g1) {
    const Matrix &W = *tg.W;
    const TypeKernels &k = ks.for_type(W.type);
    const int64_t group_bytes = W.group_bytes();
    const int64_t per_pass = n_tok == 1 ? kDecodeGroupsPerPass : kGroupsPerPass;
    for (int64_t g = g0; g < g1; g += per_pass) {
        const int ng = int(std::min<int64_t>(per_pass, g1 - g));
        k.gemm8(int(W.cols), ng, W.groups + g * group_bytes, int(n_tok), x.at(0, W.type), x.stride(W.type),
                tg.out + g * kPackRows, tg.ldo);
    }
}

// Rows [r0, r1) of a target: its packed groups inside the range, single rows around them.
void rows_of(const KernelSet &ks, const MatmulTarget &tg, const Operand &x, int64_t n_tok, int64_t r0, int64_t r1) {
    const int64_t packed_end = tg.W->n_groups * kPackRows;
    const int64_t a = std::min(r1, (r0 + kPackRows - 1) / kPackRows * kPackRows);
    const int64_t b = std::max(a, std::min(packed_end, r1 / kPackRows * kPackRows));
    if (!tg.W->groups || a >= b) return single_rows(ks, tg, x, n_tok, r0, r1);
    single_rows(ks, tg, x, n_tok, r0, a);
    packed_groups(ks, tg, x, n_tok, a / kPackRows, b / kPackRows);
    single_rows(ks, tg, x, n_tok, b, r1);
}

// Several matrices in a single pool job (q, k and v against one operand; a mixture's experts each against its
// tokens): their rows are split as one range, so the threads synchronise once instead of once per matrix.
// x, n_tok: the operand of the targets that name none.
void matmul_job(const KernelSet &ks, ThreadPool &pool, const MatmulTarget *targets, int n_targets, Operand *x,
                int64_t n_tok) {
    int64_t total = 0, work = 0;
    for (int i = 0; i < n_targets; ++i) {
        const MatmulTarget &tg = targets[i];
        const int64_t nt = tg.x ? tg.n_tok : n_tok;
        prepare(ks, tg.x ? *tg.x : *x, nt, tg.W->type);
        total += tg.W->rows;
        // rows without packed groups (f32/f16: the predictor's fc1, float models) go through dot4 at several
        // times the cost of a packed multiply-add and wait on memory: they count kRowDotCost each
        work += tg.W->rows * tg.W->cols * nt * (tg.W->groups ? 1 : kRowDotCost);
    }
    auto job = [&](int chunk, int n_chunks, int) {
        int64_t g0, g1;
        split_range(total, chunk, n_chunks, &g0, &g1, kPackRows);  // on group boundaries where rows allow
        int64_t base = 0;
        for (int i = 0; i < n_targets && g0 < g1; ++i) {
            const MatmulTarget &tg = targets[i];
            const int64_t rows = tg.W->rows;
            const int64_t r0 = std::max<int64_t>(g0 - base, 0), r1 = std::min<int64_t>(g1 - base, rows);
            if (r0 < r1) rows_of(ks, tg, tg.x ? *tg.x : *x, tg.x ? tg.n_tok : n_tok, r0, r1);
            base += rows;
        }
    };
    pool.run(pool.chunks_for(work, kGrain), job);
}

}  // namespace

void matmul(const KernelSet &ks, ThreadPool &pool, const MatmulTarget *targets, int n_targets, Operand &x,
            int64_t n_tok) {
    matmul_job(ks, pool, targets, n_targets, &x, n_tok);
}

void matmul(const KernelSet &ks, ThreadPool &pool, const MatmulTarget *targets, int n_targets) {
    matmul_job(ks, pool, targets, n_targets, nullptr, 0);
}

void rows_product(const KernelSet &ks, ThreadPool &pool, const RowsTarget *targets, int n_targets, float *partials) {
    int64_t n_runs[kRowsTargets], first_run[kRowsTargets + 1] = {0}, first_partial[kRowsTargets];
    if (n_targets > kRowsTargets) fail(PI_ERR_INTERNAL, "rows_product: too many targets");
    for (int i = 0, at = 0; i < n_targets; ++i) {
        n_runs[i] = down_run_count(targets[i].n_rows);
        first_run[i + 1] = first_run[i] + n_runs[i];
        first_partial[i] = at;
        at += int(n_runs[i] * targets[i].n);
    }
    auto run_rows = [&](int chunk, int, int) {
        int i = 0;
        while (chunk >= first_run[i + 1]) ++i;
        const RowsTarget &tg = targets[i];
        const int64_t run = chunk - first_run[i];
        down_run(ks.for_type(tg.type), tg.n, tg.n_rows, tg.rows, tg.coef, run,
                 partials + first_partial[i] + run * tg.n);
    };
    pool.run(int(first_run[n_targets]), run_rows);
    for (int i = 0; i < n_targets; ++i)
        sum_down_runs(targets[i].n, n_runs[i], partials + first_partial[i], targets[i].y);
}

}  // namespace pi
