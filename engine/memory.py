"""What this machine's memory gives the engine: the read rate of weight rows picked by index against rows read
in order (csrc/runtime/read_probe.h). The byte model prices every byte alike; this says how far apart they are here."""
from __future__ import annotations

import ctypes

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
