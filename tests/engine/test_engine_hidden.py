"""pi_eval_hidden: the last hidden state through the output norm (what the head reads, what /v1/embeddings pools),
against transformers' last_hidden_state on tiny random models, in a prompt batch and in decode steps; the sampler
refuses the logits such an evaluation did not make."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import converted, hf_model, max_rel_err, random_tokens  # noqa: F401

import powerinfer_engine as engine

TOKENS = random_tokens(40, 384, seed=5)


@pytest.mark.parametrize("kind", ["llama-silu", "falcon", "opt"])
def test_hidden_states_match_transformers(kind, converted, tiny_model_dir):
    model, _ = hf_model(tiny_model_dir(kind))
    with torch.no_grad():
        ref = model.base_model(torch.tensor([TOKENS])).last_hidden_state[0].double().numpy()
    with engine.Model(converted(kind), threads=2, ctx_size=128) as m:
        got = np.concatenate([m.eval_hidden(TOKENS[:32])] + [m.eval_hidden([t]) for t in TOKENS[32:]])
    assert got.shape == (len(TOKENS), m.n_embd)
    assert max_rel_err(got, ref) <= 1e-4


def test_sampling_needs_the_logits_of_an_eval(converted):
    with engine.Model(converted("llama-silu"), threads=2, ctx_size=128) as m:
        hidden = m.eval_hidden(TOKENS[:8])
        with pytest.raises(engine.EngineError, match="hidden states, not logits"):
            m.sample()
        logits = m.eval(TOKENS[8:9])[-1]
        assert 0 <= m.sample() < m.n_vocab
        m.reset()
        # the same prompt evaluated for logits: its last hidden state is what the head turned into them
        assert np.array_equal(m.eval_hidden(TOKENS[:9])[:8], hidden)
        m.reset()
        assert np.allclose(m.eval(TOKENS[:9])[-1], logits, rtol=1e-5, atol=1e-5)
