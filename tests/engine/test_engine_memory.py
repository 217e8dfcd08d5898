"""The engine's read probe (engine.read_rows_rate): a rate for rows picked by index and for rows in order, and a
clear error for every argument it cannot take."""
from __future__ import annotations

import math

import pytest

import powerinfer_engine as engine


@pytest.mark.parametrize("row_bytes,density", [(324, 0.5), (612, 0.1), (100, 1.0), (8, 0.3)])
def test_rates_are_bytes_per_second(row_bytes, density):
    rate = engine.read_rows_rate(row_bytes, density, threads=2, buffer_bytes=16 << 20, passes=2)
    assert math.isfinite(rate) and 1e7 < rate < 1e13


@pytest.mark.parametrize("kwargs,message", [
    ({"density": 0.0}, "density must be in"),
    ({"density": 1.5}, "density must be in"),
    ({"density": math.nan}, "density must be in"),
    ({"threads": 0}, "threads must be in"),
    ({"passes": 0}, "passes must be in"),
    ({"row_bytes": 4}, "row_bytes must be in"),
    ({"row_bytes": 2 << 20}, "row_bytes must be in"),
    ({"buffer_bytes": 1 << 37}, "at most 64 GiB"),
    ({"buffer_bytes": 4096}, "at least 64 rows per pass"),
])
def test_bad_arguments_are_refused(kwargs, message):
    args = {"row_bytes": 324, "density": 0.5, "threads": 1, "buffer_bytes": 1 << 20, "passes": 2} | kwargs
    with pytest.raises(engine.EngineError, match=message):
        engine.read_rows_rate(**args)
