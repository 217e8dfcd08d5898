/* pi_engine_testing: the engine library's entry points for tests and measurements, apart from the inference
 * API (pi_engine.h, whose contract they keep: status codes, no call aborts). Single kernels of a named
 * instruction set on caller buffers (to test SIMD against scalar code), the machine's read rate of rows picked
 * by index (pi-tools bench), the memory limits the engine checks against read from files a test wrote, and an
 * engine whose hot tier runs on another backend (to test the tier boundary).
 */
#ifndef PI_ENGINE_TESTING_H
#define PI_ENGINE_TESTING_H

#include "pi_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Exported as pi_engine.h's functions are (the library's others are hidden). */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

/* ---- tier backends ---- */
/* pi_open with the hot tier (opts->gpuidx_path's neurons) computed by `hot_backend`: "cpu" (what pi_open
 * uses) or "reference" (the scalar reference kernels, a token and a neuron at a time, on a thread of its own
 * while the cold tier runs: the same logits within rounding). */
pi_status pi_open_with_hot_backend(const char *path, const pi_options *opts, const char *hot_backend, pi_engine **out);

/* ---- kernel access for tests: run one kernel of a named instruction set on caller buffers ---- */
/* 1 when the kernel set `isa` exists in this build and the CPU runs it. */
int32_t pi_isa_available(const char *isa);
const char *pi_isa_selected(void);
/* Weight types: GGML ids (0 f32, 1 f16, 2 q4_0, 8 q8_0). The activation operand of dot is f32 for
 * f32/f16 weights and q8_0 blocks for q4_0/q8_0 weights. n must be a multiple of the block size. */
pi_status pi_kernel_dot(const char *isa, int32_t type, int32_t n, const void *w, const void *x, float *out);
pi_status pi_kernel_axpy(const char *isa, int32_t type, int32_t n, float a, const void *w, float *y);
/* out[r] = dot of row w[r] with x, for 4 rows (each bit-identical to pi_kernel_dot). */
pi_status pi_kernel_dot4(const char *isa, int32_t type, int32_t n, const void *const *w, const void *x, float *out);
/* out[r] = dot of row w[r] with x for n_rows rows read by pointer (a sparse FFN's gathered rows): q4_0/q8_0
 * with the packed kernels' arithmetic (bit-identical to pi_kernel_gemm8 over pi_kernel_pack8 of the same rows,
 * 8 at a time), other types bit-identical to pi_kernel_dot. */
pi_status pi_kernel_dot_rows(const char *isa, int32_t type, int32_t n, int32_t n_rows, const void *const *w,
                             const void *x, float *out);
/* y[i] += sum_r a[r] * w[r][col0 + i] for i < n (bit-identical to n_rows pi_kernel_axpy calls in order);
 * n and col0 multiples of the block size. */
pi_status pi_kernel_axpy_rows(const char *isa, int32_t type, int32_t n, int32_t n_rows, const void *const *w,
                              int32_t col0, const float *a, float *y);
/* Packs 8 rows of q4_0/q8_0 (n elements each) into the engine's 8-row interleaved layout: n/32 blocks of
 * 144 (q4_0) or 272 (q8_0) bytes. */
pi_status pi_kernel_pack8(int32_t type, int32_t n, const void *const *rows, void *out);
/* Packs n_rows q4_0 rows (n elements each) into the 4-row layout of kernels/packed.h: (n_rows + 3) / 4 quads
 * of n/32 * 72 bytes. */
pi_status pi_kernel_pack_quads(int32_t n, int32_t n_rows, const void *const *rows, void *out);
/* y[i] += sum_r a[r] * row r[i], i < n, over n_rows q4_0 rows packed by pi_kernel_pack_quads (bit-identical to
 * pi_kernel_axpy_rows over the rows); PI_ERR_UNSUPPORTED where the set has no such kernel. */
pi_status pi_kernel_axpy_quads(const char *isa, int32_t n, int32_t n_rows, const void *quads, const float *a, float *y);
/* The transpose of columns [col0, col0 + n_cols) of n_rows q4_0/q8_0 rows requantized to q8_0 8-row groups
 * (a batch's down projection in integers, kernels.h pack_columns8): n_cols / 8 groups of n_rows / 32 blocks of 272
 * bytes, group g holding columns col0 + 8g .. + 8; n_rows, col0 and n_cols multiples of 32. */
pi_status pi_kernel_pack_columns8(const char *isa, int32_t type, int32_t n_rows, const void *const *rows, int32_t col0,
                                  int32_t n_cols, void *out);
