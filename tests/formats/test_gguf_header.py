"""formats/gguf_header.py, the header reader `pi-tools plan` uses: the same metadata, tensor table and byte
costs as gguf-py's GGUFReader on a file with a 32000-token vocabulary, and one-line errors on damaged files."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from hostile_files import write_corpus
from placement_fixtures import power_law_counts, write_model, write_profile

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_header import read_header
from powerinfer_tools.formats import neuron_order
from powerinfer_tools.formats.gguf_io import field, open_reader
from powerinfer_tools.stages.placement import placement

N_LAYER, N_FF, N_VOCAB = 2, 96, 32000
TOKENS = "tokenizer.ggml.tokens"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / "vocab.powerinfer.gguf", N_LAYER, N_FF, "Q4_0",
                       n_vocab=N_VOCAB, vocabulary=True, neuron_order=True)


def gguf_py_table(reader) -> list[tuple]:
    return [(t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type, int(t.n_bytes), int(t.data_offset))
            for t in reader.tensors]


def table(header) -> list[tuple]:
    return [(t.name, t.shape, t.type, t.n_bytes, t.offset) for t in header.tensors]


def test_costs_metadata_and_tensors_equal_gguf_py_on_a_32000_token_file(model):
    reader = open_reader(model)
    old = placement.costs_from_tensors(
        str(model), lambda key, default=None: field(reader, key, default),
        ((name, shape, n_bytes) for name, shape, _, n_bytes, _ in gguf_py_table(reader)))
    new = placement.model_costs(model)
    for f in dataclasses.fields(placement.ModelCosts):
        a, b = getattr(old, f.name), getattr(new, f.name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, f.name

    header = read_header(model)
    assert table(header) == gguf_py_table(reader)
    assert header.skipped == {TOKENS: N_VOCAB}  # the vocabulary's strings walked over, not decoded
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(header.metadata) == sorted(k for k in keys if k != TOKENS)
    for key in header.metadata:
        assert header.get(key) == field(reader, key), key
    assert len(header.get("tokenizer.ggml.scores")) == N_VOCAB
    with pytest.raises(KeyError, match="skipped"):
        header.get(TOKENS)
    assert read_header(model, strings=[TOKENS]).get(TOKENS) == field(reader, TOKENS)
    alone = read_header(model, tensors=False)  # the metadata a run's default context needs, no tensor table
    assert (alone.metadata, alone.skipped, alone.tensors) == (header.metadata, header.skipped, [])


def test_plan_maps_the_profile_through_the_files_neuron_order(model, tmp_path):
    counts = power_law_counts(N_LAYER, N_FF)
    costs = placement.model_costs(model)
    fixed, _ = placement.fixed_costs(costs, 512, 0, True, "all")
    half = sum(fixed.values()) + int(costs.neuron_bytes[0]) * N_FF  # room for half of the neurons
    plan = placement.plan_for_model(write_profile(tmp_path / "prof", counts), model, half, ctx_size=512,
                                    reserve_bytes=0, min_layer_neurons=0)
    assert 0 < plan.gpu_neurons.sum() < N_LAYER * N_FF
    assert plan.neuron_order == field(open_reader(model), neuron_order.ORDER_KEY)
    for c, idx in zip(counts, plan.gpu_index):  # the file keeps each layer reversed: position p is neuron n-1-p
        assert (c[::-1][idx].min() if idx.size else np.inf) >= np.delete(c[::-1], idx).max(initial=0)


def test_a_truncated_file_is_one_line_for_the_reader_and_for_plan(model, tmp_path, capsys):
    data = model.read_bytes()
    profile = write_profile(tmp_path / "prof", power_law_counts(N_LAYER, N_FF))
    header_end = max(t.offset for t in read_header(model).tensors)
    for cut in (3, 10, 20, 1000, len(data) // 3, header_end - 8, len(data) - 1):
        bad = tmp_path / f"cut-{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(UserError) as err:
            read_header(bad)
        assert len(str(err.value).splitlines()) == 1 and str(bad) in str(err.value)
        code, _, stderr = run_cli(capsys, "plan", "--profile", profile, "-m", bad, "--vram-budget", 1,
                                  "-o", tmp_path / "never.gpuidx")
        assert_one_line_error(code, stderr, str(bad))
        assert not (tmp_path / "never.gpuidx").exists()


def test_hostile_files_are_refused_in_one_line_where_the_engine_refuses_them(tmp_path):
    """tests/hostile_files.py's corpus: refused by this reader exactly where the engine's checks (and gguf-py)
    refuse it, in one line; read as gguf-py reads it otherwise. Text that is not UTF-8 is refused when asked for."""
    read = refused = 0
    for path, _ in write_corpus(tmp_path / "corpus", random_per_seed=6):
        try:
            reader = open_reader(path)
        except UserError:
            reader = None
        try:
            header = read_header(path)
        except UserError as exc:
            assert len(str(exc).splitlines()) == 1, path
            assert reader is None, f"{path}: {exc}"
            refused += 1
            continue
        assert reader is not None, path
        read += 1
        assert table(header) == gguf_py_table(reader), path
        if path.name.endswith("name-not-utf8.gguf"):
            with pytest.raises(UserError, match="general.name holds text that is not UTF-8"):
                header.get("general.name")
    assert read and refused
