#include "backend/device_library.h"

#include <dlfcn.h>

#include <cstdlib>

#include "backend/library_check.h"
#include "runtime/common.h"

namespace pi {

std::string device_library_path(const std::string &path) {
    if (!path.empty()) return path;
    const char *env = std::getenv("PI_GPU_LIBRARY");
    return env ? env : "";
}

const pi_device_api &load_device_library(const std::string &requested) {
    const std::string path = device_library_path(requested);
    if (path.empty()) fail(PI_ERR_UNSUPPORTED, "no device library: this build has no CUDA library (install with nvcc on the PATH)");
    const std::string problem = library_problem(path, {"pi_device_api_get"});
    if (!problem.empty()) fail(PI_ERR_UNSUPPORTED, "cannot load the device library " + path + ": " + problem);
    // never closed: the loader counts the opens of a path and maps it once
    void *handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) fail(PI_ERR_UNSUPPORTED, "cannot load the device library " + path + ": " + dlerror());
    auto get = reinterpret_cast<pi_device_api_get_fn>(dlsym(handle, "pi_device_api_get"));
    if (!get) fail(PI_ERR_UNSUPPORTED, path + " is not a device library (no pi_device_api_get)");
    const pi_device_api *api = get();
    if (!api || api->api_version != PI_DEVICE_API_VERSION)
        fail(PI_ERR_UNSUPPORTED, path + " speaks device API " + std::to_string(api ? api->api_version : -1) +
                                     ", this engine " + std::to_string(PI_DEVICE_API_VERSION) + ": rebuild it");
    return *api;
}

}  // namespace pi
