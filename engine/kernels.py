"""Direct access to single kernels of a named instruction set, for testing SIMD against scalar code."""
from __future__ import annotations

import ctypes

import numpy as np

from ._lib import check, lib

TYPE_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
BLOCK = {"f32": (1, 4), "f16": (1, 2), "q4_0": (32, 18), "q8_0": (32, 34)}


def available(isa: str) -> bool:
    return bool(lib().pi_isa_available(isa.encode()))


def selected() -> str:
    return lib().pi_isa_selected().decode()


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _raw(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w).view(np.uint8)


def dot(isa: str, wtype: str, n: int, w: np.ndarray, x: np.ndarray) -> float:
    """w: n elements stored as `wtype`; x: n f32 values (f32/f16) or n/32 q8_0 blocks (q4_0/q8_0)."""
    w, x, out = _raw(w), np.ascontiguousarray(x), ctypes.c_float()
    check(lib().pi_kernel_dot(isa.encode(), TYPE_IDS[wtype], n, _ptr(w), _ptr(x), ctypes.byref(out)))
    return out.value


def axpy(isa: str, wtype: str, n: int, a: float, w: np.ndarray, y: np.ndarray) -> np.ndarray:
    w, y = _raw(w), np.array(y, dtype=np.float32, copy=True)
    check(lib().pi_kernel_axpy(isa.encode(), TYPE_IDS[wtype], n, a, _ptr(w), _ptr(y)))
    return y


