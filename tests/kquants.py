"""Test helpers for the GGUF types llama.cpp's files hold: random valid blocks of every type the engine reads, and
small numpy quantizers to q4_K and q6_K (gguf-py quantizes q4_1, q5_0, q5_1 and q8_0 but not the k-quants), checked
against gguf-py's dequantizers (gguf.quants), which are the reference for the engine's decoding."""
from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# where each block holds its f16 scale and min (byte offsets), after ggml-common.h's block structs
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
              Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """(rows, bytes) of valid blocks: random codes (and sub-block scales), f16 scales near `scale`."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = (scale * rng.uniform(0.5, 1.5, size=(rows, cols // block, 1))).astype(np.float16)
        blocks[..., at:at + 2] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def random_bf16(rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """(rows, 2 cols) bytes of bf16 values (gguf-py's own bf16 rounding of normal values)."""
    return gguf.quants.quantize(rng.normal(0, scale, size=(rows, cols)).astype(np.float32), Q.BF16)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x (rows, cols), cols % 256 == 0 -> q4_K bytes: per 32 values a 6-bit scale and min of two f16 super-block
    factors, codes 0..15 (min/max per sub-block, not llama.cpp's search: a valid, somewhat worse q4_K)."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15
    d = _f16(scale.max(-1, keepdims=True) / 63)
    dmin = _f16(-lo.min(-1, keepdims=True) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.ceil(scale / d)), 0, 63).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.round(-lo / dmin)), 0, 63).astype(np.uint8)
        step = (d * sc)[..., None]
        codes = np.nan_to_num(np.round((sub + (dmin * mn)[..., None]) / step))
    codes = np.clip(codes, 0, 15).astype(np.uint8)
    packed = np.empty((sub.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2k (low) and 2k + 1 (high)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), packed, qs],
                         axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x (rows, cols), cols % 256 == 0 -> q6_K bytes: per 16 values an int8 scale of one f16 factor, codes -32..31
    (max-abs per sub-block)."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1, keepdims=True) / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d)), -128, 127).astype(np.int8)
        codes = np.nan_to_num(np.round(sub / (d * sc)[..., None]))
    q = (np.clip(codes, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [half][q][l]: value 32 q + l
    ql = np.empty((q.shape[0], 2, 64), np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                          d.astype(np.float16).view(np.uint8)], axis=1)
    return out.reshape(rows, -1)


QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x in qtype: ours for q4_K / q6_K, gguf-py's otherwise."""
    return QUANTIZERS[qtype](x) if qtype in QUANTIZERS else gguf.quants.quantize(x.astype(np.float32), qtype)
