#include "format/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "runtime/common.h"
#include "format/types.h"
#include "pi_names.h"

namespace pi {
namespace {

constexpr uint64_t kMaxKeyLength = 1 << 16;
constexpr uint64_t kMaxNameLength = 1 << 12;

// Bounds-checked little-endian cursor over the mapped header.
class Cursor {
public:
    Cursor(const uint8_t *base, uint64_t size, const std::string &file) : base_(base), size_(size), file_(file) {}

    uint64_t pos() const { return pos_; }
    uint64_t left() const { return size_ - pos_; }

    [[noreturn]] void bad(const std::string &what) const {
        fail(PI_ERR_FORMAT, file_ + ": " + what + " (at byte " + std::to_string(pos_) + ")");
    }

    const uint8_t *take(uint64_t n, const char *what) {
        if (n > left()) bad(std::string("file ends inside ") + what);
        const uint8_t *p = base_ + pos_;
        pos_ += n;
        return p;
    }
    template <class T>
    T read(const char *what) {
        T v;
        std::memcpy(&v, take(sizeof(T), what), sizeof(T));
        return v;
    }
    std::string read_string(uint64_t max_len, const char *what) {
        const uint64_t len = read<uint64_t>(what);
        if (len > max_len) bad(std::string(what) + " length " + std::to_string(len) + " is implausible");
        if (len > left()) bad(std::string(what) + " of length " + std::to_string(len) + " runs past the end");
        const uint8_t *p = take(len, what);
        return std::string(reinterpret_cast<const char *>(p), len);
    }

private:
    const uint8_t *base_;
    uint64_t size_;
    uint64_t pos_ = 0;
    const std::string &file_;
};

uint64_t scalar_size(uint32_t type) {
    switch (type) {
        case GV_UINT8: case GV_INT8: case GV_BOOL: return 1;
        case GV_UINT16: case GV_INT16: return 2;
        case GV_UINT32: case GV_INT32: case GV_FLOAT32: return 4;
        case GV_UINT64: case GV_INT64: case GV_FLOAT64: return 8;
        default: return 0;
    }
}

void read_scalar(Cursor &c, uint32_t type, GgufValue &v) {
    switch (type) {
        case GV_UINT8: v.i = c.read<uint8_t>("u8 value"); v.is_int = true; break;
        case GV_INT8: v.i = c.read<int8_t>("i8 value"); v.is_int = true; break;
        case GV_UINT16: v.i = c.read<uint16_t>("u16 value"); v.is_int = true; break;
        case GV_INT16: v.i = c.read<int16_t>("i16 value"); v.is_int = true; break;
        case GV_UINT32: v.i = c.read<uint32_t>("u32 value"); v.is_int = true; break;
        case GV_INT32: v.i = c.read<int32_t>("i32 value"); v.is_int = true; break;
        case GV_INT64: v.i = c.read<int64_t>("i64 value"); v.is_int = true; break;
        case GV_UINT64:
            v.u = c.read<uint64_t>("u64 value");
            v.i = v.u > uint64_t(INT64_MAX) ? -1 : int64_t(v.u);
            v.is_int = v.u <= uint64_t(INT64_MAX);
            break;
        case GV_BOOL: {
            const uint8_t b = c.read<uint8_t>("bool value");
            if (b > 1) c.bad("bool value " + std::to_string(b) + " is neither 0 nor 1");
            v.i = b;
            v.is_int = true;
            break;
        }
        case GV_FLOAT32: v.f = c.read<float>("f32 value"); v.is_float = true; break;
        case GV_FLOAT64: v.f = c.read<double>("f64 value"); v.is_float = true; break;
        default: c.bad("unknown metadata value type " + std::to_string(type));
    }
}

}  // namespace

GgufFile::GgufFile(const std::string &path) : path_(path) {
    // O_NONBLOCK: a FIFO at the path opens at once and is refused below instead of waiting for a writer
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) fail(PI_ERR_IO, path + ": cannot open (" + std::strerror(errno) + ")");
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        fail(PI_ERR_IO, path + ": not a regular file");
    }
    size_ = uint64_t(st.st_size);
    stamp_ = stamp_of(st);
    if (size_ < 24) {
        ::close(fd);
        fail(PI_ERR_FORMAT, path + ": file of " + std::to_string(size_) + " bytes is too short for a GGUF header");
    }
    void *m = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) fail(PI_ERR_IO, path + ": mmap failed (" + std::strerror(errno) + ")");
    map_ = static_cast<const uint8_t *>(m);
    try {
        parse();
    } catch (...) {
        munmap(const_cast<uint8_t *>(map_), size_);
        map_ = nullptr;
        throw;
    }
}

