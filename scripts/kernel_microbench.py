"""Throughput of the engine's row kernels (GB/s of weight bytes read, ns per 32-value row-block), one thread.

Each kernel runs as the decode step calls it, on half the rows of SmolLM2-wide matrices (576 values) picked
at random and sorted, or on all of them in order:

* `gemm8` over packed 8-row groups (attention, output head, a dense FFN's gate/up),
* `dot_rows` over gathered rows (a sparse FFN's gate/up rows read by index),
* `axpy_rows` over gathered rows (the down projection's `ffn_down_t` rows), and over all of them in order,
* `axpy_quads` (q4_0, the SIMD sets) over all of them in quads (a SiLU model's dense decode step),
* `gemv_columns` over the column layout of the same matrices (input sparsity's decode step), the `--drop` share
  of the inputs zeroed (the smallest |x|, 0.25 by default): its GB/s counts the bytes it reads (the kept inputs'
  columns and every block's scales), to set against gemm8's over the whole matrix (the rate at which the skipped
  bytes pay).

and as a prompt batch calls them on one L2-resident tile (`--tokens` tokens, 128 by default):

* `gemm8` over a packed tile of 128 rows x 1024 values (a batch's gate/up, or attention),
* the batch down projection in integers over the same number of weights, a panel of 1024 `ffn_down_t` rows x
  128 columns: `pack_columns8` (the panel's transpose requantized to q8_0 groups) then `gemm8` on them,
* `gemm_f32` over the panel already widened to floats (the float path it replaced, without its widening).

Batch rows give GB/s of the tile's stored bytes per batch call and ns per 32-value block per token.

"hot": one matrix, cache-resident at SmolLM2's width (the kernel's compute cost); "cold": the same call over 60 such
matrices (~30 MB at SmolLM2's width, more than this machine's L3 share), DRAM latency and bandwidth included. One C call per
matrix, so the ctypes overhead (~1 us) is small against the work; the best of `--passes` is kept (shared
machine). Used for docs/log/perf-notes.md: prediction vs outcome per kernel change.

    python scripts/kernel_microbench.py [--isa avx2] [--passes 20] [--tokens 128]
    python scripts/kernel_microbench.py --cols 4096 --rows 11008 --matrices 4   # the 7B shape's gate/up
    python scripts/kernel_microbench.py --cols 4096 --rows 14336 --matrices 2   # Llama-3.1-8B's down_t
"""
from __future__ import annotations

import argparse
import ctypes
import time

import gguf
import numpy as np

from powerinfer_engine import EngineError, kernels
from powerinfer_engine._lib import lib

Q = gguf.GGMLQuantizationType
COLS, N_ROWS, N_MATRICES = 576, 1536, 60  # the defaults: SmolLM2's gate/up
PANEL_ROWS, TILE_COLS = 1024, 128  # csrc/backend/cpu_backend.cpp kDownPanelRows, kDownTileCols
PACKED_BLOCK = {"q4_0": 144, "q8_0": 272}


