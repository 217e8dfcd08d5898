"""The scripts that measure quality and the profile's cost in transformers (docs/profile.md, docs/sparsify.md), run
as documented on the tiny SiLU Llama with a few hundred tokens: each prints its table, the dense row first, and
what input_sparsity_quality.py saves is a profile `convert` takes."""
from __future__ import annotations

import re

from cli_helpers import run_cli
from script_helpers import run_script, table_rows
from tiny_models import DATA

CALIB, EVAL = DATA / "wikitext-2-valid.txt", DATA / "wikitext-2-raw-test.txt"
SMALL = ("--calib-tokens", "256", "--eval-tokens", "256", "--seq-len", "64")


def rows(out: str) -> dict[str, list[str]]:
    """The table's body rows by their first cell."""
    return {r[0]: r[1:] for r in table_rows(out)}


def test_sparsity_quality_sets_thresholds_and_a_sparsified_model_against_the_original(tiny_model_dir):
    out = run_script("sparsity_quality.py", "--model", tiny_model_dir("llama-silu"), "--calib", CALIB, "--eval", EVAL,
                     "--eval", DATA / "tinyshakespeare.txt", "--targets", "0.3", "--sparsified",
                     tiny_model_dir("llama-relu"), *SMALL)
    table = rows(out)
    assert table["original"][0] == "0.000" and table["original"][2] == "1.000x" and table["original"][4] == "1.000x"
    assert abs(float(table["thresholds at 0.3"][0]) - 0.3) < 0.05  # the share calibrated on other text
    assert float(table[f"sparsify {tiny_model_dir('llama-relu').name}"][0]) > 0.3  # ReLU's exact zeros


def test_input_sparsity_quality_saves_tables_convert_stores(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama-silu")
    out = run_script("input_sparsity_quality.py", "--model", model, "--calib", CALIB, "--eval", EVAL, "--shares",
                     "0.25", "--allocations", "uniform,greedy", "--save", tmp_path / "tables", *SMALL)
    table = rows(out)
    assert table["dense"][0] == "0" and set(table) == {"dense", "uniform", "greedy"}, out
    assert all(re.fullmatch(r"[+-]\d+\.\d %", table[a][2]) for a in ("uniform", "greedy")), out
    code, _, err = run_cli(capsys, "convert", "-m", model, "--profile", tmp_path / "tables" / "uniform",
                           "--input-thresholds", "--outtype", "f32", "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err


def test_bench_profile_overhead_times_both_passes(tiny_model_dir):
    out = run_script("bench_profile_overhead.py", "--model", tiny_model_dir("llama-silu"), "--calib", CALIB,
                     "--tokens", "256", "--seq-len", "64", "--batch", "2", "--max-samples", "256", "--repeats", "1")
    assert re.search(r"^tokens 256, threads \d+, repeats 1$", out, re.M), out
    for what in ("plain forward", "profiled forward"):
        assert re.search(rf"^{what} *: median [\d.]+ s  \(\d+ tok/s\)", out, re.M), out
    assert float(re.search(r"profiled / plain throughput: ([\d.]+)x", out).group(1)) > 0
