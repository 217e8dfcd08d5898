#include "runtime/usable_memory.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

namespace pi {
namespace {

// The least of the memory limits of the cgroup at `path` (relative to `base`) and of every cgroup above it, as
// `file` states them ("max", v2's "no limit", does not parse and leaves `limit` as it is).
double cgroup_limit(const std::string &base, std::string path, const char *file, double limit) {
    while (true) {
        std::ifstream in(base + (path == "/" ? "" : path) + "/" + file);
        double value;
        if (in >> value && value > 0) limit = std::min(limit, value);
        if (path.empty() || path == "/") return limit;
        path = path.substr(0, path.rfind('/'));
    }
}

}  // namespace

double usable_memory_bytes() {
    double limit = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
    std::ifstream groups("/proc/self/cgroup");
    std::string line;
    while (std::getline(groups, line)) {  // "0::/path" (v2), "4:memory:/path" or "4:cpu,memory:/path" (v1)
        const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",", path = line.substr(b + 1);
        if (controllers == ",,")
            limit = cgroup_limit("/sys/fs/cgroup", path, "memory.max", limit);
        else if (controllers.find(",memory,") != std::string::npos)
            limit = cgroup_limit("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", limit);
    }
    return limit;
}

double process_anonymous_bytes() {
    std::ifstream status("/proc/self/status");
    std::string key;
    while (status >> key) {
        if (key == "RssAnon:") {
            double kib = 0;
            status >> kib;
            return kib * 1024;
        }
        status.ignore(1 << 16, '\n');
    }
    return 0;
}

}  // namespace pi
