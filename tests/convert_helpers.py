"""Shared by the convert / inspect / tokenizer tests: random predictor dirs in the documented format,
and reading a written file back with gguf-py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def write_predictors(out: Path, n_layer: int, n_embd: int, n_ff: int, rank: int = 16, seed: int = 0,
                     thresholds: list[float] | None = None) -> Path:
    """A predictor directory as train-predictor writes it (docs/formats.md), with random weights."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for i in range(n_layer):
        torch.save({"fc1.weight": torch.randn(rank, n_embd, generator=gen),
                    "fc2.weight": torch.randn(n_ff, rank, generator=gen)}, out / f"model_{i}.pt")
    thresholds = thresholds if thresholds is not None else [0.1 * (i + 1) for i in range(n_layer)]
    (out / "config.json").write_text(json.dumps({
        "format": "powerinfer-tools.predictors/1", "sparse_threshold": 0.0,
        "layers": [{"layer": i, "rank": rank, "threshold": t} for i, t in enumerate(thresholds)]}))
    return out


def read_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (type name, float32 data in numpy (rows, cols) order) of every tensor in a GGUF/PWRI file."""
    import gguf

    from powerinfer_tools.formats.gguf_io import open_reader

    reader = open_reader(path)
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        out[t.name] = (t.tensor_type.name, data)
    return out


def read_fields(path: Path) -> dict:
    from powerinfer_tools.formats.gguf_io import open_reader

    return {k: f.contents() for k, f in open_reader(path).fields.items()}
