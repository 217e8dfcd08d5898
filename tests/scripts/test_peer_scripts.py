"""The scripts that run a peer engine beside ours, at a tiny size where this machine has the peer (never a test
dependency): llama.cpp's quantizer through llama-cpp-python (scripts/quant_vs_llamacpp.py, docs/bench.md's
"Quantizer quality") and PowerInfer's CPU build (scripts/bench_powerinfer.py, "Against PowerInfer's CPU build";
scripts/check_powerinfer_interop.sh, docs/formats.md's "Checked against PowerInfer's binaries")."""
from __future__ import annotations

import json
import re

import pytest
from peer_helpers import llama_cpp_python, powerinfer_build
from script_helpers import build_synthetic, run_script, table_rows
from tiny_models import DATA


@pytest.fixture
def powerinfer():
    build = powerinfer_build()
    if build is None:
        pytest.skip("needs a CPU build of PowerInfer: set PI_POWERINFER_BUILD to its build directory (bin/main)")
    return build


@pytest.mark.slow
def test_quant_vs_llamacpp_scores_both_quantizers(tmp_path):
    peer = llama_cpp_python()
    if peer is None:
        pytest.skip("needs llama-cpp-python's quantizer: install it here or set PI_BENCH_PEER_PYTHON")
    out = run_script("quant_vs_llamacpp.py", "--peer-python", peer, "--text", DATA / "wikitext-2-raw-test.txt",
                     "--work", tmp_path, "--types", "q8_0", "--chunks", "1", "--ctx", "64", timeout=1800)
    rows = {(r[0], r[1]): r for r in table_rows(out)}
    assert set(rows) == {("q8_0", "llama.cpp"), ("q8_0", "pi-tools")}, out
    assert all(float(r[2]) > 1 for r in rows.values()) and float(rows[("q8_0", "llama.cpp")][3]) > 1, out


def test_bench_powerinfer_runs_both_engines_on_one_file(powerinfer, tmp_path):
    files = build_synthetic(tmp_path)
    out = run_script("bench_powerinfer.py", "--file", files.gguf, "--powerinfer", powerinfer / "bin" / "main",
                     "--rounds", "1", "--n-gen", "4", "--threads", "1", "--json", tmp_path / "rates.json")
    rec = json.loads((tmp_path / "rates.json").read_text())
    assert len(rec["rounds"]) == 1 and rec["ratio"]["tg"] > 0, out
    assert rec["rounds"][0]["powerinfer"]["tg"] > 0 and rec["rounds"][0]["ours predictor"]["tg"] > 0, out


def test_check_powerinfer_interop_on_the_default_pipeline(powerinfer, tmp_path):
    out = run_script("check_powerinfer_interop.sh", powerinfer, "--work", tmp_path, "--kinds", "llama-relu",
                     "--types", "q8_0", "--default-pipeline-only", "--tokens", "8", "--profile-tokens", "1024",
                     timeout=1200)
    assert re.search(r"^PowerInfer \S+ at ", out, re.M) and "== llama-relu" in out, out
    assert table_rows(out), out
