// How fast this machine reads weight rows picked by index, against the same rows read in order: the price per
// byte that a sparse decode step pays and the byte model (powerinfer_tools/byte_model.py) does not see. DRAM
// serves a core only so many misses at a time (docs/engine.md, "Gathered rows"), so rows by index, each a few lines
// long, come slower than a stream the hardware prefetchers run ahead of. pi-tools bench records the rate
// beside the streaming bandwidth.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pi {

class ThreadPool;

// Bytes per second of rows read: `density` of the rows of `row_bytes` in a buffer of `buffer_bytes` (picked at
// random, read in ascending order, each row's lines asked for kProbeAhead rows before it is read, as the engine's
// gathered kernels do), the list split between the pool's threads in contiguous shares as a decode step splits a
// layer's rows. Density 1: every row in order, nothing asked for ahead (the hardware prefetchers' case). Each of
// `passes` passes reads its own region of the buffer, so no pass finds the previous one's rows in cache; the best
// pass counts (on a shared machine the slower ones measure the neighbours).
double read_rows_rate(ThreadPool &pool, size_t row_bytes, size_t buffer_bytes, double density, int passes,
                      uint64_t seed);

}  // namespace pi
