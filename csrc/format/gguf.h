// A GGUF v2/v3 file (or PowerInfer's PWRI-magic variant) mapped read-only, with every header field
// checked against the file before anything points into it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/derived_file.h"

namespace pi {

enum GgufValueType : uint32_t {
    GV_UINT8 = 0, GV_INT8 = 1, GV_UINT16 = 2, GV_INT16 = 3, GV_UINT32 = 4, GV_INT32 = 5, GV_FLOAT32 = 6,
    GV_BOOL = 7, GV_STRING = 8, GV_ARRAY = 9, GV_UINT64 = 10, GV_INT64 = 11, GV_FLOAT64 = 12,
};

// One metadata value. Scalars are decoded; arrays keep their element type, count and (for numeric
// elements) a pointer to the packed elements inside the mapping.
struct GgufValue {
    uint32_t type = 0;
    bool is_int = false, is_float = false;
    int64_t i = 0;    // integer and bool scalars (u64 above INT64_MAX is rejected when read as int)
    uint64_t u = 0;   // raw unsigned value for u64
    double f = 0.0;   // float scalars
    std::string str;  // string scalars
    uint32_t array_type = 0;
    uint64_t array_count = 0;
    const uint8_t *array_data = nullptr;  // numeric arrays only
};

struct GgufTensor {
    std::string name;
    uint32_t type = 0;
    uint32_t n_dims = 0;
    uint64_t ne[4] = {1, 1, 1, 1};  // GGUF order: ne[0] is the row length
    uint64_t offset = 0;            // from the start of the data section
    uint64_t n_bytes = 0;
    const uint8_t *data = nullptr;
};

class GgufFile {
public:
    // Maps and validates `path`; throws EngineFailure (IO or FORMAT) with a one-line reason.
    explicit GgufFile(const std::string &path);
    ~GgufFile();
    GgufFile(const GgufFile &) = delete;
    GgufFile &operator=(const GgufFile &) = delete;

    const std::string &path() const { return path_; }
    bool pwri_magic() const { return pwri_; }
    uint64_t file_size() const { return size_; }
    // The file's stamp when it was mapped (runtime/derived_file.h): what files made from it record.
    const SourceStamp &stamp() const { return stamp_; }

    const GgufValue *find(const std::string &key) const;
    // The metadata keys that start with `prefix`, in order.
    std::vector<std::string> keys_with_prefix(const std::string &prefix) const;
    const GgufTensor *tensor(const std::string &name) const;
    const std::vector<GgufTensor> &tensors() const { return tensors_; }

    // Typed getters that name the key and the file in their errors.
    std::string get_string(const std::string &key) const;
    bool has(const std::string &key) const { return find(key) != nullptr; }
    int64_t get_int(const std::string &key, int64_t lo, int64_t hi) const;
    int64_t get_int_or(const std::string &key, int64_t fallback, int64_t lo, int64_t hi) const;
    double get_float_or(const std::string &key, double fallback) const;
    bool get_bool_or(const std::string &key, bool fallback) const;
    // A float32 array of exactly `count` finite values.
    std::vector<float> get_f32_array(const std::string &key, uint64_t count) const;
    // A bool array of exactly `count` values.
    std::vector<bool> get_bool_array(const std::string &key, uint64_t count) const;
    // Drops the mapped pages wholly inside [p, p + n) from this process's memory (they are read from the
    // file again if touched): for tensors the engine has copied into another layout.
    void release(const uint8_t *p, size_t n) const;
    // Where the mapped bytes [p, p + n) are in the file, or -1 where they are not all inside the mapping (a copy).
    int64_t offset_of(const uint8_t *p, size_t n) const {
        if (p < map_ || p > map_ + size_ || n > size_t(map_ + size_ - p)) return -1;
        return int64_t(p - map_);
    }

private:
    void parse();
    // the array under `key`, failing unless it holds exactly `count` values of `type`
    const GgufValue *find_array(const std::string &key, uint32_t type, const char *type_name, uint64_t count) const;

    std::string path_;
    const uint8_t *map_ = nullptr;
    uint64_t size_ = 0;
    SourceStamp stamp_;
    bool pwri_ = false;
    std::map<std::string, GgufValue> kv_;
    std::vector<GgufTensor> tensors_;
    std::map<std::string, size_t> tensor_index_;
};

}  // namespace pi
