"""The maintained tools that are not measurements of a model: the fuzzer's corpus maker (its seeds load and run, its
regression inputs are the committed ones byte for byte), the server's benchmark (a short soak against a tiny chat
model) and the GPU check's device-free steps: `speed` (on the emulated device, the tiny shape, the CPU and the
hybrid budget, the peers' rows against a stand-in for PowerInfer's main), `moe` (a tiny mixture's experts planned onto
the emulated device at three budgets, timed beside the CPU) and `prepare-peer` (the peer's source packed without its
models)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile

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
    # a soak shorter than the RSS sampler's 2 s still samples both of its halves
    out = run_script("serve_bench.py", "-m", tiny_chat_file, "-t", "1", "--rounds", "1", "--clients", "2", "--soak",
                     "1.5", "-n", "16", "-c", "128", "--json", tmp_path / "serve.json")
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["soak"]["errors"] == [] and result["soak"]["answers"] > 0, result["soak"]
    assert result["soak"]["rss_mib_second_half_median"] > 0
    assert result["sigterm"]["exit_status"] == 0
    assert result["decode_ratio_median"] > 0 and result["client_over_engine_median"] > 0
    assert "| SIGTERM | exit 0 after" in out


def test_gpu_check_moe_on_the_emulated_device(tmp_path):
    emulated = sorted((ROOT / "engine").glob("_pi_device_emulated*.so"))
    if not emulated:
        pytest.skip("no emulated device library in engine/ (the build makes it beside the engine)")
    out = tmp_path / "out"
    run_script("gpu_check.sh", "moe", OUT=str(out), WORK=str(tmp_path / "work"), MOE_SHAPE="tiny-moe", MOE_LAYERS="2",
               THREADS="1", PI_GPU_LIBRARY=str(emulated[0]), PI_EMULATED_DEVICE_MIB="512", timeout=600)
    rows = [json.loads(line) for line in (out / "moe.jsonl").read_text().splitlines()]
    assert [r["row"].split(" (")[0] for r in rows] == ["cpu", "gpu 25% experts", "gpu 50% experts", "gpu 100% experts"]
    assert all("error" not in r and r["decode_tps"] > 0 for r in rows), rows
    assert not rows[0]["gpu_used"] and all(r["gpu_used"] for r in rows[1:])
    placed = [r["experts_on_device"] for r in rows[1:]]
    assert 0 < placed[0] <= placed[1] <= placed[2] == 2 * 8, placed  # all 16 experts of the 2 layers at the last
    assert all(r["expert_pairs"] > 0 for r in rows[1:])
    assert "| gpu 100% experts" in (out / "moe.txt").read_text()


def test_gpu_check_speed_on_the_emulated_device(tmp_path):
    emulated = sorted((ROOT / "engine").glob("_pi_device_emulated*.so"))
    if not emulated:
        pytest.skip("no emulated device library in engine/ (the build makes it beside the engine)")
    out = tmp_path / "out"
    # PowerInfer's main stands in as a script that records its arguments and prints llama.cpp's timings
    peer = tmp_path / "main"
    calls = tmp_path / "peer-calls.txt"
    peer.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
echo "llama_print_timings: prompt eval time =     100.00 ms /    20 tokens" >&2
echo "llama_print_timings:        eval time =     400.00 ms /    31 runs" >&2
""")
    peer.chmod(0o755)
    run_script("gpu_check.sh", "speed", OUT=str(out), WORK=str(tmp_path / "work"), SHAPE="tiny", LAYERS="1",
               RUNS="cpu gpu8", THREADS="1", PI_GPU_LIBRARY=str(emulated[0]), PI_EMULATED_DEVICE_MIB="4096",
               PI_POWERINFER_MAIN=str(peer), timeout=600)
    table = (out / "speed.txt").read_text()
    assert table.startswith("tiny shape, 1 layers"), table
    assert re.search(r"^cpu +ours predictor +pp +[\d.]+ t/s +tg +[\d.]+ t/s +1\.00x CPU predictor +all on the CPU",
                     table, re.M), table
    assert re.search(r"^gpu8 +ours predictor .* hot rows of 1/1 layers, attention \+ KV cache of 1/1 on the device",
                     table, re.M), table
    assert re.search(r"device per token: \d+ µs, \d+ launches", table), table
    steps = (out / "speed-steps.txt").read_text()
    assert "FAILED" not in steps and "hybrid" not in steps, steps
    # the peers at the hybrid budget (0.175 GiB at 1 layer) and half of it: ours on the emulated device, the stand-in
    # on the same PowerInfer file with the index beside it, and with -ngl on the dense file; ours on the CPU
    rows = [json.loads(line) for line in (out / "peers.jsonl").read_text().splitlines()]
    assert [r["row"] for r in rows] == ["ours cpu predictor", "ours hybrid 0.175", "powerinfer 0.175",
                                        "powerinfer -ngl 1 dense 0.175", "ours hybrid 0.087", "powerinfer 0.087",
                                        "powerinfer -ngl 1 dense 0.087"], rows
    assert all(r["tg"] > 0 for r in rows), rows
    assert [r["tg"] for r in rows if r["row"].startswith("powerinfer")] == [31 / 0.4] * 4
    argv = calls.read_text().splitlines()
    assert len(argv) == 4 and all("-t 1 " in a and "--temp 0" in a for a in argv), argv
    assert "model.powerinfer.gguf" in argv[0] and "--vram-budget 0.175" in argv[0]
    assert "model.llamacpp.gguf" in argv[1] and "-ngl 1" in argv[1]
    assert re.search(r"^  ours hybrid 0.175 / powerinfer 0.175: decode [\d.]+x, prompt [\d.]+x$", table, re.M), table
    assert re.search(r"^  ours hybrid 0.175 / powerinfer -ngl 1 dense 0.175: decode", table, re.M), table



