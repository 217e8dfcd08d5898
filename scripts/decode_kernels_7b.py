"""The engine's q4_0 decode kernels on 7B-sized matrices (n_embd 4096, n_ff 11008), 1 and 2 threads, against the
read probes (engine.read_rows_rate at density 1, and the bench's numpy streaming probe).

Kernels as a dense decode step calls them:
  gemm8 packed, 4096 cols x 11008 rows  (dense FFN gate/up: 8-row groups)
  gemm8 packed, 4096 cols x 4096 rows   (attention q/k/v/o)
  axpy_rows ffn_down_t, 11008 rows of 4096, in runs of 256 rows into a 4096-float partial (sparse steps' down)
  axpy_quads the same rows in quads (kernels/packed.h), the same runs (a SiLU model's dense down; AVX-512 only)
  dot_rows by pointer, 11008 rows of 4096 (a sparse step's gate/up rows, all of them here)
"hot": one matrix resident in L2/L3 (the kernel's compute rate), "cold": cycling over MATS matrices (~1.2 GB),
each thread over its own half of every matrix's rows (as the pool splits them). Random nibbles, scale 0.01.

    python scripts/decode_kernels_7b.py [--mats 48] [--passes 5]
"""
from __future__ import annotations

import argparse
import ctypes
import threading
import time

import numpy as np

import powerinfer_engine as engine
from powerinfer_engine import kernels
from powerinfer_engine._lib import lib
from powerinfer_tools.bench import machine

E, F = 4096, 11008
BLK = E // 32
ROW = BLK * 18          # q4_0 row bytes at 4096 cols: 2304
PACKED = 144            # bytes of an 8-row packed q4_0 block
ptr = ctypes.c_void_p


