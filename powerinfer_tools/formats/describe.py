"""What is inside a GGUF / PowerInfer file: metadata, tensor table, and for a gpuidx the per-layer
GPU share -- the first thing to look at when a file does not load."""
from __future__ import annotations

import os
import re

import numpy as np

from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import field, open_reader, read_magic


def describe(path: str | os.PathLike) -> dict:
    """The file's magic, metadata (key -> value), tensors and, for a gpuidx, GPU shares per layer."""
    reader = open_reader(path)
    metadata = {key: field(reader, key, lossy=True) for key in reader.fields if not key.startswith("GGUF.")}
    tensors = [{"name": t.name, "shape": tuple(int(n) for n in reversed(t.shape)), "type": t.tensor_type.name,
                "bytes": int(t.n_bytes)} for t in reader.tensors]
    info = {"path": str(path), "magic": read_magic(path).decode("ascii", "replace"),
            "version": int(reader.fields["GGUF.version"].contents()), "metadata": metadata, "tensors": tensors,
            "gpu_layers": None}
    if field(reader, names.KEY_ARCHITECTURE) == names.GPU_INDEX_ARCH:
        info["gpu_layers"] = _gpu_shares(reader)
    return info


def _gpu_shares(reader) -> list[dict]:
    layers = []
    for t in reader.tensors:
        match = re.fullmatch(rf"blk\.(\d+)\.{names.GPU_IDX}", t.name)
        if match:
            on_gpu = np.asarray(t.data).astype(bool)
            layers.append({"layer": int(match.group(1)), "n_ff": int(on_gpu.size), "gpu": int(on_gpu.sum()),
                           "share": float(on_gpu.mean()) if on_gpu.size else 0.0})
    return sorted(layers, key=lambda row: row["layer"])


def _value(value, max_items: int) -> str:
    if isinstance(value, list):
        head = ", ".join(_value(v, max_items) for v in value[:max_items])
        return f"[{head}{', ...' if len(value) > max_items else ''}] ({len(value)} items)"
    if isinstance(value, str):
        one_line = value.replace("\n", "\\n")
        return repr(one_line if len(one_line) <= 120 else one_line[:117] + "...")
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def render(info: dict, max_items: int = 6) -> str:
    """The human-readable report `pi-tools inspect` prints."""
    lines = [f"{info['path']}: magic {info['magic']}, GGUF v{info['version']}, "
             f"{len(info['metadata'])} metadata keys, {len(info['tensors'])} tensors", "", "metadata:"]
    width = max((len(k) for k in info["metadata"]), default=0)
    lines += [f"  {k:<{width}}  {_value(v, max_items)}" for k, v in info["metadata"].items()]
    lines += ["", "tensors:"]
    name_w = max((len(t["name"]) for t in info["tensors"]), default=4)
    lines.append(f"  {'name':<{name_w}}  {'shape (rows, cols)':<20} {'type':<6} {'bytes':>12}")
    for t in info["tensors"]:
        lines.append(f"  {t['name']:<{name_w}}  {str(list(t['shape'])):<20} {t['type']:<6} {t['bytes']:>12,}")
    total = sum(t["bytes"] for t in info["tensors"])
    lines.append(f"  {'total':<{name_w}}  {'':<20} {'':<6} {total:>12,}")
    if info["gpu_layers"] is not None:
        lines += ["", "GPU share per layer (neurons placed on the GPU):"]
        for row in info["gpu_layers"]:
            lines.append(f"  layer {row['layer']:>3}: {row['gpu']:>7} / {row['n_ff']:<7} {row['share']:7.1%}")
        n = sum(r["n_ff"] for r in info["gpu_layers"])
        if n:
            lines.append(f"  all      : {sum(r['gpu'] for r in info['gpu_layers']):>7} / {n:<7} "
                         f"{sum(r['gpu'] for r in info['gpu_layers']) / n:7.1%}")
    return "\n".join(lines)
