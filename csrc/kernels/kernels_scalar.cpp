// The scalar reference kernels: plain C++, the definition every SIMD set is tested against.
#include <cmath>
#include <cstring>

#include "kernels/kernels.h"
#include "kernels/packed.h"

namespace pi {
namespace {

float dot_f32(int n, const void *w, const void *x) {
    const float *a = static_cast<const float *>(w), *b = static_cast<const float *>(x);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

float dot_f16(int n, const void *w, const void *x) {
    const uint16_t *a = static_cast<const uint16_t *>(w);
    const float *b = static_cast<const float *>(x);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += f16_to_f32(a[i]) * b[i];
    return sum;
}

// One block's exact integer sum of products with a q8_0 block of x.
int32_t block_isum(const BlockQ8_0 &a, const BlockQ8_0 &b) {
    int32_t isum = 0;
    for (int i = 0; i < QK; ++i) isum += int32_t(a.qs[i]) * int32_t(b.qs[i]);
    return isum;
}

int32_t block_isum(const BlockQ4_0 &a, const BlockQ8_0 &b) {
    int32_t isum = 0;
    for (int i = 0; i < QK / 2; ++i) {
        isum += (int32_t(a.qs[i] & 0x0f) - 8) * int32_t(b.qs[i]);
        isum += (int32_t(a.qs[i] >> 4) - 8) * int32_t(b.qs[i + QK / 2]);
    }
    return isum;
}

template <class Block>
float dot_q(int n, const void *w, const void *x) {
    const Block *a = static_cast<const Block *>(w);
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(x);
    float sum = 0.0f;
    for (int k = 0; k < n / QK; ++k) sum += f16_to_f32(a[k].d) * f16_to_f32(b[k].d) * float(block_isum(a[k], b[k]));
    return sum;
}

float dot_q8_0(int n, const void *w, const void *x) { return dot_q<BlockQ8_0>(n, w, x); }
float dot_q4_0(int n, const void *w, const void *x) { return dot_q<BlockQ4_0>(n, w, x); }

// Rows by pointer with the packed kernels' arithmetic: tot = fma(isum, d_w * d_x, tot) block after block.
template <class Block>
void dot_rows_q(int n, int n_rows, const void *const *w, const void *x, float *out) {
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(x);
    for (int r = 0; r < n_rows; ++r) {
        const Block *a = static_cast<const Block *>(w[r]);
        float tot = 0.0f;
        for (int k = 0; k < n / QK; ++k)
            tot = std::fma(float(block_isum(a[k], b[k])), f16_to_f32(a[k].d) * f16_to_f32(b[k].d), tot);
        out[r] = tot;
    }
}

void to_float_f32(int n, const void *w, float *out) {
    const float *a = static_cast<const float *>(w);
    for (int i = 0; i < n; ++i) out[i] = a[i];
}

void to_float_f16(int n, const void *w, float *out) {
    const uint16_t *a = static_cast<const uint16_t *>(w);
    for (int i = 0; i < n; ++i) out[i] = f16_to_f32(a[i]);
}

void to_float_q8_0(int n, const void *w, float *out) {
    const BlockQ8_0 *a = static_cast<const BlockQ8_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float d = f16_to_f32(a[k].d);
        for (int i = 0; i < QK; ++i) out[k * QK + i] = float(a[k].qs[i]) * d;
    }
}

void to_float_q4_0(int n, const void *w, float *out) {
    const BlockQ4_0 *a = static_cast<const BlockQ4_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float d = f16_to_f32(a[k].d);
        for (int i = 0; i < QK / 2; ++i) {
            out[k * QK + i] = float(int(a[k].qs[i] & 0x0f) - 8) * d;
            out[k * QK + i + QK / 2] = float(int(a[k].qs[i] >> 4) - 8) * d;
        }
    }
}

void axpy_f32(int n, float a, const void *w, float *y) {
    const float *b = static_cast<const float *>(w);
    for (int i = 0; i < n; ++i) y[i] += a * b[i];
}

void axpy_f16(int n, float a, const void *w, float *y) {
    const uint16_t *b = static_cast<const uint16_t *>(w);
    for (int i = 0; i < n; ++i) y[i] += a * f16_to_f32(b[i]);
}

void axpy_q8_0(int n, float a, const void *w, float *y) {
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float s = a * f16_to_f32(b[k].d);  // the block scale folded into the coefficient
        for (int i = 0; i < QK; ++i) y[k * QK + i] += s * float(b[k].qs[i]);
    }
}

void axpy_q4_0(int n, float a, const void *w, float *y) {
    const BlockQ4_0 *b = static_cast<const BlockQ4_0 *>(w);
    for (int k = 0; k < n / QK; ++k) {
        const float s = a * f16_to_f32(b[k].d);
        for (int i = 0; i < QK / 2; ++i) {
            y[k * QK + i] += s * float(int(b[k].qs[i] & 0x0f) - 8);
            y[k * QK + i + QK / 2] += s * float(int(b[k].qs[i] >> 4) - 8);
        }
    }
}