def q4_rows(rows: int, rng) -> np.ndarray:
    a = rng.integers(0, 256, size=(rows, BLK, 18), dtype=np.uint8)
    a[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return a.reshape(rows, ROW)


def packed_of(m: np.ndarray) -> np.ndarray:
    return np.concatenate([kernels.pack8("q4_0", E, list(m[g:g + 8])) for g in range(0, m.shape[0], 8)])


def run_threads(fns):
    """fns: one callable per thread; returns (wall seconds for all, the longest thread's CPU seconds)."""
    cpu = [0.0] * len(fns)

    def wrap(i, f):
        def go():
            c0 = time.thread_time()
            f()
            cpu[i] = time.thread_time() - c0
        return go
    ts = [threading.Thread(target=wrap(i, f)) for i, f in enumerate(fns)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, max(cpu)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mats", type=int, default=48)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    f, isa, tid = lib(), kernels.selected().encode(), kernels.TYPE_IDS["q4_0"]
    print(f"isa {kernels.selected()}")
    x = np.zeros(BLK * 34, np.uint8).reshape(BLK, 34)
    x[:, 0:2] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    x[:, 2:] = rng.integers(-127, 128, size=(BLK, 32)).astype(np.int8).view(np.uint8)
    xp = ptr(x.ctypes.data)

    t0 = time.time()
    ffn = [q4_rows(F, rng) for _ in range(args.mats)]                 # gate/up/down_t-shaped, raw rows
    packed_ffn = [packed_of(m) for m in ffn[: args.mats // 2]]        # half as packed gate/up
    att = [q4_rows(E, rng) for _ in range(8)]
    packed_att = [packed_of(m) for m in att]
    print(f"built {sum(m.nbytes for m in ffn) / 1e9:.2f} GB raw + {sum(p.nbytes for p in packed_ffn) / 1e9:.2f} GB "
          f"packed in {time.time() - t0:.0f} s")
    rowptrs = [(ptr * F)(*[m.ctypes.data + r * ROW for r in range(F)]) for m in ffn]
    quads = [kernels.pack_quads(E, list(m)) for m in ffn] if kernels.selected() == "avx512" else []
    coef = np.full(F, 0.5, np.float32)

    def gemm8_job(p, rows, g0, g1, out):
        return lambda: f.pi_kernel_gemm8(isa, tid, E, g1 - g0, ptr(p.ctypes.data + g0 * BLK * PACKED), 1, xp,
                                         ptr(out.ctypes.data))

    def axpy_job(rp, r0, r1, part):
        def go():
            for c in range(r0, r1, 256):
                n = min(256, r1 - c)
                f.pi_kernel_axpy_rows(isa, tid, E, n, ctypes.cast(ctypes.byref(rp, c * 8), ctypes.c_void_p), 0,
                                      ptr(coef.ctypes.data + c * 4), ptr(part.ctypes.data))
        return go

    def quads_job(q, r0, r1, part):
        def go():
            for c in range(r0, r1, 256):
                f.pi_kernel_axpy_quads(isa, E, min(256, r1 - c), ptr(q.ctypes.data + c // 4 * BLK * 72),
                                       ptr(coef.ctypes.data + c * 4), ptr(part.ctypes.data))
        return go

    def dot_job(rp, r0, r1, out):
        return lambda: f.pi_kernel_dot_rows(isa, tid, E, r1 - r0, ctypes.cast(ctypes.byref(rp, r0 * 8), ctypes.c_void_p),
                                            xp, ptr(out.ctypes.data))

    outs = [np.zeros(F, np.float32) for _ in range(2)]
    parts = [np.zeros(E, np.float32) for _ in range(2)]

    def timed(kind, mats_idx, threads, rows):
        """seconds for one pass over the matrices listed, work split by rows across threads."""
        per = []
        for k in range(threads):
            jobs = []
            if kind in ("gemm8_ffn", "gemm8_att"):
                groups = rows // 8
                g0, g1 = groups * k // threads, groups * (k + 1) // threads
                for i in mats_idx:
                    p = packed_ffn[i] if kind == "gemm8_ffn" else packed_att[i]
                    jobs.append(gemm8_job(p, rows, g0, g1, outs[k]))
            else:
                r0, r1 = rows * k // threads, rows * (k + 1) // threads
                if kind in ("axpy", "quads"):  # whole runs of 256 rows per thread
                    r0, r1 = r0 // 256 * 256, r1 // 256 * 256 if k < threads - 1 else r1
                for i in mats_idx:
                    jobs.append(axpy_job(rowptrs[i], r0, r1, parts[k]) if kind == "axpy" else
                                quads_job(quads[i], r0, r1, parts[k]) if kind == "quads" else
                                dot_job(rowptrs[i], r0, r1, outs[k]))
            per.append(lambda jobs=jobs: [j() for j in jobs])
        return run_threads(per)

    def best(fn, passes):
        fn()
        r = [fn() for _ in range(passes)]
        return min(w for w, _ in r), min(c for _, c in r)

    threads_list = [int(t) for t in args.threads.split(",")]
    print("probes (GB/s): ", end="")
    for t in threads_list:
        seq = engine.read_rows_rate(ROW, 1.0, t)
        idx50 = engine.read_rows_rate(ROW, 0.5, t)
        npb = machine.read_bandwidth(t, 256 << 20)
        print(f"{t} thr: read_rows_rate(2304 B, all in order) {seq / 1e9:.1f}, at 50 % by index {idx50 / 1e9:.1f}, "
              f"numpy stream (bench's 'of limit') {npb / 1e9:.1f};  ", end="")
    print()
    cases = [("gemm8_ffn", F, len(packed_ffn), "gate/up gemm8 packed 11008x4096"),
             ("gemm8_att", E, len(packed_att), "attention gemm8 packed 4096x4096"),
             ("axpy", F, args.mats, "down axpy_rows down_t 11008x4096"),
             *([("quads", F, args.mats, "down axpy_quads down_t 11008x4096")] if quads else []),
             ("dot", F, args.mats, "dot_rows by index 11008x4096 (all rows)")]
    print(f"{'kernel':42s} {'thr':>3s} {'hot GB/s':>9s} {'cold GB/s':>10s}   (by CPU time: hot, cold)")
    for kind, rows, nm, label in cases:
        nbytes = rows * ROW
        for t in threads_list:
            hot, hot_c = (v / 10 for v in best(lambda: timed(kind, [0] * 10, t, rows), args.passes))
            cold, cold_c = (v / nm for v in best(lambda: timed(kind, list(range(nm)), t, rows), max(2, args.passes // 2)))
            print(f"{label:42s} {t:3d} {nbytes / hot / 1e9:9.1f} {nbytes / cold / 1e9:10.1f}   "
                  f"({nbytes / hot_c / 1e9:.1f}, {nbytes / cold_c / 1e9:.1f})", flush=True)


if __name__ == "__main__":
    main()
