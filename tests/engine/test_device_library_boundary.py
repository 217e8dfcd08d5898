"""The device library's attention and head boundary (csrc/include/pi_device.h) called directly, on the host emulation
and (marked `gpu`) the CUDA library where a CUDA device is: what the engine never sends but another caller of the ABI may (a job before its upload, positions past
the context, an upload twice, a matrix of another shape, a tier made without RoPE's tables) is refused with one
line, never a crash; and a layer's attention over a batch equals the same tokens one at a time (the cache holds
what a batch stored)."""
from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

import powerinfer_engine as engine

E, H, HKV, D, CTX, BATCH, VOCAB = 64, 4, 2, 16, 32, 8, 48
F32 = 0


class TierDesc(C.Structure):
    _fields_ = [("device", C.c_int32), ("n_embd", C.c_int32), ("n_layer", C.c_int32), ("n_batch", C.c_int32),
                ("activation", C.c_int32), ("gated", C.c_int32), ("n_head", C.c_int32), ("n_head_kv", C.c_int32),
                ("d_head", C.c_int32), ("n_rot", C.c_int32), ("rope", C.c_int32), ("norm", C.c_int32),
                ("norm_eps", C.c_float), ("n_ctx", C.c_int32), ("kv_f16", C.c_int32),
                ("rope_cos", C.POINTER(C.c_float)), ("rope_sin", C.POINTER(C.c_float)), ("n_vocab", C.c_int32),
                ("n_expert", C.c_int32), ("n_expert_used", C.c_int32), ("n_ff_expert", C.c_int32)]


class Matrix(C.Structure):
    _fields_ = [("type", C.c_uint32), ("rows", C.c_int32), ("cols", C.c_int32), ("data", C.c_void_p),
                ("bias", C.POINTER(C.c_float))]


class Attention(C.Structure):
    _fields_ = [("norm_w", C.POINTER(C.c_float)), ("norm_b", C.POINTER(C.c_float)), ("q", Matrix), ("k", Matrix),
                ("v", Matrix), ("o", Matrix), ("ffn_norm_w", C.POINTER(C.c_float)), ("ffn_norm_b", C.POINTER(C.c_float))]


class AttentionJob(C.Structure):
    _fields_ = [("layer", C.c_int32), ("n_tok", C.c_int32), ("n_past", C.c_int32), ("x", C.POINTER(C.c_float)),
                ("out", C.POINTER(C.c_float))]


class Head(C.Structure):
    _fields_ = [("norm_w", C.POINTER(C.c_float)), ("norm_b", C.POINTER(C.c_float)), ("out", Matrix)]


class HeadJob(C.Structure):
    _fields_ = [("n_tok", C.c_int32), ("x", C.POINTER(C.c_float)), ("logits", C.POINTER(C.c_float)),
                ("ld_logits", C.c_int64), ("first", C.c_int32)]


class Counts(C.Structure):
    _fields_ = [(n, C.c_double) for n in ("active", "computed", "h2d_bytes", "d2h_bytes", "seconds", "launches",
                                          "device_bytes")]


class Predictor(C.Structure):
    _fields_ = [("fc1", Matrix), ("fc2", Matrix), ("threshold", C.c_float)]


class SplitJob(C.Structure):
    _fields_ = [("layer", C.c_int32), ("n_tok", C.c_int32), ("n_past", C.c_int32), ("hot_mode", C.c_int32),
                ("x_in", C.POINTER(C.c_float)), ("x_mid", C.POINTER(C.c_float)), ("xn", C.POINTER(C.c_float)),
                ("counts", C.POINTER(Counts))]


