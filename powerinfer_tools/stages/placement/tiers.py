"""The memory and disk tiers of a plan (docs/placement.md, "Three tiers"): what one activation of a neuron costs on
the GPU, in memory and on disk, and the room the engine gives resident neurons at a memory budget.

The room is the engine's own (its disk tier's rule: the budget less the fixed part, less the cache of neuron
bundles), read from the engine opened at that budget (`stats()["disk"]["resident_room_bytes"]`), so that no second
accounting of what the fixed part holds lives here. Memory's rate is the engine's read probe (rows picked by index,
csrc/runtime/read_probe.cpp); the disk's and the device's are the constants below, each with its source.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import neuron_bundles
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE

# Random O_DIRECT reads at the disk tier's queue depth of 32, 8-64 KiB: a read costs about 8.1 us plus 4.8 us per
# 8 KiB (docs/history.md, "Fewer, larger reads", the least-squares fit of the disk measured there; no probe of the
# disk is bundled).
DISK_READ_S = 8.1e-6
DISK_BYTES_PER_S = 8192 / 4.8e-6
# The device's memory rate: an H100 PCIe's HBM2e, 2.0 TB/s (NVIDIA H100 Tensor Core GPU datasheet); a decode step's
# hot rows are read once from it.
DEVICE_BYTES_PER_S = 2.0e12


@dataclass(frozen=True)
class MemoryTier:
    """A memory budget as the engine spends it, and what an activation costs in each tier (seconds, per layer)."""

    budget: int  # the engine's memory_budget (bytes)
    room: int  # bytes its resident share may take at that budget
    bundle_bytes: np.ndarray  # int64 [L]: what one resident neuron takes
    memory_bytes_per_s: float  # the read probe's rate for this model's rows
    device_s: np.ndarray  # float [L]
    memory_s: np.ndarray
    disk_s: np.ndarray


def bundle_bytes(neuron_bytes: np.ndarray) -> np.ndarray:
    """A neuron's bundle in the sidecar: its rows padded to whole pages (formats/neuron_bundles.py)."""
    align = neuron_bundles.ALIGN
    return (np.asarray(neuron_bytes, np.int64) + align - 1) // align * align


def costs_per_activation(neuron_bytes: np.ndarray, memory_bytes_per_s: float):
    """(device, memory, disk) seconds one activation of a layer's neuron costs: its rows read from the device's
    memory, from memory at the probed rate, or its bundle read from disk."""
    rows = np.asarray(neuron_bytes, np.float64)
    return (rows / DEVICE_BYTES_PER_S, rows / memory_bytes_per_s,
            DISK_READ_S + bundle_bytes(neuron_bytes) / DISK_BYTES_PER_S)


def engine_room(model_path: str | Path, budget_bytes: int, ctx_size: int) -> int:
    """The bytes the engine's resident share may take at this budget and context (its own rule), from the engine
    opened with them and the KV cache type `run` opens with; needs the model's neuron bundles beside it."""
    import powerinfer_engine as engine

    try:
        with engine.Model(model_path, ctx_size=ctx_size, sparse_mode="predictor", kv_type=DEFAULT_KV_TYPE,
                          memory_budget=budget_bytes / 2**30) as m:
            return int(m.stats()["disk"]["resident_room_bytes"])
    except engine.EngineError as e:
        raise UserError(f"--memory-budget: {e}") from None


def memory_rate(row_bytes: int, density: float) -> float:
    """Bytes per second of rows read by index at `density` with the engine's default threads (its read probe)."""
    import powerinfer_engine as engine

    return engine.read_rows_rate(int(row_bytes), float(min(max(density, 0.05), 1.0)), os.cpu_count() or 1)


def memory_tier(model_path: str | Path, neuron_bytes: np.ndarray, row_bytes: int, density: float, budget_bytes: int,
                ctx_size: int) -> MemoryTier:
    rate = memory_rate(row_bytes, density)
    device, memory, disk = costs_per_activation(neuron_bytes, rate)
    return MemoryTier(int(budget_bytes), engine_room(model_path, budget_bytes, ctx_size), bundle_bytes(neuron_bytes),
                      rate, device, memory, disk)


def frequency_rule(counts: list[np.ndarray], gpu: np.ndarray, tier: MemoryTier) -> np.ndarray:
    """Per layer, how many neurons the engine's rule without a plan holds in memory: the most frequently active
    cold neurons of all layers (those past each layer's `gpu` hottest) while the room lasts."""
    cold = [np.sort(c)[::-1][int(k):] for c, k in zip(counts, gpu)]
    held = int(tier.room // int(tier.bundle_bytes.max())) if len(counts) else 0
    layer = np.concatenate([np.full(len(c), i) for i, c in enumerate(cold)]) if cold else np.zeros(0, int)
    order = np.argsort(-np.concatenate(cold), kind="stable")[:held] if cold else np.zeros(0, int)
    return np.bincount(layer[order], minlength=len(counts)).astype(np.int64)


def seconds_per_token(prefix: list[np.ndarray], tier: MemoryTier, gpu: np.ndarray, memory: np.ndarray,
                      tokens: float) -> float:
    """Expected seconds a token's FFN rows cost: the hottest gpu[i] from the device, the next memory[i] from
    memory, the rest from disk (prefix[i][k]: the layer's k largest counts summed)."""
    total = 0.0
    for i, p in enumerate(prefix):
        k, s = int(gpu[i]), int(gpu[i] + memory[i])
        total += tier.device_s[i] * p[k] + tier.memory_s[i] * (p[s] - p[k]) + tier.disk_s[i] * (p[-1] - p[s])
    return total / max(tokens, 1.0)


def check_memory_budget(budget_gib: float | None, granularity: str | int) -> None:
    if budget_gib is None:
        return
    limits.MEMORY_BUDGET_GIB.check("--memory-budget", budget_gib)
    if str(granularity).strip() != "1":
        raise UserError("--memory-budget places neurons one by one: it takes --granularity 1 only")
