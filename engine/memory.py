"""What this machine's memory gives the engine: the read rate of weight rows picked by index against rows read
in order (csrc/runtime/read_probe.h). The byte model prices every byte alike; this says how far apart they are here.
And the memory limits the engine checks a model against (csrc/runtime/usable_memory.h), read from files a test wrote.
"""
from __future__ import annotations

import ctypes
import os

from ._lib import UINT64_MAX, c_float, c_int, check, lib

DEFAULT_BUFFER_BYTES = 256 << 20  # 8x a 32 MiB last-level cache: each pass's region is past every cache


def read_rows_rate(row_bytes: int, density: float, threads: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                   passes: int = 4) -> float:
    """Bytes per second of rows of `row_bytes` read by `threads` threads: `density` of them picked at random (in
    ascending order, each asked for a few rows ahead, as a sparse decode step reads rows by index), or all of
    them in order at density 1. Best of `passes`."""
    out = ctypes.c_double()
    check(lib().pi_read_rows_rate(c_int("row_bytes", row_bytes, 0, UINT64_MAX), c_float("density", density),
                                  c_int("threads", threads), c_int("buffer_bytes", buffer_bytes, 0, UINT64_MAX),
                                  c_int("passes", passes), ctypes.byref(out)))
    return out.value


def memory_limits(proc: str | os.PathLike, cgroup_root: str | os.PathLike, machine_bytes: float) -> tuple[float, float]:
    """(usable bytes, anonymous bytes) as the engine's memory checks read them, from `proc` in place of /proc/self
    and `cgroup_root` in place of /sys/fs/cgroup: `machine_bytes` lowered by the limits of the cgroups proc/cgroup
    names, and RssAnon of proc/status. Tests point them at files of their own."""
    usable, anonymous = ctypes.c_double(), ctypes.c_double()
    check(lib().pi_memory_limits(os.fsencode(proc), os.fsencode(cgroup_root), c_float("machine_bytes", machine_bytes),
                                 ctypes.byref(usable), ctypes.byref(anonymous)))
    return usable.value, anonymous.value
