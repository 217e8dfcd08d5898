"""The three-tier plan beside a model (model.gguf.tiers): per layer, how many of its hottest neurons the plan puts on
the GPU and how many of the next in memory; the rest are read from disk (docs/placement.md, "Three tiers").

`pi-tools plan --memory-budget` writes it; the engine's disk tier reads it at open (csrc/model/tier_plan.h) and
holds in memory each layer's hottest gpu + memory neurons that its hot tier does not hold, in the neuron bundles'
order (hottest first by the profile: formats/neuron_bundles.py), instead of the most frequent neurons of all layers.
This module is the format's one Python owner.

Layout (little-endian): magic `PITP`, version u32, n_layer u32, n_ff u32, the VRAM and memory budgets the plan was
made for (u64 bytes, for the record), then per layer gpu u32 and memory u32 (gpu + memory <= n_ff), then a u64
checksum of everything before it (neuron_bundles.checksum, the engine's bundle_checksum).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names
from powerinfer_tools.formats.neuron_bundles import checksum

VERSION = 1
HEADER = struct.Struct("<4s3I2Q")
MAX_LAYERS = 1 << 16  # a bound before arrays are sized from the file


@dataclass(frozen=True)
class TierCounts:
    """Per layer: the hottest `gpu` neurons on the GPU, the next `memory` in memory, the rest on disk."""

    n_ff: int
    gpu: np.ndarray  # int64 [L]
    memory: np.ndarray  # int64 [L]
    vram_budget: int = 0
    memory_budget: int = 0

    def __post_init__(self):
        gpu, memory = np.asarray(self.gpu, np.int64), np.asarray(self.memory, np.int64)
        if gpu.shape != memory.shape or gpu.ndim != 1 or np.any(gpu < 0) or np.any(memory < 0) \
                or np.any(gpu + memory > self.n_ff):
            raise ValueError("a tier plan's counts are per layer, non-negative, and at most n_ff together")
        object.__setattr__(self, "gpu", gpu)
        object.__setattr__(self, "memory", memory)


def path_for(model: str | os.PathLike) -> Path:
    """The plan beside `model`, where the engine looks for it."""
    return Path(str(model) + names.TIER_PLAN_SUFFIX)


def encode(plan: TierCounts) -> bytes:
    body = HEADER.pack(names.TIER_PLAN_MAGIC.encode(), VERSION, len(plan.gpu), plan.n_ff, int(plan.vram_budget),
                       int(plan.memory_budget))
    body += np.stack([plan.gpu, plan.memory], axis=1).astype("<u4").tobytes()
    return body + struct.pack("<Q", checksum(body))


def write(plan: TierCounts, path: str | os.PathLike) -> None:
    with atomic_file(path) as tmp:
        Path(tmp).write_bytes(encode(plan))


def read(path: str | os.PathLike, n_layer: int | None = None, n_ff: int | None = None) -> TierCounts:
    """The plan at `path`, checked as the engine checks it (one line naming what is wrong), for a model of `n_layer`
    layers of `n_ff` neurons where given."""
    n_layer_model, n_ff_model = n_layer, n_ff
    raw = Path(path).read_bytes()
    if len(raw) < HEADER.size + 8:
        raise UserError(f"{path}: too short for a tier plan")
    magic, version, n_layer, n_ff, vram, memory = HEADER.unpack_from(raw)
    if magic != names.TIER_PLAN_MAGIC.encode() or version != VERSION:
        raise UserError(f"{path}: not a version {VERSION} tier plan")
    if (n_layer_model, n_ff_model) != (None, None) and (n_layer, n_ff) != (n_layer_model, n_ff_model):
        raise UserError(f"{path}: made for {n_layer} layers of {n_ff} neurons, not this model's {n_layer_model} of "
                        f"{n_ff_model} (pi-tools plan --memory-budget writes it anew)")
    if n_layer > MAX_LAYERS or len(raw) != HEADER.size + 8 * n_layer + 8:
        raise UserError(f"{path}: its size does not match its {n_layer} layers")
    if struct.unpack_from("<Q", raw, len(raw) - 8)[0] != checksum(raw[:-8]):
        raise UserError(f"{path}: damaged (checksum mismatch)")
    counts = np.frombuffer(raw, "<u4", 2 * n_layer, HEADER.size).reshape(n_layer, 2).astype(np.int64)
    try:
        return TierCounts(n_ff, counts[:, 0], counts[:, 1], vram, memory)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
