// The identity of a file derived from another, its source: the decode cache of a model file (model/decode_cache.h),
// the neuron bundles of a GGUF (model/disk_tier.h). One rule for both (docs/engine.md, "What identifies a file made
// from the model"):
//  - the derived file records a digest of the source bytes it was made from, and the source's stamp (SourceStamp);
//  - a recorded stamp equal to the source's accepts it without reading the source: touch -r, tar and os.utime set
//    the modification time but not the change time (they set that to now), every write sets both, and a file
//    renamed over the source has another inode;
//  - any other stamp (the source copied, restored, touched, rewritten) and the digest decides: recomputed from the
//    source's bytes, equal accepts it and the stamp is recorded anew, unequal refuses it;
//  - a stamp taken less than kSettleNs after the source's last change is recorded as none (zeros, no file's stamp):
//    a change within the same tick of the file system's clock would leave the source's times as they were.
// It does not guard a load against a source rewritten while it is read.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <string>

namespace pi {

// Little-endian on disk, as laid out here.
struct SourceStamp {
    uint64_t dev = 0, ino = 0, size = 0;
    int64_t mtime_ns = 0, ctime_ns = 0;
};
static_assert(sizeof(SourceStamp) == 40, "a recorded stamp is 40 bytes");

// A source changed less than this long ago is checked by its bytes: file system clocks as coarse as 2 s included.
constexpr int64_t kSettleNs = 2000000000;

SourceStamp stamp_of(const struct stat &st);

enum class SourceMatch { Stamp, Bytes, Changed };
// The rule above: `recorded` equal to `now` (and not none) is Stamp; otherwise bytes_equal() says Bytes or Changed.
SourceMatch match_source(const SourceStamp &recorded, const SourceStamp &now, const std::function<bool()> &bytes_equal);

// After a Bytes match: writes `now` at `offset` of the derived file `path`, unless `now` is too recent to record.
// A stamp that cannot be written (a read-only file) costs the next open the same check of the bytes; a write torn
// by a crash leaves a stamp that matches no file, which costs the same.
void record_stamp(const std::string &path, uint64_t offset, const SourceStamp &now);

// What a derived file written now records of `s`: s, or none where the source changed less than kSettleNs ago.
SourceStamp recordable(const SourceStamp &s);

}  // namespace pi
