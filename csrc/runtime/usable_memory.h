// The memory this process may use: the machine's, or less where its cgroup (or one above it) sets a lower limit.
#pragma once

namespace pi {

// Bytes: a container's limit is enforced by the kernel killing the process (the kernel's
// Documentation/admin-guide/cgroup-v2.rst, memory.max; cgroup-v1/memory.rst, memory.limit_in_bytes).
double usable_memory_bytes();

}  // namespace pi