/* out[t][8g + r] = dot of row r of packed group g with token t's x (q8_0 blocks, n_tok operands one after
 * the other), for n_groups consecutive groups. */
pi_status pi_kernel_gemm8(const char *isa, int32_t type, int32_t n, int32_t n_groups, const void *w, int32_t n_tok,
                          const void *x, float *out);
/* Packs n_rows q4_0/q8_0 rows (n_in elements each) as the first outputs of an n_out-output matrix in input
 * sparsity's column layout (kernels/packed.h; n_out a multiple of 64 (q4_0: 128), at least n_rows; tiles of `tile`
 * outputs, a multiple of 256): n_in / 32 * n_out * (2 + 32)
 * bytes (q8_0) or n_in / 32 * n_out * (2 + 16) (q4_0). */
pi_status pi_kernel_pack_columns(int32_t type, int32_t n_in, int32_t n_rows, const void *const *rows, int32_t n_out,
                                 int32_t tile, void *out);
/* y[o] = dot of output o's row of a matrix packed by pi_kernel_pack_columns with x (n_in / 32 q8_0 blocks), for o in
 * [o0, o1) (o0 a multiple of tile, o1 too or n_out), reading only the columns of x's nonzero quants: bit-identical to pi_kernel_gemm8 over
 * the same rows. */
pi_status pi_kernel_gemv_columns(const char *isa, int32_t type, int32_t n_in, int32_t n_out, int32_t tile, const void *w,
                                 const void *x, int32_t o0, int32_t o1, float *y);
/* y[t][c] += sum_r h[t][r] * w[r][c]: h n_tok x n_rows, w n_rows x n_cols, y n_tok x n_cols, row-major. */
pi_status pi_kernel_gemm_f32(const char *isa, int32_t n_tok, int32_t n_rows, int32_t n_cols, const float *h,
                             const float *w, float *y);
/* The same with w in IEEE half precision, each element widened to float as it is read. */
pi_status pi_kernel_gemm_f16(const char *isa, int32_t n_tok, int32_t n_rows, int32_t n_cols, const float *h,
                             const uint16_t *w, float *y);
/* y += h @ w for w a q8_0 KV cache's int8 elements q and f16 block scales s (csrc/kernels/kv_q8.h), widened as
 * q * scale: columns 0, values (blocks along w's rows, n_cols % 32 == 0, scale of element e at s[e / 32]); 1, a
 * key tile (w n_rows x 64, n_rows % 32 == 0, n_cols <= 64; scale of element e at s[e / 2048 * 64 + e % 64]). */
pi_status pi_kernel_gemm_q8(const char *isa, int32_t columns, int32_t n_tok, int32_t n_rows, int32_t n_cols,
                            const float *h, const int8_t *q, const uint16_t *s, float *y);
/* out[i] = x[i] * sigmoid(x[i]), as the engine's SiLU rule computes it. */
pi_status pi_kernel_silu(const char *isa, int32_t n, const float *x, float *out);
/* x[i] = exp(scale x[i] - max) / sum, in place (n >= 1): attention's softmax, bit-identical across sets. */
pi_status pi_kernel_softmax(const char *isa, int32_t n, float scale, float *x);
pi_status pi_kernel_to_float(const char *isa, int32_t type, int32_t n, const void *w, float *out);
pi_status pi_kernel_quantize_q8_0(const char *isa, int32_t n, const float *x, void *out);

/* ---- the machine ---- */
/* Bytes per second this machine reads rows of `row_bytes` at: `density` of them picked at random from a buffer of
 * `buffer_bytes` (read in ascending order, each asked for a few rows ahead, as sparse decode steps read rows by
 * index), or every row in order at density 1; `threads` threads share the list; best of `passes` passes, each
 * over its own region of the buffer. */
pi_status pi_read_rows_rate(uint64_t row_bytes, double density, int32_t threads, uint64_t buffer_bytes,
                            int32_t passes, double *bytes_per_second);
/* What the engine's memory checks read, from other files: `usable_bytes`, `machine_bytes` lowered by the cgroup
 * limits that `proc`/cgroup (standing for /proc/self/cgroup) places this process under, read below `cgroup_root`
 * (for /sys/fs/cgroup: v2's memory.max, v1's memory/.../memory.limit_in_bytes; a missing file, "max" or anything
 * but a number leaves it as it was), and `anonymous_bytes`, RssAnon of `proc`/status (0 where it is missing). */
pi_status pi_memory_limits(const char *proc, const char *cgroup_root, double machine_bytes, double *usable_bytes,
                           double *anonymous_bytes);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif

#endif /* PI_ENGINE_TESTING_H */
