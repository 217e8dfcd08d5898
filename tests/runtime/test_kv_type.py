"""What the f16 KV cache, the default of every command and of the LLM (as llama.cpp's), and the q8_0 one on request
cost in quality on the real SmolLM2 q8_0 (slow): their perplexity over wikitext-2 test windows stays within a bound of
the f32 cache's (f16) and of the f16 cache's (q8_0), and the f32 cache remains one flag away.

The bounds, 1 %, are over twice what each cache moved it on these windows (docs/engine.md, "The KV cache") and a
twentieth of what a q4_0 file costs over q8_0 (tests/convert/test_quant_quality.py).
"""
from __future__ import annotations

import math

import pytest
from tiny_models import DATA

import powerinfer_engine as engine
from powerinfer_tools import LLM
from powerinfer_tools.formats.tokenizer import tokenizer_from_file
from powerinfer_tools.runtime.inference import perplexity
from powerinfer_tools.stages.profiling.calibration import sequences_from_text

pytestmark = pytest.mark.slow
WINDOWS, CTX = 4, 512
MAX_RELATIVE = 0.01


def test_the_f16_cache_is_the_default_and_within_a_bound_of_f32_and_q8_0_of_f16(smollm2_file):
    text_file = DATA / "wikitext-2-raw-test.txt"
    if not text_file.is_file():
        pytest.skip("shared data not present")
    path = smollm2_file("q8_0")
    with LLM(path, threads=2, ctx_size=CTX) as llm:
        assert llm.model.info["kv_type"] == "f16"
    windows = sequences_from_text(tokenizer_from_file(path), [text_file.read_text()[:100_000]], CTX,
                                  CTX * WINDOWS).numpy()
    ppl = {}
    for kv in ("f16", "f32", "q8_0"):
        with engine.Model(path, threads=2, ctx_size=CTX, sparse_mode="dense", gpu="off", kv_type=kv) as m:
            assert m.info["kv_type"] == kv
            ppl[kv] = perplexity(m, windows, progress=False)["perplexity"]
    assert math.isfinite(ppl["f16"]) and abs(ppl["f16"] / ppl["f32"] - 1) <= MAX_RELATIVE, ppl
    assert math.isfinite(ppl["q8_0"]) and abs(ppl["q8_0"] / ppl["f16"] - 1) <= MAX_RELATIVE, ppl
