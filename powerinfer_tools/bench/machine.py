"""The machine a benchmark ran on: CPU model and SIMD flags, cores, memory, and the measured memory read
bandwidth that turns a byte count into a physical speed limit, with the rate of rows read by index beside it
(what a sparse step's bytes cost here).

The bandwidth is a streaming read of a buffer far larger than the last-level cache, split over the
benchmark's thread count (numpy's BLAS dot of each slice with itself reads it once and releases the
GIL, so Python threads run the slices in parallel). The best of a few passes is kept: on a shared
machine the slower passes measure the neighbours, not the memory.
"""
from __future__ import annotations

import os
import platform
import threading
import time

import numpy as np

# The flags that decide which kernels run (ours and llama.cpp's).
SIMD_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "amx_int8")


def _cpuinfo() -> dict[str, str]:
    """The first processor's entries of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def _total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class BandwidthProbe:
    """Streaming reads of one preallocated buffer by `threads` readers: bytes per second of the best pass.
    Kept for a whole benchmark, so that the bandwidth can be sampled between timed rounds at no allocation."""

    def __init__(self, threads: int, buffer_bytes: int = 512 << 20):
        self.data = np.ones(buffer_bytes // 4, dtype=np.float32)
        self.slices = np.array_split(self.data, max(1, threads))
        self._one_pass()  # page in the buffer

    def _one_pass(self) -> float:
        workers = [threading.Thread(target=np.dot, args=(s, s)) for s in self.slices]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    def measure(self, passes: int = 5) -> float:
        return self.data.nbytes / min(self._one_pass() for _ in range(passes))


def read_bandwidth(threads: int, buffer_bytes: int = 512 << 20, passes: int = 5) -> float:
    """Bytes per second one streaming read of `buffer_bytes` achieves with `threads` readers (best pass)."""
    return BandwidthProbe(threads, buffer_bytes).measure(passes)


# Shares of a matrix's rows the read probe picks by index (1: all of them, in order).
PROBE_DENSITIES = (0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 1.0)


def rows_by_index(row_bytes: int, threads: int, densities: tuple[float, ...] = PROBE_DENSITIES) -> dict:
    """How fast `threads` threads read rows of `row_bytes` picked by index at each density, against all of them in
    order (the engine's read probe: a sparse step's access pattern without its arithmetic), in bytes/s."""
    import powerinfer_engine as engine

    engine.read_rows_rate(int(row_bytes), 0.1, threads, 16 << 20)  # a process's first probe read low (~30 %)
    return {"row_bytes": int(row_bytes), "threads": threads, "density": list(densities),
            "bytes_per_second": [engine.read_rows_rate(int(row_bytes), d, threads) for d in densities]}


def machine_record(threads: int, measure_bandwidth: bool = True) -> dict:
    """What the benchmark's numbers depend on; bandwidths in bytes/s for 1 and `threads` readers."""
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    record = {
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "cores": usable_cores(),
        "memory_bytes": _total_memory_bytes(),
        "simd": [f for f in SIMD_FLAGS if f in flags],
        "flags": sorted(flags),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if measure_bandwidth:
        record["read_bandwidth"] = {"1": read_bandwidth(1), str(threads): read_bandwidth(threads)}
    return record
