"""The FFN's tier boundary (csrc/backend/tier_backend.h): the hot tier computed by a second backend, the scalar
reference one (a token and a neuron at a time by dot and axpy, from its own copy of the rows, on a thread of its
own while the cold tier runs), gives the CPU backend's logits within rounding in every mode, architecture and
type; the public header declares only the inference API."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import converted, max_rel_err, random_tokens, write_gpuidx  # noqa: F401
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_engine import EngineError

TOKENS = random_tokens(40, 384, seed=3)
N_PROMPT = 32
HEADER = Path(__file__).resolve().parents[2] / "csrc" / "include"


def logits(path, mode, hot_backend, batch_size=16, **kw):
    with engine.Model(path, threads=2, sparse_mode=mode, batch_size=batch_size, hot_backend=hot_backend, **kw) as m:
        rows = [m.eval(TOKENS[:N_PROMPT])] + [m.eval([t])[None, 0] for t in TOKENS[N_PROMPT:]]
        assert m.info["hot_backend"] == hot_backend
        return np.concatenate(rows), m.stats()


@pytest.fixture(scope="module")
def gpuidx(tmp_path_factory):
    hot = [np.random.default_rng(21 + i).random(N_FF) < 0.4 for i in range(N_LAYER)]
    return write_gpuidx(tmp_path_factory.mktemp("hot") / "hot.gpuidx", hot)


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("kind", ["llama-relu", "llama-silu", "bamboo", "falcon", "opt"])
def test_reference_hot_backend_gives_the_same_logits(kind, outtype, converted, gpuidx):
    """Every mode within rounding: f32 files with the prompt in batches, quantized ones token by token (a CPU
    batch multiplies a quantized down projection in integers, q8_0 input and transposed weights, where the
    reference backend sums floats; a random tiny model's thresholds turn that rounding into other neurons). A
    quantized file's dense batches: within that rounding (bounded against float64 in test_engine_logits.py)."""
    path = converted(kind, outtype, predictors=True)
    steps = 16 if outtype == "f32" else 1
    for mode in ("dense", "gate", "predictor", "auto"):
        cpu, cpu_stats = logits(path, mode, "cpu", batch_size=steps, gpuidx=gpuidx, cpu_hot_tier=True)
        ref, ref_stats = logits(path, mode, "reference", batch_size=steps, gpuidx=gpuidx)
        # the same rule on the same values; the sums in another order (and q8_0 dots without gemm8's grouping)
        assert max_rel_err(ref, cpu) <= 2e-4, (mode, max_rel_err(ref, cpu))
        for a, b in zip(ref_stats["layers"], cpu_stats["layers"]):
            assert abs(a["hot_density"] - b["hot_density"]) <= 0.01, (mode, a, b)
    if outtype != "f32":
        cpu = logits(path, "dense", "cpu", gpuidx=gpuidx, cpu_hot_tier=True)[0]
        ref = logits(path, "dense", "reference", gpuidx=gpuidx)[0]
        assert max_rel_err(ref, cpu) <= 3e-2, max_rel_err(ref, cpu)  # measured 1.0e-2 to 1.8e-2


def test_without_a_hot_tier_the_backend_is_never_asked(converted):
    path = converted("llama-relu", "q8_0", predictors=True)
    np.testing.assert_array_equal(logits(path, "gate", "reference")[0], logits(path, "gate", "cpu")[0])


def test_an_unknown_backend_is_refused(converted):
    with pytest.raises(EngineError, match="unknown tier backend 'gpu'"):
        engine.Model(converted("llama-relu"), hot_backend="gpu")


def test_the_public_header_declares_only_the_inference_api():
    public = (HEADER / "pi_engine.h").read_text()
    testing = (HEADER / "pi_engine_testing.h").read_text()
    for name in ("pi_kernel_dot", "pi_isa_available", "pi_read_rows_rate", "pi_open_with_hot_backend"):
        assert name not in public and name + "(" in testing, name
