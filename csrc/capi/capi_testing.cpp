// The testing API (pi_engine_testing.h): single kernels, the read probe, the memory limits read from other files, an
// engine with another hot-tier backend.
#include <cstring>
#include <string>

#include "capi/guarded.h"
#include "kernels/kernels.h"
#include "kernels/packed.h"
#include "pi_engine_testing.h"
#include "runtime/read_probe.h"
#include "runtime/threadpool.h"
#include "runtime/usable_memory.h"

using pi::guarded;
using pi::need;

namespace {

const pi::KernelSet &kernel_set(const char *isa) {
    const pi::KernelSet *k = pi::kernels_named(isa);
    if (!k) pi::fail(PI_ERR_UNSUPPORTED, std::string("kernel set '") + (isa ? isa : "") + "' is not available");
    return *k;
}

void check_kernel_args(int32_t type, int32_t n) {
    if (!pi::type_computable(uint32_t(type))) pi::fail(PI_ERR_ARGUMENT, "type " + std::to_string(type) + " has no kernels");
    if (n < 0 || n % int32_t(pi::type_size(uint32_t(type)).block) != 0)
        pi::fail(PI_ERR_ARGUMENT, "n must be a non-negative multiple of the block size");
}

// y += h @ w by a set's gemm_f32 or gemm_f16 (which: the KernelSet member)
template <class W, class Gemm>
pi_status kernel_gemm(const char *isa, int32_t n_tok, int32_t n_rows, int32_t n_cols, const float *h, const W *w,
                      float *y, Gemm pi::KernelSet::*which) {
    return guarded([&] {
        if (n_tok < 0 || n_rows < 0 || n_cols < 0) pi::fail(PI_ERR_ARGUMENT, "sizes must be >= 0");
        need(h, "h");
        need(w, "w");
        need(y, "y");
        (kernel_set(isa).*which)(n_tok, n_rows, n_cols, h, n_rows, w, n_cols, y, n_cols);
    });
}

}  // namespace

