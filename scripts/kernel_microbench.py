"""Throughput of single engine kernels (GB/s of weight bytes read and ns per 32-value block), one thread.

A kernel runs over `--rows` rows of SmolLM2's width (576) that together fit in L2 (default), so the
figure is the kernel's compute cost rather than DRAM's; the best of `--passes` is kept (shared
machine). Used for docs/perf-notes.md: prediction vs outcome per kernel change.

    python scripts/kernel_microbench.py [--isa avx2] [--rows 256] [--n 576]
"""
from __future__ import annotations

import argparse
import ctypes
import time

import gguf
import numpy as np

from engine import kernels
from engine._lib import lib

Q = gguf.GGMLQuantizationType


def best(fn, passes: int) -> float:
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default=kernels.selected())
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--n", type=int, default=576)
    ap.add_argument("--passes", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n, rows = args.n, args.rows
    x = rng.normal(0, 1, n).astype(np.float32)
    xq = gguf.quants.quantize(x, Q.Q8_0)
    f = lib()
    for wtype, qt in (("q4_0", Q.Q4_0), ("q8_0", Q.Q8_0)):
        w = gguf.quants.quantize(rng.normal(0, 1, (rows, n)).astype(np.float32), qt)
        row_bytes = w.shape[1]
        base = w.ctypes.data
        out = ctypes.c_float()
        y = np.zeros(n, np.float32)
        tid = kernels.TYPE_IDS[wtype]
        isa = args.isa.encode()
        xp = xq.ctypes.data_as(ctypes.c_void_p)
        yp = y.ctypes.data_as(ctypes.c_void_p)

        def dots():
            for r in range(rows):
                f.pi_kernel_dot(isa, tid, n, ctypes.c_void_p(base + r * row_bytes), xp, ctypes.byref(out))

        def axpys():
            for r in range(rows):
                f.pi_kernel_axpy(isa, tid, n, 0.5, ctypes.c_void_p(base + r * row_bytes), yp)

        # the per-call ctypes overhead, measured with a zero-length-equivalent call, is subtracted
        def empty():
            for r in range(rows):
                f.pi_kernel_dot(isa, tid, 32, ctypes.c_void_p(base + r * row_bytes), xp, ctypes.byref(out))

        t0 = best(empty, args.passes)
        blocks = rows * n / 32
        for name, fn in (("dot", dots), ("axpy", axpys)):
            t = best(fn, args.passes) - t0 * (1 - 32 / n)
            print(f"{args.isa:8s} {wtype} {name:5s} {w.nbytes / t / 1e9:6.2f} GB/s  {t / blocks * 1e9:6.2f} ns/block")


if __name__ == "__main__":
    main()