// Packed groups (packed.h): each row's integer block sums as dot computes them, then
// tot = fma(isum, d_w * d_x, tot) block after block (bit-identical with every SIMD set).
template <uint32_t Type>
void gemv8(int n, int n_groups, const void *w, const void *x, float *out) {
    const BlockQ8_0 *b = static_cast<const BlockQ8_0 *>(x);
    const uint8_t *p = static_cast<const uint8_t *>(w);
    const size_t block_bytes = packed_block_bytes(Type);
    for (int g = 0; g < n_groups; ++g)
        for (int r = 0; r < kPackRows; ++r) {
            float tot = 0.0f;
            for (int k = 0; k < n / QK; ++k) {
                const uint8_t *blk = p + (size_t(g) * size_t(n / QK) + size_t(k)) * block_bytes;
                uint16_t d;
                std::memcpy(&d, blk + 2 * r, 2);
                const uint8_t *qs = blk + 2 * kPackRows;
                int32_t isum = 0;
                const int chunks = Type == TYPE_Q4_0 ? QK / 8 : QK / 4;
                for (int i = 0; i < chunks; ++i) {
                    for (int j = 0; j < 4; ++j) {
                        const uint8_t v = qs[32 * i + 4 * r + j];
                        if (Type == TYPE_Q4_0) {
                            isum += (int32_t(v & 0x0f) - 8) * int32_t(b[k].qs[4 * i + j]);
                            isum += (int32_t(v >> 4) - 8) * int32_t(b[k].qs[4 * i + j + QK / 2]);
                        } else {
                            isum += int32_t(int8_t(v)) * int32_t(b[k].qs[4 * i + j]);
                        }
                    }
                }
                tot = std::fma(float(isum), f16_to_f32(d) * f16_to_f32(b[k].d), tot);  // as the SIMD sets
            }
            out[g * kPackRows + r] = tot;
        }
}

template <uint32_t Type>
void gemm8(int n, int n_groups, const void *w, int n_tok, const void *x, size_t x_stride, float *out, int64_t ldo) {
    for (int t = 0; t < n_tok; ++t)
        gemv8<Type>(n, n_groups, w, static_cast<const uint8_t *>(x) + size_t(t) * x_stride, out + t * ldo);
}

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return f16_to_f32(v); }

// w: a pointer to f32 or f16 elements, or a q8_0 cache's view (its operator[] widens)
template <class W>
void gemm(int n_tok, int n_rows, int n_cols, const float *h, int ldh, W w, int ldw, float *y, int ldy) {
    for (int t = 0; t < n_tok; ++t)
        for (int c = 0; c < n_cols; ++c) {
            float acc = y[t * ldy + c];
            for (int r = 0; r < n_rows; ++r) acc = std::fma(h[t * ldh + r], widen(w[r * ldw + c]), acc);
            y[t * ldy + c] = acc;
        }
}

void silu(int n, const float *x, float *out) {
    for (int i = 0; i < n; ++i) out[i] = silu_ref(x[i]);
}

// The SIMD sets' order: the maximum (exact in any order), exps, their sum as 8 strided partial sums reduced
// pairwise ((0+4)+(1+5)) + ((2+6)+(3+7)), then the elements past the last multiple of 8 in turn.
void softmax(int n, float scale, float *x) {
    float mx = -INFINITY;
    for (int i = 0; i < n; ++i) {
        x[i] *= scale;
        mx = std::fmax(mx, x[i]);
    }
    const int n8 = n / 8 * 8;
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; ++i) {
        x[i] = exp_ref(x[i] - mx);
        if (i < n8) part[i % 8] += x[i];
    }
    float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (int i = n8; i < n; ++i) sum += x[i];
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; ++i) x[i] *= inv;
}

