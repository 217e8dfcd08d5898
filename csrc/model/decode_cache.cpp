#include "model/decode_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace pi {
namespace {

constexpr char kMagic[4] = {'P', 'I', 'D', 'C'};
// Bumped whenever what decode.cpp makes of a tensor, or this file's layout, changes: a cache of another version is
// rewritten.
constexpr uint32_t kVersion = 2;
constexpr uint64_t kMaxEntries = uint64_t(1) << 20;
constexpr uint64_t kMaxName = uint64_t(1) << 12;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// A 64-bit checksum of n bytes, four independent lanes of multiply-rotate mixing (fast enough to verify a cache
// on every load; it detects damage, it does not resist tampering).
uint64_t checksum(const uint8_t *p, size_t n, uint64_t seed = 0) {
    const uint64_t k1 = 0x87c37b91114253d5ull, k2 = 0x4cf5ad432745937full;
    uint64_t h[4] = {0x9e3779b97f4a7c15ull ^ n, 0xc2b2ae3d27d4eb4full ^ seed, 0x165667b19e3779f9ull,
                     0x27d4eb2f165667c5ull};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 4; ++l) {
            uint64_t w;
            std::memcpy(&w, p + i + 8 * l, 8);
            h[l] = rotl(h[l] ^ (w * k1), 31) * k2;
        }
    uint64_t tail = 0;
    for (size_t j = 0; i < n; ++i, ++j) tail ^= uint64_t(p[i]) << (8 * (j % 8)) ^ uint64_t(j / 8) << 59;
    uint64_t out = h[0] ^ rotl(h[1], 17) ^ rotl(h[2], 29) ^ rotl(h[3], 43) ^ (tail * k2);
    out ^= out >> 33;
    out *= k1;
    return out ^ (out >> 29);
}

// A little-endian reader over the mapped index that fails softly: any read past the end leaves ok false.
struct Cursor {
    const uint8_t *p;
    uint64_t at, end;
    bool ok = true;
    template <typename T>
    T get() {
        T v{};
        if (!ok || end - at < sizeof(T)) {
            ok = false;
            return v;
        }
        std::memcpy(&v, p + at, sizeof(T));
        at += sizeof(T);
        return v;
    }
    std::string text(uint64_t n) {
        if (!ok || n > kMaxName || end - at < n) {
            ok = false;
            return {};
        }
        std::string s(reinterpret_cast<const char *>(p + at), size_t(n));
        at += n;
        return s;
    }
};

// What a cached tensor was decoded from: the tensor's bytes, seeded by its type and shape (the same bytes read as
// another type or shape decode to other rows).
uint64_t source_digest(const GgufTensor &t) {
    uint64_t seed = t.type;
    for (uint64_t n : t.ne) seed = rotl(seed, 21) * 0x100000001b3ull ^ n;
    return checksum(t.data, size_t(t.n_bytes), seed);
}

template <typename T>
void put(std::string &out, T v) {
    out.append(reinterpret_cast<const char *>(&v), sizeof(T));
}

bool write_all(int fd, const void *data, size_t n) {
    const char *p = static_cast<const char *>(data);
    while (n > 0) {
        const ssize_t w = ::write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w;
        n -= size_t(w);
    }
    return true;
}

}  // namespace

DecodeCache::~DecodeCache() {
    close_mapping();
    abandon_write();
}

void DecodeCache::close_mapping() {
    if (map_) munmap(const_cast<uint8_t *>(map_), map_bytes_);
    map_ = nullptr;
    map_bytes_ = 0;
}

void DecodeCache::abandon_write() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (!temp_.empty()) ::unlink(temp_.c_str());
    temp_.clear();
}

