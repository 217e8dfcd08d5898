#include "model/decode.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "format/dequant.h"
#include "format/types.h"
#include "kernels/kernels.h"
#include "runtime/common.h"
#include "runtime/usable_memory.h"

namespace pi {
namespace {

// Whether every bf16 value at p converts to a finite f16: below 65536 in magnitude (the largest bf16 under
// f16's limit of 65504 is 65280), not inf or nan.
bool bf16_fits_f16(const uint8_t *p, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        if ((h & 0x7fff) >= 0x4780) return false;
    }
    return true;
}

uint32_t target_type(const GgufTensor &t, int64_t out_cols) {
    if (t.type == TYPE_F32) return TYPE_F32;
    if (t.type == TYPE_BF16) return bf16_fits_f16(t.data, t.n_bytes / 2) ? TYPE_F16 : TYPE_F32;
    if (t.type == TYPE_F16 || out_cols % QK != 0) return TYPE_F16;
    return TYPE_Q8_0;
}

// n floats as one row of `type`.
void encode_row(uint32_t type, const float *x, int64_t n, uint8_t *out) {
    if (type == TYPE_Q8_0) {
        best_kernels().quantize_q8_0(int(n), x, out);
    } else if (type == TYPE_F16) {
        for (int64_t i = 0; i < n; ++i) {
            const uint16_t h = f32_to_f16(x[i]);
            std::memcpy(out + 2 * i, &h, 2);
        }
    } else {
        std::memcpy(out, x, size_t(n) * 4);
    }
}

// Calls work(i) for i < n on up to `threads` threads, each claiming the next i.
template <typename Work>
void parallel_for(int64_t n, int threads, Work work) {
    std::atomic<int64_t> next{0};
    auto run = [&] {
        for (int64_t i = next++; i < n; i = next++) work(i);
    };
    std::vector<std::thread> helpers;
    for (int k = 1; k < std::min<int64_t>(threads, n); ++k) helpers.emplace_back(run);
    run();
    for (std::thread &h : helpers) h.join();
}

// Transposed, a tensor is decoded in bands of this many stored columns (a multiple of every block size):
// each band's values are read once, then written out as that many rows.
constexpr int64_t kBand = 256;

}  // namespace

DecodedRows DecodedWeights::decode(const std::string &path, const GgufTensor &t, int64_t rows, int64_t cols,
                                   bool transpose, int threads) {
    const auto started = std::chrono::steady_clock::now();
    const int64_t out_rows = transpose ? cols : rows, out_cols = transpose ? rows : cols;
    const uint32_t to = target_type(t, out_cols);
    const TypeSize src = type_size(t.type), dst = type_size(to);
    const size_t src_row_bytes = size_t(cols / src.block) * src.bytes;
    DecodedRows out{to, size_t(out_cols / dst.block) * dst.bytes, nullptr};
    const size_t need = size_t(out_rows) * out.row_bytes;
    if (usable_ < 0.0) usable_ = usable_memory_bytes();
    if (usable_ > 0.0 && double(bytes() + need) > usable_) {
        const auto gib = [](double b) { return std::to_string(b / double(1 << 30)).substr(0, 8); };
        fail(PI_ERR_MEMORY, path + ": the weights decoded at load (" + src.name + " to " + dst.name + " at tensor " +
                                t.name + ") would take " + gib(double(bytes() + need)) + " GiB, more than the " +
                                gib(usable_) + " GiB this process may use (the machine's memory or its cgroup's " +
                                "limit); pi-tools convert --outtype q4_0 makes a file that runs as stored");
    }
    PageMemory buffer(need, false, "decoded weights");
    uint8_t *base = buffer.data();
    out.data = base;
    if (cache_.read(t.name, transpose, to, out.row_bytes, base, need)) {
        from_cache_ += 1;
    } else if (!transpose) {
        const int64_t chunk = 64;
        parallel_for((rows + chunk - 1) / chunk, threads, [&](int64_t c) {
            std::vector<float> x(static_cast<size_t>(cols));
            for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
                dequantize_row(t.type, t.data + size_t(r) * src_row_bytes, x.data(), cols);
                encode_row(to, x.data(), cols, base + size_t(r) * out.row_bytes);
            }
        });
    } else {
        parallel_for((cols + kBand - 1) / kBand, threads, [&](int64_t b) {
            const int64_t c0 = b * kBand, w = std::min(kBand, cols - c0);
            std::vector<float> band(static_cast<size_t>(rows * w)), column(static_cast<size_t>(rows));
            for (int64_t r = 0; r < rows; ++r)
                dequantize_row(t.type, t.data + size_t(r) * src_row_bytes + size_t(c0 / src.block) * src.bytes,
                               band.data() + r * w, w);
            for (int64_t j = 0; j < w; ++j) {
                for (int64_t r = 0; r < rows; ++r) column[size_t(r)] = band[size_t(r * w + j)];
                encode_row(to, column.data(), rows, base + size_t(c0 + j) * out.row_bytes);
            }
        });
    }
    cache_.add(t, transpose, to, out.row_bytes, base, need);
    auto tally = std::find_if(tallies_.begin(), tallies_.end(), [&](const DecodeTally &d) {
        return d.from == t.type && d.to == to && d.transposed == transpose;
    });
    if (tally == tallies_.end()) tally = tallies_.insert(tallies_.end(), DecodeTally{t.type, to, transpose});
    tally->tensors += 1;
    tally->bytes += buffer.size();
    tally->file_bytes += size_t(t.n_bytes);
    held_.push_back(Held{std::move(buffer), size_t(tally - tallies_.begin())});
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return out;
}

int64_t DecodedWeights::holder(const uint8_t *p) const {
    for (size_t i = 0; i < held_.size(); ++i) {
        const PageMemory &rows = held_[i].rows;
        if (!rows.empty() && p >= rows.data() && p < rows.data() + rows.size()) return int64_t(i);
    }
    return -1;
}

void DecodedWeights::discard(int64_t i) {
    Held &h = held_[size_t(i)];
    tallies_[h.kind].bytes -= h.rows.size();
    h.rows = PageMemory();
}

size_t DecodedWeights::bytes() const {
    size_t n = 0;
    for (const DecodeTally &d : tallies_) n += d.bytes;
    return n;
}

}  // namespace pi
