"""Synthetic profile directories in the documented format (docs/formats.md), for predictor tests.

learnable: x ~ N(0, I) and neuron j fires when (x @ W)_j > bias_j, like a ReLU layer whose gate is W
(W of low rank `signal_rank`, one value or one per layer, so a small predictor suffices); shuffled: the same masks permuted
across rows, which keeps every neuron's firing rate but cuts any link to x.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file


def write_profile(out: Path, *, n_layer=2, n_embd=32, n_ff=128, rows=4096, seq_len=64, signal_rank=4,
                  bias=0.5, shuffled=False, seed=0, data_seed=None, shard_rows=1024, config_hash="synthetic-a",
                  rule="nonzero") -> Path:
    """`seed` fixes the layer weights (the "model"), `data_seed` the rows (the "calibration text")."""
    weights_rng = np.random.default_rng(seed)
    rng = np.random.default_rng(seed if data_seed is None else 1000 + data_seed)
    out = Path(out)
    for sub in ("activation", "magnitude", "samples"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    seq = np.repeat(np.arange(rows // seq_len), seq_len).astype(np.int64)
    pos = np.tile(np.arange(seq_len), rows // seq_len).astype(np.int64)
    layer_stats = []
    for layer in range(n_layer):
        x = rng.standard_normal((rows, n_embd)).astype(np.float32)
        k = signal_rank[layer] if isinstance(signal_rank, (list, tuple)) else signal_rank
        w = weights_rng.standard_normal((n_embd, k)) @ weights_rng.standard_normal((k, n_ff)) / np.sqrt(n_embd * k)
        offset = bias * weights_rng.random(n_ff) * np.linalg.norm(w, axis=0)
        a = np.maximum(x @ w - offset, 0.0)
        if shuffled:
            a = a[rng.permutation(rows)]
        active = a > 0
        torch.save(torch.from_numpy(active.sum(0).astype(np.int64)), out / "activation" / f"activation_{layer}.pt")
        torch.save(torch.from_numpy(a.sum(0).astype(np.float32)), out / "magnitude" / f"magnitude_{layer}.pt")
        layer_dir = out / "samples" / f"layer_{layer}"
        layer_dir.mkdir(parents=True, exist_ok=True)
        for k, start in enumerate(range(0, rows, shard_rows)):
            part = slice(start, start + shard_rows)
            save_file({"x": x[part].astype(np.float16),
                       "mask": np.packbits(active[part], axis=1, bitorder="little"),
                       "seq": seq[part], "pos": pos[part]}, str(layer_dir / f"shard_{k:04d}.safetensors"))
        layer_stats.append({"layer": layer, "sparsity": float(1 - active.mean()), "hot10": 0.2, "hot20": 0.35,
                            "hot50": 0.7})
    meta = {
        "format": "powerinfer-tools.profile/1",
        "model": {"source": f"synthetic-{seed}", "arch": "llama-relu", "gguf_arch": "llama", "model_type": "llama",
                  "activation": "relu", "n_layer": n_layer, "n_embd": n_embd, "n_ff": n_ff,
                  "config_hash": config_hash},
        "rule": rule, "thresholds": [0.0] * n_layer, "target_sparsity": None,
        "tokens": rows, "sequences": rows // seq_len, "seq_len": seq_len, "calibration": ["synthetic"],
        "samples": {"rows": rows, "x_dtype": "float16"},
        "layers": layer_stats,
    }
    (out / "profile.json").write_text(json.dumps(meta, indent=2))
    return out
