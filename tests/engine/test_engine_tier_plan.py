"""The disk tier following a three-tier plan (docs/engine.md, "Models larger than memory"; docs/placement.md, "Three
tiers"): the resident share is each layer's cold neurons among its plan's gpu + memory hottest, not the most frequent
of all layers; the hot tier (a .gpuidx, on the emulated device) and the disk tier combine; the logits are the bits of
the run with every cold row mapped; a damaged, foreign or impossible plan is refused in one line."""
from __future__ import annotations

import os
import shutil
import struct

import numpy as np
import pytest
from device_fixtures import device, gpuidx_30, run  # noqa: F401
from engine_helpers import converted, write_gpuidx  # noqa: F401
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import neuron_bundles, tier_plan

MEMORY = np.array([N_FF // 2, N_FF // 8] + [N_FF // 4] * (N_LAYER - 2))  # unequal: not what frequencies give


@pytest.fixture(params=["f32", "q8_0", "q4_0"])
def bundled(request, converted, tmp_path):  # noqa: F811
    """The tiny ReLU llama with predictors and its bundles (random frequencies, the same spread in every layer), the
    frequencies, and the bytes the engine holds besides bundles (from a budget that caches every bundle)."""
    model = tmp_path / "m.gguf"
    shutil.copy(converted("llama-relu", request.param, predictors=True), model)
    freqs = [np.random.default_rng(10 + i).random(N_FF) for i in range(N_LAYER)]
    sidecar = neuron_bundles.write(model, frequencies=freqs, progress=False)
    disk = logits(model, 64 << 30)[1]
    bundle = neuron_bundles.read_layout(sidecar)["bundle_bytes"]
    return model, freqs, disk["resident_bytes"] - N_LAYER * N_FF * bundle, bundle


def logits(model, budget_bytes=None, **kw):
    """Logits of a 24-token prompt then 16 decode steps in predictor mode, and the disk tier's stats."""
    kw |= {} if budget_bytes is None else {"memory_budget": budget_bytes / 2**30}
    rows, _, stats = run(model, "predictor", ctx_size=128, **kw)
    return rows, stats["disk"]


def test_the_resident_share_is_the_plans(bundled):
    model, _, fixed, bundle = bundled
    mapped, _ = logits(model)
    budget = fixed + (N_FF + MEMORY.sum()) * bundle + 1024  # a cache of one layer, and the plan's neurons
    by_frequency, disk = logits(model, budget)
    assert not disk["tier_plan"] and sum(disk["resident_neurons"]) == MEMORY.sum()
    assert disk["resident_neurons"] != MEMORY.tolist()  # so that the plan's counts below are the plan's doing
    tier_plan.write(tier_plan.TierCounts(N_FF, np.zeros(N_LAYER), MEMORY), tier_plan.path_for(model))
    planned, disk = logits(model, budget)
    assert disk["tier_plan"] and disk["resident_neurons"] == MEMORY.tolist()
    assert disk["resident_room_bytes"] == MEMORY.sum() * bundle and disk["tokens"] > 0 and disk["cache_misses"] > 0
    assert np.array_equal(planned, mapped) and np.array_equal(by_frequency, mapped)


def topped_up(freqs: list[np.ndarray], planned: np.ndarray, room: int) -> list[int]:
    """Per layer, the resident neurons of a plan of `planned` hottest at a room of `room` neurons: the plan's, then
    the most frequent of the rest of all layers (random frequencies: no ties)."""
    rest = [np.sort(f)[::-1][p:] for f, p in zip(freqs, planned)]
    layer = np.concatenate([np.full(len(r), i) for i, r in enumerate(rest)])
    top = np.argsort(-np.concatenate(rest))[:room - int(planned.sum())]
    return (planned + np.bincount(layer[top], minlength=len(freqs))).tolist()


def test_a_plan_beyond_the_room_keeps_its_most_frequent_and_a_smaller_one_is_topped_up_by_frequency(bundled):
    model, freqs, fixed, bundle = bundled
    budget = fixed + (N_FF + MEMORY.sum()) * bundle + 1024
    _, by_frequency = logits(model, budget)
    tier_plan.write(tier_plan.TierCounts(N_FF, np.zeros(N_LAYER), np.full(N_LAYER, N_FF)), tier_plan.path_for(model))
    _, disk = logits(model, budget)  # every neuron planned in memory: trimmed by frequency, the frequency rule's
    assert disk["resident_neurons"] == by_frequency["resident_neurons"]
    lopsided = np.array([N_FF // 2 - 8] + [0] * (N_LAYER - 1))  # fewer than the room, all in layer 0
    tier_plan.write(tier_plan.TierCounts(N_FF, np.zeros(N_LAYER), lopsided), tier_plan.path_for(model))
    _, disk = logits(model, budget)
    assert disk["resident_neurons"] == topped_up(freqs, lopsided, int(MEMORY.sum()))
    assert disk["resident_neurons"] != by_frequency["resident_neurons"]
    assert disk["resident_bytes"] == by_frequency["resident_bytes"]


def raw_plan(n_layer: int, n_ff: int, counts: list[tuple[int, int]]) -> bytes:
    body = tier_plan.HEADER.pack(b"PITP", 1, n_layer, n_ff, 0, 0)  # version 1: still read
    body += b"".join(struct.pack("<2I", g, m) for g, m in counts)
    return body + struct.pack("<Q", neuron_bundles.checksum(body))


@pytest.mark.parametrize("outtype", ["q4_0"])
def test_a_damaged_foreign_or_impossible_plan_is_refused_in_one_line(converted, tmp_path, outtype):  # noqa: F811
    model = tmp_path / "m.gguf"
    shutil.copy(converted("llama-relu", outtype, predictors=True), model)
    neuron_bundles.write(model, progress=False)
    path = tier_plan.path_for(model)
    good = raw_plan(N_LAYER, N_FF, [(0, 8)] * N_LAYER)
    cases = {"damaged": good[:20] + bytes([good[20] ^ 1]) + good[21:],
             "its size": good[:-1],
             f"made for {N_LAYER + 1} layers of {N_FF} neurons": raw_plan(N_LAYER + 1, N_FF, [(0, 8)] * (N_LAYER + 1)),
             f"made for {N_LAYER} layers of {N_FF + 1} neurons": raw_plan(N_LAYER, N_FF + 1, [(0, 8)] * N_LAYER),
             "more than its": raw_plan(N_LAYER, N_FF, [(N_FF, 1)] + [(0, 0)] * (N_LAYER - 1)),
             "not a version": b"XXXX" + good[4:]}
    for words, raw in cases.items():
        path.write_bytes(raw)
        with pytest.raises(engine.EngineError, match=words) as e:
            engine.Model(model, sparse_mode="predictor", ctx_size=128, memory_budget=64)
        assert "\n" not in str(e.value)
        with pytest.raises(UserError):
            tier_plan.read(path, N_LAYER, N_FF)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(engine.EngineError, match="not a regular file"):
        engine.Model(model, sparse_mode="predictor", ctx_size=128, memory_budget=64)


def test_the_format_round_trips(tmp_path):
    plan = tier_plan.TierCounts(N_FF, [3, 0], [5, N_FF], vram_budget=7 << 30, memory_budget=3 << 30)
    tier_plan.write(plan, tmp_path / "p.tiers")
    back = tier_plan.read(tmp_path / "p.tiers")
    assert (back.n_ff, back.vram_budget, back.memory_budget) == (N_FF, 7 << 30, 3 << 30)
    assert back.gpu.tolist() == [3, 0] and back.memory.tolist() == [5, N_FF]
    with pytest.raises(ValueError):
        tier_plan.TierCounts(N_FF, [1, 0], [N_FF, 0])
    experts = tier_plan.ExpertCounts(8, [4, 0], ([6, 1], list(range(8))))
    tier_plan.write(tier_plan.TierCounts(N_FF, [0, 0], [0, 0], experts=experts), tmp_path / "e.tiers")
    back = tier_plan.read(tmp_path / "e.tiers", 2, N_FF, 8).experts
    assert back.slots.tolist() == [4, 0] and [p.tolist() for p in back.pinned] == [[6, 1], list(range(8))]
    with pytest.raises(ValueError, match="more than its 8"):
        tier_plan.ExpertCounts(8, [5, 0], ([6, 1, 2, 3], []))
    # version 3: each layer's device experts beside its pinned ones
    experts = tier_plan.ExpertCounts(8, [2, 0], ([6], []), ([0, 3], [7]))
    tier_plan.write(tier_plan.TierCounts(N_FF, [0, 0], [0, 0], experts=experts), tmp_path / "d.tiers")
    back = tier_plan.read(tmp_path / "d.tiers", 2, N_FF, 8).experts
    assert [d.tolist() for d in back.device] == [[0, 3], [7]] and [p.tolist() for p in back.pinned] == [[6], []]
    for device, words in ((([6], []), "puts on the device expert 6 twice, or pins it too"),
                          (([8], []), "puts on the device expert 8, past its 8"),
                          (([0, 1, 2, 3, 4, 5], []), "more than its 8")):
        with pytest.raises(ValueError, match=words):
            tier_plan.ExpertCounts(8, [2, 0], ([6], []), device)


def assert_hot_and_disk_combine(bundled, tmp_path, **hot_tier) -> None:
    """Each layer's hottest by the bundles' frequencies in the hot tier, the plan's next in memory, the rest from
    disk: the resident share is the plan's, and the logits are the bits of the same hot tier with every cold row
    mapped."""
    model, freqs, _, bundle = bundled
    gpu = np.array([N_FF // 8, N_FF // 16] + [N_FF // 8] * (N_LAYER - 2))  # cold: more than the one-layer cache
    hot = [np.isin(np.arange(N_FF), np.argsort(-f, kind="stable")[:k]) for f, k in zip(freqs, gpu)]
    hot_tier |= dict(gpuidx=write_gpuidx(tmp_path / "hot.gpuidx", hot), batch_size=1)
    hot_mapped, disk = logits(model, **hot_tier)
    assert disk is None
    tier_plan.write(tier_plan.TierCounts(N_FF, gpu, MEMORY // 2), tier_plan.path_for(model))
    # the fixed part with a hot tier (a device's host side, its scratch), from a budget that holds every cold bundle
    fixed = logits(model, 64 << 30, **hot_tier)[1]["resident_bytes"] - (N_LAYER * N_FF - gpu.sum()) * bundle
    tiered, disk = logits(model, fixed + (N_FF + MEMORY.sum() // 2) * bundle + 1024, **hot_tier)
    assert disk["tier_plan"] and disk["resident_neurons"] == (MEMORY // 2).tolist()
    assert disk["cache_misses"] > 0
    assert np.array_equal(tiered, hot_mapped)


def test_the_hot_tier_on_a_device_and_the_disk_tier_combine(bundled, device, tmp_path):  # noqa: F811
    """On the emulated device, and on CUDA where there is one."""
    assert_hot_and_disk_combine(bundled, tmp_path, gpu="on", gpu_library=device)


def test_a_hot_tier_kept_on_the_cpu_and_the_disk_tier_combine(bundled, tmp_path):
    assert_hot_and_disk_combine(bundled, tmp_path, gpu="off", cpu_hot_tier=True)


def test_reads_across_a_gap_skip_the_hot_tiers_neurons(bundled, tmp_path):
    """Hot neurons scattered among the bundles (not the hottest), so that reads merged across gaps pass over their
    bundles: the logits stay the bits of the hot tier with every cold row mapped. (Reading a hot neuron's slot as
    a cold one's would read the word before the tier's table: undefined, caught by a sanitizer, not here.)"""
    model, _, _, bundle = bundled
    hot = [np.random.default_rng(7 + i).random(N_FF) < 0.3 for i in range(N_LAYER)]
    hot_tier = dict(gpuidx=write_gpuidx(tmp_path / "hot.gpuidx", hot), batch_size=1, gpu="off", cpu_hot_tier=True)
    mapped, _ = logits(model, **hot_tier)
    fixed = logits(model, 64 << 30, **hot_tier)[1]["resident_bytes"] - (N_LAYER * N_FF - sum(map(np.sum, hot))) * bundle
    tiered, disk = logits(model, fixed + N_FF * bundle + 1024, **hot_tier)  # a one-layer cache, nothing resident
    assert sum(disk["resident_neurons"]) == 0 and disk["bytes"] > disk["cache_misses"] * bundle
    assert np.array_equal(tiered, mapped)
