"""Bytes one generated token reads, per FFN mode and measured density: the yardstick for the engine's speed.

Generation of a small model on a CPU is memory-bound: every weight row it uses is read once per token.
So the bytes a token reads predict (a) the speedup of a sparse mode over our own dense mode,
bytes(dense) / bytes(mode), and (b) the physical limit, bandwidth / bytes(mode) tokens/s.

Per layer (row sizes from the file, densities from the engine's per-layer statistics of the run):
  attention   wq, wk, wv, wo and the norms, always;
  predictor   fc1 and fc2, for tokens the layer ran in predictor mode;
  gate        every row in dense and gate mode, the predicted rows in predictor mode;
  up, down    the rows actually used (neurons passing the rule; all of them in dense mode);
  KV cache    the keys and values of the positions attended to (f32 in our cache);
plus the output head and one embedding row. A mixture of experts' layer reads its router and the gate, up and down
rows of the n_expert_used experts a token takes (n_ff: their neurons together). For a ReLU-gated model `up` is read for exactly the rows
used; for dReLU (bamboo) `up` is read wherever the gate passes, which this model undercounts.

The model prices every byte alike. `machine_seconds` prices the same bytes at what this machine charges for
them (engine.read_rows_rate, measured by pi-tools bench): an FFN matrix's share of rows at the probed rate for
rows picked by index at that share, or the whole matrix in order where that is quicker; everything else in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import field, head_width, open_reader
from powerinfer_tools.stages.options import KV_ELEMENT_BYTES

_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm", "attn_qkv")


@dataclass(frozen=True)
class LayerBytes:
    attention: int
    predictor: int
    gate_row: int
    up_row: int
    down_row: int
    n_ff: int
    router: int = 0  # a mixture of experts' ffn_gate_inp, read whole by every token


@dataclass(frozen=True)
class ModelBytes:
    layers: list[LayerBytes]
    head: int             # output head (the embedding when there is no output.weight)
    embedding_row: int
    kv_per_position: int  # K and V bytes of one cached position in one layer
    input_levels: tuple[float, ...] = ()   # input sparsity's calibrated shares (none: the file has no thresholds)


def model_bytes(path: Path, kv_type: str = "f32") -> ModelBytes:
    """Row and matrix sizes of a PowerInfer file, from its tensor table; the KV cache's in kv_type."""
    reader = open_reader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    rows = {t.name: int(t.shape[-1]) if len(t.shape) > 1 else 1 for t in reader.tensors}
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    arch = field(reader, "general.architecture")
    n_layer = int(field(reader, f"{arch}.block_count"))
    n_head = int(field(reader, f"{arch}.attention.head_count"))
    n_kv = int(field(reader, f"{arch}.attention.head_count_kv", n_head))
    n_embd = int(field(reader, f"{arch}.embedding_length"))
    layers = []
    for i in range(n_layer):
        def size(name: str) -> int:
            return sizes.get(f"blk.{i}.{name}", 0)

        def row(name: str) -> int:
            full = f"blk.{i}.{name}.weight"
            return sizes[full] // rows[full] if full in sizes else 0

        attention = sum(size(f"{n}.{kind}") for n in _ATTENTION for kind in ("weight", "bias"))
        if f"blk.{i}.{names.FFN_UP_EXPS}.weight" in sizes:  # GGUF order: (n_embd, n_ff, n_expert)
            _, n_ff_exp, n_expert = shapes[f"blk.{i}.{names.FFN_UP_EXPS}.weight"]

            def neuron(name: str) -> int:  # bytes of one neuron's row of an expert's matrix
                return size(f"{name}.weight") // (n_expert * n_ff_exp)
            k = int(field(reader, f"{arch}.expert_used_count"))
            layers.append(LayerBytes(attention, 0, neuron(names.FFN_GATE_EXPS), neuron(names.FFN_UP_EXPS),
                                     neuron(names.FFN_DOWN_EXPS), k * n_ff_exp, size(f"{names.FFN_GATE_INP}.weight")))
            continue
        n_ff = rows[f"blk.{i}.ffn_up.weight"]
        layers.append(LayerBytes(attention, size("fc1.weight") + size("fc2.weight"), row("ffn_gate"),
                                 row("ffn_up"), row("ffn_down_t"), n_ff))
    head = sizes.get("output.weight", sizes["token_embd.weight"])
    embedding_row = sizes["token_embd.weight"] // rows["token_embd.weight"]
    kv = round(2 * head_width(lambda key, default: field(reader, key, default), arch, n_embd, n_head) * n_kv *
               KV_ELEMENT_BYTES[kv_type])
    levels = reader.fields.get(names.KEY_INPUT_SPARSITY_LEVELS)
    return ModelBytes(layers, head, embedding_row, kv, tuple(levels.contents()) if levels is not None else ())