def tile_fits(n_out: int, tile: int, threads: int) -> bool:
    n_tiles = -(-n_out // tile)
    return n_tiles >= threads and -(-n_tiles // threads) * tile <= 1.15 * n_out / threads


def has_quads(isa: str) -> bool:
    """Whether the set has axpy_quads (kernels.h: the SIMD sets)."""
    try:
        kernels.axpy_quads(isa, 32, 1, kernels.pack_quads(32, [np.zeros(18, np.uint8)]), np.ones(1), np.zeros(32))
    except EngineError:
        return False
    return True


def best(fn, passes: int) -> float:
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default=kernels.selected())
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the batch kernels (default 128)")
    ap.add_argument("--cols", type=int, default=COLS, help=f"values per row (inputs) of the decode kernels' matrices "
                    f"(default {COLS}; 4096: the 7B shape)")
    ap.add_argument("--rows", type=int, default=N_ROWS, help=f"rows (outputs) of each (default {N_ROWS}; 11008: the 7B "
                    f"shape's gate/up)")
    ap.add_argument("--matrices", type=int, default=N_MATRICES, help=f"matrices cycled for the cold column (default "
                    f"{N_MATRICES}; fewer at the 7B shape)")
    ap.add_argument("--drop", type=float, default=0.25, help="share of inputs gemv_columns finds zeroed (default 0.25)")
    args = ap.parse_args()
    if args.tokens < 1:
        raise SystemExit("kernel_microbench: --tokens must be at least 1")
    if args.cols < 32 or args.cols % 32 or args.rows < 128 or args.rows % 128 or args.matrices < 1:
        raise SystemExit("kernel_microbench: --cols must be a multiple of 32, --rows of 128, --matrices at least 1")
    if not 0 <= args.drop < 1:
        raise SystemExit("kernel_microbench: --drop must be in [0, 1)")
    rng = np.random.default_rng(0)
    N, ROWS, MATRICES = args.cols, args.rows, args.matrices
    f, isa = lib(), args.isa.encode()
    x = rng.normal(0, 1, N).astype(np.float32)
    xq = gguf.quants.quantize(x, Q.Q8_0)
    x[np.abs(x) <= np.quantile(np.abs(x), args.drop)] = 0.0
    xz = gguf.quants.quantize(x, Q.Q8_0)  # the operand of gemv_columns: its dropped inputs zero
    n_kept = int(np.count_nonzero(xz.reshape(-1, 34)[:, 2:]))
    y = np.zeros(N, np.float32)
    coef = np.full(ROWS, 0.5, np.float32)
    out = np.zeros(ROWS, np.float32)
    ptr = ctypes.c_void_p
    xp, yp, cp, op, zp = (ptr(a.ctypes.data) for a in (xq, y, coef, out, xz))
    print(f"{'isa':8s} {'type':5s} {'kernel':10s} {'rows':10s} {'hot GB/s':>9s} {'ns/blk':>7s} {'cold GB/s':>10s} {'ns/blk':>7s}")
    for wtype, qt in (("q4_0", Q.Q4_0), ("q8_0", Q.Q8_0)):
        tid = kernels.TYPE_IDS[wtype]
        mats = [gguf.quants.quantize(rng.normal(0, 1, (ROWS, N)).astype(np.float32), qt) for _ in range(MATRICES)]
        row_bytes = mats[0].shape[1]
        half = [np.sort(rng.choice(ROWS, ROWS // 2, replace=False)) for _ in range(MATRICES)]
        gathered = [(ptr * len(h))(*[m.ctypes.data + int(r) * row_bytes for r in h]) for m, h in zip(mats, half)]
        every = [(ptr * ROWS)(*[m.ctypes.data + r * row_bytes for r in range(ROWS)]) for m in mats]
        quads = [kernels.pack_quads(N, list(m)) for m in mats] if wtype == "q4_0" and has_quads(args.isa) else []
        packed = [np.concatenate([kernels.pack8(wtype, N, list(m[g:g + 8])) for g in range(0, ROWS, 8)]) for m in mats]
        n_half = ROWS // 2
        # the engine's tile at 2 threads (Engine::column_tile): the widest giving no thread over 1.15x an even share
        tile = next(t for t in (1024, 512, 256) if t == 256 or tile_fits(ROWS, t, threads=2))
        columns = [kernels.pack_columns(wtype, N, list(m), ROWS, tile) for m in mats]
        col_bytes = ROWS // 2 if wtype == "q4_0" else ROWS

        def gemm8(k):
            f.pi_kernel_gemm8(isa, tid, N, ROWS // 8, ptr(packed[k].ctypes.data), 1, xp, op)

        def dot_rows(k):
            f.pi_kernel_dot_rows(isa, tid, N, n_half, gathered[k], xp, op)

        def axpy_rows(k):
            f.pi_kernel_axpy_rows(isa, tid, N, n_half, gathered[k], 0, cp, yp)

        def axpy_all(k):
            f.pi_kernel_axpy_rows(isa, tid, N, ROWS, every[k], 0, cp, yp)

        def axpy_quads(k):
            f.pi_kernel_axpy_quads(isa, N, ROWS, ptr(quads[k].ctypes.data), cp, yp)

        def gemv_columns(k):
            f.pi_kernel_gemv_columns(isa, tid, N, ROWS, tile, ptr(columns[k].ctypes.data), zp, 0, ROWS, op)

        kept_bytes = n_kept * col_bytes + N // 32 * 2 * ROWS
        cases = [("gemm8", gemm8, ROWS * row_bytes, "all, packed"),
                 ("dot_rows", dot_rows, n_half * row_bytes, "half, index"),
                 ("axpy_rows", axpy_rows, n_half * row_bytes, "half, index"),
                 ("axpy_rows", axpy_all, ROWS * row_bytes, "all, index"),
                 ("gemv_cols", gemv_columns, kept_bytes, f"{n_kept / N:.2f} kept")]
        if quads:
            cases.insert(4, ("axpy_quads", axpy_quads, ROWS * row_bytes, "all, quads"))
        for name, fn, nbytes, which in cases:
            blocks = nbytes / row_bytes * N / 32
            hot = best(lambda: [fn(0) for _ in range(10)], args.passes) / 10
            cold = best(lambda: [fn(k) for k in range(MATRICES)], max(3, args.passes // 4)) / MATRICES
            print(f"{args.isa:8s} {wtype:5s} {name:10s} {which:10s} {nbytes / hot / 1e9:9.1f} {hot / blocks * 1e9:7.2f} "
                  f"{nbytes / cold / 1e9:10.1f} {cold / blocks * 1e9:7.2f}")


    batch(args, rng)


def batch(args, rng) -> None:
    """The batch kernels on one tile (module docstring)."""
    f, isa, ptr, T = lib(), args.isa.encode(), ctypes.c_void_p, args.tokens
    h = rng.normal(0, 1, (T, PANEL_ROWS)).astype(np.float32)
    hq = np.ascontiguousarray(gguf.quants.quantize(h, Q.Q8_0))
    tile = np.zeros(TILE_COLS // 8 * PANEL_ROWS // 32 * PACKED_BLOCK["q8_0"], np.uint8)
    out = np.zeros((T, max(TILE_COLS, PANEL_ROWS)), np.float32)
    y = np.zeros((T, TILE_COLS), np.float32)
    blocks = PANEL_ROWS * TILE_COLS / 32 * T
    print(f"\n{'isa':8s} {'type':5s} {'batch kernel':34s} {'tokens':>6s} {'GB/s':>7s} {'ns/blk/tok':>11s}")
    for wtype, qt in (("q4_0", Q.Q4_0), ("q8_0", Q.Q8_0)):
        tid = kernels.TYPE_IDS[wtype]
        down_t = np.ascontiguousarray(gguf.quants.quantize(rng.normal(0, 1, (PANEL_ROWS, TILE_COLS)).astype(np.float32), qt))
        rows = (ptr * PANEL_ROWS)(*[down_t.ctypes.data + r * down_t.shape[1] for r in range(PANEL_ROWS)])
        gate = np.ascontiguousarray(gguf.quants.quantize(rng.normal(0, 1, (TILE_COLS, PANEL_ROWS)).astype(np.float32), qt))
        packed = np.concatenate([kernels.pack8(wtype, PANEL_ROWS, list(gate[g:g + 8])) for g in range(0, TILE_COLS, 8)])
        widened = gguf.quants.dequantize(down_t, qt).astype(np.float32)
        nbytes = down_t.nbytes

        def pack():
            f.pi_kernel_pack_columns8(isa, tid, PANEL_ROWS, rows, 0, TILE_COLS, ptr(tile.ctypes.data))

        def down_int():
            pack()
            f.pi_kernel_gemm8(isa, kernels.TYPE_IDS["q8_0"], PANEL_ROWS, TILE_COLS // 8, ptr(tile.ctypes.data), T,
                              ptr(hq.ctypes.data), ptr(out.ctypes.data))

        def gate_gemm8():
            f.pi_kernel_gemm8(isa, tid, PANEL_ROWS, TILE_COLS // 8, ptr(packed.ctypes.data), T, ptr(hq.ctypes.data),
                              ptr(out.ctypes.data))

        def down_f32():
            f.pi_kernel_gemm_f32(isa, T, PANEL_ROWS, TILE_COLS, ptr(h.ctypes.data), ptr(widened.ctypes.data),
                                 ptr(y.ctypes.data))

        for name, fn, per_token in (("gemm8 (gate/up tile)", gate_gemm8, True),
                                    ("down: pack_columns8 + gemm8 q8_0", down_int, True),
                                    ("down: pack_columns8 alone", pack, False),
                                    ("down: gemm_f32 on widened rows", down_f32, True)):
            t = best(fn, args.passes)
            per_blk = f"{t / blocks * 1e9:11.3f}" if per_token else f"{'':>11s}"
            print(f"{args.isa:8s} {wtype:5s} {name:34s} {T if per_token else '':>6} {nbytes / t / 1e9:7.2f} {per_blk}")


if __name__ == "__main__":
    main()
