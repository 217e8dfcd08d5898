// The rows DecodedWeights makes at load (model/decode.h), kept in a file of their own, so that a later load of
// the same model file copies them instead of decoding again (a llama.cpp K-quant file: seconds at every load).
//
// The file: "PIDC" and a version, each tensor's rows, then an index (the model file's stamp; per tensor: name,
// transposed, type, row bytes, offset, length, checksum, and the digest of the model file's bytes it was decoded
// from) and the index's offset. It is trusted only whole: every bound and every checksum is verified before a row
// of it is used, and it is the model file's by runtime/derived_file.h's rule (the stamp, else the digests of the
// tensors' bytes in the model file now); anything else (missing, damaged, another model file, another version)
// and the load decodes and writes it anew, under a temporary name renamed when the load completes. A cache that
// cannot be written costs the next load its decoding, never this one; a path that holds something other than a
// regular file (a FIFO, a directory) is neither read nor replaced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "runtime/derived_file.h"

namespace pi {

struct CachedRows {
    std::string name;
    bool transposed = false;
    uint32_t type = 0;
    uint64_t row_bytes = 0, offset = 0, bytes = 0, checksum = 0;
    uint64_t source_digest = 0;  // of the model file's tensor it was decoded from (its bytes, type and shape)
};

class DecodeCache {
public:
    DecodeCache() = default;
    DecodeCache(const DecodeCache &) = delete;
    DecodeCache &operator=(const DecodeCache &) = delete;
    ~DecodeCache();

    // path: the cache file ("" for none); source: the model file it is for.
    void open(const std::string &path, const GgufFile &source);
    // Copies the cached rows of tensor `name` into out when the cache holds them in this form; false otherwise.
    bool read(const std::string &name, bool transposed, uint32_t type, size_t row_bytes, uint8_t *out, size_t bytes);
    // Keeps rows decoded from `source` by this load for the file being written (nothing when the cache was read).
    void add(const GgufTensor &source, bool transposed, uint32_t type, size_t row_bytes, const uint8_t *data,
             size_t bytes);
    // At the end of the load: a written file renamed into place; a read one that lacked a tensor removed.
    void finish();
    // "off", "read", "written", or "not written" (the directory or disk refused it).
    const char *state() const;

private:
    enum class Mode { Off, Read, Write };
    void close_mapping();
    void abandon_write();
    // The index of the mapped file, checked whole; false where anything is out of bounds or damaged.
    bool read_index();

    Mode mode_ = Mode::Off;
    std::string path_, temp_;
    SourceStamp source_stamp_;
    uint64_t stamp_at_ = 0;  // where the read file's index records the stamp
    // reading: the cache file mapped, and its verified index
    const uint8_t *map_ = nullptr;
    size_t map_bytes_ = 0;
    std::vector<CachedRows> index_;
    bool stale_ = false;  // a tensor this load decoded was not in the cache read
    // writing
    int fd_ = -1;
    uint64_t written_ = 0;
    bool write_failed_ = false, finished_ = false;
};

}  // namespace pi
