"""The engine on the real SmolLM2-135M (slow): converted to f32, 64 greedy tokens identical to
transformers'; converted to q8_0, top-1 agreement with transformers over 2k wikitext tokens within 2
points of what the q8_0 weights allow (see the test: >= 99% is not reachable on this model)."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import powerinfer_engine as engine
from powerinfer_tools import models
from powerinfer_tools.stages.calibration import sequences_from_text
from tiny_models import DATA
from powerinfer_tools.formats.tokenizer import tokenizer_from_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return models.load_model(models.resolve("smollm2"))[0]


def test_f32_greedy_tokens_equal_transformers(smollm2, smollm2_file):
    path = smollm2_file("f32")
    tok = tokenizer_from_file(path)
    ids = tok("The history of the Roman Empire")["input_ids"]
    with torch.no_grad():
        ref = smollm2.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    with engine.Model(path, threads=2, ctx_size=256) as m:
        got = list(m.generate(ids, 64))
    assert got == ref[0, len(ids):].tolist()


def test_q8_0_top1_agreement_on_wikitext(smollm2, smollm2_file):
    """q8_0 against transformers' f32 top-1 over 2k wikitext tokens. On SmolLM2, rounding decides the
    top token at a few percent of positions: transformers itself, running the file's q8_0 weights,
    agrees at ~97% (measured 96.8%), and the same q8_0 emulation in float64 instead of float32 moves
    logits by up to 0.6. The engine (8-bit activations, as llama.cpp) must stay within 2 points of
    that weight-only figure, and above 94%."""
    from engine_helpers import load_file_weights

    path = smollm2_file("q8_0")
    text_file = DATA / "wikitext-2-raw-test.txt"
    if not text_file.is_file():
        pytest.skip("shared data not present")
    text = text_file.read_text()[:200_000]
    windows = sequences_from_text(tokenizer_from_file(path), [text], 512, 2048)
    assert windows.shape == (4, 512)
    with torch.no_grad():
        ref = np.concatenate([smollm2(ids[None]).logits[0].argmax(-1).numpy() for ids in windows])
    with engine.Model(path, threads=2, ctx_size=512) as m:
        got = []
        for ids in windows:
            m.reset()
            got.append(m.eval(ids.tolist()).argmax(-1))
    engine_agreement = float((np.concatenate(got) == ref).mean())
    c = smollm2.config
    load_file_weights(smollm2, path, c.num_attention_heads, c.num_key_value_heads)  # last use of the fixture
    with torch.no_grad():
        weights_only = np.concatenate([smollm2(ids[None]).logits[0].argmax(-1).numpy() for ids in windows])
    weights_only_agreement = float((weights_only == ref).mean())
    print(f"q8_0 top-1 agreement: engine {engine_agreement:.4f}, transformers with q8_0 weights "
          f"{weights_only_agreement:.4f}")
    assert engine_agreement >= 0.94
    assert engine_agreement >= weights_only_agreement - 0.02