void GgufFile::release(const uint8_t *p, size_t n) const {
    const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    if (!map_ || p < map_ || n > size_ || p > map_ + (size_ - n)) return;
    const uintptr_t begin = (uintptr_t(p) + page - 1) / page * page, end = (uintptr_t(p) + n) / page * page;
    if (begin < end) madvise(reinterpret_cast<void *>(begin), end - begin, MADV_DONTNEED);
}

GgufFile::~GgufFile() {
    if (map_) munmap(const_cast<uint8_t *>(map_), size_);
}

void GgufFile::parse() {
    Cursor c(map_, size_, path_);
    const uint8_t *magic = c.take(4, "magic");
    if (std::memcmp(magic, "GGUF", 4) == 0) {
        pwri_ = false;
    } else if (std::memcmp(magic, "PWRI", 4) == 0) {
        pwri_ = true;
    } else {
        char shown[32];
        std::snprintf(shown, sizeof shown, "%02x %02x %02x %02x", magic[0], magic[1], magic[2], magic[3]);
        fail(PI_ERR_FORMAT, path_ + ": not a GGUF/PowerInfer file (magic bytes " + shown + ", expected GGUF or PWRI)");
    }
    const uint32_t version = c.read<uint32_t>("version");
    if (version != 2 && version != 3)
        fail(PI_ERR_FORMAT, path_ + ": GGUF version " + std::to_string(version) + " is not supported (2 or 3)");
    const uint64_t n_tensors = c.read<uint64_t>("tensor count");
    const uint64_t n_kv = c.read<uint64_t>("metadata count");
    // Each entry needs at least a length field plus its type: bound counts before looping on them.
    if (n_kv > c.left() / 12) c.bad("metadata count " + std::to_string(n_kv) + " exceeds what the file can hold");
    if (n_tensors > c.left() / 28) c.bad("tensor count " + std::to_string(n_tensors) + " exceeds what the file can hold");

    for (uint64_t k = 0; k < n_kv; ++k) {
        std::string key = c.read_string(kMaxKeyLength, "metadata key");
        if (key.empty()) c.bad("empty metadata key");
        const uint32_t type = c.read<uint32_t>("metadata type");
        GgufValue v;
        v.type = type;
        if (type == GV_STRING) {
            v.str = c.read_string(c.left(), "string value");
        } else if (type == GV_ARRAY) {
            v.array_type = c.read<uint32_t>("array element type");
            v.array_count = c.read<uint64_t>("array length");
            if (v.array_type == GV_STRING) {
                if (v.array_count > c.left() / 8) c.bad("array of " + std::to_string(v.array_count) + " strings runs past the end");
                for (uint64_t j = 0; j < v.array_count; ++j) c.read_string(c.left(), "array string");
            } else if (v.array_type == GV_ARRAY) {
                c.bad("nested metadata arrays (key " + key + ") are not supported");
            } else {
                const uint64_t es = scalar_size(v.array_type);
                if (es == 0) c.bad("unknown array element type " + std::to_string(v.array_type) + " for key " + key);
                if (v.array_count > c.left() / es) c.bad("array " + key + " of " + std::to_string(v.array_count) + " elements runs past the end");
                v.array_data = c.take(v.array_count * es, "array");
                if (v.array_type == GV_BOOL)
                    for (uint64_t j = 0; j < v.array_count; ++j)
                        if (v.array_data[j] > 1) c.bad("bool array " + key + " holds a value that is neither 0 nor 1");
            }
        } else {
            read_scalar(c, type, v);
        }
        if (!kv_.emplace(key, std::move(v)).second) c.bad("duplicate metadata key " + key);
    }

    uint64_t alignment = 32;
    if (const GgufValue *a = find("general.alignment")) {
        // The GGUF spec asks for a multiple of 8; below that, f32/f16 tensors would be read misaligned.
        if (!a->is_int || a->type != GV_UINT32 || a->i < 8 || (a->i & (a->i - 1)) != 0 || a->i > (1 << 20))
            fail(PI_ERR_FORMAT, path_ + ": general.alignment must be a u32 power of two from 8 to 2^20");
        alignment = uint64_t(a->i);
    }

    const GgufValue *arch = find(names::kKeyArchitecture);
    const bool gpu_index = arch && arch->type == GV_STRING && arch->str == names::kGpuIndexArch;
    tensors_.reserve(size_t(n_tensors));
    for (uint64_t t = 0; t < n_tensors; ++t) {
        GgufTensor ti;
        ti.name = c.read_string(kMaxNameLength, "tensor name");
        if (ti.name.empty()) c.bad("empty tensor name");
        ti.n_dims = c.read<uint32_t>("tensor dimension count");
        if (ti.n_dims < 1 || ti.n_dims > 4)
            c.bad("tensor " + ti.name + " has " + std::to_string(ti.n_dims) + " dimensions (1 to 4 allowed)");
        uint64_t n_elems = 1;
        for (uint32_t d = 0; d < ti.n_dims; ++d) {
            ti.ne[d] = c.read<uint64_t>("tensor shape");
            if (ti.ne[d] > (uint64_t(1) << 40))
                c.bad("tensor " + ti.name + " has an implausible dimension " + std::to_string(ti.ne[d]));
            if (ti.ne[d] != 0 && n_elems > (uint64_t(1) << 50) / ti.ne[d])
                c.bad("tensor " + ti.name + " is implausibly large");
            n_elems *= ti.ne[d];  // an empty tensor (a dimension of 0) is legal and holds no bytes
        }
        ti.type = c.read<uint32_t>("tensor type");
        if (gpu_index && ti.type == TYPE_I32_POWERINFER) ti.type = TYPE_I32;
        const TypeSize ts = type_size(ti.type);
        if (ts.block == 0) c.bad("tensor " + ti.name + " has unknown type id " + std::to_string(ti.type));
        if (ti.ne[0] % ts.block != 0)
            c.bad("tensor " + ti.name + " row length " + std::to_string(ti.ne[0]) + " is not a multiple of the " +
                  ts.name + " block size " + std::to_string(ts.block));
        ti.n_bytes = n_elems / ts.block * ts.bytes;
        ti.offset = c.read<uint64_t>("tensor offset");
        if (ti.offset % alignment != 0)
            c.bad("tensor " + ti.name + " offset " + std::to_string(ti.offset) + " is not aligned to " + std::to_string(alignment));
        if (!tensor_index_.emplace(ti.name, tensors_.size()).second) c.bad("duplicate tensor name " + ti.name);
        tensors_.push_back(std::move(ti));
    }

    const uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
    for (GgufTensor &ti : tensors_) {
        if (data_start > size_ || ti.offset > size_ - data_start || ti.n_bytes > size_ - data_start - ti.offset)
            fail(PI_ERR_FORMAT, path_ + ": tensor " + ti.name + " (offset " + std::to_string(ti.offset) + ", " +
                                    std::to_string(ti.n_bytes) + " bytes) lies past the end of the file (" +
                                    std::to_string(size_) + " bytes): truncated or damaged");
        ti.data = map_ + data_start + ti.offset;
    }
    // Writers lay tensors out one after another; overlapping tensors would let a small file declare
    // (and make the engine copy or cache) far more data than it holds, so they are refused.
    std::vector<const GgufTensor *> by_offset;
    by_offset.reserve(tensors_.size());
    for (const GgufTensor &ti : tensors_)
        if (ti.n_bytes > 0) by_offset.push_back(&ti);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensor *a, const GgufTensor *b) { return a->offset < b->offset; });
    for (size_t k = 1; k < by_offset.size(); ++k)
        if (by_offset[k - 1]->offset + by_offset[k - 1]->n_bytes > by_offset[k]->offset)
            fail(PI_ERR_FORMAT, path_ + ": tensors " + by_offset[k - 1]->name + " and " + by_offset[k]->name +
                                    " overlap in the file");
}