ERR = (C.c_char_p, C.c_size_t)
CALLS = [("device_count", C.c_int32, [*ERR]),
         ("device_memory", C.c_int32, [C.c_int32, C.c_void_p, C.c_void_p, C.c_char_p, C.c_size_t, *ERR]),
         ("tier_create", C.c_void_p, [C.POINTER(TierDesc), *ERR]),
         ("tier_upload", C.c_int32, [C.c_void_p, C.c_void_p, C.c_int32, *ERR]),
         ("tier_submit", C.c_int32, [C.c_void_p, C.c_void_p, *ERR]),
         ("tier_wait", C.c_int32, [C.c_void_p, C.c_void_p, *ERR]),
         ("attention_upload", C.c_int32, [C.c_void_p, C.POINTER(Attention), C.c_int32, *ERR]),
         ("attention_run", C.c_int32, [C.c_void_p, C.POINTER(AttentionJob), C.POINTER(Counts), *ERR]),
         ("head_upload", C.c_int32, [C.c_void_p, C.POINTER(Head), *ERR]),
         ("head_run", C.c_int32, [C.c_void_p, C.POINTER(HeadJob), C.POINTER(Counts), *ERR]),
         ("layer_run", C.c_int32, [C.c_void_p, C.c_void_p, *ERR]),
         ("predictor_upload", C.c_int32, [C.c_void_p, C.POINTER(Predictor), C.c_int32, *ERR]),
         ("split_begin", C.c_int32, [C.c_void_p, C.POINTER(SplitJob), *ERR]),
         ("split_end", C.c_int32, [C.c_void_p, C.POINTER(C.c_float), C.POINTER(C.c_float), *ERR]),
         ("copy_rate", C.c_int32, [C.c_int32, C.POINTER(C.c_double), *ERR]),
         ("tier_bytes", C.c_uint64, [C.c_void_p]),
         ("tier_destroy", None, [C.c_void_p]),
         ("expert_upload", C.c_int32, [C.c_void_p, C.c_void_p, C.c_int32, C.c_int32, *ERR]),
         ("experts_submit", C.c_int32, [C.c_void_p, C.c_void_p, *ERR]),
         ("experts_wait", C.c_int32, [C.c_void_p, C.c_void_p, *ERR])]


class Api(C.Structure):
    _fields_ = [("api_version", C.c_int32), ("name", C.c_char_p)] + [
        (name, C.CFUNCTYPE(ret, *args)) for name, ret, args in CALLS]


def floats(a: np.ndarray):
    return a.ctypes.data_as(C.POINTER(C.c_float))


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def api(request, monkeypatch):
    monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "64")
    monkeypatch.delenv("PI_EMULATED_DEVICES", raising=False)
    path = engine.device_library_path(request.param)
    if path is None:
        pytest.skip("built without nvcc: no CUDA library")
    lib = C.CDLL(str(path))
    lib.pi_device_api_get.restype = C.POINTER(Api)
    table = lib.pi_device_api_get().contents
    assert table.api_version == 5 and table.name == request.param.encode()
    err = C.create_string_buffer(256)
    if table.device_count(err, 256) == 0:
        pytest.skip(err.value.decode())
    return table


class Tier:
    """A tier of one layer with random f32 attention weights, RoPE's tables, and the calls' one-line errors."""

    def __init__(self, api, rope_tables=True):
        rng = np.random.default_rng(0)
        self.api, self.err = api, C.create_string_buffer(256)
        half = D // 2
        angles = np.arange(CTX)[:, None] * 10000.0 ** (-np.arange(half) / half)
        self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        self.desc = TierDesc(0, E, 1, BATCH, 0, 1, H, HKV, D, D, 1, 0, 1e-5, CTX, 0,
                             floats(self.cos) if rope_tables else None, floats(self.sin) if rope_tables else None, VOCAB)
        self.tier = api.tier_create(C.byref(self.desc), self.err, 256)
        assert self.tier, self.err.value
        self.keep = [rng.standard_normal((r, c)).astype(np.float32) * 0.2
                     for r, c in ((H * D, E), (HKV * D, E), (HKV * D, E), (E, H * D), (VOCAB, E))]
        self.norm = np.ones(E, np.float32)

    def matrix(self, i, rows=None):
        w = self.keep[i]
        return Matrix(F32, rows or w.shape[0], w.shape[1], w.ctypes.data, None)

    def attention(self, **wrong):
        parts = {"q": self.matrix(0), "k": self.matrix(1), "v": self.matrix(2), "o": self.matrix(3)} | wrong
        return Attention(floats(self.norm), None, parts["q"], parts["k"], parts["v"], parts["o"])

    def call(self, name, *args):
        self.err.value = b""
        rc = getattr(self.api, name)(self.tier, *args, self.err, 256)
        return rc, self.err.value.decode()

    def attend(self, x, n_past):
        out = np.zeros_like(x)
        job = AttentionJob(0, x.shape[0], n_past, floats(x), floats(out))
        rc, msg = self.call("attention_run", C.byref(job), C.byref(Counts()))
        assert rc == 0, msg
        return out

    def close(self):
        self.api.tier_destroy(self.tier)


