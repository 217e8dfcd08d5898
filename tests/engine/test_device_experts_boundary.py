"""A mixture's experts through the device library's C ABI (csrc/include/pi_device.h: expert_upload, experts_submit,
experts_wait) called directly, on the host emulation and (marked `gpu`) the CUDA library where a CUDA device is: a
job's y is each token's pairs' expert outputs, weighted and summed (against numpy's SiLU experts, f32 and q8_0
weights), a token without a pair gets zeros; what the engine never sends (a job before its experts' upload, pairs out
of range or not grouped by expert, an upload twice, of another shape, with biases, to a tier without experts) is
refused in one line, never a crash."""
from __future__ import annotations

import ctypes as C

import gguf
import numpy as np
import pytest
from test_device_library_boundary import ERR, Counts, Matrix, TierDesc, api, floats  # noqa: F401 (api: a fixture)

E, F, N_EXPERT, K, BATCH, N_LAYER = 64, 32, 4, 2, 8, 2
F32, Q8_0 = 0, 8


class Expert(C.Structure):
    _fields_ = [("gate", Matrix), ("up", Matrix), ("down", Matrix)]


class ExpertsJob(C.Structure):
    _fields_ = [("layer", C.c_int32), ("n_tok", C.c_int32), ("n_pairs", C.c_int32), ("x", C.POINTER(C.c_float)),
                ("pair_token", C.POINTER(C.c_int32)), ("pair_expert", C.POINTER(C.c_int32)),
                ("pair_weight", C.POINTER(C.c_float)), ("y", C.POINTER(C.c_float))]


def ints(a: np.ndarray):
    return a.ctypes.data_as(C.POINTER(C.c_int32))


class ExpertTier:
    """A tier of two layers of N_EXPERT SiLU experts (E wide, F neurons, top-K), random weights in f32 or q8_0."""

    def __init__(self, api, weight_type=F32, n_expert=N_EXPERT):
        rng = np.random.default_rng(3)
        self.api, self.err = api, C.create_string_buffer(256)
        self.desc = TierDesc(device=0, n_embd=E, n_layer=N_LAYER, n_batch=BATCH, activation=1, gated=1,
                             n_expert=n_expert, n_expert_used=K, n_ff_expert=F)
        self.tier = api.tier_create(C.byref(self.desc), self.err, 256)
        assert self.tier, self.err.value
        self.type = weight_type
        # [expert] (gate [F, E], up [F, E], down [E, F]) as f32, their file bytes, and what the device computes with
        self.f32 = [[rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((F, E), (F, E), (E, F))]
                    for _ in range(N_EXPERT)]
        if weight_type == Q8_0:
            self.raw = [[np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)) for w in ws]
                        for ws in self.f32]
            self.weights = [[gguf.quants.dequantize(r, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)
                             for r, w in zip(rs, ws)] for rs, ws in zip(self.raw, self.f32)]
        else:
            self.raw, self.weights = self.f32, self.f32

    def expert(self, e, rows=None, bias=None):
        (g, u, d), (gw, uw, dw) = self.raw[e], self.f32[e]
        return Expert(Matrix(self.type, rows or gw.shape[0], E, g.ctypes.data, bias), Matrix(self.type, F, E, u.ctypes.data, None),
                      Matrix(self.type, E, F, d.ctypes.data, None))

    def call(self, name, *args):
        self.err.value = b""
        rc = getattr(self.api, name)(self.tier, *args, self.err, 256)
        return rc, self.err.value.decode()

    def upload(self, layer, e, **wrong):
        return self.call("expert_upload", C.byref(self.expert(e, **wrong)), layer, e)

    def job(self, layer, x, tokens, experts, weights):
        keep = (np.ascontiguousarray(x, np.float32), np.array(tokens, np.int32), np.array(experts, np.int32),
                np.array(weights, np.float32), np.full((x.shape[0], E), np.nan, np.float32))
        self._keep = keep
        return ExpertsJob(layer, x.shape[0], len(tokens), floats(keep[0]), ints(keep[1]), ints(keep[2]),
                          floats(keep[3]), floats(keep[4])), keep[4]

    def run(self, *args):
        job, y = self.job(*args)
        rc, msg = self.call("experts_submit", C.byref(job))
        assert rc == 0, msg
        counts = Counts()
        rc, msg = self.call("experts_wait", C.byref(counts))
        assert rc == 0, msg
        return y, counts

    def reference(self, x, tokens, experts, weights):
        """numpy's: each pair's SiLU expert (the device's weights, float64), weighted, summed per token."""
        y = np.zeros((x.shape[0], E))
        for t, e, w in zip(tokens, experts, weights):
            g, u, d = (m.astype(np.float64) for m in self.weights[e])
            a = g @ x[t]
            y[t] += w * (d @ (a / (1 + np.exp(-a)) * (u @ x[t])))
        return y

    def close(self):
        self.api.tier_destroy(self.tier)