const GgufValue *GgufFile::find(const std::string &key) const {
    auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
}

std::vector<std::string> GgufFile::keys_with_prefix(const std::string &prefix) const {
    std::vector<std::string> keys;
    for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it)
        keys.push_back(it->first);
    return keys;
}

const GgufTensor *GgufFile::tensor(const std::string &name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::string GgufFile::get_string(const std::string &key) const {
    const GgufValue *v = find(key);
    if (!v) fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is missing");
    if (v->type != GV_STRING) fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is not a string");
    return v->str;
}

int64_t GgufFile::get_int(const std::string &key, int64_t lo, int64_t hi) const {
    const GgufValue *v = find(key);
    if (!v) fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is missing");
    if (!v->is_int || v->type == GV_BOOL) fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is not an integer");
    if (v->i < lo || v->i > hi)
        fail(PI_ERR_FORMAT, path_ + ": " + key + " = " + std::to_string(v->i) + " is out of range [" +
                                std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return v->i;
}

int64_t GgufFile::get_int_or(const std::string &key, int64_t fallback, int64_t lo, int64_t hi) const {
    return has(key) ? get_int(key, lo, hi) : fallback;
}

bool GgufFile::get_bool_or(const std::string &key, bool fallback) const {
    const GgufValue *v = find(key);
    if (!v) return fallback;
    if (v->type != GV_BOOL) fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is not a bool");
    return v->i != 0;
}

double GgufFile::get_float_or(const std::string &key, double fallback) const {
    const GgufValue *v = find(key);
    if (!v) return fallback;
    double x;
    if (v->is_float) x = v->f;
    else if (v->is_int && v->type != GV_BOOL) x = double(v->i);
    else fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is not a number");
    if (!std::isfinite(x)) fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is not finite");
    return x;
}

const GgufValue *GgufFile::find_array(const std::string &key, uint32_t type, const char *type_name,
                                      uint64_t count) const {
    const GgufValue *v = find(key);
    if (!v) fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is missing");
    if (v->type != GV_ARRAY || v->array_type != type)
        fail(PI_ERR_FORMAT, path_ + ": metadata key " + key + " is not an array of " + type_name);
    if (v->array_count != count)
        fail(PI_ERR_FORMAT, path_ + ": " + key + " has " + std::to_string(v->array_count) + " values, expected " +
                                std::to_string(count));
    return v;
}

std::vector<bool> GgufFile::get_bool_array(const std::string &key, uint64_t count) const {
    const GgufValue *v = find_array(key, GV_BOOL, "bool", count);  // each 0 or 1, checked when read
    return std::vector<bool>(v->array_data, v->array_data + count);
}

std::vector<float> GgufFile::get_f32_array(const std::string &key, uint64_t count) const {
    const GgufValue *v = find_array(key, GV_FLOAT32, "f32", count);
    std::vector<float> out(count);
    std::memcpy(out.data(), v->array_data, count * 4);
    for (float x : out)
        if (!std::isfinite(x)) fail(PI_ERR_FORMAT, path_ + ": " + key + " holds a value that is not finite");
    return out;
}

}  // namespace pi
