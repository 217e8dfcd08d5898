// Compute kernels, one set per instruction-set level, chosen once at load (runtime dispatch).
//
// Every weight row is read in its stored type. The activation operand of a dot product is f32 for
// f32/f16 weights and q8_0 blocks for q4_0/q8_0 weights (integer dot products, as llama.cpp).
// Every set computes the same functions; tests compare each against the scalar reference.
#pragma once

#include <cstddef>
#include <cstdint>

#include "format/types.h"
#include "kernels/axpy_int.h"
#include "kernels/exp_ref.h"
#include "kernels/kv_q8.h"

namespace pi {

struct TypeKernels {
    // sum_i w[i] * x[i] over n elements (n a multiple of the type's block size)
    float (*dot)(int n, const void *w, const void *x);
    // y[i] += a * w[i]
    void (*axpy)(int n, float a, const void *w, float *y);
    // out[i] = w[i]
    void (*to_float)(int n, const void *w, float *out);
    // out[r] = dot(n, w[r], x) for 4 rows sharing one operand (each row bit-identical to dot)
    void (*dot4)(int n, const void *const *w, const void *x, float *out);
    // y[i] += sum_r a[r] * w[r][col0 + i], i < n (col0 and n multiples of the block size). f32 / f16 / q8_0
    // rows: bit-identical to n_rows axpy calls in order, y held in registers across rows; q4_0 rows: in
    // integers, as axpy_int.h defines (bit-identical across sets, within 2^-15 of a group's largest term)
    void (*axpy_rows)(int n, int n_rows, const void *const *w, int col0, const float *a, float *y);
    // out[t * ldo + 8g + r] = dot of row r of packed group g with token t's operand (q8_0 blocks, x_stride
    // bytes apart), for n_groups groups in the 8-row layout of packed.h and n_tok tokens; each token's
    // result is independent of the others (q4_0 / q8_0 only, else nullptr; n <= kGemv8MaxCols)
    void (*gemm8)(int n, int n_groups, const void *w, int n_tok, const void *x, size_t x_stride, float *out,
                  int64_t ldo);
    // out[i] = dot of row w[i] with x for n_rows rows read by pointer (the gathered rows of a sparse FFN):
    // q4_0 / q8_0 with gemm8's arithmetic, 8 rows at a time interleaved in registers (bit-identical to gemm8
    // over pack_rows8 of the same rows, so a neuron's value does not depend on the path that computed it);
    // other types bit-identical to dot
    void (*dot_rows)(int n, int n_rows, const void *const *w, const void *x, float *out);
    // y[i] += sum_r a[r] * row r[i], i < n, for n_rows q4_0 rows in the 4-row layout of packed.h (pack_quads),
    // starting at quads: bit-identical to axpy_rows over the same rows. The SIMD sets (AVX-512 VNNI, AVX2), whose
    // axpy_rows transposes each quad's bytes in registers; the scalar set nullptr (axpy_rows reads rows as fast).
    void (*axpy_quads)(int n, int n_rows, const void *quads, const float *a, float *y);
    // The transpose of a panel of rows requantized for gemm8 (a batch's down projection in integers): columns
    // [col0, col0 + n_cols) of rows w[0, n_rows) become n_cols / 8 q8_0 groups in the 8-row layout of packed.h,
    // group g = columns col0 + 8g .. + 8 (gemm8's rows), block k = rows 32k .. 32k + 32 (gemm8's columns). Each
    // column's 32 values (to_float's) are requantized as one q8_0 block: d = amax / 127 (stored in f16),
    // q = nearbyint(v / d) (ties to even), bit-identical across sets. n_rows, col0 and n_cols multiples of 32.
    // q4_0 / q8_0 only, else nullptr.
    void (*pack_columns8)(int n_rows, const void *const *w, int col0, int n_cols, uint8_t *out);
    // y[o] = the dot of output o's row with x (n_in / 32 q8_0 blocks) for o in [o0, o1), of a matrix in the column
    // layout of packed.h (n_out outputs in tiles of `tile`; o0 a multiple of tile, o1 one or n_out), reading only the columns of the inputs
    // whose quant in x is not zero (input sparsity's decode step, its dropped inputs zeroed before x was made):
    // gemm8's arithmetic (exact integer block sums, then y = fma(sum, d * dx, y) over the blocks in order), so
    // bit-identical to gemm8 over the same rows in the 8-row layout. q4_0 / q8_0 only, else nullptr.
    void (*gemv_columns)(int n_in, int n_out, int tile, const void *w, const void *x, int o0, int o1, float *y);
};

constexpr int kGemv8MaxCols = 1 << 16;

struct KernelSet {
    const char *isa;
    TypeKernels f32, f16, q4_0, q8_0;
    // x (n floats, n % 32 == 0) -> n/32 q8_0 blocks, bit-exact with gguf-py's Q8_0 quantizer
    void (*quantize_q8_0)(int n, const float *x, void *out);
    // y[t][c] += sum_r h[t][r] * w[r][c] (t < n_tok, c < n_cols, r < n_rows): a batch's
    // down projection from a panel of widened f32/f16 rows, and attention. Each element is an fma chain over r in order.
    void (*gemm_f32)(int n_tok, int n_rows, int n_cols, const float *h, int ldh, const float *w, int ldw, float *y,
                     int ldy);
    // the same with w in f16 (a KV cache in half precision), each element widened as it is read: bit-identical
    // to gemm_f32 over the widened matrix
    void (*gemm_f16)(int n_tok, int n_rows, int n_cols, const float *h, int ldh, const uint16_t *w, int ldw, float *y,
                     int ldy);
    // the same with w a q8_0 cache (kernels/kv_q8.h): values (blocks along the rows) or keys (blocks down the
    // columns), each element widened as element * scale: bit-identical to gemm_f32 over the widened matrix
    void (*gemm_q8_rows)(int n_tok, int n_rows, int n_cols, const float *h, int ldh, Q8Rows w, int ldw, float *y,
                         int ldy);
    void (*gemm_q8_columns)(int n_tok, int n_rows, int n_cols, const float *h, int ldh, Q8Columns w, int ldw,
                            float *y, int ldy);
    // out[i] = silu(x[i]) as silu_ref computes it (bit for bit); out may be x
    void (*silu)(int n, const float *x, float *out);
    // x[i] = exp(s x[i] - max_j s x[j]) / sum of those, i < n (n >= 1), exps as exp_ref, the sum in a fixed
    // order (the scalar set's comment): bit-identical across sets
    void (*softmax)(int n, float scale, float *x);