extern "C" {

pi_status pi_open_with_hot_backend(const char *path, const pi_options *opts, const char *hot_backend, pi_engine **out) {
    return pi::open_engine(path, opts, hot_backend, out);
}

int32_t pi_isa_available(const char *isa) { return isa && pi::kernels_named(isa) ? 1 : 0; }
const char *pi_isa_selected(void) { return pi::best_kernels().isa; }

pi_status pi_kernel_dot(const char *isa, int32_t type, int32_t n, const void *w, const void *x, float *out) {
    return guarded([&] {
        check_kernel_args(type, n);
        need(w, "w");
        need(x, "x");
        need(out, "out");
        *out = kernel_set(isa).for_type(uint32_t(type)).dot(n, w, x);
    });
}

pi_status pi_kernel_axpy(const char *isa, int32_t type, int32_t n, float a, const void *w, float *y) {
    return guarded([&] {
        check_kernel_args(type, n);
        need(w, "w");
        need(y, "y");
        kernel_set(isa).for_type(uint32_t(type)).axpy(n, a, w, y);
    });
}

pi_status pi_kernel_dot4(const char *isa, int32_t type, int32_t n, const void *const *w, const void *x, float *out) {
    return guarded([&] {
        check_kernel_args(type, n);
        need(w, "w");
        for (int r = 0; r < 4; ++r) need(w[r], "a row of w");
        need(x, "x");
        need(out, "out");
        kernel_set(isa).for_type(uint32_t(type)).dot4(n, w, x, out);
    });
}

pi_status pi_kernel_dot_rows(const char *isa, int32_t type, int32_t n, int32_t n_rows, const void *const *w,
                             const void *x, float *out) {
    return guarded([&] {
        check_kernel_args(type, n);
        if (n > pi::kGemv8MaxCols) pi::fail(PI_ERR_ARGUMENT, "n is above the packed kernels' limit");
        if (n_rows < 0) pi::fail(PI_ERR_ARGUMENT, "n_rows must be >= 0");
        need(w, "w");
        for (int32_t r = 0; r < n_rows; ++r) need(w[r], "a row of w");
        need(x, "x");
        need(out, "out");
        kernel_set(isa).for_type(uint32_t(type)).dot_rows(n, n_rows, w, x, out);
    });
}

pi_status pi_kernel_axpy_rows(const char *isa, int32_t type, int32_t n, int32_t n_rows, const void *const *w,
                              int32_t col0, const float *a, float *y) {
    return guarded([&] {
        check_kernel_args(type, n);
        check_kernel_args(type, col0);
        if (n_rows < 0) pi::fail(PI_ERR_ARGUMENT, "n_rows must be >= 0");
        need(w, "w");
        for (int32_t r = 0; r < n_rows; ++r) need(w[r], "a row of w");
        need(a, "a");
        need(y, "y");
        kernel_set(isa).for_type(uint32_t(type)).axpy_rows(n, n_rows, w, col0, a, y);
    });
}

pi_status pi_kernel_pack8(int32_t type, int32_t n, const void *const *rows, void *out) {
    return guarded([&] {
        check_kernel_args(type, n);
        if (pi::packed_block_bytes(uint32_t(type)) == 0) pi::fail(PI_ERR_ARGUMENT, "only q4_0 and q8_0 rows are packed");
        need(rows, "rows");
        for (int r = 0; r < pi::kPackRows; ++r) need(rows[r], "a row");
        need(out, "out");
        pi::pack_rows8(uint32_t(type), n, rows, static_cast<uint8_t *>(out));
    });
}

pi_status pi_kernel_pack_quads(int32_t n, int32_t n_rows, const void *const *rows, void *out) {
    return guarded([&] {
        check_kernel_args(pi::TYPE_Q4_0, n);
        if (n_rows < 0) pi::fail(PI_ERR_ARGUMENT, "n_rows must be >= 0");
        need(rows, "rows");
        for (int32_t r = 0; r < n_rows; ++r) need(rows[r], "a row");
        need(out, "out");
        pi::pack_quads(n, n_rows, rows, static_cast<uint8_t *>(out));
    });
}

pi_status pi_kernel_axpy_quads(const char *isa, int32_t n, int32_t n_rows, const void *quads, const float *a, float *y) {
    return guarded([&] {
        check_kernel_args(pi::TYPE_Q4_0, n);
        if (n_rows < 0) pi::fail(PI_ERR_ARGUMENT, "n_rows must be >= 0");
        const pi::TypeKernels &k = kernel_set(isa).q4_0;
        if (!k.axpy_quads) pi::fail(PI_ERR_UNSUPPORTED, std::string("the ") + isa + " kernels have no axpy_quads");
        need(quads, "quads");
        need(a, "a");
        need(y, "y");
        k.axpy_quads(n, n_rows, quads, a, y);
    });
}

pi_status pi_kernel_pack_columns8(const char *isa, int32_t type, int32_t n_rows, const void *const *rows, int32_t col0,
                                  int32_t n_cols, void *out) {
    return guarded([&] {
        check_kernel_args(type, n_cols);
        const pi::TypeKernels &k = kernel_set(isa).for_type(uint32_t(type));
        if (!k.pack_columns8) pi::fail(PI_ERR_ARGUMENT, "only q4_0 and q8_0 rows are packed by columns");
        if (n_rows < 0 || n_rows % pi::QK != 0 || col0 < 0 || col0 % pi::QK != 0)
            pi::fail(PI_ERR_ARGUMENT, "n_rows and col0 must be non-negative multiples of 32");
        need(rows, "rows");
        for (int32_t r = 0; r < n_rows; ++r) need(rows[r], "a row");
        need(out, "out");
        k.pack_columns8(n_rows, rows, col0, n_cols, static_cast<uint8_t *>(out));
    });
}

pi_status pi_kernel_gemm8(const char *isa, int32_t type, int32_t n, int32_t n_groups, const void *w, int32_t n_tok,
                          const void *x, float *out) {
    return guarded([&] {
        check_kernel_args(type, n);
        const pi::TypeKernels &k = kernel_set(isa).for_type(uint32_t(type));
        if (!k.gemm8) pi::fail(PI_ERR_ARGUMENT, "only q4_0 and q8_0 rows are packed");
        if (n > pi::kGemv8MaxCols) pi::fail(PI_ERR_ARGUMENT, "n is above the packed kernels' limit");
        if (n_groups < 0 || n_tok < 0) pi::fail(PI_ERR_ARGUMENT, "n_groups and n_tok must be >= 0");
        need(w, "w");
        need(x, "x");
        need(out, "out");
        k.gemm8(n, n_groups, w, n_tok, x, size_t(n / pi::QK) * sizeof(pi::BlockQ8_0), out, int64_t(n_groups) * pi::kPackRows);
    });
}

pi_status pi_kernel_pack_columns(int32_t type, int32_t n_in, int32_t n_rows, const void *const *rows, int32_t n_out,
                                 int32_t tile, void *out) {
    return guarded([&] {
        check_kernel_args(type, n_in);
        if (pi::packed_block_bytes(uint32_t(type)) == 0) pi::fail(PI_ERR_ARGUMENT, "only q4_0 and q8_0 rows are packed");
        if (n_rows < 0 || n_out < n_rows || n_out % pi::column_span(uint32_t(type)) != 0)
            pi::fail(PI_ERR_ARGUMENT, "n_out must be a multiple of 64 (q4_0: 128) and at least n_rows >= 0");
        if (tile <= 0 || tile % pi::kColumnWindow != 0) pi::fail(PI_ERR_ARGUMENT, "tile must be a positive multiple of 256");
        if (n_rows) need(rows, "rows");
        for (int32_t r = 0; r < n_rows; ++r) need(rows[r], "a row");
        need(out, "out");
        pi::pack_columns(uint32_t(type), n_in, n_rows, rows, n_out, tile, static_cast<uint8_t *>(out));
    });
}

pi_status pi_kernel_gemv_columns(const char *isa, int32_t type, int32_t n_in, int32_t n_out, int32_t tile, const void *w,
                                 const void *x, int32_t o0, int32_t o1, float *y) {
    return guarded([&] {
        check_kernel_args(type, n_in);
        const pi::TypeKernels &k = kernel_set(isa).for_type(uint32_t(type));
        if (!k.gemv_columns) pi::fail(PI_ERR_ARGUMENT, "only q4_0 and q8_0 matrices have the column layout");
        if (n_out < 0 || n_out % pi::column_span(uint32_t(type)) != 0 || o0 < 0 || o0 > o1 || o1 > n_out || tile <= 0 ||
            tile % pi::kColumnWindow != 0 || o0 % tile != 0 || (o1 % tile != 0 && o1 != n_out))
            pi::fail(PI_ERR_ARGUMENT, "n_out must be a multiple of 64 (q4_0: 128), tile of 256, o0 of tile, o1 too or n_out, "
                                      "0 <= o0 <= o1 <= n_out");
        need(w, "w");
        need(x, "x");
        need(y, "y");
        k.gemv_columns(n_in, n_out, tile, w, x, o0, o1, y);
    });
}

pi_status pi_kernel_gemm_f32(const char *isa, int32_t n_tok, int32_t n_rows, int32_t n_cols, const float *h,
                             const float *w, float *y) {
    return kernel_gemm(isa, n_tok, n_rows, n_cols, h, w, y, &pi::KernelSet::gemm_f32);
}

pi_status pi_kernel_gemm_f16(const char *isa, int32_t n_tok, int32_t n_rows, int32_t n_cols, const float *h,
                             const uint16_t *w, float *y) {
    return kernel_gemm(isa, n_tok, n_rows, n_cols, h, w, y, &pi::KernelSet::gemm_f16);
}

pi_status pi_kernel_gemm_q8(const char *isa, int32_t columns, int32_t n_tok, int32_t n_rows, int32_t n_cols,
                            const float *h, const int8_t *q, const uint16_t *s, float *y) {
    return guarded([&] {
        if (n_tok < 0 || n_rows < 0 || n_cols < 0) pi::fail(PI_ERR_ARGUMENT, "sizes must be >= 0");
        need(h, "h");
        need(q, "q");
        need(s, "s");
        need(y, "y");
        const pi::KernelSet &k = kernel_set(isa);
        if (columns) {
            if (n_rows % pi::QK != 0 || n_cols > pi::kKvKeyTile)
                pi::fail(PI_ERR_ARGUMENT, "a key tile has a multiple of 32 rows and at most 64 columns");
            k.gemm_q8_columns(n_tok, n_rows, n_cols, h, n_rows, pi::Q8Columns{q, s}, int(pi::kKvKeyTile), y, n_cols);
        } else {
            if (n_cols % pi::QK != 0) pi::fail(PI_ERR_ARGUMENT, "values have a multiple of 32 columns");
            k.gemm_q8_rows(n_tok, n_rows, n_cols, h, n_rows, pi::Q8Rows{q, s}, n_cols, y, n_cols);
        }
    });
}

pi_status pi_kernel_silu(const char *isa, int32_t n, const float *x, float *out) {
    return guarded([&] {
        if (n < 0) pi::fail(PI_ERR_ARGUMENT, "n must be >= 0");
        need(x, "x");
        need(out, "out");
        kernel_set(isa).silu(n, x, out);
    });
}

pi_status pi_kernel_softmax(const char *isa, int32_t n, float scale, float *x) {
    return guarded([&] {
        if (n < 1) pi::fail(PI_ERR_ARGUMENT, "n must be >= 1");
        need(x, "x");
        kernel_set(isa).softmax(n, scale, x);
    });
}

pi_status pi_kernel_to_float(const char *isa, int32_t type, int32_t n, const void *w, float *out) {
    return guarded([&] {
        check_kernel_args(type, n);
        need(w, "w");
        need(out, "out");
        kernel_set(isa).for_type(uint32_t(type)).to_float(n, w, out);
    });
}

pi_status pi_kernel_quantize_q8_0(const char *isa, int32_t n, const float *x, void *out) {
    return guarded([&] {
        check_kernel_args(pi::TYPE_Q8_0, n);
        need(x, "x");
        need(out, "out");
        kernel_set(isa).quantize_q8_0(n, x, out);
    });
}

pi_status pi_read_rows_rate(uint64_t row_bytes, double density, int32_t threads, uint64_t buffer_bytes,
                            int32_t passes, double *bytes_per_second) {
    return guarded([&] {
        need(bytes_per_second, "bytes_per_second");
        if (!(density > 0.0 && density <= 1.0)) pi::fail(PI_ERR_ARGUMENT, "density must be in (0, 1]");
        if (threads < 1 || threads > 1024) pi::fail(PI_ERR_ARGUMENT, "threads must be in 1..1024");
        if (passes < 1 || passes > 64) pi::fail(PI_ERR_ARGUMENT, "passes must be in 1..64");
        if (row_bytes < 8 || row_bytes > (uint64_t(1) << 20)) pi::fail(PI_ERR_ARGUMENT, "row_bytes must be in 8..1 MiB");
        if (buffer_bytes > (uint64_t(1) << 36)) pi::fail(PI_ERR_ARGUMENT, "buffer_bytes must be at most 64 GiB");
        if (buffer_bytes / uint64_t(passes) / row_bytes < 64)
            pi::fail(PI_ERR_ARGUMENT, "buffer_bytes must hold at least 64 rows per pass");
        pi::ThreadPool pool(threads);
        *bytes_per_second = pi::read_rows_rate(pool, size_t(row_bytes), size_t(buffer_bytes), density, passes, 1);
    });
}

pi_status pi_memory_limits(const char *proc, const char *cgroup_root, double machine_bytes, double *usable_bytes,
                           double *anonymous_bytes) {
    return guarded([&] {
        need(proc, "proc");
        need(cgroup_root, "cgroup_root");
        need(usable_bytes, "usable_bytes");
        need(anonymous_bytes, "anonymous_bytes");
        *usable_bytes = pi::usable_memory_bytes(proc, cgroup_root, machine_bytes);
        *anonymous_bytes = pi::process_anonymous_bytes(proc);
    });
}

}  // extern "C"
