"""Numbers handed to the engine are checked before ctypes converts them: ctypes keeps only the low 32 bits of
an int32 argument (2**32 + 8 would become 8), np.fromiter truncates 3.7 to 3 and parses "5", a C float rounds
1e-300 to 0 (input sparsity off), and True is 1 (GiB)."""
from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import converted  # noqa: F401

import powerinfer_engine as engine


@pytest.fixture(scope="module")
def model_file(converted):
    return converted("llama-relu")


@pytest.mark.parametrize("kwargs,message", [
    ({"ctx_size": 2**32 + 8}, "ctx_size = 4294967304 is out of range"),
    ({"threads": 2**32 + 1}, "threads = 4294967297 is out of range"),
    ({"batch_size": 2**31}, "batch_size = 2147483648 is out of range"),
    ({"ctx_size": 64.5}, "ctx_size must be an integer, not float"),
    ({"threads": "2"}, "threads must be an integer, not str"),
    ({"memory_budget": True}, "memory_budget must be a number, not bool"),
    ({"input_sparsity": 1e-300}, "input_sparsity = 1e-300 is too small for the engine's float"),
])
def test_open_refuses_integers_ctypes_would_cut(model_file, kwargs, message):
    with pytest.raises(engine.EngineError, match=message):
        engine.Model(model_file, **kwargs)


def test_calls_refuse_integers_ctypes_would_cut(model_file):
    with engine.Model(model_file, threads=1, ctx_size=64) as m:
        m.eval([1, 2, 3])
        with pytest.raises(engine.EngineError, match="n_keep = 4294967297 is out of range"):
            m.reset(2**32 + 1)
        assert m.n_past == 3  # nothing was truncated
        for bad in ([1, 2.0], [1, 3.7], ["5"], [None]):
            with pytest.raises(engine.EngineError, match="token ids must be integers"):
                m.eval(bad)
        with pytest.raises(engine.EngineError, match="outside the vocabulary"):
            m.eval([2**64 + 1])
        with pytest.raises(engine.EngineError, match="top_k = 1099511627776 is out of range"):
            m.sample(top_k=2**40)
        with pytest.raises(engine.EngineError, match="temperature must be a number"):
            m.sample(temperature="0.5")
        with pytest.raises(engine.EngineError, match="seed = 18446744073709551617 is out of range"):
            m.seed(2**64 + 1)
        with pytest.raises(engine.EngineError, match="seed = -1 is out of range"):
            m.seed(-1)
        assert m.n_past == 3
        assert m.eval(np.array([4, 5], dtype=np.uint16)).shape == (2, m.n_vocab)


def test_read_rows_rate_refuses_integers_ctypes_would_cut():
    with pytest.raises(engine.EngineError, match="threads = 4294967297 is out of range"):
        engine.read_rows_rate(4096, 0.5, threads=2**32 + 1, buffer_bytes=1 << 20, passes=1)
    with pytest.raises(engine.EngineError, match="row_bytes = 18446744073709551616 is out of range"):
        engine.read_rows_rate(2**64, 0.5, threads=1, buffer_bytes=1 << 20, passes=1)
