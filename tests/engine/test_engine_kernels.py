"""Kernels: the scalar reference against gguf-py's formats and float64 arithmetic, and every SIMD set
against the scalar reference on awkward sizes (not multiples of the vector width or of 64/256)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from powerinfer_engine import kernels

Q = gguf.GGMLQuantizationType
QTYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
SIMD = [isa for isa in ("avx2", "avx512") if kernels.available(isa)]
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


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("wtype,n", CASES)
def test_dot4_is_four_dots(isa, wtype, n):
    """dot4 (the multi-row kernel) gives each row exactly the set's own dot, and the scalar reference's
    value within rounding."""
    rng = np.random.default_rng(3000 + n)
    rows = [stored(wtype, rng.normal(0, 1, n) * rng.uniform(0.1, 5)) for _ in range(4)]
    x, xv = operand(wtype, rng.normal(0, 1, n))
    got = kernels.dot4(isa, wtype, n, rows, x)
    np.testing.assert_array_equal(got, np.array([kernels.dot(isa, wtype, n, r, x) for r in rows], np.float32))
    for r, g in zip(rows, got):
        scale = float(np.abs(values(wtype, r) * xv).sum())
        assert abs(g - kernels.dot("scalar", wtype, n, r, x)) <= 1e-5 * scale + 1e-30


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("wtype,n", [(t, n) for t in ("q8_0", "q4_0") for n in BLOCK_SIZES])
def test_gemm8_on_packed_rows_is_eight_dots_per_token(isa, wtype, n):
    """gemm8 over 8-row interleaved groups gives each row its dot with each token's operand within rounding,
    bit-identical across sets and whatever the token count (1, 3, 6: off the 2- and 4-token passes);
    groups 1 and 3."""
    rng = np.random.default_rng(5000 + n)
    for n_groups, n_tok in ((1, 1), (3, 3), (1, 6)):
        rows = [stored(wtype, rng.normal(0, 1, n) * rng.uniform(0.1, 5)) for _ in range(8 * n_groups)]
        packed = np.concatenate([kernels.pack8(wtype, n, rows[8 * g:8 * g + 8]) for g in range(n_groups)])
        ops = [operand(wtype, rng.normal(0, 1, n)) for _ in range(n_tok)]
        x = np.concatenate([o[0].reshape(-1) for o in ops])
        got = kernels.gemm8(isa, wtype, n, packed, x)
        np.testing.assert_array_equal(got, kernels.gemm8("scalar", wtype, n, packed, x))
        for t, (xt, xv) in enumerate(ops):
            np.testing.assert_array_equal(got[t], kernels.gemm8(isa, wtype, n, packed, xt)[0])
            for r, g in zip(rows, got[t]):
                scale = float(np.abs(values(wtype, r) * xv).sum())
                assert abs(g - kernels.dot(isa, wtype, n, r, xt)) <= 1e-5 * scale + 1e-30
                assert abs(g - float((values(wtype, r) * xv).sum())) <= 1e-5 * scale + 1e-30


@pytest.mark.parametrize("isa", SIMD)
def test_gemm8_q4_0_at_the_largest_integer_sums(isa):
    """q4_0 gemm8 where every product is as large as a block allows (nibbles 15 or 0, quants +-127): the sums
    AVX2 keeps in int16 lanes (16 products of at most 15 x 127 each) come out exact, as float64's, for
    4, 2 and 1 tokens a pass."""
    n, n_groups = 256, 2
    nb = n // 32
    rows = []
    for r in range(8 * n_groups):
        blocks = np.zeros((nb, 18), dtype=np.uint8)
        blocks[:, :2] = np.frombuffer(np.float16(0.5 + r / 16).tobytes(), np.uint8)
        blocks[:, 2:] = 0xFF if r % 2 == 0 else 0x00  # every value +7 or every value -8
        rows.append(blocks.reshape(-1))
    packed = np.concatenate([kernels.pack8("q4_0", n, rows[8 * g:8 * g + 8]) for g in range(n_groups)])
    n_tok = 7
    x = np.zeros((n_tok, nb, 34), dtype=np.uint8)
    x[:, :, :2] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    for t in range(n_tok):
        x[t, :, 2:] = np.full(32, 127 if t % 2 == 0 else -127, dtype=np.int8).view(np.uint8)
    got = kernels.gemm8(isa, "q4_0", n, packed, x)
    for t in range(n_tok):
        for r in range(8 * n_groups):
            want = nb * (0.5 + r / 16) * 0.25 * 32 * (7 if r % 2 == 0 else -8) * (127 if t % 2 == 0 else -127)
            assert got[t, r] == np.float32(want)


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("wtype,n", CASES)
def test_dot_rows_is_gemm8_on_the_same_rows(isa, wtype, n):
    """dot_rows (gathered rows by pointer, any count: 1, 5, 8, 19 rows, one row repeated) gives a q4_0/q8_0
    row exactly what gemm8 gives it in a packed group (bit-identical to the scalar reference), so a neuron's
    value does not depend on the path, and other types exactly the set's own dot."""
    rng = np.random.default_rng(6000 + n)
    pool = [stored(wtype, rng.normal(0, 1, n) * rng.uniform(0.1, 5)) for _ in range(24)]
    x, _ = operand(wtype, rng.normal(0, 1, n))
    for count in (1, 5, 8, 19):
        rows = [pool[i] for i in rng.choice(len(pool), count, replace=True)]
        got = kernels.dot_rows(isa, wtype, n, rows, x)
        if wtype in ("q4_0", "q8_0"):
            np.testing.assert_array_equal(got, kernels.dot_rows("scalar", wtype, n, rows, x))
            padded = rows + [rows[-1]] * (-count % 8)
            expect = np.concatenate([kernels.gemm8(isa, wtype, n, kernels.pack8(wtype, n, padded[g:g + 8]), x)[0]
                                     for g in range(0, len(padded), 8)])[:count]
        else:
            expect = np.array([kernels.dot(isa, wtype, n, r, x) for r in rows], np.float32)
        np.testing.assert_array_equal(got, expect)


