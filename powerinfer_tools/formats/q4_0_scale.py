"""q4_0 blocks whose scale is searched per block for the least squared error, in ggml's q4_0 layout.

ggml's reference quantizer (quantize_row_q4_0_ref, what gguf-py and llama.cpp's quantizer without an importance
matrix write) takes d = m / -8 for the block's value m of largest magnitude. A q4_0 block holds a scale and 32
values q in [-8, 7] (x ~ d * q), and d = m / -8 is not the best one: a slightly larger step can land more values
near a level. Here d = m / s for s from -8 to -6.5 (the reference first), the values rounded against d as stored
(f16), and the block keeps the d of least squared error, so no block is worse than the reference's; the search
follows the idea of llama.cpp's make_qx_quants (ggml-quants.c), without weights. Same format: every reader of
q4_0 (this engine, PowerInfer, llama.cpp) reads the blocks as they are. docs/bench.md, "Quantizer quality",
measures what it changes.
"""
from __future__ import annotations

import numpy as np

QK = 32
STEPS = np.arange(-8.0, -6.45, 0.1)  # m / STEPS[i] is a candidate scale; -8 is the reference's
CHUNK_BLOCKS = 2048  # blocks searched at a time: the search's temporaries stay in the CPU's caches


def quantize(rows: np.ndarray) -> np.ndarray:
    """float32 rows (a multiple of 32 values each) as q4_0 blocks: uint8 [n_rows, n_cols / 32 * 18]."""
    n_rows = rows.shape[0]
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, QK)
    blocks = [_search(x[i:i + CHUNK_BLOCKS]) for i in range(0, len(x), CHUNK_BLOCKS)]
    return np.concatenate(blocks).reshape(n_rows, -1) if blocks else np.zeros((n_rows, 0), np.uint8)


def _search(x: np.ndarray) -> np.ndarray:
    """Blocks [n, 32] of float32 as q4_0 blocks [n, 18], each at its best scale."""
    m = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    best_err = np.full((len(x), 1), np.inf, np.float32)
    best_d = np.zeros((len(x), 1), np.float32)
    for step in STEPS:
        d = (m / np.float32(step)).astype(np.float16).astype(np.float32)  # the scale as stored
        err = ((x - d * _levels(x, d)) ** 2).sum(axis=1, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_d = np.where(better, d, best_d)
    q = (_levels(x, best_d) + 8).astype(np.uint8)
    packed = q[:, :QK // 2] | (q[:, QK // 2:] << 4)  # ggml's order: value i in the low nibble of byte i, i+16 high
    return np.concatenate([best_d.astype(np.float16).view(np.uint8), packed], axis=1)


def _levels(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The nearest of q4_0's levels -8..7 to x / d (0 where d is 0: an all-zero block)."""
    safe = np.where(d == 0, np.float32(1), d)
    return np.where(d == 0, np.float32(0), np.clip(np.round(x / safe), -8, 7))