    const TypeKernels &for_type(uint32_t type) const {
        switch (type) {
            case TYPE_F16: return f16;
            case TYPE_Q4_0: return q4_0;
            case TYPE_Q8_0: return q8_0;
            default: return f32;
        }
    }
};

// Byte offset of element `col` (a multiple of the block size) in a row of `type`.
inline size_t element_offset(uint32_t type, int64_t col) {
    switch (type) {
        case TYPE_F16: return size_t(col) * 2;
        case TYPE_Q4_0: return size_t(col / QK) * sizeof(BlockQ4_0);
        case TYPE_Q8_0: return size_t(col / QK) * sizeof(BlockQ8_0);
        default: return size_t(col) * 4;
    }
}

// dot4 and axpy_rows composed from a set's dot and axpy: the reference definition, and the
// implementation where a set has nothing faster.
template <float (*Dot)(int, const void *, const void *)>
void dot4_by_rows(int n, const void *const *w, const void *x, float *out) {
    for (int r = 0; r < 4; ++r) out[r] = Dot(n, w[r], x);
}

template <float (*Dot)(int, const void *, const void *)>
void dot_rows_by_row(int n, int n_rows, const void *const *w, const void *x, float *out) {
    for (int r = 0; r < n_rows; ++r) out[r] = Dot(n, w[r], x);
}

template <void (*Axpy)(int, float, const void *, float *), uint32_t Type>
void axpy_rows_by_row(int n, int n_rows, const void *const *w, int col0, const float *a, float *y) {
    const size_t off = element_offset(Type, col0);
    for (int r = 0; r < n_rows; ++r) Axpy(n, a[r], static_cast<const uint8_t *>(w[r]) + off, y);
}

// Whether the activation operand of `type` is q8_0 blocks (else f32).
inline bool act_is_q8(uint32_t type) { return type == TYPE_Q4_0 || type == TYPE_Q8_0; }


const KernelSet &scalar_kernels();
// nullptr when the build or the CPU lacks the instruction set.
const KernelSet *avx2_kernels();
const KernelSet *avx512_kernels();

// "scalar", "avx2", "avx512"; nullptr when unknown or unavailable.
const KernelSet *kernels_named(const char *isa);
// The best available set, selected on first use.
const KernelSet &best_kernels();

}  // namespace pi