@pytest.mark.parametrize("weight_type", [F32, Q8_0])
def test_a_job_sums_each_tokens_pairs_weighted(api, weight_type):
    """Four tokens, six pairs over three of layer 1's experts (each expert's pairs together, a token's pairs in two
    experts' runs), token 3 without a pair: y against numpy (q8_0: the device's operands are q8_0 too, within their
    rounding); the counts: every pair's neurons, two launches an expert beside the gather, products and sum (and
    the two quantizations of q8_0 weights), the bus traffic."""
    t = ExpertTier(api, weight_type)
    for e in range(N_EXPERT):
        assert t.upload(1, e) == (0, "")
    x = np.random.default_rng(4).standard_normal((4, E)).astype(np.float32)
    pairs = ([0, 2, 1, 0, 2, 1], [0, 0, 2, 2, 2, 3], [0.7, 0.4, 0.25, 0.3, 0.6, 0.75])
    y, counts = t.run(1, x, *pairs)
    ref = t.reference(x, *pairs)
    tol = 1e-5 if weight_type == F32 else 3e-2
    assert np.abs(y - ref).max() <= tol * np.abs(ref).max(), np.abs(y - ref).max() / np.abs(ref).max()
    assert not y[3].any() and np.abs(ref).max() > 0.1
    assert counts.active == counts.computed == 6 * F
    assert counts.launches == 3 + 2 * 3 + (2 if weight_type == Q8_0 else 0)
    assert counts.h2d_bytes == 4 * E * 4 + 4 * (3 * 6 + 4 + 1) and counts.d2h_bytes == 4 * E * 4
    # the same pairs split over two jobs (one token each time): the same rows
    a, _ = t.run(1, x[:1], [0, 0], [0, 2], [0.7, 0.3])
    np.testing.assert_allclose(a[0], y[0], rtol=1e-5, atol=1e-6 * np.abs(y).max())
    t.close()


def test_experts_jobs_and_uploads_that_cannot_run_are_one_line(api):
    t = ExpertTier(api)
    x = np.ones((2, E), np.float32)
    job, _ = t.job(0, x, [0, 1], [1, 1], [0.5, 0.5])
    assert t.call("experts_submit", C.byref(job)) == (1, "layer 0's expert 1 was not uploaded")
    assert t.call("experts_wait", None) == (1, "no experts job to wait for")
    assert t.upload(0, 1, rows=F - 1) == (1, "cannot upload an expert whose matrices are not the tier's shape")
    bias = np.zeros(F, np.float32)
    assert t.upload(0, 1, bias=floats(bias)) == (1, "cannot upload an expert with biases")
    assert t.call("expert_upload", C.byref(t.expert(0)), 0, N_EXPERT) == (1, f"no expert {N_EXPERT}")
    assert t.call("expert_upload", C.byref(t.expert(0)), N_LAYER, 0) == (1, "bad expert upload")
    assert t.upload(0, 1) == (0, "") and t.upload(0, 2) == (0, "")
    assert t.upload(0, 1) == (1, "layer 0's expert 1 was uploaded already")
    for tokens, experts, why in (([0, 1, 0], [1, 2, 1], "an experts job whose expert's pairs are not one after the other"),
                                 ([0, 2], [1, 1], "an experts job's pair out of range"),
                                 ([0, 1], [1, N_EXPERT], "an experts job's pair out of range")):
        job, _ = t.job(0, x, tokens, experts, [0.5] * len(tokens))
        assert t.call("experts_submit", C.byref(job)) == (1, why)
    job, _ = t.job(0, np.ones((BATCH + 1, E), np.float32), [0], [1], [1.0])
    assert t.call("experts_submit", C.byref(job)) == (1, "bad experts job")
    job, _ = t.job(1, x, [0], [1], [1.0])  # uploaded to layer 0, not 1
    assert t.call("experts_submit", C.byref(job)) == (1, "layer 1's expert 1 was not uploaded")
    t.close()
    bare = ExpertTier(api, n_expert=0)
    assert bare.upload(0, 0) == (1, "cannot upload an expert to a tier described without experts, or with an expert "
                                    "width not a multiple of 32")
    bare.close()
