"""The vocabulary written into a converted file rebuilds (tokenizer_from_file, no hub, no model
directory) a tokenizer that encodes and decodes text exactly as the model's own HF tokenizer."""
from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer, LlamaTokenizer

from powerinfer_tools.formats import tokenizer
from powerinfer_tools.stages.conversion.conversion import convert_model
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.light_tokenizer import SETTINGS_FILE
from powerinfer_tools.formats.tokenizer import HF_JSON_KEY, tokenizer_from_file
from tiny_models import DATA


def sample_text() -> str:
    path = DATA / "wikitext-2-valid.txt"
    real = path.read_text()[:4000] if path.is_file() else "The quick brown fox jumps over the lazy dog. " * 20
    return (real + "\n\n  two  spaces, tabs\tand newlines\n ünïcödé 日本語 emoji 🙂 1234567 x=y+z;"
            " pi 3.14159 , in 2024: 1,000,000!!! ...")


@pytest.mark.parametrize("kind,model", [("llama-relu", "llama"), ("bamboo", "llama"), ("falcon", "gpt2"),
                                        ("opt", "gpt2")])
def test_round_trip_matches_hf_tokenizer(kind, model, tiny_model_dir, tmp_path, monkeypatch):
    src = tiny_model_dir(kind)
    out = tmp_path / "m.gguf"
    convert_model(str(src), out, "f32", progress=False)
    # The class the checkpoint declares (tokenizer_config.json). AutoTokenizer would give the Mistral-typed
    # bamboo a generic backend that applies the tiny SentencePiece model's NFKC/whitespace-collapsing
    # normalizer, which neither LlamaTokenizer nor llama.cpp (the file's semantics) apply.
    ref = LlamaTokenizer.from_pretrained(src) if model == "llama" else AutoTokenizer.from_pretrained(src)
    from convert_helpers import read_fields

    fields = read_fields(out)
    assert fields["tokenizer.ggml.model"] == model
    # byte-level BPE keeps its tokenizer.json (how text is split before merging); SentencePiece needs none
    assert (HF_JSON_KEY in fields) == (model == "gpt2")
    text = sample_text()
    ids = ref(text).input_ids
    built = tokenizer_from_file(out)
    with monkeypatch.context() as mp:  # the second time from the cache, without a build
        mp.setattr(tokenizer, "_build_tokenizer", lambda path: pytest.fail("built again instead of loaded"))
        cached = tokenizer_from_file(out)
    for tok in (built, cached):
        assert tok(text).input_ids == ids
        assert tok(text, add_special_tokens=False).input_ids == ref(text, add_special_tokens=False).input_ids
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert tok.bos_token == ref.bos_token and tok.eos_token == ref.eos_token
        if model == "llama":
            assert ids[0] == ref.bos_token_id  # the add-BOS flag survived


def test_cached_tokenizer_follows_the_file(tiny_model_dir, tmp_path, monkeypatch):
    """A file rewritten (another modification time) or a damaged cache entry builds the tokenizer again; the cache
    keeps the most recently used CACHE_KEEP tokenizers."""
    out = tmp_path / "m.gguf"
    convert_model(str(tiny_model_dir("llama-relu")), out, "f32", progress=False)
    builds = []
    real_build = tokenizer._build_tokenizer
    monkeypatch.setattr(tokenizer, "_build_tokenizer", lambda path: builds.append(path) or real_build(path))
    monkeypatch.setattr(tokenizer, "cache_root", lambda: tmp_path / "cache")
    text = sample_text()
    ids = tokenizer_from_file(out)(text).input_ids
    assert tokenizer_from_file(out)(text).input_ids == ids and len(builds) == 1
    stat = out.stat()
    os.utime(out, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_from_file(out)(text).input_ids == ids and len(builds) == 2
    (tokenizer._cache_entry(out) / "tokenizer.json").write_text("{ damaged")
    assert tokenizer_from_file(out)(text).input_ids == ids and len(builds) == 3
    for n, damage in enumerate(('{"chat_template": 5}', '{"colour": "blue"}', "[]"), start=4):  # other shapes
        (tokenizer._cache_entry(out) / SETTINGS_FILE).write_text(damage)
        assert tokenizer_from_file(out)(text).input_ids == ids and len(builds) == n
    for i in range(tokenizer.CACHE_KEEP + 2):  # other files' tokenizers push the oldest out
        copy = tmp_path / f"copy{i}.gguf"
        copy.write_bytes(out.read_bytes())
        tokenizer_from_file(copy)
    assert len([e for e in (tmp_path / "cache").iterdir() if not e.name.startswith(".")]) == tokenizer.CACHE_KEEP


def test_file_without_vocabulary_is_refused(tmp_path):
    import gguf

    path = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(UserError, match="no vocabulary"):
        tokenizer_from_file(path)


@pytest.mark.parametrize("damage", ["{not json", '{"version": "1.0"}', "null"])
def test_damaged_stored_tokenizer_json_is_a_clear_error(damage, tmp_path):
    import gguf

    path = tmp_path / "badjson.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([b"a", b"b"])
    w.add_string(HF_JSON_KEY, damage)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(UserError, match="tokenizer.huggingface.json does not load"):
        tokenizer_from_file(path)