def dot4(isa: str, wtype: str, n: int, rows: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The dots of 4 stored rows with one operand x (as `dot`), in one call."""
    rows = [_raw(r) for r in rows]
    ptrs = (ctypes.c_void_p * 4)(*[r.ctypes.data for r in rows])
    x, out = np.ascontiguousarray(x), np.zeros(4, dtype=np.float32)
    check(lib().pi_kernel_dot4(isa.encode(), TYPE_IDS[wtype], n, ptrs, _ptr(x), _ptr(out)))
    return out


def dot_rows(isa: str, wtype: str, n: int, rows: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The dots of any number of stored rows, read by pointer, with one operand x (a sparse FFN's gathered
    rows): q4_0/q8_0 as gemm8 computes them, other types as `dot`."""
    rows = [_raw(r) for r in rows]
    ptrs = (ctypes.c_void_p * max(1, len(rows)))(*[r.ctypes.data for r in rows])
    x, out = np.ascontiguousarray(x), np.zeros(len(rows), dtype=np.float32)
    check(lib().pi_kernel_dot_rows(isa.encode(), TYPE_IDS[wtype], n, len(rows), ptrs, _ptr(x), _ptr(out)))
    return out


def axpy_rows(isa: str, wtype: str, n: int, rows: list[np.ndarray], col0: int, a: np.ndarray,
              y: np.ndarray) -> np.ndarray:
    """y + sum_r a[r] * rows[r][col0:col0 + n] (rows stored as wtype), in one call."""
    rows = [_raw(r) for r in rows]
    ptrs = (ctypes.c_void_p * max(1, len(rows)))(*[r.ctypes.data for r in rows])
    a = np.ascontiguousarray(a, dtype=np.float32)
    y = np.array(y, dtype=np.float32, copy=True)
    check(lib().pi_kernel_axpy_rows(isa.encode(), TYPE_IDS[wtype], n, len(rows), ptrs, col0, _ptr(a), _ptr(y)))
    return y


PACKED_BLOCK = {"q4_0": 144, "q8_0": 272}


def pack8(wtype: str, n: int, rows: list[np.ndarray]) -> np.ndarray:
    """8 stored rows in the engine's 8-row interleaved layout (attention and output head matrices)."""
    rows = [_raw(r) for r in rows]
    ptrs = (ctypes.c_void_p * 8)(*[r.ctypes.data for r in rows])
    out = np.zeros(n // 32 * PACKED_BLOCK.get(wtype, 0), dtype=np.uint8)
    check(lib().pi_kernel_pack8(TYPE_IDS[wtype], n, ptrs, _ptr(out)))
    return out


def pack_quads(n: int, rows: list[np.ndarray]) -> np.ndarray:
    """q4_0 rows in the 4-row layout a dense step's down projection reads (kernels/packed.h)."""
    rows = [_raw(r) for r in rows]
    ptrs = (ctypes.c_void_p * max(1, len(rows)))(*[r.ctypes.data for r in rows])
    out = np.zeros((len(rows) + 3) // 4 * (n // 32) * 72, dtype=np.uint8)
    check(lib().pi_kernel_pack_quads(n, len(rows), ptrs, _ptr(out)))
    return out


def axpy_quads(isa: str, n: int, n_rows: int, quads: np.ndarray, a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y + sum_r a[r] * row r over n_rows q4_0 rows packed by pack_quads (as axpy_rows over the rows)."""
    quads = _raw(quads)
    a = np.ascontiguousarray(a, dtype=np.float32)
    y = np.array(y, dtype=np.float32, copy=True)
    check(lib().pi_kernel_axpy_quads(isa.encode(), n, n_rows, _ptr(quads), _ptr(a), _ptr(y)))
    return y


def pack_columns8(isa: str, wtype: str, rows: list[np.ndarray], col0: int, n_cols: int) -> np.ndarray:
    """Columns [col0, col0 + n_cols) of stored q4_0/q8_0 rows, transposed and requantized to q8_0 8-row groups
    (gemm8's q8_0 layout; a batch's down projection in integers): group g holds columns col0 + 8g .. + 8."""
    rows = [_raw(r) for r in rows]
    ptrs = (ctypes.c_void_p * max(1, len(rows)))(*[r.ctypes.data for r in rows])
    out = np.zeros(n_cols // 8 * (len(rows) // 32) * PACKED_BLOCK["q8_0"], dtype=np.uint8)
    check(lib().pi_kernel_pack_columns8(isa.encode(), TYPE_IDS[wtype], len(rows), ptrs, col0, n_cols, _ptr(out)))
    return out


def gemm8(isa: str, wtype: str, n: int, packed: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The dots of every row of consecutive packed 8-row groups with each token's q8_0 operand: x holds one
    operand (n/32 blocks) per token, one after the other; returns [tokens, rows]."""
    packed, x = _raw(packed), np.ascontiguousarray(x).view(np.uint8)
    n_groups = packed.size // max(1, n // 32 * PACKED_BLOCK[wtype])
    n_tok = x.size // max(1, n // 32 * 34)
    out = np.zeros((n_tok, 8 * n_groups), dtype=np.float32)
    check(lib().pi_kernel_gemm8(isa.encode(), TYPE_IDS[wtype], n, n_groups, _ptr(packed), n_tok, _ptr(x), _ptr(out)))
    return out


def pack_columns(wtype: str, n_in: int, rows: list[np.ndarray], n_out: int, tile: int = 256) -> np.ndarray:
    """Stored q4_0/q8_0 rows as the first outputs of an n_out-output matrix in input sparsity's column layout
    (kernels/packed.h): per block of 32 inputs, the outputs' scales, then each input's quants over the outputs."""
    rows = [_raw(r) for r in rows]
    ptrs = (ctypes.c_void_p * max(1, len(rows)))(*[r.ctypes.data for r in rows])
    out = np.zeros(n_in // 32 * n_out * (2 + (16 if wtype == "q4_0" else 32)), dtype=np.uint8)
    check(lib().pi_kernel_pack_columns(TYPE_IDS[wtype], n_in, len(rows), ptrs, n_out, tile, _ptr(out)))
    return out


def gemv_columns(isa: str, wtype: str, n_in: int, n_out: int, packed: np.ndarray, x: np.ndarray, o0: int = 0,
                 o1: int | None = None, tile: int = 256) -> np.ndarray:
    """Outputs [o0, o1) of a column-layout matrix times one q8_0 operand, reading only the columns of its nonzero
    quants (input sparsity's decode step); the other outputs are left 0."""
    packed, x = _raw(packed), np.ascontiguousarray(x).view(np.uint8)
    y = np.zeros(n_out, dtype=np.float32)
    check(lib().pi_kernel_gemv_columns(isa.encode(), TYPE_IDS[wtype], n_in, n_out, tile, _ptr(packed), _ptr(x), o0,
                                       n_out if o1 is None else o1, _ptr(y)))
    return y


def gemm_f32(isa: str, h: np.ndarray, w: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y + h @ w (float32, row-major), as the batch down projection and attention compute it; w float16: as
    attention over a half-precision KV cache computes it (each element widened as it is read)."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    half = np.asarray(w).dtype == np.float16
    w = np.ascontiguousarray(w, dtype=np.float16 if half else np.float32)
    y = np.array(y, dtype=np.float32, copy=True)
    gemm = lib().pi_kernel_gemm_f16 if half else lib().pi_kernel_gemm_f32
    check(gemm(isa.encode(), h.shape[0], h.shape[1], w.shape[1], _ptr(h), _ptr(w), _ptr(y)))
    return y


def gemm_q8(isa: str, h: np.ndarray, q: np.ndarray, scales: np.ndarray, y: np.ndarray, columns: bool) -> np.ndarray:
    """y + h @ w for w a q8_0 KV cache (int8 q, float16 block scales in the layout of csrc/kernels/kv_q8.h): values
    (columns False: q [n_rows][n_cols], scales [n_rows][n_cols / 32]) or a key tile (columns True: q [n_rows][64],
    scales [n_rows / 32][64]; h @ w over the first y.shape[1] columns)."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    q = np.ascontiguousarray(q, dtype=np.int8)
    scales = np.ascontiguousarray(scales, dtype=np.float16)
    y = np.array(y, dtype=np.float32, copy=True)
    check(lib().pi_kernel_gemm_q8(isa.encode(), int(columns), h.shape[0], h.shape[1], y.shape[1], _ptr(h), _ptr(q),
                                  _ptr(scales), _ptr(y)))
    return y


def silu(isa: str, x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) elementwise, the engine's SiLU."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros_like(x)
    check(lib().pi_kernel_silu(isa.encode(), x.size, _ptr(x), _ptr(out)))
    return out


def softmax(isa: str, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """exp(scale x - max) / sum, the engine's attention softmax over one row of scores."""
    out = np.array(x, dtype=np.float32, copy=True)
    check(lib().pi_kernel_softmax(isa.encode(), out.size, scale, _ptr(out)))
    return out


def to_float(isa: str, wtype: str, n: int, w: np.ndarray) -> np.ndarray:
    w, out = _raw(w), np.zeros(n, dtype=np.float32)
    check(lib().pi_kernel_to_float(isa.encode(), TYPE_IDS[wtype], n, _ptr(w), _ptr(out)))
    return out


def quantize_q8_0(isa: str, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // 32 * 34, dtype=np.uint8)
    check(lib().pi_kernel_quantize_q8_0(isa.encode(), x.size, _ptr(x), _ptr(out)))
    return out