def test_pack8_and_gemm8_check_their_arguments():
    from powerinfer_engine import EngineError

    rows = [stored("q4_0", np.ones(64)) for _ in range(8)]
    with pytest.raises(EngineError, match="only q4_0 and q8_0"):
        kernels.pack8("f16", 64, [stored("f16", np.ones(64))] * 8)
    packed = kernels.pack8("q4_0", 64, rows)
    with pytest.raises(EngineError, match="multiple of the block size"):
        kernels.gemm8("scalar", "q4_0", 48, packed, stored("q8_0", np.ones(64)))


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("n_tok,n_rows,n_cols", [(1, 1, 1), (3, 5, 17), (4, 33, 64), (7, 128, 200), (9, 70, 88),
                                                (2, 9, 15), (5, 8, 31), (1, 64, 75), (3, 300, 64), (6, 16, 100),
                                                (2, 40, 37)])
def test_gemm_f32_is_y_plus_h_at_w(isa, n_tok, n_rows, n_cols):
    """The batch down projection's and the attention's tile kernel: y + h @ w within float rounding of
    float64, bit-identical across sets (fma chains over the rows in order); token counts and widths off the
    4 x 64 tile (tiles of 3 and 2 tokens, the query heads of a kv head; 32 columns after the 64-wide ones),
    and last columns short of a vector (masked lanes: 15 and 31 leave 7 and 15 of them; a decode step's
    scores over 75 keys, 11)."""
    rng = np.random.default_rng(6000 + n_tok * n_rows + n_cols)
    h, w = rng.normal(0, 1, (n_tok, n_rows)), rng.normal(0, 1, (n_rows, n_cols))
    y = rng.normal(0, 1, (n_tok, n_cols)).astype(np.float32)
    got = kernels.gemm_f32(isa, h, w, y)
    np.testing.assert_array_equal(got, kernels.gemm_f32("scalar", h, w, y))
    exact = y.astype(np.float64) + h.astype(np.float32).astype(np.float64) @ w.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(n_rows))
    # w in f16 (a half-precision KV cache): the same bits as the f32 kernel over the widened values
    w16 = w.astype(np.float16)
    half = kernels.gemm_f32(isa, h, w16, y)
    np.testing.assert_array_equal(half, kernels.gemm_f32("scalar", h, w16.astype(np.float32), y))
    np.testing.assert_array_equal(half, kernels.gemm_f32("scalar", h, w16, y))


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
def test_silu_within_two_ulp_and_identical_across_sets(isa):
    """The SiLU the engine's rule uses: within 2 ulp of float64 where it is above 1e-35 in magnitude (below,
    for x < -88, it returns 0), sane at the extremes, bit-identical in every set; n = 1027 leaves a tail."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.normal(0, 4, 1000), [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0,
                                                   1e4, -1e4, 3.4e38, -3.4e38, 0.5, -0.5, 1.0, -1.0, 5.0, -5.0,
                                                   -87.0, 87.0, -90.0, 90.0, 2.0, -2.0, 10.0]]).astype(np.float32)
    got = kernels.silu(isa, x)
    np.testing.assert_array_equal(got, kernels.silu("scalar", x))
    xd = x.astype(np.float64)
    exact = xd / (1.0 + np.exp(np.minimum(-xd, 700.0)))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= 2 * ulp + 1e-35), np.max(np.abs(got - exact) / ulp)


def test_dot_rows_and_softmax_check_their_arguments():
    from powerinfer_engine import EngineError

    with pytest.raises(EngineError, match="multiple of the block size"):
        kernels.dot_rows("scalar", "q4_0", 48, [stored("q4_0", np.ones(64))], stored("q8_0", np.ones(64)))
    with pytest.raises(EngineError, match="n must be >= 1"):
        kernels.softmax("scalar", np.zeros(0, np.float32))
    with pytest.raises(EngineError, match="unknown|not available"):
        kernels.softmax("no-such-isa", np.ones(3, np.float32))


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 200, 1031])
def test_softmax_matches_float64_and_is_identical_across_sets(isa, n):
    """Attention's softmax: within a few ulp of float64 (scores spread over exp's range, very negative
    scores underflowing to ~0), summing to 1, bit-identical in every set whatever n's tail."""
    rng = np.random.default_rng(n)
    x = (rng.normal(0, 30, n)).astype(np.float32)
    scale = 0.125
    got = kernels.softmax(isa, x, scale)
    np.testing.assert_array_equal(got, kernels.softmax("scalar", x, scale))
    y = x.astype(np.float32) * np.float32(scale)
    e = np.exp(y.astype(np.float64) - y.max())
    exact = e / e.sum()
    np.testing.assert_allclose(got, exact, rtol=4e-6, atol=1e-37)
    assert abs(float(got.astype(np.float64).sum()) - 1.0) < 1e-5


