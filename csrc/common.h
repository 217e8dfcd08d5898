// Shared basics of the engine: the exception that carries a pi_status to the C API boundary, and a row's
// prefetch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "pi_engine.h"

namespace pi {

// Thrown anywhere inside the engine; the C API turns it into a status code and pi_last_error().
struct EngineFailure : std::runtime_error {
    pi_status status;
    EngineFailure(pi_status s, const std::string &msg) : std::runtime_error(msg), status(s) {}
};

[[noreturn]] inline void fail(pi_status status, const std::string &msg) { throw EngineFailure(status, msg); }

inline void require(bool ok, pi_status status, const std::string &msg) {
    if (!ok) fail(status, msg);
}

// Asks for a row's cache lines, one per 64 bytes from its start, into L2 (the gathered kernels' hint).
inline void prefetch_row(const void *row, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const uint8_t *>(row) + off, 0, 2);
}

}  // namespace pi
