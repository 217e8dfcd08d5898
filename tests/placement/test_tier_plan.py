"""`pi-tools plan --memory-budget`: the three-tier plan of a converted model, written beside it for the engine's disk
tier. At --vram-budget 0 it is the engine's frequency rule (equal bundle bytes: docs/placement.md, "Three tiers"),
and the engine opened at the same budget holds exactly its counts; with VRAM the program is never slower than the
tiers chosen apart. Refusals in one line."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from engine_helpers import converted  # noqa: F401
from placement_fixtures import write_profile
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.formats import neuron_bundles, tier_plan
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE
from powerinfer_tools.stages.placement import placement

TOKENS = 100_000


@pytest.fixture
def planned(converted, tmp_path):  # noqa: F811
    """The tiny ReLU llama at q4_0 with predictors, a profile whose layers differ (none ties another's), its bundles in
    the profile's order, and the engine's fixed bytes at ctx 128 (from a budget that caches every bundle)."""
    model = tmp_path / "m.gguf"
    shutil.copy(converted("llama-relu", "q4_0", predictors=True), model)
    rng = np.random.default_rng(4)
    a, b = rng.choice(TOKENS // 2, size=(N_LAYER, N_FF), replace=False)[:2]
    counts = [2 * a, 2 * (b // 3) + 1] + [2 * (b // 5) + 1] * (N_LAYER - 2)  # even against odd: no tie across layers
    profile = write_profile(tmp_path / "prof", counts, tokens=TOKENS)
    sidecar = neuron_bundles.write(model, frequencies=placement.profile_frequencies(profile, model), progress=False)
    with engine.Model(model, ctx_size=128, sparse_mode="predictor", kv_type=DEFAULT_KV_TYPE, memory_budget=64) as m:
        disk = m.stats()["disk"]
    bundle = neuron_bundles.read_layout(sidecar)["bundle_bytes"]
    return model, profile, disk["resident_bytes"] - N_LAYER * N_FF * bundle, bundle


def resident(model, budget_bytes):
    with engine.Model(model, ctx_size=128, sparse_mode="predictor", kv_type=DEFAULT_KV_TYPE,
                      memory_budget=budget_bytes / 2**30) as m:
        return m.stats()["disk"]


def test_no_vram_gives_the_frequency_rule_and_the_engine_holds_the_plans_counts(planned, capsys):
    model, profile, fixed, bundle = planned
    budget = fixed + (N_FF + N_FF * 3 // 4) * bundle + 1024
    by_frequency = resident(model, budget)["resident_neurons"]
    code, out, _ = run_cli(capsys, "plan", "--profile", profile, "-m", model, "--vram-budget", 0, "--memory-budget",
                           budget / 2**30, "-c", 128)
    assert code == 0
    assert "expected FFN time a token" in out and "memory budget" in out
    plan = tier_plan.read(tier_plan.path_for(model), N_LAYER, N_FF)
    assert plan.gpu.tolist() == [0] * N_LAYER and plan.memory.tolist() == by_frequency
    assert sum(by_frequency) == N_FF * 3 // 4 and len(set(by_frequency)) > 1  # uneven: layer 0's counts are larger
    disk = resident(model, budget)
    assert disk["tier_plan"] and disk["resident_neurons"] == plan.memory.tolist()
    summary = json.loads((model.parent / "m.gguf.generated.gpuidx.json").read_text())
    memory = summary["memory"]
    assert memory["room_bytes"] == disk["resident_room_bytes"]
    assert [layer["memory_neurons"] for layer in summary["layers"]] == by_frequency
    t = memory["ffn_seconds_per_token"]
    assert t["plan"] == pytest.approx(t["frequency_rule"]) == pytest.approx(t["apart"])


def test_with_vram_the_plan_is_never_slower_than_the_tiers_chosen_apart(planned, capsys):
    model, profile, fixed, bundle = planned
    budget = fixed + (N_FF + N_FF // 2) * bundle + 1024
    code, _, err = run_cli(capsys, "plan", "--profile", profile, "-m", model, "--vram-budget", 0.0002, "--memory-budget",
                           budget / 2**30, "-c", 128, "--reserve-mib", 0, "--no-offload-output", "--min-layer-neurons", 8)
    assert code == 0, err
    summary = json.loads((model.parent / "m.gguf.generated.gpuidx.json").read_text())
    t = summary["memory"]["ffn_seconds_per_token"]
    assert t["plan"] <= t["apart"] * (1 + 1e-9) and t["plan"] <= t["frequency_rule"] * (1 + 1e-9)
    plan = tier_plan.read(tier_plan.path_for(model), N_LAYER, N_FF)
    assert plan.gpu.tolist() == [layer["gpu_neurons"] for layer in summary["layers"]] and plan.gpu.sum() > 0
    assert int(np.sum(plan.memory)) * bundle <= summary["memory"]["room_bytes"]


def test_refusals_are_one_line(planned, capsys, tmp_path):
    model, profile, _, _ = planned
    code, _, err = run_cli(capsys, "plan", "--profile", profile, "-m", model, "--vram-budget", 0, "--memory-budget", 0.5,
                           "--granularity", 4)
    assert_one_line_error(code, err, "granularity 1")
    code, _, err = run_cli(capsys, "plan", "--dry-run", "-m", "relullama-70b", "--vram-budget", 8, "--memory-budget", 4)
    assert_one_line_error(code, err, "--dry-run")
    bare = tmp_path / "bare.gguf"
    shutil.copy(model, bare)
    code, _, err = run_cli(capsys, "plan", "--profile", profile, "-m", bare, "--vram-budget", 0, "--memory-budget", 0.5,
                           "-c", 128)
    assert_one_line_error(code, err, "neuron bundles")
