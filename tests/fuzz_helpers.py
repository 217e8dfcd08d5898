"""The engine run on fuzz inputs as the fuzz target runs it (csrc/fuzz/fuzz_load.cpp), in a subprocess so that a
crash fails the test: the seed corpus (tests/fuzz_corpus/, scripts/make_fuzz_corpus.py) and past findings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPLIT = b"\n--pi-fuzz-gpuidx--\n"  # fuzz_load.cpp's kSplit: model bytes, then a GPU index

RUNNER = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import powerinfer_engine as engine
SPLIT = bytes.fromhex(sys.argv[2])
work = Path(sys.argv[3])
out = {}
for i, src in enumerate(sys.argv[4:]):
    data = Path(src).read_bytes()
    model, _, index = data.partition(SPLIT)
    (work / f"{i}.gguf").write_bytes(model)
    gpuidx = None
    if SPLIT in data:
        gpuidx = work / f"{i}.gpuidx"
        gpuidx.write_bytes(index)
    try:
        with engine.Model(work / f"{i}.gguf", threads=1, ctx_size=16, gpuidx=gpuidx, cpu_hot_tier=True) as m:
            for mode in ("dense", "gate", "predictor", "auto"):
                try:
                    m.sparse_mode = mode
                except engine.EngineError:
                    continue
                m.reset()
                m.eval([0, 1])
        out[src] = "ok"
    except engine.EngineError as e:
        out[src] = "error: " + str(e)
print(json.dumps(out))
"""


def run_inputs(paths: list[Path], work: Path) -> dict:
    """{path: "ok" or "error: MESSAGE"} for each input, loaded and run in every FFN mode it takes."""
    done = subprocess.run([sys.executable, "-c", RUNNER, str(ROOT), SPLIT.hex(), str(work), *map(str, paths)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the engine crashed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_seeds_load(seeds: list[Path], results: dict) -> None:
    """Every seed is a valid file and runs, but the GPU index alone, which is refused by name."""
    for path in seeds:
        if path.name == "gpuidx-alone":  # a GPU index where a model belongs: refused, named
            assert "architecture 'generic.gpu_index'" in results[str(path)], results[str(path)]
        else:
            assert results[str(path)] == "ok", (path.name, results[str(path)])
