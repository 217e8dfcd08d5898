"""The three-tier plan beside a model (model.gguf.tiers): per layer, how many of its hottest neurons the plan puts on
the GPU and how many of the next in memory; the rest are read from disk (docs/placement.md, "Three tiers"). For a
mixture of experts, per layer also the experts pinned in memory and the cache slots its other experts share.

`pi-tools plan --memory-budget` writes it; the engine's disk tier reads it at open (csrc/model/tier_plan.h) and
holds in memory each layer's hottest gpu + memory neurons that its hot tier does not hold, in the neuron bundles'
order (hottest first by the profile: formats/neuron_bundles.py), instead of the most frequent neurons of all layers;
its expert tier reads the pinned experts at open and never evicts them, and gives each layer a cache of its slots.
This module is the format's one Python owner.

Layout (little-endian): magic `PITP`, version u32, n_layer u32, n_ff u32, the VRAM and memory budgets the plan was
made for (u64 bytes, for the record), then per layer gpu u32 and memory u32 (gpu + memory <= n_ff); version 2 then
has n_expert u32 (0: a dense model, nothing follows) and, where it is not 0, per layer cache slots u32 and pinned u32
(slots + pinned <= n_expert), then (version 3) per layer the count of experts it keeps on the device u32 (slots +
pinned + device <= n_expert), then each layer's pinned expert ids u32 in turn (each below n_expert, none twice), then
(version 3) each layer's device expert ids u32 in turn (likewise, none also pinned). Last, a u64 checksum of everything before it
(neuron_bundles.checksum, the engine's bundle_checksum). Versions 1 (no expert section) and 2 (no device experts) are
still read.
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

VERSION = 3
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
    experts: "ExpertCounts | None" = None  # a mixture's

    def __post_init__(self):
        gpu, memory = np.asarray(self.gpu, np.int64), np.asarray(self.memory, np.int64)
        if gpu.shape != memory.shape or gpu.ndim != 1 or np.any(gpu < 0) or np.any(memory < 0) \
                or np.any(gpu + memory > self.n_ff):
            raise ValueError("a tier plan's counts are per layer, non-negative, and at most n_ff together")
        object.__setattr__(self, "gpu", gpu)
        object.__setattr__(self, "memory", memory)
        if self.experts is not None and len(self.experts.slots) != len(gpu):
            raise ValueError("a tier plan's expert section has one entry per layer")


@dataclass(frozen=True)
class ExpertCounts:
    """Per layer of a mixture of n_expert experts: the expert ids on the device, those pinned in memory, and the cache
    slots the others share."""

    n_expert: int
    slots: np.ndarray  # int64 [L]
    pinned: tuple  # [L] of int64 arrays
    device: tuple = ()  # [L] of int64 arrays (empty: none on the device)

    def __post_init__(self):
        slots = np.asarray(self.slots, np.int64)
        pinned = tuple(np.asarray(p, np.int64).reshape(-1) for p in self.pinned)
        device = tuple(np.asarray(d, np.int64).reshape(-1) for d in self.device) or \
            tuple(np.zeros(0, np.int64) for _ in pinned)
        if slots.ndim != 1 or len(pinned) != len(slots) or len(device) != len(slots) or np.any(slots < 0) \
                or self.n_expert < 1:
            raise ValueError("an expert section has per layer its cache slots (non-negative), its pinned experts and "
                             "its device experts")
        for il, (c, p, d) in enumerate(zip(slots, pinned, device)):
            if len(p) + len(d) + c > self.n_expert:
                raise ValueError(f"layer {il} puts {len(d)} experts on the device, pins {len(p)} and caches {c}, more "
                                 f"than its {self.n_expert}")
            for verb, ids in (("pins", p), ("puts on the device", d)):
                for e in ids[(ids < 0) | (ids >= self.n_expert)][:1]:
                    raise ValueError(f"layer {il} {verb} expert {e}, past its {self.n_expert}")
            for ids, words in ((p, "pins expert {} twice"), (np.concatenate([p, d]), "puts on the device expert {} twice, "
                                                                                      "or pins it too")):
                ids, times = np.unique(ids, return_counts=True)
                for e in ids[times > 1][:1]:
                    raise ValueError(f"layer {il} " + words.format(e))
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "pinned", pinned)
        object.__setattr__(self, "device", device)


def path_for(model: str | os.PathLike) -> Path:
    """The plan beside `model`, where the engine looks for it."""
    return Path(str(model) + names.TIER_PLAN_SUFFIX)


def encode(plan: TierCounts) -> bytes:
    body = HEADER.pack(names.TIER_PLAN_MAGIC.encode(), VERSION, len(plan.gpu), plan.n_ff, int(plan.vram_budget),
                       int(plan.memory_budget))
    body += np.stack([plan.gpu, plan.memory], axis=1).astype("<u4").tobytes()
    x = plan.experts
    body += struct.pack("<I", x.n_expert if x else 0)
    if x:
        body += np.stack([x.slots, [len(p) for p in x.pinned]], axis=1).astype("<u4").tobytes()
        body += np.array([len(d) for d in x.device], "<u4").tobytes()
        body += b"".join(p.astype("<u4").tobytes() for p in x.pinned)
        body += b"".join(d.astype("<u4").tobytes() for d in x.device)
    return body + struct.pack("<Q", checksum(body))


def write(plan: TierCounts, path: str | os.PathLike) -> None:
    with atomic_file(path) as tmp:
        Path(tmp).write_bytes(encode(plan))


def read(path: str | os.PathLike, n_layer: int | None = None, n_ff: int | None = None,
         n_expert: int | None = None) -> TierCounts:
    """The plan at `path`, checked as the engine checks it (one line naming what is wrong), for a model of `n_layer`
    layers of `n_ff` neurons and `n_expert` experts (0: dense) where given."""
    n_layer_model, n_ff_model = n_layer, n_ff
    raw = Path(path).read_bytes()
    if len(raw) < HEADER.size + 8:
        raise UserError(f"{path}: too short for a tier plan")
    magic, version, n_layer, n_ff, vram, memory = HEADER.unpack_from(raw)
    if magic != names.TIER_PLAN_MAGIC.encode() or not 1 <= version <= VERSION:
        raise UserError(f"{path}: not a version 1 to {VERSION} tier plan")
    if (n_layer_model, n_ff_model) != (None, None) and (n_layer, n_ff) != (n_layer_model, n_ff_model):
        raise UserError(f"{path}: made for {n_layer} layers of {n_ff} neurons, not this model's {n_layer_model} of "
                        f"{n_ff_model} (pi-tools plan --memory-budget writes it anew)")
    dense_end = HEADER.size + 8 * n_layer
    size_error = UserError(f"{path}: its size does not match its {n_layer} layers")
    if n_layer > MAX_LAYERS or len(raw) < dense_end + 8 + (4 if version >= 2 else 0):
        raise size_error
    experts, end = None, dense_end
    if version >= 2:
        (n_exp,), end = struct.unpack_from("<I", raw, dense_end), dense_end + 4
        if n_expert is not None and n_exp != n_expert:
            raise UserError(f"{path}: made for {n_exp} experts a layer, not this model's {n_expert} (pi-tools plan "
                            "--memory-budget writes it anew)")
        if n_exp:
            if len(raw) < end + 8 * n_layer + 8:
                raise size_error
            table = np.frombuffer(raw, "<u4", 2 * n_layer, end).reshape(n_layer, 2).astype(np.int64)
            end += 8 * n_layer
            mismatch = UserError(f"{path}: its size does not match its {n_layer} layers and their pinned and device "
                                 "experts")
            counts_dev = np.zeros(n_layer, np.int64)
            if version >= 3:
                if len(raw) < end + 4 * n_layer + 8:
                    raise mismatch
                counts_dev = np.frombuffer(raw, "<u4", n_layer, end).astype(np.int64)
                end += 4 * n_layer
            n_pinned, n_device = int(table[:, 1].sum()), int(counts_dev.sum())
            if np.any(table.sum(axis=1) > n_exp) or len(raw) != end + 4 * (n_pinned + n_device) + 8:
                raise mismatch
            ids = np.frombuffer(raw, "<u4", n_pinned, end).astype(np.int64)
            dev_ids = np.frombuffer(raw, "<u4", n_device, end + 4 * n_pinned).astype(np.int64)
            end += 4 * (n_pinned + n_device)
            device = np.split(dev_ids, np.cumsum(counts_dev)[:-1])
            experts = (n_exp, table[:, 0], np.split(ids, np.cumsum(table[:, 1])[:-1]), device)
    if len(raw) != end + 8:
        raise size_error
    if struct.unpack_from("<Q", raw, len(raw) - 8)[0] != checksum(raw[:-8]):
        raise UserError(f"{path}: damaged (checksum mismatch)")
    counts = np.frombuffer(raw, "<u4", 2 * n_layer, HEADER.size).reshape(n_layer, 2).astype(np.int64)
    try:
        section = ExpertCounts(experts[0], experts[1], tuple(experts[2]), tuple(experts[3])) if experts else None
        return TierCounts(n_ff, counts[:, 0], counts[:, 1], vram, memory, section)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