def test_attention_jobs_and_uploads_that_cannot_run_are_one_line(api):
    t = Tier(api)
    x = np.ones((2, E), np.float32)
    out = np.zeros_like(x)
    job = AttentionJob(0, 2, 0, floats(x), floats(out))
    assert t.call("attention_run", C.byref(job), None) == (1, "layer 0's attention was not uploaded")
    assert t.call("attention_upload", C.byref(t.attention(k=t.matrix(1, rows=HKV * D - 1))), 0) == (
        1, "cannot upload an attention matrix of another shape")
    assert t.call("attention_upload", C.byref(t.attention()), 1)[0] == 1  # no layer 1
    assert t.call("attention_upload", C.byref(t.attention()), 0) == (0, "")
    assert t.call("attention_upload", C.byref(t.attention()), 0) == (1, "layer 0's attention was uploaded already")
    for bad in (AttentionJob(0, 2, CTX - 1, floats(x), floats(out)), AttentionJob(0, BATCH + 1, 0, floats(x), floats(out)),
                AttentionJob(0, 0, 0, floats(x), floats(out)), AttentionJob(0, 2, -1, floats(x), floats(out)),
                AttentionJob(0, 2, 0, None, floats(out))):
        assert t.call("attention_run", C.byref(bad), None) == (1, "bad attention job")
    head_job = HeadJob(1, floats(x), floats(np.zeros(VOCAB, np.float32)), VOCAB)
    assert t.call("head_run", C.byref(head_job), None) == (1, "the output head was not uploaded")
    assert t.call("head_upload", C.byref(Head(floats(t.norm), None, t.matrix(4, rows=VOCAB - 1)))) == (
        1, "cannot upload an output head of another shape")
    t.close()
    no_tables = Tier(api, rope_tables=False)
    assert no_tables.call("attention_upload", C.byref(no_tables.attention()), 0) == (1, "a tier made without RoPE's tables")
    no_tables.close()


def test_a_batch_attends_as_its_tokens_one_at_a_time(api):
    """The cache holds what a batch stored: a batch of 6 after 2 cached tokens gives each token the output it gets
    one step at a time; and the head over the rows is the norm's then the matrix's product."""
    x = np.random.default_rng(1).standard_normal((8, E)).astype(np.float32)
    batched, stepped = Tier(api), Tier(api)
    for t in (batched, stepped):
        assert t.call("attention_upload", C.byref(t.attention()), 0) == (0, "")
    together = np.concatenate([batched.attend(x[:2], 0), batched.attend(x[2:], 2)])
    apart = np.concatenate([stepped.attend(x[i:i + 1], i) for i in range(8)])
    np.testing.assert_allclose(together, apart, rtol=1e-5, atol=1e-6)
    assert np.abs(together).max() > 0.1
    assert stepped.call("head_upload", C.byref(Head(floats(stepped.norm), None, stepped.matrix(4)))) == (0, "")
    logits = np.zeros((2, VOCAB + 3), np.float32)
    rc, msg = stepped.call("head_run", C.byref(HeadJob(2, floats(x), floats(logits), VOCAB + 3)), None)
    assert rc == 0, msg
    xn = x[:2] / np.sqrt((x[:2].astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(logits[:, :VOCAB], xn @ stepped.keep[4].T, rtol=1e-4, atol=1e-5)
    assert not logits[:, VOCAB:].any()  # past n_vocab in each row: untouched
    for t in (batched, stepped):
        t.close()


def test_split_jobs_out_of_turn_are_one_line(api):
    """A split layer's calls where the engine never makes them: an end without a begin, a begin before the layer's
    attention, FFN norm and hot rows are there (or its predictor, to select by), a predictor before the hot rows or
    of a rank the device does not take: one line each."""
    t = Tier(api)
    x = np.ones((1, E), np.float32)
    mid, xn, y = np.zeros_like(x), np.zeros_like(x), np.zeros_like(x)
    counts = Counts()
    try:
        assert t.call("split_end", floats(y), None) == (1, "no split layer to end")
        job = SplitJob(0, 1, 0, 1, floats(x), floats(mid), floats(xn), C.pointer(counts))
        assert t.call("split_begin", C.byref(job)) == (
            1, "layer 0's attention, FFN norm and hot rows were not all uploaded")
        job.hot_mode = 3
        assert t.call("split_begin", C.byref(job)) == (1, "bad split job")
        fc1, fc2 = np.ones((32, E), np.float32), np.ones((4, 32), np.float32)
        predictor = Predictor(Matrix(F32, 32, E, fc1.ctypes.data, None), Matrix(F32, 4, 32, fc2.ctypes.data, None), 0.0)
        assert t.call("predictor_upload", C.byref(predictor), 0) == (1, "layer 0's hot rows were not uploaded")
    finally:
        t.close()
