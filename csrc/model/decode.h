// Weights the kernels cannot read as stored, made once at load into a type they compute with (types.h), in
// memory of their own: a readable type other than f32, f16, q4_0 and q8_0 (format/dequant.h), and
// llama.cpp's down projection ffn_down (n_embd rows of n_ff), which the engine reads as ffn_down_t (a row
// per neuron, docs/formats.md).
//
// The target: q8_0 for the quantized types (one rounding of ggml's exact values to 8 bits per 32), f16 for
// bf16 (f32 for a tensor holding a value beyond f16's range) and for rows that do not split into 32-value
// blocks; a transposed f32 / f16 tensor keeps its type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "model/decode_cache.h"
#include "runtime/page_memory.h"

namespace pi {

// The matrix as decoded: rows of `row_bytes` in `type`.
struct DecodedRows {
    uint32_t type = 0;
    size_t row_bytes = 0;
    const uint8_t *data = nullptr;
};

// What one kind of decoding (type to type, transposed or not) cost at load, for pi_info_json.
struct DecodeTally {
    uint32_t from = 0, to = 0;
    bool transposed = false;
    int64_t tensors = 0;
    size_t bytes = 0;       // memory the decoded rows take (less those freed: DecodedWeights::discard)
    size_t file_bytes = 0;  // the tensors' bytes in the file (their mapped pages are handed back)
};

class DecodedWeights {
public:
    // Tensor t of file `path`, of `rows` rows of `cols` values as stored (its shape checked by the caller), in a
    // computed type; `transpose`: as `cols` rows of `rows` values. Decoded on up to `threads` threads. Refused
    // (PI_ERR_MEMORY) where the decoded weights would pass the memory this process may use.
    DecodedRows decode(const std::string &path, const GgufTensor &t, int64_t rows, int64_t cols, bool transpose,
                       int threads);
    // How many tensors were decoded; the one whose rows hold p (-1: none).
    int64_t count() const { return int64_t(held_.size()); }
    int64_t holder(const uint8_t *p) const;
    // Frees decoded tensor i's rows, which nothing may read afterwards (their kind's `bytes` go down).
    void discard(int64_t i);
    const std::vector<DecodeTally> &tallies() const { return tallies_; }
    size_t bytes() const;
    double seconds() const { return seconds_; }
    // The decoded rows of model file `source` kept in (or read from) cache file `path` (model/decode_cache.h;
    // "": none): opened before the first decode, finished after the last.
    void open_cache(const std::string &path, const GgufFile &source) { cache_.open(path, source); }
    void finish_cache() { cache_.finish(); }
    const char *cache_state() const { return cache_.state(); }
    int64_t from_cache() const { return from_cache_; }  // tensors copied from the cache instead of decoded

private:
    struct Held {
        PageMemory rows;
        size_t kind = 0;  // its entry in tallies_
    };
    std::vector<Held> held_;
    std::vector<DecodeTally> tallies_;
    double seconds_ = 0.0;
    double usable_ = -1.0;
    DecodeCache cache_;
    int64_t from_cache_ = 0;  // usable_memory_bytes(), read at the first decode
};

}  // namespace pi
