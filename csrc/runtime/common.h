// Shared basics of the engine: the exception that carries a pi_status to the C API boundary, and a row's
// prefetch.
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "pi_engine.h"

namespace pi {

// `text` with control bytes (NUL above all: the message crosses the C API as a C string, which would end
// there) written as \xNN; messages quote names and values read from files.
inline std::string printable(const std::string &text) {
    static const char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(text.size());
    for (const unsigned char ch : text) {
        if (ch < 0x20 || ch == 0x7f) {
            out += "\\x";
            out += hex[ch >> 4];
            out += hex[ch & 15];
        } else {
            out += char(ch);
        }
    }
    return out;
}

// Thrown anywhere inside the engine; the C API turns it into a status code and pi_last_error().
struct EngineFailure : std::runtime_error {
    pi_status status;
    EngineFailure(pi_status s, const std::string &msg) : std::runtime_error(printable(msg)), status(s) {}
};

// A byte count for a message: "1.25 GiB".
inline std::string gib(double bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f GiB", bytes / double(1 << 30));
    return text;
}

[[noreturn]] inline void fail(pi_status status, const std::string &msg) { throw EngineFailure(status, msg); }

inline void require(bool ok, pi_status status, const std::string &msg) {
    if (!ok) fail(status, msg);
}

// Asks for every cache line a row touches, into L2 (the gathered kernels' hint). Rows start anywhere (324-byte
// q4_0 rows, 612-byte q8_0 ones), so the walk starts at the line holding the first byte and ends at the one
// holding the last: one prefetch per 64 bytes from the row's start would leave out the last line of every
// row that starts late in a line (half of the q8_0 rows).
inline void prefetch_row(const void *row, size_t bytes) {
    if (bytes == 0) return;
    const uintptr_t first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63);
    const uintptr_t last = reinterpret_cast<uintptr_t>(row) + bytes - 1;
    for (uintptr_t line = first; line <= last; line += 64) __builtin_prefetch(reinterpret_cast<const void *>(line), 0, 2);
}

}  // namespace pi
