"""What a 4-bit file of the real SmolLM2-135M costs in quality (slow): its head (the tied embedding) is q8_0, as
llama.cpp's quantizer keeps it (conversion.HEAD_OUTTYPE), and its perplexity stays within a bound of the q8_0
file's on the same wikitext windows.

Measured (docs/bench.md, "Quantizer quality"), 4 windows of 512 of wikitext-2 test, engine dense: q8_0 31.80,
q4_0 37.47 (1.178x); with the head at q4_0 and ggml's rounding, as before, 41.29 (1.298x). The bound, 1.22x, is
3.5 % above what was measured and below the q4_0 head's ratio. (Four windows do not rank close files: ggml's
rounding scores 36.65 here, and the searched scales 1 point better than it over 32 windows.)
"""
from __future__ import annotations

import math

import pytest
from tiny_models import DATA

import powerinfer_engine as engine
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.formats.tokenizer import tokenizer_from_file
from powerinfer_tools.runtime.inference import perplexity
from powerinfer_tools.stages.profiling.calibration import sequences_from_text

pytestmark = pytest.mark.slow
WINDOWS, CTX = 4, 512
MAX_RATIO = 1.22


def file_perplexity(path, windows) -> float:
    with engine.Model(path, threads=2, ctx_size=CTX, sparse_mode="dense", gpu="off") as m:
        return perplexity(m, windows, progress=False)["perplexity"]


def test_q4_0_head_is_q8_0_and_costs_at_most_a_bound_over_q8_0(smollm2_file):
    text_file = DATA / "wikitext-2-raw-test.txt"
    if not text_file.is_file():
        pytest.skip("shared data not present")
    q4, q8 = smollm2_file("q4_0"), smollm2_file("q8_0")
    types = {t.name: t.tensor_type.name for t in open_reader(q4).tensors}
    assert "output.weight" not in types  # tied: the embedding is the head, stored once
    assert types["token_embd.weight"] == "Q8_0"
    assert {types[f"blk.{i}.{k}.weight"] for i in range(30) for k in ("attn_q", "ffn_gate", "ffn_down_t")} == {"Q4_0"}

    text = text_file.read_text()[:100_000]
    windows = sequences_from_text(tokenizer_from_file(q8), [text], CTX, CTX * WINDOWS).numpy()
    assert windows.shape == (WINDOWS, CTX)
    ppl4, ppl8 = file_perplexity(q4, windows), file_perplexity(q8, windows)
    assert math.isfinite(ppl4) and ppl8 < ppl4 <= MAX_RATIO * ppl8, (ppl4, ppl8)