void DecodeCache::open(const std::string &path, const GgufFile &source) {
    if (path.empty()) return;
    path_ = path;
    source_stamp_ = source.stamp();
    // O_NONBLOCK: open(2) of a FIFO would wait for a writer
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) {
        struct stat cs {};
        const bool regular = ::fstat(fd, &cs) == 0 && S_ISREG(cs.st_mode);
        write_failed_ = !regular;  // not a file of ours: neither read nor replaced
        if (regular && cs.st_size >= 24) {
            void *m = mmap(nullptr, size_t(cs.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
            if (m != MAP_FAILED) {
                map_ = static_cast<const uint8_t *>(m);
                map_bytes_ = size_t(cs.st_size);
            }
        }
        ::close(fd);
    }
    SourceStamp recorded;
    bool valid = read_index();
    if (valid) std::memcpy(&recorded, map_ + stamp_at_, sizeof recorded);
    const auto same_bytes = [&] {
        for (const CachedRows &r : index_) {
            const GgufTensor *t = source.tensor(r.name);
            if (!t || source_digest(*t) != r.source_digest) return false;
        }
        return true;
    };
    const SourceMatch match = valid ? match_source(recorded, source_stamp_, same_bytes) : SourceMatch::Changed;
    if (match != SourceMatch::Changed) {
        mode_ = Mode::Read;
        if (match == SourceMatch::Bytes) record_stamp(path_, stamp_at_, source_stamp_);
        return;
    }
    close_mapping();
    index_.clear();
    mode_ = Mode::Write;  // the file is created by the first add(): a model that decodes nothing leaves none
}

bool DecodeCache::read_index() {
    if (!map_ || std::memcmp(map_, kMagic, 4) != 0) return false;
    const uint64_t size = map_bytes_;
    Cursor head{map_, 4, size};
    uint64_t index_at = 0;
    std::memcpy(&index_at, map_ + size - 8, 8);
    if (head.get<uint32_t>() != kVersion || index_at < 8 || index_at > size - 8) return false;
    Cursor c{map_, index_at, size - 8};
    stamp_at_ = index_at;
    c.get<SourceStamp>();
    const uint64_t n = c.get<uint64_t>();
    if (!c.ok || n > kMaxEntries) return false;
    for (uint64_t i = 0; i < n; ++i) {
        CachedRows r;
        r.name = c.text(c.get<uint64_t>());
        r.transposed = c.get<uint8_t>() != 0;
        r.type = c.get<uint32_t>();
        r.row_bytes = c.get<uint64_t>();
        r.offset = c.get<uint64_t>();
        r.bytes = c.get<uint64_t>();
        r.checksum = c.get<uint64_t>();
        r.source_digest = c.get<uint64_t>();
        if (!c.ok || r.offset < 8 || r.offset > index_at || r.bytes > index_at - r.offset ||
            checksum(map_ + r.offset, size_t(r.bytes)) != r.checksum)
            return false;
        index_.push_back(std::move(r));
    }
    return c.at == size - 8;
}

bool DecodeCache::read(const std::string &name, bool transposed, uint32_t type, size_t row_bytes, uint8_t *out,
                       size_t bytes) {
    if (mode_ != Mode::Read || finished_) return false;  // (a decode after load: Model::transpose_down)
    for (const CachedRows &r : index_)
        if (r.name == name && r.transposed == transposed) {
            if (r.type != type || r.row_bytes != row_bytes || r.bytes != bytes) break;
            std::memcpy(out, map_ + r.offset, bytes);
            return true;
        }
    stale_ = true;
    return false;
}

void DecodeCache::add(const GgufTensor &source, bool transposed, uint32_t type, size_t row_bytes, const uint8_t *data,
                      size_t bytes) {
    if (mode_ != Mode::Write || write_failed_ || finished_) return;
    if (fd_ < 0) {  // a new file, under a temporary name in the same directory
        temp_ = path_ + ".tmp." + std::to_string(::getpid());
        fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0644);
        std::string head(kMagic, 4);
        put<uint32_t>(head, kVersion);
        if (fd_ < 0 || !write_all(fd_, head.data(), head.size())) {
            write_failed_ = true;
            abandon_write();
            return;
        }
        written_ = head.size();
    }
    if (!write_all(fd_, data, bytes)) {
        write_failed_ = true;
        abandon_write();
        return;
    }
    index_.push_back(CachedRows{source.name, transposed, type, row_bytes, written_, bytes, checksum(data, bytes),
                                source_digest(source)});
    written_ += bytes;
}

void DecodeCache::finish() {
    if (finished_) return;
    finished_ = true;
    close_mapping();
    if (mode_ == Mode::Read) {
        if (stale_) ::unlink(path_.c_str());  // not what this file decodes to: the next load writes it anew
        return;
    }
    if (mode_ != Mode::Write || fd_ < 0) return;
    std::string tail;
    put<SourceStamp>(tail, recordable(source_stamp_));
    put<uint64_t>(tail, index_.size());
    for (const CachedRows &r : index_) {
        put<uint64_t>(tail, r.name.size());
        tail += r.name;
        put<uint8_t>(tail, r.transposed ? 1 : 0);
        put<uint32_t>(tail, r.type);
        put<uint64_t>(tail, r.row_bytes);
        put<uint64_t>(tail, r.offset);
        put<uint64_t>(tail, r.bytes);
        put<uint64_t>(tail, r.checksum);
        put<uint64_t>(tail, r.source_digest);
    }
    put<uint64_t>(tail, written_);
    const bool ok = write_all(fd_, tail.data(), tail.size()) && ::fsync(fd_) == 0 && ::close(fd_) == 0;
    fd_ = -1;
    if (!ok || ::rename(temp_.c_str(), path_.c_str()) != 0) {
        write_failed_ = true;
        abandon_write();
        return;
    }
    temp_.clear();
}

const char *DecodeCache::state() const {
    if (mode_ == Mode::Read) return "read";
    if (mode_ == Mode::Write) return write_failed_ ? "not written" : finished_ && !index_.empty() ? "written" : "off";
    return "off";
}

}  // namespace pi
