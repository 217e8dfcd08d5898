// What every entry point of the C API shares: the engine behind a handle, and the guard that turns whatever a
// call throws into a status code and pi_last_error()'s message, so no call aborts the process on bad input.
#pragma once

#include <new>
#include <string>

#include "engine/engine.h"
#include "pi_engine.h"
#include "runtime/common.h"

struct pi_engine {
    pi::Engine engine;
    pi_engine(const std::string &path, const pi_options &o, const std::string &hot_backend = "cpu")
        : engine(path, o, hot_backend) {}
};

namespace pi {

// The calling thread's message of its last failing call (pi_last_error).
std::string &last_error();

template <class F>
pi_status guarded(F &&f) {
    try {
        f();
        last_error().clear();
        return PI_OK;
    } catch (const pi::EngineFailure &e) {
        last_error() = e.what();
        return e.status;
    } catch (const std::bad_alloc &) {
        last_error() = "out of memory";
        return PI_ERR_MEMORY;
    } catch (const std::length_error &) {
        last_error() = "out of memory (requested size too large)";
        return PI_ERR_MEMORY;
    } catch (const std::exception &e) {
        last_error() = std::string("internal error: ") + e.what();
        return PI_ERR_INTERNAL;
    } catch (...) {
        last_error() = "internal error";
        return PI_ERR_INTERNAL;
    }
}

// pi_open with the hot tier on `hot_backend` (Engine's constructor names them).
pi_status open_engine(const char *path, const pi_options *opts, const char *hot_backend, pi_engine **out);

inline void need(const void *p, const char *what) {
    if (!p) pi::fail(PI_ERR_ARGUMENT, std::string(what) + " is NULL");
}

}  // namespace pi