def _axpy_rows_case(wtype: str, n: int, seed: int):
    """Rows wider than n (the slice starts at col0, a block multiple), coefficients, and y."""
    rng = np.random.default_rng(seed)
    block = 32 if wtype in QTYPES else 1
    col0 = block * int(rng.integers(0, 3))
    n_rows = int(rng.choice([1, 3, 7, 33, 70]))  # 33, 70: several row groups of the SIMD kernels
    width = col0 + n + block * int(rng.integers(0, 2))
    rows = [stored(wtype, rng.normal(0, 1, width)) for _ in range(n_rows)]
    return rows, col0, rng.normal(0, 1, n_rows).astype(np.float32), rng.normal(0, 1, n).astype(np.float32)


AXPY_ROWS_CASES = CASES + [("q4_0", 64), ("q8_0", 128), ("f32", 64), ("f16", 200)]
GROUP, STEPS = 32, 16256  # csrc/kernels/axpy_int.h: rows per integer scale, steps to a group's largest


def _block_slices(wtype, rows, col0, n):
    """Each row's float values on [col0, col0 + n)."""
    return np.stack([values(wtype, r)[col0:col0 + n] for r in rows])


def _scales(rows, col0, n):
    """Each q4_0 row's block scales over the slice, repeated per element (float64)."""
    d = np.stack([r.reshape(-1).view(np.uint8).reshape(-1, 18)[:, :2].copy().view(np.float16)[:, 0] for r in rows])
    return np.repeat(d[:, col0 // 32:(col0 + n) // 32].astype(np.float64), 32, axis=1)


def axpy_rows_bound(rows, col0, n, a):
    """The integer path's error bound per element: each coefficient a_r * d_r moves by at most half a step of
    its group's largest, times the weight's integer value; plus float rounding of the sums."""
    v, d = _block_slices("q4_0", rows, col0, n), _scales(rows, col0, n)
    c = a[:, None].astype(np.float64) * d
    ints = np.where(d != 0, v / np.where(d != 0, d, 1), 0)
    bound = np.zeros(n)
    for g in range(0, len(rows), GROUP):
        m = np.abs(c[g:g + GROUP]).max(axis=0)
        bound += 0.5 * m / STEPS * np.abs(ints[g:g + GROUP]).sum(axis=0)
    return bound + 1e-6 * (np.abs(a[:, None] * v).sum(axis=0) + 1)


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("wtype,n", [(t, n) for t, n in AXPY_ROWS_CASES if t != "q4_0"])
def test_float_axpy_rows_is_a_sequence_of_axpys(isa, wtype, n):
    """f32/f16/q8_0 axpy_rows (y held in registers across rows) equals the set's own axpy applied row after row,
    bit for bit, and the scalar reference within rounding, on slices that start inside the row."""
    rows, col0, a, y = _axpy_rows_case(wtype, n, 4000 + n)
    expect = y.copy()
    for r, ar in zip(rows, a):
        piece = r.reshape(-1)[col0 // 32 * 34:] if wtype == "q8_0" else r[col0:]
        expect = kernels.axpy(isa, wtype, n, float(ar), np.ascontiguousarray(piece), expect)
    got = kernels.axpy_rows(isa, wtype, n, rows, col0, a, y)
    np.testing.assert_array_equal(got, expect)
    exact = y.astype(np.float64) + sum(float(ar) * values(wtype, r)[col0:col0 + n] for r, ar in zip(rows, a))
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)


Q4_CASES = [n for t, n in AXPY_ROWS_CASES if t == "q4_0"] + [576, 4096]  # 576, 4096: SmolLM2's and a 7B's width


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("n", Q4_CASES)
def test_q4_0_axpy_rows_simd_is_the_scalar_reference(isa, n):
    """The integer axpy_rows is bit-identical across sets (its definition: csrc/kernels/axpy_int.h)."""
    rows, col0, a, y = _axpy_rows_case("q4_0", n, 4000 + n)
    np.testing.assert_array_equal(kernels.axpy_rows(isa, "q4_0", n, rows, col0, a, y),
                                  kernels.axpy_rows("scalar", "q4_0", n, rows, col0, a, y))


@pytest.mark.parametrize("n", Q4_CASES)
def test_q4_0_axpy_rows_is_within_its_rounding_of_exact(n):
    """Each coefficient rounds to 14 bits of its group's largest: the result is within that bound of the float64
    sum, a bound 2^-15 of the group's largest coefficient times the weights' integers."""
    rows, col0, a, y = _axpy_rows_case("q4_0", n, 4000 + n)
    got = kernels.axpy_rows("scalar", "q4_0", n, rows, col0, a, y)
    exact = y.astype(np.float64) + a.astype(np.float64) @ _block_slices("q4_0", rows, col0, n)
    assert np.all(np.abs(got - exact) <= axpy_rows_bound(rows, col0, n, a) + 1e-6 * np.abs(exact))


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
def test_q4_0_axpy_rows_edge_coefficients(isa):
    """Zero groups leave y as it was (signed zeros included); a group holding inf or NaN is summed in floats
    (so inf and NaN reach y, in that group's columns only); tiny and huge coefficients keep their precision; the
    extremes of the coefficient's two bytes (exactly +-its group's largest) are exact."""
    wtype = "q4_0"
    rng = np.random.default_rng(9)
    n, n_rows = 96, 70
    rows = [stored(wtype, rng.normal(0, 1, n)) for _ in range(n_rows)]
    v = _block_slices(wtype, rows, 0, n)
    y = np.full(n, -0.0, dtype=np.float32)
    zero = kernels.axpy_rows(isa, wtype, n, rows, 0, np.zeros(n_rows, np.float32), y)
    assert np.array_equal(np.signbit(zero), np.ones(n, bool)) and not zero.any()
    for scale in (1e-25, 1.0, 1e25):
        a = (rng.normal(0, 1, n_rows) * scale).astype(np.float32)
        a[5], a[6] = scale * 3, -scale * 3  # the largest of group 0, both signs
        got = kernels.axpy_rows(isa, wtype, n, rows, 0, a, np.zeros(n, np.float32)).astype(np.float64)
        exact = a.astype(np.float64) @ v
        np.testing.assert_allclose(got / scale, exact / scale, rtol=2e-4, atol=2e-4 * np.abs(exact / scale).max())
    a = rng.normal(0, 1, n_rows).astype(np.float32)
    a[40] = np.inf  # group 1 (rows 32..63)
    got = kernels.axpy_rows(isa, wtype, n, rows, 0, a, np.zeros(n, np.float32))
    np.testing.assert_array_equal(got, kernels.axpy_rows("scalar", wtype, n, rows, 0, a, np.zeros(n, np.float32)))
    assert not np.isfinite(got[v[40] != 0]).any()
    a[40] = np.nan
    assert np.isnan(kernels.axpy_rows(isa, wtype, n, rows, 0, a, np.zeros(n, np.float32))).all()


@pytest.mark.parametrize("isa", SIMD)  # every SIMD set has axpy_quads (csrc/kernels/kernels.h)
@pytest.mark.parametrize("n", [32, 96, 576, 4096])
@pytest.mark.parametrize("n_rows", [1, 3, 4, 5, 31, 32, 33, 70, 256])
def test_axpy_quads_is_axpy_rows_on_the_same_rows(isa, n, n_rows):
    """axpy_quads over pack_quads of q4_0 rows (the 4-row layout a dense step's down projection reads) equals the
    scalar reference axpy_rows over the rows, bit for bit: every group size, a last quad with missing rows, zero
    coefficients, and widths with a chunk of blocks left over (n = 576: 16 + 2 blocks)."""
    rng = np.random.default_rng(n * 1000 + n_rows)
    rows = [stored("q4_0", rng.normal(0, 1, n) * rng.uniform(0.01, 3)) for _ in range(n_rows)]
    a = rng.normal(0, 1, n_rows).astype(np.float32)
    a[::5] = 0
    y = rng.normal(0, 1, n).astype(np.float32)
    quads = kernels.pack_quads(n, rows)
    assert quads.size == (n_rows + 3) // 4 * 4 * rows[0].size  # as many bytes as the rows (4 per quad)
    np.testing.assert_array_equal(kernels.axpy_quads(isa, n, n_rows, quads, a, y),
                                  kernels.axpy_rows("scalar", "q4_0", n, rows, 0, a, y))


@pytest.mark.parametrize("isa", SIMD)
def test_axpy_quads_edge_coefficients_take_the_same_paths(isa):
    """Blocks whose coefficients hold inf or NaN, whose largest is tiny (below 1e-30), or that are all zero go the
    same way as in axpy_rows (floats, floats, nothing): the same bits, NaN where axpy_rows has NaN."""
    rng = np.random.default_rng(11)
    n, n_rows = 160, 70
    rows = [stored("q4_0", rng.normal(0, 1, n)) for _ in range(n_rows)]
    for change in ({40: np.inf}, {3: np.nan}, {r: 1e-38 for r in range(32)}, {r: 0.0 for r in range(64)},
                   {5: 3e38, 6: -3e38}):
        a = rng.normal(0, 1, n_rows).astype(np.float32)
        for r, v in change.items():
            a[r] = v
        y = np.full(n, -0.0, dtype=np.float32)
        ref = kernels.axpy_rows("scalar", "q4_0", n, rows, 0, a, y)
        got = kernels.axpy_quads(isa, n, n_rows, kernels.pack_quads(n, rows), a, y)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(np.nan_to_num(got).view(np.uint32), np.nan_to_num(ref).view(np.uint32))


def test_axpy_quads_checks_its_arguments():
    from powerinfer_engine import EngineError

    quads = kernels.pack_quads(64, [stored("q4_0", np.ones(64))])
    with pytest.raises(EngineError, match="no axpy_quads"):
        kernels.axpy_quads("scalar", 64, 1, quads, np.ones(1), np.zeros(64))
    with pytest.raises(EngineError, match="multiple of the block size"):
        kernels.axpy_quads("scalar", 48, 1, quads, np.ones(1), np.zeros(48))


def test_axpy_rows_checks_its_arguments():
    from powerinfer_engine import EngineError

    w = stored("q4_0", np.ones(64))
    with pytest.raises(EngineError, match="multiple of the block size"):
        kernels.axpy_rows("scalar", "q4_0", 32, [w], 16, np.ones(1), np.zeros(32))


def _columns_case(wtype: str, n_rows: int, col0: int, n_cols: int, seed: int):
    """Rows wider than the slice, with one block of rows zero on the slice (a column block of scale 0)."""
    rng = np.random.default_rng(seed)
    width = col0 + n_cols + 32 * int(rng.integers(0, 2))
    x = rng.normal(0, 1, (n_rows, width)) * rng.uniform(0.01, 5, (n_rows, 1))
    x[:32, col0:col0 + 32] = 0.0
    return [stored(wtype, r) for r in x]


def pack_columns8_reference(wtype: str, rows, col0: int, n_cols: int) -> np.ndarray:
    """kernels.h pack_columns8 in numpy: each column's 32 values per block of rows as one q8_0 block (float32
    arithmetic: d = amax / 127, q = nearest, ties to even, of v * (1 / d)), in pack_rows8's layout."""
    v = np.stack([values(wtype, r).astype(np.float32)[col0:col0 + n_cols] for r in rows])  # [rows, cols]
    nb = len(rows) // 32
    blocks = v.T.reshape(n_cols, nb, 32)  # [col, block, row in block]
    amax = np.abs(blocks).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int8)
    out = np.zeros((n_cols // 8, nb, 272), np.uint8)
    for g in range(n_cols // 8):
        cols = slice(8 * g, 8 * g + 8)
        out[g, :, :16] = d[cols].astype(np.float16).T.copy().view(np.uint8).reshape(nb, 16)
        # chunk c, lane r: rows 4c..4c+3 of column r
        chunks = q[cols].transpose(1, 2, 0).reshape(nb, 8, 4, 8).transpose(0, 1, 3, 2)
        out[g, :, 16:] = chunks.reshape(nb, 256).view(np.uint8)
    return out.reshape(-1)


COLUMN_CASES = [(t, n_rows, col0, n_cols) for t in ("q4_0", "q8_0")
                for n_rows, col0, n_cols in ((32, 0, 32), (96, 32, 64), (160, 64, 160), (1056, 0, 128))]


@pytest.mark.parametrize("wtype,n_rows,col0,n_cols", COLUMN_CASES)
def test_pack_columns8_is_the_q8_0_transpose_and_identical_across_sets(wtype, n_rows, col0, n_cols):
    """A batch's down projection in integers packs the transpose of its rows requantized to q8_0: the scalar
    set as the numpy definition, every SIMD set bit for bit (a zero block of rows: scale 0, quants 0)."""
    rows = _columns_case(wtype, n_rows, col0, n_cols, 7000 + n_rows + col0)
    expect = pack_columns8_reference(wtype, rows, col0, n_cols)
    for isa in ["scalar"] + SIMD:
        np.testing.assert_array_equal(kernels.pack_columns8(isa, wtype, rows, col0, n_cols), expect)


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("wtype", ["q4_0", "q8_0"])
def test_batch_down_in_integers_is_within_its_rounding_of_float64(isa, wtype):
    """gemm8 over pack_columns8's transpose with the tokens' coefficients in q8_0 (the CPU's batch down
    projection) against h @ W in float64: within the two requantizations' half steps (the weights' per column
    and block of rows, d rounded to f16, the coefficients' per token and block) and float rounding."""
    n_rows, col0, n_cols, n_tok = 160, 32, 64, 5
    rows = _columns_case(wtype, n_rows, col0, n_cols, 7100)
    rng = np.random.default_rng(7101)
    h = (rng.normal(0, 1, (n_tok, n_rows)) * rng.uniform(0.01, 3, n_rows)).astype(np.float32)
    hq = np.stack([stored("q8_0", t) for t in h])
    got = kernels.gemm8(isa, "q8_0", n_rows, kernels.pack_columns8(isa, wtype, rows, col0, n_cols), hq.reshape(-1))
    w = np.stack([values(wtype, r)[col0:col0 + n_cols] for r in rows])  # [rows, cols]
    exact = h.astype(np.float64) @ w
    # half a step of each requantization, 127 steps of f16's rounding of d (2^-11 relative) on top
    dw = np.repeat(np.abs(w).reshape(n_rows // 32, 32, n_cols).max(axis=1) / 127, 32, axis=0) * (0.5 + 127 / 2048)
    dh = np.repeat(np.abs(h).reshape(n_tok, n_rows // 32, 32).max(axis=2) / 127, 32, axis=1) * (0.5 + 127 / 2048)
    ah = np.abs(h).astype(np.float64)
    bound = ah @ dw + dh @ np.abs(w) + dh @ dw + 1e-5 * (ah @ np.abs(w)) + 1e-30
    assert np.all(np.abs(got - exact) <= bound)
    assert np.abs(got - exact).max() > 0  # the bound is met by rounding, not by exact arithmetic
    np.testing.assert_array_equal(got, kernels.gemm8("scalar", "q8_0", n_rows,
                                                     kernels.pack_columns8("scalar", wtype, rows, col0, n_cols),
                                                     hq.reshape(-1)))


def test_pack_columns8_checks_its_arguments():
    from powerinfer_engine import EngineError

    rows = [stored("q4_0", np.ones(64)) for _ in range(32)]
    with pytest.raises(EngineError, match="only q4_0 and q8_0"):
        kernels.pack_columns8("scalar", "f16", [stored("f16", np.ones(64))] * 32, 0, 32)
    with pytest.raises(EngineError, match="multiples of 32"):
        kernels.pack_columns8("scalar", "q4_0", rows[:31], 0, 32)
    with pytest.raises(EngineError, match="multiple of the block size"):
        kernels.pack_columns8("scalar", "q4_0", rows, 0, 40)


def _zeroed_operand(rng, n: int, share: float):
    """A q8_0 operand of x with its `share` smallest |x| zeroed first (input sparsity), a whole block among them."""
    x = rng.normal(0, 1, n).astype(np.float32)
    x[np.abs(x) <= np.quantile(np.abs(x), share)] = 0.0
    x[:32] = 0.0  # a block with no kept input: skipped by gemv_columns, 0 times its scales in gemm8
    return operand("q8_0", x)


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("n_in,n_rows,n_out", [(96, 64, 64), (160, 200, 256), (1056, 100, 576), (4128, 192, 192),
                                               (224, 300, 320), (128, 50, 704)])
def test_gemv_columns_is_gemm8_over_the_zeroed_operand(isa, wtype, n_in, n_rows, n_out):
    """Input sparsity's column kernel gives every output exactly gemm8's value over the same rows and operand
    (its dropped inputs zero), identical across sets, within rounding of float64; rows past n_rows (zero padding)
    give 0; a range of tiles [o0, o1) writes only its outputs; tiles of 256 and 512 (windows of 256 in a tile). Shares 0.25 and 0.9, n_out of 1 to 9 units of 64 (tiles
    of 256: a last one of 1 to 3 units; q4_0: n_out rounded up to its span of 128)."""
    span = 128 if wtype == "q4_0" else 64
    n_out = -(-n_out // span) * span
    rng = np.random.default_rng(9000 + n_in + n_out)
    rows = [stored(wtype, rng.normal(0, 1, n_in) * rng.uniform(0.1, 5)) for _ in range(n_rows)]
    tile = 512 if n_out > 512 else 256  # 704: tiles of 512 and 192 (q4_0: 256)
    packed = kernels.pack_columns(wtype, n_in, rows, n_out, tile)
    padded = rows + [stored(wtype, np.zeros(n_in))] * (-n_rows % 8)
    groups = np.concatenate([kernels.pack8(wtype, n_in, padded[g:g + 8]) for g in range(0, len(padded), 8)])
    for share in (0.25, 0.9):
        x, xv = _zeroed_operand(rng, n_in, share)
        got = kernels.gemv_columns(isa, wtype, n_in, n_out, packed, x, tile=tile)
        np.testing.assert_array_equal(got[:n_rows], kernels.gemm8(isa, wtype, n_in, groups, x)[0][:n_rows])
        np.testing.assert_array_equal(got, kernels.gemv_columns("scalar", wtype, n_in, n_out, packed, x, tile=tile))
        assert not got[n_rows:].any()
        for r, g in zip(rows, got):
            exact = values(wtype, r) * xv
            assert abs(g - float(exact.sum())) <= 1e-5 * float(np.abs(exact).sum()) + 1e-30
        if n_out > tile:
            part = kernels.gemv_columns(isa, wtype, n_in, n_out, packed, x, tile, n_out, tile=tile)
            np.testing.assert_array_equal(part[tile:], got[tile:])
            assert not part[:tile].any()


def test_gemv_columns_checks_its_arguments():
    from powerinfer_engine import EngineError

    rows = [stored("q8_0", np.ones(64))]
    packed = kernels.pack_columns("q8_0", 64, rows, 64)
    x, _ = operand("q8_0", np.ones(64))
    with pytest.raises(EngineError, match="o1 too or n_out"):
        kernels.gemv_columns("scalar", "q8_0", 64, 64, packed, x, 0, 32)
    with pytest.raises(EngineError, match="tile must be a positive multiple of 256"):
        kernels.pack_columns("q8_0", 64, rows, 64, tile=100)
    with pytest.raises(EngineError, match="only q4_0 and q8_0"):
        kernels.gemv_columns("scalar", "f32", 64, 64, packed, x)
    with pytest.raises(EngineError, match="multiple of 64"):
        kernels.pack_columns("q8_0", 64, rows, 32)
    with pytest.raises(EngineError, match="q4_0: 128"):
        kernels.pack_columns("q4_0", 64, [stored("q4_0", np.ones(64))], 64)
