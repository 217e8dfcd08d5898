// The C API: every entry point catches everything, so no call aborts the process on bad input.
#include <cstring>
#include <new>
#include <string>

#include "runtime/common.h"
#include "engine/engine.h"
#include "format/gguf.h"
#include "kernels/kernels.h"
#include "kernels/packed.h"
#include "runtime/read_probe.h"
#include "runtime/threadpool.h"
#include "pi_engine.h"

struct pi_engine {
    pi::Engine engine;
    pi_engine(const std::string &path, const pi_options &o) : engine(path, o) {}
};

namespace {

thread_local std::string g_last_error;

template <class F>
pi_status guarded(F &&f) {
    try {
        f();
        g_last_error.clear();
        return PI_OK;
    } catch (const pi::EngineFailure &e) {
        g_last_error = e.what();
        return e.status;
    } catch (const std::bad_alloc &) {
        g_last_error = "out of memory";
        return PI_ERR_MEMORY;
    } catch (const std::length_error &) {
        g_last_error = "out of memory (requested size too large)";
        return PI_ERR_MEMORY;
    } catch (const std::exception &e) {
        g_last_error = std::string("internal error: ") + e.what();
        return PI_ERR_INTERNAL;
    } catch (...) {
        g_last_error = "internal error";
        return PI_ERR_INTERNAL;
    }
}

void need(const void *p, const char *what) {
    if (!p) pi::fail(PI_ERR_ARGUMENT, std::string(what) + " is NULL");
}

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

const char *pi_last_error(void) { return g_last_error.c_str(); }
int32_t pi_api_version(void) { return PI_ENGINE_API_VERSION; }

void pi_options_default(pi_options *o) {
    if (!o) return;
    std::memset(o, 0, sizeof *o);
    o->ffn_mode = PI_FFN_DENSE;
}

void pi_sampling_default(pi_sampling *p) {
    if (!p) return;
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
}

pi_status pi_open(const char *path, const pi_options *opts, pi_engine **out) {
    return guarded([&] {
        need(path, "path");
        need(out, "out");
        *out = nullptr;
        pi_options o;
        pi_options_default(&o);
        if (opts) o = *opts;
        *out = new pi_engine(path, o);
    });
}

void pi_close(pi_engine *e) { delete e; }

pi_status pi_check_gguf(const char *path) {
    return guarded([&] {
        need(path, "path");
        pi::GgufFile file(path);
    });
}

pi_status pi_info_json(pi_engine *e, const char **json) {
    return guarded([&] {
        need(e, "engine");
        need(json, "json");
        *json = e->engine.info_json().c_str();
    });
}

pi_status pi_set_ffn_mode(pi_engine *e, int32_t mode) {
    return guarded([&] {
        need(e, "engine");
        e->engine.set_ffn_mode(mode);
    });
}

pi_status pi_set_recall_check(pi_engine *e, int32_t enabled) {
    return guarded([&] {
        need(e, "engine");
        e->engine.set_recall_check(enabled != 0);
    });
}

pi_status pi_eval(pi_engine *e, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits) {
    return guarded([&] {
        need(e, "engine");
        e->engine.eval(tokens, n, logits, all_logits != 0);
    });
}

int32_t pi_n_past(const pi_engine *e) { return e ? e->engine.n_past() : -1; }

pi_status pi_truncate(pi_engine *e, int32_t n_keep) {
    return guarded([&] {
        need(e, "engine");
        e->engine.truncate(n_keep);
    });
}

pi_status pi_sample(pi_engine *e, const pi_sampling *params, int32_t *token) {
    return guarded([&] {
        need(e, "engine");
        need(params, "params");
        need(token, "token");
        *token = e->engine.sample(*params);
    });
}

pi_status pi_set_seed(pi_engine *e, uint64_t seed) {
    return guarded([&] {
        need(e, "engine");
        e->engine.set_seed(seed);
    });
}

pi_status pi_stats_json(pi_engine *e, const char **json) {
    return guarded([&] {
        need(e, "engine");
        need(json, "json");
        *json = e->engine.stats_json().c_str();
    });
}

pi_status pi_stats_reset(pi_engine *e) {
    return guarded([&] {
        need(e, "engine");
        e->engine.reset_stats();
    });
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

pi_status pi_kernel_gemm_f32(const char *isa, int32_t n_tok, int32_t n_rows, int32_t n_cols, const float *h,
                             const float *w, float *y) {
    return kernel_gemm(isa, n_tok, n_rows, n_cols, h, w, y, &pi::KernelSet::gemm_f32);
}

pi_status pi_kernel_gemm_f16(const char *isa, int32_t n_tok, int32_t n_rows, int32_t n_cols, const float *h,
                             const uint16_t *w, float *y) {
    return kernel_gemm(isa, n_tok, n_rows, n_cols, h, w, y, &pi::KernelSet::gemm_f16);
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

}  // extern "C"