@dataclass(frozen=True)
class LayerReads:
    attention: float
    predictor: float
    ffn: list[tuple[float, float]]  # (bytes of the whole matrix, share of its rows read): gate, up, down, router


def layer_reads(lb: LayerBytes, st: dict | None) -> LayerReads:
    """What one decoded token reads in a layer; `st` = the engine's stats of that layer in the run (None: dense)."""
    whole = [lb.n_ff * lb.gate_row, lb.n_ff * lb.up_row, lb.n_ff * lb.down_row]
    router = [(lb.router, 1.0)] if lb.router else []
    if st is None or not st.get("tokens"):
        return LayerReads(lb.attention, 0.0, [(b, 1.0) for b in whole] + router)
    modes = st.get("modes") or {"dense": 1.0}
    in_predictor = modes.get("predictor", 0.0) / sum(modes.values())
    predicted = st.get("predicted_density")
    predicted = 1.0 if predicted is None else predicted
    computed = st["computed_density"]
    gate_share = 1.0 - in_predictor + in_predictor * predicted
    return LayerReads(lb.attention, in_predictor * lb.predictor,
                      [(whole[0], gate_share), (whole[1], computed), (whole[2], computed)] + router)


def token_bytes(mb: ModelBytes, layer_stats: list[dict] | None, position: float) -> dict:
    """Bytes one decoded token at cache `position` reads; `layer_stats` = the engine's per-layer stats
    of the run (density fields and the tier-mode token counts); None means dense."""
    parts = {"attention": 0.0, "predictor": 0.0, "ffn": 0.0, "head": float(mb.head + mb.embedding_row),
             "kv_cache": float(mb.kv_per_position * position * len(mb.layers))}
    for i, lb in enumerate(mb.layers):
        r = layer_reads(lb, layer_stats[i] if layer_stats else None)
        parts["attention"] += r.attention
        parts["predictor"] += r.predictor
        parts["ffn"] += sum(whole * share for whole, share in r.ffn)
    parts["total"] = sum(parts.values())
    return parts


def machine_seconds(mb: ModelBytes, layer_stats: list[dict] | None, position: float, rates: dict) -> float:
    """Seconds one decoded token takes at this machine's read rates: `rates` = {"density": [...], "bytes_per_second":
    [...]} from the read probe (density 1: every row in order), interpolated between the probed densities. Never
    less than the byte model's bytes at the in-order rate, so its speedups over dense never exceed the byte model's."""
    density, rate = np.asarray(rates["density"], float), np.asarray(rates["bytes_per_second"], float)
    in_order = float(rate[np.argmax(density)])
    seconds = (mb.head + mb.embedding_row + mb.kv_per_position * position * len(mb.layers)) / in_order
    for i, lb in enumerate(mb.layers):
        r = layer_reads(lb, layer_stats[i] if layer_stats else None)
        seconds += (r.attention + r.predictor) / in_order
        for whole, share in r.ffn:
            if share > 0:  # a byte by index costs at least a byte in order (a probe's noise aside)
                by_index = min(float(np.interp(share, density, rate)), in_order)
                seconds += min(whole * share / by_index, whole / in_order)
    return seconds
