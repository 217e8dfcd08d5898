// A device library (pi_device.h) loaded at run time: dlopen'd and kept for the process (a device
// runtime such as CUDA's does not unload cleanly), its API version checked.
#pragma once

#include <string>

#include "pi_device.h"

namespace pi {

// The library at `path` (or, for an empty path, the one PI_GPU_LIBRARY names); throws EngineFailure with
// PI_ERR_UNSUPPORTED saying why it cannot be used (missing, not a device library, another API version).
const pi_device_api &load_device_library(const std::string &path);

// The path load_device_library takes for `path`: itself, else PI_GPU_LIBRARY, else "" (none).
std::string device_library_path(const std::string &path);

}  // namespace pi
