// The units a pool job's size is counted in, to cut it into chunks (ThreadPool::chunks_for): multiply-adds of
// the packed kernels, and what other reads are worth in them.
#pragma once

#include <cstdint>

namespace pi {

const int64_t kGrain = 1 << 16;     // multiply-adds below which a chunk is not worth handing to another thread
const int64_t kCacheReadCost = 16;  // multiply-adds a float read from the KV cache is worth (it misses the caches)
const int64_t kRowDotCost = 8;      // the same for a multiply-add of an f32/f16 row (no packed groups)

// Packed 8-row groups per pass over a batch's tokens (~40 KB at n_embd 576, q4_0), and for one token (nothing
// to reuse across tokens, longer lists).
const int64_t kGroupsPerPass = 16;
const int64_t kDecodeGroupsPerPass = 64;
static_assert(kDecodeGroupsPerPass >= kGroupsPerPass, "the gate/up lists are sized for the longer pass");

}  // namespace pi
