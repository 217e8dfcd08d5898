"""Kernels: the scalar reference against gguf-py's formats and float64 arithmetic, and every SIMD set
against the scalar reference on awkward sizes (not multiples of the vector width or of 64/256)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine import kernels

Q = gguf.GGMLQuantizationType
QTYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
SIMD = [isa for isa in ("avx2",) if kernels.available(isa)]
FLOAT_SIZES = [1, 7, 8, 13, 31, 33, 100, 257, 1023]
BLOCK_SIZES = [32, 96, 160, 224, 1056, 4128]


def stored(wtype: str, x: np.ndarray) -> np.ndarray:
    """x (float32) in the stored form of wtype, as gguf-py writes it."""
    if wtype == "f32":
        return x.astype(np.float32)
    if wtype == "f16":
        return x.astype(np.float16)
    return gguf.quants.quantize(x.astype(np.float32), QTYPES[wtype])


def values(wtype: str, w: np.ndarray) -> np.ndarray:
    """The float values a stored row holds (gguf-py's dequantization)."""
    if wtype in ("f32", "f16"):
        return w.astype(np.float64)
    return gguf.quants.dequantize(w, QTYPES[wtype]).astype(np.float64)


def operand(wtype: str, x: np.ndarray):
    """The activation operand of a dot with a wtype row, and the float values it stands for."""
    if wtype in ("f32", "f16"):
        return x.astype(np.float32), x.astype(np.float64)
    q = gguf.quants.quantize(x.astype(np.float32), Q.Q8_0)
    return q, gguf.quants.dequantize(q, Q.Q8_0).astype(np.float64)


def sizes(wtype: str):
    return FLOAT_SIZES if wtype in ("f32", "f16") else BLOCK_SIZES


CASES = [(t, n) for t in ("f32", "f16", "q8_0", "q4_0") for n in sizes(t)]


@pytest.mark.parametrize("wtype,n", CASES)
def test_scalar_to_float_is_gguf_dequantize(wtype, n):
    rng = np.random.default_rng(n)
    w = stored(wtype, rng.normal(0, 1, n) * rng.uniform(0.01, 10))
    np.testing.assert_array_equal(kernels.to_float("scalar", wtype, n, w), values(wtype, w).astype(np.float32))


@pytest.mark.parametrize("wtype,n", CASES)
def test_scalar_dot_and_axpy_match_float64(wtype, n):
    rng = np.random.default_rng(1000 + n)
    w = stored(wtype, rng.normal(0, 1, n))
    x, xv = operand(wtype, rng.normal(0, 1, n))
    exact = float(values(wtype, w) @ xv)
    scale = float(np.abs(values(wtype, w) * xv).sum())
    assert abs(kernels.dot("scalar", wtype, n, w, x) - exact) <= 1e-5 * scale + 1e-30
    y = rng.normal(0, 1, n).astype(np.float32)
    expect = y.astype(np.float64) + 0.37 * values(wtype, w)
    np.testing.assert_allclose(kernels.axpy("scalar", wtype, n, 0.37, w, y), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", BLOCK_SIZES)
def test_quantize_q8_0_is_bit_exact_with_gguf_py(n):
    rng = np.random.default_rng(n)
    x = (rng.normal(0, 1, n) * 10 ** rng.uniform(-3, 3, n)).astype(np.float32)
    # halfway cases: with amax 127 the scale is 1, so x * id lands exactly on .5
    x[:32] = np.array([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5] * 4, dtype=np.float32)
    x[32:64] = 0.0  # an all-zero block (d = 0)
    expect = gguf.quants.quantize(x, Q.Q8_0).reshape(-1)
    for isa in ["scalar"] + SIMD:
        np.testing.assert_array_equal(kernels.quantize_q8_0(isa, x), expect, err_msg=isa)


def test_f16_conversion_covers_every_half():
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got = kernels.to_float("scalar", "f16", 65536, halves)
    expect = halves.astype(np.float32)
    nan = np.isnan(expect)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], expect[~nan])
    # and float -> half on the quantizer's scale path: every d written equals numpy's rounding
    rng = np.random.default_rng(7)
    amax = np.concatenate([rng.uniform(0, 1, 3000) * 10.0 ** rng.integers(-9, 7, 3000), [6.1e-5 * 127, 65504 * 127]])
    blocks = np.zeros((amax.size, 32), dtype=np.float32)
    blocks[:, 0] = amax
    q = kernels.quantize_q8_0("scalar", blocks.reshape(-1)).reshape(-1, 34)
    np.testing.assert_array_equal(q[:, :2].copy().view(np.float16)[:, 0],
                                  (blocks[:, 0] / np.float32(127)).astype(np.float16))


@pytest.mark.skipif(not SIMD, reason="no SIMD kernel set on this CPU/build")
@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("wtype,n", CASES)
def test_simd_matches_scalar(isa, wtype, n):
    rng = np.random.default_rng(2000 + n)
    w = stored(wtype, rng.normal(0, 1, n) * rng.uniform(0.1, 5))
    x, xv = operand(wtype, rng.normal(0, 1, n))
    scale = float(np.abs(values(wtype, w) * xv).sum())
    ref, got = kernels.dot("scalar", wtype, n, w, x), kernels.dot(isa, wtype, n, w, x)
    assert abs(got - ref) <= 1e-5 * scale + 1e-30, (got, ref)
    np.testing.assert_array_equal(kernels.to_float(isa, wtype, n, w), kernels.to_float("scalar", wtype, n, w))
    y = rng.normal(0, 1, n).astype(np.float32)
    a = float(rng.normal())
    np.testing.assert_allclose(kernels.axpy(isa, wtype, n, a, w, y), kernels.axpy("scalar", wtype, n, a, w, y),
                               rtol=1e-6, atol=1e-6)


def test_best_kernel_set_is_available():
    assert kernels.available(kernels.selected())
    assert kernels.available("scalar")
    assert not kernels.available("no-such-isa")
