"""A GGUF source read through transformers (profile, sparsify, bench from `-m file.gguf` or `smollm2`): the file is
parsed by gguf-py once for its config and weights, once for its tokenizer, and again once it changes
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
def test_the_default_model_is_parsed_once_for_config_and_weights(parses):
    source = models.resolve("smollm2")
    models.load_config(source)
    model, _ = models.load_model(source)
    models.load_tokenizer(source)
    assert parses == [os.path.realpath(source.path)] * 3  # one each: the config; the model (its config and weights); the tokenizer
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
        second = gguf.GGUFReader(path)
        assert second is not first and int(second.fields["test.value"].contents()) == 22
    with parse_once():  # a load's readers are not kept after it
        assert gguf.GGUFReader(path) is not second
    assert len(parses) == 3


def test_a_subclass_of_the_reader_made_during_a_load_is_its_own(tmp_path):
    """gguf_io's reader of PowerInfer files subclasses gguf.GGUFReader when it is called, inside a load too."""
    from powerinfer_tools.formats import gguf_io

    path = tmp_path / "m.gguf"
    write(path, 7)
    gguf_io.set_pwri_magic(path)
    with parse_once():
        reader = gguf_io.open_reader(path)
        assert type(reader).__name__ == "PwriReader" and int(reader.fields["test.value"].contents()) == 7
