"""/v1/embeddings through `pi-tools serve` and the real `openai` client, on the real SmolLM2 q8_0: the pooled, unit
vectors of the model's last hidden states (LLM.embed; the hidden states themselves are checked against
transformers in tests/engine/test_engine_hidden.py), in floats and base64 alike, each input's vector the same alone,
in a batch and after a generation; what is not computed is one 400 naming the field."""
from __future__ import annotations

import numpy as np
import openai
import pytest

from powerinfer_tools.runtime.llm import LLM

TEXTS = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Quarterly revenue rose by five percent."]


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float64)


def test_embeddings_are_the_llms_pooled_hidden_states(server, smollm2_file):
    client = server.client()
    r = client.embeddings.create(model="any", input=TEXTS, encoding_format="float")
    got = vectors(r)
    with LLM(smollm2_file("q8_0"), threads=2, sparse_mode="dense", ctx_size=1024) as llm:
        want = np.array(llm.embed(TEXTS).vectors)
        n_tokens = sum(len(llm.tokenize(t)) for t in TEXTS)
        last = np.array(llm.embed(TEXTS[0], pooling="last").vectors)
    assert got.shape == (3, 576) and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    assert np.array_equal(got.astype(np.float32), want)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens
    assert not np.allclose(last, want[0], atol=1e-2)  # another pooling, another vector
    cos = got @ got.T
    assert cos[0, 1] > cos[0, 2], cos  # the two sentences about a cat are nearer each other


def test_base64_alone_in_a_batch_and_after_a_generation_agree(server):
    client = server.client()
    batch = vectors(client.embeddings.create(model="any", input=TEXTS, encoding_format="float"))
    # the openai client asks for base64 by default and decodes it
    alone = vectors(client.embeddings.create(model="any", input=TEXTS[1]))
    assert np.array_equal(alone[0], batch[1])
    before = client.completions.create(model="any", prompt="Paris is", max_tokens=8, temperature=0).choices[0].text
    after_generation = vectors(client.embeddings.create(model="any", input=[TEXTS[2]], encoding_format="float"))
    assert np.array_equal(after_generation[0], batch[2])
    # the embedding left the cache empty: the same completion, computed as a fresh request
    again = client.completions.create(model="any", prompt="Paris is", max_tokens=8, temperature=0).choices[0].text
    assert again == before
    ids = server.request("POST", "/tokenize", b'{"content": "The cat sat on the mat.", "add_special": true}')[1]
    by_ids = vectors(client.embeddings.create(model="any", input=ids["tokens"], encoding_format="float"))
    assert np.array_equal(by_ids[0], batch[0])


@pytest.mark.parametrize("kwargs, param", [
    ({"input": "x", "dimensions": 64}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [[1, 10**9]]}, "input"),
    ({"input": "word " * 2000}, "input"),
])
def test_what_is_not_computed_is_one_400(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().embeddings.create(model="any", encoding_format="float", **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param and "\n" not in e.value.body["message"]
