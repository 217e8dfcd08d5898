"""The fuzzer's seed corpus and every crashing input it ever found (tests/fuzz_regressions/, remade by
scripts/make_fuzz_corpus.py --regressions), loaded and run by the engine as the fuzz target does
(csrc/fuzz/fuzz_load.cpp): in a subprocess, so a crash fails the test. Seeds are valid files and must load; a
regression input must fail with a message."""
from __future__ import annotations

from fuzz_helpers import ROOT, assert_seeds_load, run_inputs

CORPUS, REGRESSIONS = ROOT / "tests" / "fuzz_corpus", ROOT / "tests" / "fuzz_regressions"


def test_seed_corpus_and_regressions(tmp_path):
    seeds, regressions = sorted(CORPUS.iterdir()), sorted(REGRESSIONS.iterdir())  # a folder gone is a failure
    assert len(seeds) >= 5 and regressions and all(p.stat().st_size < 64 * 1024 for p in seeds + regressions)
    results = run_inputs(seeds + regressions, tmp_path)
    assert_seeds_load(seeds, results)
    for path in regressions:
        assert results[str(path)].startswith("error: "), (path.name, results[str(path)])
