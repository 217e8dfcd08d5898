"""The device tests' shared pieces: the device library fixtures (the emulated one, and the CUDA one where a CUDA
device is, marked `gpu`), hot-tier indexes and a run of a prompt batch then decode steps."""
from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import random_tokens, write_gpuidx
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine

TOKENS = random_tokens(40, 384, seed=5)
N_PROMPT = 24
KINDS = ["llama-relu", "llama-silu", "prosparse", "bamboo", "falcon", "falcon7b", "opt"]


def comparable_batch(outtype: str) -> int:
    """The batch size at which a device run's logits are compared with a CPU run's: 16, or token by token for a
    quantized file. A CPU batch (the device run's cold tier's too) multiplies a quantized down projection in
    integers (its input and the transposed weights in q8_0), the device in floats, and a random tiny model's
    predictor or rule thresholds turn that rounding into other neurons; decode steps sum as the device does,
    within TOLERANCE. Each tier's batches are bounded against float64 instead (test_engine_device.py
    test_each_tier_is_as_close_to_float64)."""
    return 1 if outtype in ("q8_0", "q4_0") else 16


def run(path, mode="dense", tokens=TOKENS, batch_size=16, **kw):
    """Logits of every token (the first N_PROMPT as batches of batch_size, then one at a time), info and stats."""
    with engine.Model(path, threads=2, sparse_mode=mode, batch_size=batch_size, **kw) as m:
        rows = [m.eval(tokens[:N_PROMPT])] + [m.eval([t])[None, 0] for t in tokens[N_PROMPT:]]
        return np.concatenate(rows), m.info, m.stats()


def hot_index(tmp_path_factory, share: float, seed: int = 31):
    hot = [np.random.default_rng(seed + i).random(N_FF) < share for i in range(N_LAYER)]
    return write_gpuidx(tmp_path_factory.mktemp("hot") / f"hot{share}.gpuidx", hot)


@pytest.fixture(scope="module")
def gpuidx_30(tmp_path_factory):
    return hot_index(tmp_path_factory, 0.3)


@pytest.fixture(scope="module")
def gpuidx_all(tmp_path_factory):
    return hot_index(tmp_path_factory, 1.01)


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch, converted, gpuidx_30):
    """A device library: the emulated one (a device of 512 MiB), or the CUDA one where a CUDA device is present."""
    path = engine.device_library_path(request.param)
    if request.param == "emulated":
        assert path is not None, "the emulated device library is built with the engine"
        monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "512")
        monkeypatch.delenv("PI_EMULATED_DEVICES", raising=False)
        return path
    if path is None:
        pytest.skip("built without nvcc: no CUDA library")
    with engine.Model(converted("llama-relu", "q8_0"), gpuidx=gpuidx_30, gpu="auto", gpu_library=path) as m:
        if not m.info["gpu"]["used"]:
            pytest.skip(m.info['gpu']['reason'])
    return path


@pytest.fixture
def emulated(monkeypatch):
    """The emulated device library alone, with a device of 512 MiB (the checks that set its device's properties)."""
    monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "512")
    monkeypatch.delenv("PI_EMULATED_DEVICES", raising=False)
    return engine.device_library_path("emulated")
