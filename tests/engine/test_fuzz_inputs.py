"""The fuzzer's seed corpus and every crashing input it ever found (tests/fuzz_regressions/, remade by
scripts/make_fuzz_corpus.py --regressions), loaded and run by the engine as the fuzz target does
(csrc/fuzz/fuzz_load.cpp): in a subprocess, so a crash fails the test. Seeds are valid files and must load; a
regression input must fail with a message."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS, REGRESSIONS = ROOT / "tests" / "fuzz_corpus", ROOT / "tests" / "fuzz_regressions"
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
    done = subprocess.run([sys.executable, "-c", RUNNER, str(ROOT), SPLIT.hex(), str(work), *map(str, paths)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the engine crashed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_seed_corpus_and_regressions(tmp_path):
    seeds, regressions = sorted(CORPUS.iterdir()), sorted(REGRESSIONS.iterdir())  # a folder gone is a failure
    assert len(seeds) >= 5 and regressions and all(p.stat().st_size < 64 * 1024 for p in seeds + regressions)
    results = run_inputs(seeds + regressions, tmp_path)
    for path in seeds:
        if path.name == "gpuidx-alone":  # a GPU index where a model belongs: refused, named
            assert "architecture 'generic.gpu_index'" in results[str(path)], results[str(path)]
        else:
            assert results[str(path)] == "ok", (path.name, results[str(path)])
    for path in regressions:
        assert results[str(path)].startswith("error: "), (path.name, results[str(path)])
