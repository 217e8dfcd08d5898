"""A GGUF source read through transformers (profile, sparsify, bench from `-m file.gguf` or `smollm2`): the file is
parsed by gguf-py once for its config, weights and tokenizer, and parsed again once it changes
(powerinfer_tools.models.gguf_parse_once)."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from powerinfer_tools import models
from powerinfer_tools.models.gguf_parse_once import parse_once


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The paths gguf-py's reader parses from now on."""
    seen: list[str] = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            seen.append(os.path.realpath(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return seen


@pytest.mark.slow
def test_the_default_model_is_parsed_once_for_config_weights_and_tokenizer(parses):
    source = models.resolve("smollm2")
    models.load_config(source)
    model, _ = models.load_model(source)
    models.load_tokenizer(source)
    assert parses == [os.path.realpath(source.path)]
    assert model.config.num_hidden_layers == 30
    import gguf as after
    assert after.GGUFReader.__name__ == "Counting"  # the patch is undone when the load ends


def write(path, value: int) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.value", value)
    w.add_tensor("t", np.full(4, value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_file_rewritten_in_place_is_parsed_again(tmp_path, parses):
    path = tmp_path / "m.gguf"
    write(path, 1)
    with parse_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
    write(path, 22)  # another size: another identity, whatever the clock's resolution
    with parse_once():
        second = gguf.GGUFReader(path)
    assert len(parses) == 2
    assert second is not first and int(second.fields["test.value"].contents()) == 22
