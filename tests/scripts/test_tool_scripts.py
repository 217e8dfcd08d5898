"""The maintained tools that are not measurements of a model: the fuzzer's corpus maker (its seeds load and run, its
regression inputs are the committed ones byte for byte), the server's benchmark (a short soak against a tiny chat
model) and the GPU check's `speed` (on the emulated device, the tiny shape, two placements)."""
from __future__ import annotations

import json
import re

import pytest
from fuzz_helpers import assert_seeds_load, run_inputs
from script_helpers import ROOT, run_script


def test_make_fuzz_corpus_writes_seeds_that_run_and_the_committed_regressions(tmp_path):
    run_script("make_fuzz_corpus.py", tmp_path / "corpus")
    seeds = sorted((tmp_path / "corpus").iterdir())
    assert [p.name for p in seeds] == sorted(p.name for p in (ROOT / "tests" / "fuzz_corpus").iterdir())
    assert all(p.stat().st_size < 64 * 1024 for p in seeds)
    work = tmp_path / "work"
    work.mkdir()
    assert_seeds_load(seeds, run_inputs(seeds, work))
    run_script("make_fuzz_corpus.py", "--regressions", tmp_path / "regressions")
    committed = sorted((ROOT / "tests" / "fuzz_regressions").iterdir())
    assert [p.name for p in committed] == sorted(p.name for p in (tmp_path / "regressions").iterdir())
    for path in committed:
        assert (tmp_path / "regressions" / path.name).read_bytes() == path.read_bytes(), path.name


def test_serve_bench_soaks_the_server_and_stops_it_cleanly(tiny_chat_file, tmp_path):
    out = run_script("serve_bench.py", "-m", tiny_chat_file, "-t", "1", "--rounds", "1", "--clients", "2", "--soak",
                     "3", "-n", "16", "-c", "128", "--json", tmp_path / "serve.json")
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["soak"]["errors"] == [] and result["soak"]["answers"] > 0, result["soak"]
    assert result["sigterm"]["exit_status"] == 0
    assert result["decode_ratio_median"] > 0 and result["client_over_engine_median"] > 0
    assert "| SIGTERM | exit 0 after" in out


def test_gpu_check_speed_on_the_emulated_device(tmp_path):
    emulated = sorted((ROOT / "engine").glob("_pi_device_emulated*.so"))
    if not emulated:
        pytest.skip("no emulated device library in engine/ (the build makes it beside the engine)")
    out = tmp_path / "out"
    run_script("gpu_check.sh", "speed", OUT=str(out), WORK=str(tmp_path / "work"), SHAPE="tiny", LAYERS="1",
               RUNS="cpu gpu8", THREADS="1", PI_GPU_LIBRARY=str(emulated[0]), PI_EMULATED_DEVICE_MIB="4096")
    table = (out / "speed.txt").read_text()
    assert table.startswith("tiny shape, 1 layers"), table
    assert re.search(r"^cpu +ours predictor +pp +[\d.]+ t/s +tg +[\d.]+ t/s +1\.00x CPU predictor +all on the CPU",
                     table, re.M), table
    assert re.search(r"^gpu8 +ours predictor .* hot rows of 1/1 layers, attention \+ KV cache of 1/1 on the device",
                     table, re.M), table
    assert re.search(r"device per token: \d+ µs, \d+ launches", table), table
    steps = (out / "speed-steps.txt").read_text()
    assert "FAILED" not in steps and "hybrid" not in steps, steps


def test_serve_bench_parallel_scenario_measures_slots_and_the_prompt_cache(tiny_chat_file, tmp_path):
    out = run_script("serve_bench.py", "-m", tiny_chat_file, "-t", "1", "--rounds", "1", "-n", "8", "-c", "256",
                     "--scenario", "parallel", "--parallel", "2", "--concurrency", "1,2", "--prefix", "60",
                     "--json", tmp_path / "parallel.json")
    result = json.loads((tmp_path / "parallel.json").read_text())
    assert set(result["concurrency"]) == {"2:1", "2:2", "1:1", "1:2"}
    assert all(r["aggregate_tps"] > 0 for runs in result["concurrency"].values() for r in runs)
    assert result["cache"]["cached_tokens"] > 0
    assert "| --parallel 2 | 2 |" in out and "| prompt cache," in out
