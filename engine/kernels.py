"""Direct access to single kernels of a named instruction set, for testing SIMD against scalar code."""
from __future__ import annotations

import ctypes

import numpy as np

from engine._lib import check, lib

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


def to_float(isa: str, wtype: str, n: int, w: np.ndarray) -> np.ndarray:
    w, out = _raw(w), np.zeros(n, dtype=np.float32)
    check(lib().pi_kernel_to_float(isa.encode(), TYPE_IDS[wtype], n, _ptr(w), _ptr(out)))
    return out


def quantize_q8_0(isa: str, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // 32 * 34, dtype=np.uint8)
    check(lib().pi_kernel_quantize_q8_0(isa.encode(), x.size, _ptr(x), _ptr(out)))
    return out
