"""Test-only: a tiny PowerInfer model file (tensor names and types as docs/formats.md specifies, random
weights) and a profile directory of activation counts, without running the converter or the profiler."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

N_EMBD, N_HEAD, N_KV, N_VOCAB = 64, 4, 2, 96


def write_model(path: Path, n_layer: int = 3, n_ff: int = 128, qtype: str = "Q8_0") -> Path:
    """Llama-family layout: weights at `qtype`, norms f32, predictors f16 (as a quantized conversion writes)."""
    import gguf

    from powerinfer_tools.formats.gguf_io import set_pwri_magic

    rng = np.random.default_rng(0)
    kind = gguf.GGMLQuantizationType[qtype]
    d_head = N_EMBD // N_HEAD
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV)

    def weight(name, rows, cols, as_type=kind):
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        if as_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif as_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, as_type), raw_dtype=as_type)

    def norm(name):
        writer.add_tensor(name, np.ones(N_EMBD, np.float32))

    weight("token_embd.weight", N_VOCAB, N_EMBD)
    norm("output_norm.weight")
    weight("output.weight", N_VOCAB, N_EMBD)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        weight(f"blk.{i}.attn_q.weight", N_HEAD * d_head, N_EMBD)
        weight(f"blk.{i}.attn_k.weight", N_KV * d_head, N_EMBD)
        weight(f"blk.{i}.attn_v.weight", N_KV * d_head, N_EMBD)
        weight(f"blk.{i}.attn_output.weight", N_EMBD, N_HEAD * d_head)
        norm(f"blk.{i}.ffn_norm.weight")
        for part in ("ffn_gate", "ffn_up", "ffn_down_t"):
            weight(f"blk.{i}.{part}.weight", n_ff, N_EMBD)
        weight(f"blk.{i}.fc1.weight", 16, N_EMBD, gguf.GGMLQuantizationType.F16)
        weight(f"blk.{i}.fc2.weight", n_ff, 16, gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    set_pwri_magic(path)
    return path


def write_profile(folder: Path, counts: list[np.ndarray], tokens: int | None = None) -> Path:
    """DIR/activation/activation_{i}.pt as the profiler writes them (int64), and profile.json's token count
    and (ReLU-family) zero thresholds."""
    (folder / "activation").mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(counts):
        torch.save(torch.as_tensor(c), folder / "activation" / f"activation_{i}.pt")
    if tokens is not None:
        (folder / "profile.json").write_text(json.dumps({"format": "powerinfer-tools.profile/1", "tokens": tokens,
                                                         "rule": "nonzero", "thresholds": [0.0] * len(counts)}))
    return folder


def power_law_counts(n_layer: int, n_ff: int, tokens: int = 4096, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_layer):
        rate = np.minimum(1.0, 0.8 * (np.arange(1, n_ff + 1) / 4.0) ** -rng.uniform(0.6, 1.2))
        out.append(rng.permutation(rng.binomial(tokens, rate)).astype(np.int64))
    return out
