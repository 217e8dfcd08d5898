"""Incremental detokenization: the pieces StreamDecoder gives, token by token, join to exactly the text the
whole sequence decodes to after the prompt, for SentencePiece (word-boundary spaces) and byte-level BPE
(characters split across tokens, held back until complete)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from powerinfer_tools.runtime.inference import StreamDecoder

TEXT = "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 東京 🙂🙃 naïve café, 1234567 words."


@pytest.mark.parametrize("kind", ["llama-relu", "opt"])
def test_pieces_join_to_the_whole_decode(tiny_model_dir, kind):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir(kind))
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    for split in (0, 1, 5, len(ids) // 2):
        decoder = StreamDecoder(tok, ids[:split])
        pieces = [decoder.push(t) for t in ids[split:]]
        whole = tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == whole[len(tok.decode(ids[:split], skip_special_tokens=True)):]
        assert not decoder.holding
        assert all("\ufffd" not in p for p in pieces)


def test_an_unfinished_character_is_held_back(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("opt"))
    ids = tok("🙂", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # an emoji the tiny vocabulary spells in bytes
    decoder = StreamDecoder(tok, [])
    assert [decoder.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1) and decoder.holding
    assert decoder.push(ids[-1]) == "🙂" and not decoder.holding