// roundf: half away from zero, as ggml's reference and gguf-py's np_roundf.
void quantize_q8_0(int n, const float *x, void *out) {
    BlockQ8_0 *b = static_cast<BlockQ8_0 *>(out);
    for (int k = 0; k < n / QK; ++k) {
        float amax = 0.0f;
        for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(x[k * QK + i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[k].d = f32_to_f16(d);
        for (int i = 0; i < QK; ++i) {
            const float r = std::roundf(x[k * QK + i] * id);
            b[k].qs[i] = (r >= -127.0f && r <= 127.0f) ? int8_t(r) : int8_t(0);  // nan/inf from broken weights
        }
    }
}

// pack_columns8 by its definition (kernels.h): each 32 x 32 tile widened by to_float, then column by column.
template <void (*ToFloat)(int, const void *, float *), uint32_t Type>
void pack_columns8(int n_rows, const void *const *w, int col0, int n_cols, uint8_t *out) {
    const size_t bb = packed_block_bytes(TYPE_Q8_0);
    const int nb = n_rows / QK;
    float v[QK][QK];
    for (int k = 0; k < nb; ++k)
        for (int c0 = 0; c0 < n_cols; c0 += QK) {
            for (int i = 0; i < QK; ++i)
                ToFloat(QK, static_cast<const uint8_t *>(w[QK * k + i]) + element_offset(Type, col0 + c0), v[i]);
            for (int c = 0; c < QK; ++c) {
                float amax = 0.0f;
                for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(v[i][c]));
                const float d = amax / 127.0f;
                const float id = d != 0.0f ? 1.0f / d : 0.0f;
                const int col = c0 + c, r = col % kPackRows;
                uint8_t *blk = out + (size_t(col / kPackRows) * nb + k) * bb;
                const uint16_t h = f32_to_f16(d);
                std::memcpy(blk + 2 * r, &h, 2);
                for (int i = 0; i < QK; ++i) {
                    const float q = std::nearbyintf(v[i][c] * id);
                    blk[2 * kPackRows + 32 * (i / 4) + 4 * r + i % 4] = uint8_t(q >= -127.0f && q <= 127.0f ? int8_t(q) : 0);
                }
            }
        }
}

// gemv_columns by its definition (kernels.h): per output, the integer sum of each block over its nonzero inputs.
template <uint32_t Type>
void gemv_columns(int n_in, int n_out, int tile, const void *w, const void *x, int o0, int o1, float *y) {
    const BlockQ8_0 *xb = static_cast<const BlockQ8_0 *>(x);
    for (int o = o0; o < o1; ++o) y[o] = 0.0f;
    for (int k = 0; k < n_in / QK; ++k)
        for (int o = o0; o < o1; ++o) {
            const int t0 = o / tile * tile, tw = n_out - t0 < tile ? n_out - t0 : tile;
            const int r = o - t0, at = column_byte(Type, r);
            const uint8_t *blk = static_cast<const uint8_t *>(w) + column_block_offset(Type, n_in, n_out, tile, t0, k);
            int32_t isum = 0;
            for (int i = 0; i < QK; ++i) {
                if (xb[k].qs[i] == 0) continue;  // a dropped input: its piece is not read
                const uint8_t *c = blk + 2 * size_t(tw) + size_t(i) * column_piece_bytes(Type, tw);
                const int32_t q = Type == TYPE_Q4_0 ? int32_t(column_high(Type, r) ? c[at] >> 4 : c[at] & 0x0f) - 8
                                                    : int32_t(int8_t(c[at]));
                isum += q * int32_t(xb[k].qs[i]);
            }
            uint16_t d;
            std::memcpy(&d, blk + 2 * r, 2);
            y[o] = std::fma(float(isum), f16_to_f32(d) * f16_to_f32(xb[k].d), y[o]);  // as gemm8
        }
}

#define PI_TYPE_KERNELS(T, AXPY_ROWS, GEMM8, DOT_ROWS, PACK_COLUMNS, GEMV_COLUMNS) \
    {dot_##T, axpy_##T, to_float_##T, dot4_by_rows<dot_##T>, AXPY_ROWS, GEMM8, DOT_ROWS, nullptr, PACK_COLUMNS, GEMV_COLUMNS}

const KernelSet kScalar = {
    "scalar",
    PI_TYPE_KERNELS(f32, (axpy_rows_by_row<axpy_f32, TYPE_F32>), nullptr, dot_rows_by_row<dot_f32>, nullptr, nullptr),
    PI_TYPE_KERNELS(f16, (axpy_rows_by_row<axpy_f16, TYPE_F16>), nullptr, dot_rows_by_row<dot_f16>, nullptr, nullptr),
    PI_TYPE_KERNELS(q4_0, axpy_rows_q4_0_reference, gemm8<TYPE_Q4_0>, dot_rows_q<BlockQ4_0>,
                    (pack_columns8<to_float_q4_0, TYPE_Q4_0>), gemv_columns<TYPE_Q4_0>),
    PI_TYPE_KERNELS(q8_0, (axpy_rows_by_row<axpy_q8_0, TYPE_Q8_0>), gemm8<TYPE_Q8_0>, dot_rows_q<BlockQ8_0>,
                    (pack_columns8<to_float_q8_0, TYPE_Q8_0>), gemv_columns<TYPE_Q8_0>),
    quantize_q8_0,
    gemm<const float *>,
    gemm<const uint16_t *>,
    gemm<Q8Rows>,
    gemm<Q8Columns>,
    silu,
    softmax,
};

}  // namespace

const KernelSet &scalar_kernels() { return kScalar; }

}  // namespace pi