def test_serve_bench_parallel_scenario_measures_slots_and_the_prompt_cache(tiny_chat_file, tmp_path):
    out = run_script("serve_bench.py", "-m", tiny_chat_file, "-t", "1", "--rounds", "1", "-n", "8", "-c", "256",
                     "--scenario", "parallel", "--parallel", "2", "--concurrency", "1,2", "--prefix", "60",
                     "--json", tmp_path / "parallel.json")
    result = json.loads((tmp_path / "parallel.json").read_text())
    assert set(result["concurrency"]) == {"2:1", "2:2", "1:1", "1:2"}
    assert all(r["aggregate_tps"] > 0 for runs in result["concurrency"].values() for r in runs)
    assert result["cache"]["cached_tokens"] > 0
    assert "| --parallel 2 | 2 |" in out and "| prompt cache," in out


def test_serve_bench_refuses_a_prefix_beyond_the_context_and_leaves_no_server(tiny_chat_file):
    """The default -c 1024 and --prefix 2000 on the tiny model (its system prompts ~6,000 tokens): refused in one
    line before any server starts. A run that fails after its server started (no client counts) kills the server:
    no `pi-tools serve` outlives the script, so nothing waits on its pipes."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_bench.py"), "-m", str(tiny_chat_file), "-t",
                           "1", "--scenario", "parallel"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert re.fullmatch(r"serve_bench: --prefix 2000 makes system prompts of \d+ tokens, which with their question "
                        r"and reply do not fit -c 1024: raise -c or lower --prefix\n", done.stderr), done.stderr
    failing = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve_bench.py"), "-m", str(tiny_chat_file),
                                "-t", "1", "--scenario", "parallel", "--parallel", "2", "--concurrency", "0", "--prefix",
                                "30", "-c", "256"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = failing.communicate(timeout=120)  # returns once every writer of the pipes is gone, the server too
    assert failing.returncode != 0 and "max_workers must be greater than 0" in err, err


def test_gpu_check_prepare_peer_packs_the_source_without_its_models(tmp_path):
    src = tmp_path / "PowerInfer"
    for path in ("CMakeLists.txt", "ggml-cuda.cu", "examples/main/main.cpp", "models/big.gguf",
                 "smallthinker/weights.bin", "powerinfer-py/powerinfer/__init__.py"):
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(path)
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = tmp_path / "gpu"
    out = run_script("gpu_check.sh", "prepare-peer", PI_POWERINFER_SRC=str(src), GPU_DIR=str(gpu),
                     OUT=str(tmp_path / "out"))
    assert out.startswith(f"peer source: {commit}, "), out
    with tarfile.open(gpu / "powerinfer-src.tar.gz") as tar:
        names = sorted(n.removeprefix("./") for n in tar.getnames() if tar.getmember(n).isfile())
    assert names == ["CMakeLists.txt", "examples/main/main.cpp", "ggml-cuda.cu",
                     "powerinfer-py/powerinfer/__init__.py"], names
    assert (gpu / "powerinfer.commit").read_text().strip() == commit
    # unset: a line saying the peer rows will be missing, nothing written
    out = run_script("gpu_check.sh", "prepare-peer", GPU_DIR=str(tmp_path / "none"), OUT=str(tmp_path / "out"))
    assert "PI_POWERINFER_SRC is unset" in out and not (tmp_path / "none").exists()
