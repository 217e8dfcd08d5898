#include "runtime/usable_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// C stdio and strtoull, not iostreams: every open crashed in the stream code here where the libstdc++ the process had
// loaded was not the compiler's (issue 53; docs/engine.md, "Linking: what the libraries export").
namespace pi {
namespace {

// The lines of a text file, one at a time (getline: no length limit); a file that cannot be opened has none.
class Lines {
public:
    explicit Lines(const std::string &path) : f_(std::fopen(path.c_str(), "re")) {}
    ~Lines() {
        std::free(line_);
        if (f_) std::fclose(f_);
    }
    Lines(const Lines &) = delete;
    Lines &operator=(const Lines &) = delete;
    // The next line without its newline, or nullptr at the end.
    const char *next() {
        if (!f_) return nullptr;
        const ssize_t n = getline(&line_, &cap_, f_);
        if (n < 0) return nullptr;
        if (n > 0 && line_[n - 1] == '\n') line_[n - 1] = '\0';
        return line_;
    }

private:
    FILE *f_;
    char *line_ = nullptr;
    size_t cap_ = 0;
};

// A byte count written as decimal digits (and blanks around them), or 0 for anything else: "max", a sign, garbage.
double parse_bytes(const char *s) {
    while (std::isspace(static_cast<unsigned char>(*s))) ++s;
    if (!std::isdigit(static_cast<unsigned char>(*s))) return 0;
    char *end = nullptr;
    errno = 0;
    const unsigned long long value = std::strtoull(s, &end, 10);
    if (errno == ERANGE) return 0;
    while (std::isspace(static_cast<unsigned char>(*end))) ++end;
    return *end == '\0' ? double(value) : 0;
}

// The least of `limit` and the memory limits of the cgroup at `path` (under `base`) and of every cgroup above it,
// as `file` states them ("max", v2's "no limit", a missing file or garbage leave `limit` as it is).
double cgroup_limit(const std::string &base, std::string path, const char *file, double limit) {
    while (true) {
        Lines in(base + (path == "/" ? "" : path) + "/" + file);
        const char *line = in.next();
        const double value = line ? parse_bytes(line) : 0;
        if (value > 0) limit = std::min(limit, value);
        if (path.empty() || path == "/") return limit;
        const size_t slash = path.rfind('/');
        path.resize(slash == std::string::npos ? 0 : slash);
    }
}

}  // namespace

double usable_memory_bytes(const std::string &proc, const std::string &cgroup_root, double limit) {
    Lines groups(proc + "/cgroup");
    while (const char *line = groups.next()) {  // "0::/path" (v2), "4:memory:/path" or "4:cpu,memory:/path" (v1)
        const char *a = std::strchr(line, ':'), *b = a ? std::strchr(a + 1, ':') : nullptr;
        if (!b) continue;
        const std::string controllers = "," + std::string(a + 1, b) + ",", path = b + 1;
        if (controllers == ",,")
            limit = cgroup_limit(cgroup_root, path, "memory.max", limit);
        else if (controllers.find(",memory,") != std::string::npos)
            limit = cgroup_limit(cgroup_root + "/memory", path, "memory.limit_in_bytes", limit);
    }
    return limit;
}

double usable_memory_bytes() {
    const double machine = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
    return usable_memory_bytes("/proc/self", "/sys/fs/cgroup", machine);
}

double process_anonymous_bytes(const std::string &proc) {
    Lines status(proc + "/status");
    while (const char *line = status.next()) {  // "RssAnon:\t    1234 kB"
        if (std::strncmp(line, "RssAnon:", 8) != 0) continue;
        char *end = nullptr;
        const double kib = std::strtod(line + 8, &end);
        return end == line + 8 ? 0 : kib * 1024;
    }
    return 0;
}

double process_anonymous_bytes() { return process_anonymous_bytes("/proc/self"); }

}  // namespace pi
