"""The scripts that time the engine, run as docs/bench.md and docs/engine.md run them, on scripts/synthetic_llama.py's
tiny shape (converted with its predictors, its profile's order and neuron bundles): the disk tier with and without a
budget, a co-selection order written and decoded from, the open time, two builds alternated, the kernels alone, and
the profile's bound."""
from __future__ import annotations

import json
import os
import re

import pytest
from cli_helpers import profiled
from script_helpers import TINY, build_synthetic, run_script
from tiny_models import DATA

import powerinfer_engine as engine
from powerinfer_engine import kernels
from powerinfer_tools.formats import neuron_bundles


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return build_synthetic(tmp_path_factory.mktemp("engine_scripts"))


def one_layer_budget_gib(path) -> float:
    """A budget that holds what the engine must (measured at measure_disk_tier.py's options) and one layer's bundles
    more: the least the tier opens with, so most of a token's neurons come from the disk."""
    with engine.Model(path, threads=1, sparse_mode="predictor", ctx_size=64, kv_type="f16", memory_budget=64) as m:
        resident = m.stats()["disk"]["resident_bytes"]
    bundle = neuron_bundles.read_layout(str(path) + ".neurons")["bundle_bytes"]
    fixed = resident - TINY.n_layer * TINY.n_ff * bundle
    return (fixed + 1.5 * TINY.n_ff * bundle) / 2**30


def test_measure_disk_tier_reads_the_cold_neurons_under_a_budget_and_none_without(synthetic):
    free = json.loads(run_script("measure_disk_tier.py", synthetic.gguf, "-t", "1", "--n-gen", "4"))
    assert free["memory_budget_gib"] is None and "disk_reads_per_token" not in free
    assert free["decode_tokens_per_second"] > 0 and 0 < free["selected_neurons_per_token"] < TINY.n_layer * TINY.n_ff
    budget = one_layer_budget_gib(synthetic.gguf)
    tiered = json.loads(run_script("measure_disk_tier.py", synthetic.gguf, "--memory-budget", budget, "-t", "1",
                                   "--n-gen", "4"))
    assert tiered["disk_reads_per_token"] > 0 and tiered["disk_bytes_per_token"] > 0
    assert 0 <= tiered["cache_hit_rate"] < 1 and tiered["resident_gib"] <= tiered["budget_gib"]


def test_measure_coactivation_measures_and_writes_an_order_the_engine_decodes_from(synthetic, tmp_path):
    measured = json.loads(run_script("measure_coactivation.py", synthetic.predictors, synthetic.profile,
                                     "--layer", "1", "--tokens", "200", "--band", "64"))
    assert measured["layer"] == 1 and measured["tokens"] == 200
    assert 0 < measured["missing_per_token"] <= measured["selected_per_token"]
    assert measured["reads_per_token_frequency_order_gap1"] <= measured["reads_per_token_frequency_order_gap0"]
    # docs/engine.md, "Models larger than memory": a second sidecar beside a link to the file
    link = tmp_path / "co.gguf"
    os.symlink(synthetic.gguf, link)
    run_script("measure_coactivation.py", synthetic.predictors, synthetic.profile, "--tokens", "200", "--band", "64",
               "--write-order", synthetic.gguf, "--write-order-to", link)
    assert (tmp_path / "co.gguf.neurons").is_file()
    tiered = json.loads(run_script("measure_disk_tier.py", link, "--memory-budget", one_layer_budget_gib(link),
                                   "-t", "1", "--n-gen", "4"))
    assert tiered["disk_reads_per_token"] > 0


def test_measure_engine_open_reports_each_mode(synthetic):
    out = run_script("measure_engine_open.py", synthetic.gguf, "--ctx", "64", "--n-prompt", "8", "--n-gen", "2",
                     "--threads", "1")
    for mode in ("dense", "predictor"):
        line = re.search(rf"^{mode}: open ([\d.]+) s; prompt ([\d.]+) t/s; decode ([\d.]+) t/s; .* ctx 64$", out, re.M)
        assert line and float(line.group(3)) > 0, out


def test_ab_engine_builds_alternates_two_libraries(synthetic):
    lib = engine._lib.lib()._name  # the build this test run loaded, as both A and B
    out = run_script("ab_engine_builds.py", lib, lib, synthetic.gguf, "dense", "predictor", "--rounds", "1", "--runs",
                     "1", "--threads", "1", "--prompt", "8", "--gen", "4")
    for mode in ("dense", "predictor"):
        assert re.search(rf"^{mode} +A +[\d.]+ t/s +B +[\d.]+ t/s +B/A [\d.]+ \(", out, re.M), out  # rates right-aligned
    prefill = run_script("ab_engine_builds.py", lib, lib, synthetic.gguf, "dense", "--phase", "prefill", "--rounds",
                         "1", "--runs", "1", "--threads", "1", "--prompt", "16", "--gen", "0")
    assert re.search(r"^dense +A +[\d.]+ t/s", prefill, re.M), prefill


def test_kernel_microbench_times_every_kernel():
    out = run_script("kernel_microbench.py", "--passes", "1", "--matrices", "2", "--tokens", "8")
    for kernel in ("gemm8", "dot_rows", "axpy_rows", "gemv_cols", "pack_columns8 + gemm8", "gemm_f32"):
        assert kernel in out, (kernel, out)
    if kernels.selected() != "scalar":  # the SIMD sets' q4_0 down projection over quads
        assert re.search(r"^\w+ +q4_0 +axpy_quads +all, quads +[\d.]+", out, re.M), out
    for wtype in ("q4_0", "q8_0"):
        assert re.search(rf"^\w+ +{wtype} +gemm8 \(gate/up tile\) +8 +[\d.]+ +[\d.]+$", out, re.M), out


def test_profile_bound_sets_a_profile_against_the_matrix_multiplies(synthetic, tmp_path):
    prof = profiled(synthetic.model, tmp_path / "prof", DATA / "wikitext-2-valid.txt", 128, 64)
    bound = json.loads(run_script("profile_bound.py", "--model", synthetic.model, "--batch", "1", "--seq-len", "32",
                                  "--repeats", "1", "--profile", prof))
    assert bound["gflop_per_s"] > 0 and bound["bound_tokens_per_s"] > 0
    assert bound["share_of_bound"] == pytest.approx(bound["profile_tokens_per_s"] / bound["bound_tokens_per_s"])
