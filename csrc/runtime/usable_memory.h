// The memory this process may use: the machine's, or less where its cgroup (or one above it) sets a lower limit.
#pragma once

#include <string>

namespace pi {

// Bytes: a container's limit is enforced by the kernel killing the process (the kernel's
// Documentation/admin-guide/cgroup-v2.rst, memory.max; cgroup-v1/memory.rst, memory.limit_in_bytes).
double usable_memory_bytes();

// Bytes of anonymous memory this process holds now (RssAnon of /proc/self/status, the kernel's
// Documentation/filesystems/proc.rst): what the interpreter and libraries already took of that limit; mapped file
// pages are left out, the kernel can drop them.
double process_anonymous_bytes();

// The same read from other places, for tests (pi_memory_limits): `proc` stands for /proc/self (its cgroup and status
// files), `cgroup_root` for /sys/fs/cgroup; `limit` is the machine's memory, which the cgroups' limits can only lower.
double usable_memory_bytes(const std::string &proc, const std::string &cgroup_root, double limit);
double process_anonymous_bytes(const std::string &proc);

}  // namespace pi
