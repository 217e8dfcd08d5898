"""Input sparsity's calibration (stages/profiling/input_sparsity.py) on tiny models: the uniform allocation zeroes its share of
every site's inputs, the greedy one reaches each level's share of every layer's weights and moves the layers'
outputs less than the uniform one; the table's file is checked; profile writes it and convert stores it with the
transposed matrices, neuron order and all."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, profiled, run_cli
from convert_helpers import read_fields, read_tensors
from engine_helpers import hf_model
from tiny_models import training_text

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names
from powerinfer_tools.stages.profiling import input_sparsity as isp

N_SITES = len(names.INPUT_SITES)


@pytest.fixture(scope="module")
def seqs():
    return torch.randint(0, 384, (4, 128), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["llama-silu", "falcon", "opt"])
def test_uniform_zeroes_its_share_of_every_site(kind, tiny_model_dir, seqs):
    model, adapter = hf_model(tiny_model_dir(kind))
    table = isp.calibrate(model, adapter, seqs, "uniform", 2, 0)
    values = isp.sample_inputs(model, adapter, seqs, 2, 0)
    assert table.levels == list(isp.LEVELS)
    for k, level in enumerate(table.levels):
        for i, row in enumerate(table.thresholds[k]):
            for j, t in enumerate(row):
                zeroed = float((values[i][j] <= t).double().mean())
                if kind != "llama-silu" and names.INPUT_SITES[j] == "down":   # ReLU: exact zeros past the share
                    assert zeroed >= level - 0.01
                else:
                    assert zeroed == pytest.approx(level, abs=0.01), (k, i, j)
                if k:
                    assert t >= table.thresholds[k - 1][i][j]


def layer_errors(model, adapter, seqs, thresholds) -> float:
    """Squared error of every layer's output against the dense model's, each on the dense model's inputs."""
    layers = adapter.layers(model)
    captured = []
    handles = [layer.register_forward_hook(lambda m, a, k, out, i=i: captured.append((i, a, k, out)), with_kwargs=True)
               for i, layer in enumerate(layers)]
    with torch.no_grad():
        model(input_ids=seqs, use_cache=False)
    for h in handles:
        h.remove()
    total = 0.0
    with torch.no_grad(), isp.zeroed_inputs(adapter, model, thresholds):
        for i, args, kwargs, out in captured:
            dense = out[0] if isinstance(out, tuple) else out
            total += float((isp._layer_output(layers[i], args, kwargs) - dense).pow(2).sum())
    return total


@pytest.mark.parametrize("kind", ["llama-silu", "bamboo", "falcon"])
def test_greedy_reaches_each_level_and_moves_the_layers_less_than_uniform(kind, tiny_model_dir, seqs):
    model, adapter = hf_model(tiny_model_dir(kind))
    weights = isp.site_weights(isp.site_modules(adapter, model))
    greedy = isp.calibrate(model, adapter, seqs, "greedy", 2, 0)
    uniform = isp.calibrate(model, adapter, seqs, "uniform", 2, 0)
    for k, level in enumerate(greedy.levels):
        for i, shares in enumerate(greedy.shares[k]):
            assert sum(s * w for s, w in zip(shares, weights[i])) / sum(weights[i]) == pytest.approx(level, abs=1e-6)
            assert all(0 <= s <= isp.MAX_SITE_SHARE for s in shares)
    assert len({tuple(row) for row in greedy.shares[4]}) > 0 and greedy.shares[4] != uniform.shares[4]
    for share in (0.25, 0.5):
        assert layer_errors(model, adapter, seqs, greedy.at(share)) < layer_errors(model, adapter, seqs,
                                                                                     uniform.at(share))


def test_interpolation_between_levels_and_its_range(tiny_model_dir, seqs):
    model, adapter = hf_model(tiny_model_dir("llama-silu"))
    table = isp.calibrate(model, adapter, seqs, "uniform", 2, 0)
    mid = table.at(0.225)
    assert mid[1][2] == pytest.approx((table.thresholds[3][1][2] + table.thresholds[4][1][2]) / 2)
    assert table.at(0.0) == [[0.0] * N_SITES for _ in mid]
    assert table.at(0.25) == table.thresholds[4]
    for bad in (-0.01, table.levels[-1] + 0.01):
        with pytest.raises(UserError, match="input sparsity must be in"):
            table.at(bad)


def test_a_damaged_table_is_refused_in_one_line(tmp_path):
    table = isp.InputThresholds("uniform", [0.1, 0.2], [[[0.1] * N_SITES] * 2] * 2, [[[0.5] * N_SITES] * 2] * 2, 64)
    table.save(tmp_path)
    assert isp.InputThresholds.load(tmp_path, 2) == table
    with pytest.raises(UserError, match="3 layers"):
        isp.InputThresholds.load(tmp_path, 3)
    for change in ({"levels": [0.2, 0.1]}, {"thresholds": [[[float("nan")] * N_SITES] * 2] * 2},
                   {"allocation": "best"}, {"extra": 1}):
        (tmp_path / isp.FILE).write_text(json.dumps({**json.loads(json.dumps(table.__dict__)), **change}))
        with pytest.raises(UserError):
            isp.InputThresholds.load(tmp_path, 2)


@pytest.fixture(scope="module")
def profile_dir(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("input_profile")
    calib = root / "calib.txt"
    calib.write_text(training_text()[:40_000])
    return profiled(tiny_model_dir("llama-silu"), root / "prof", calib, 1024, 128, "--input-allocation", "uniform")


def test_profile_writes_the_table_and_convert_stores_it_with_the_transposed_matrices(tiny_model_dir, profile_dir,
                                                                                   tmp_path, capsys):
    assert json.loads((profile_dir / "profile.json").read_text())["input_sparsity"] == "uniform"
    table = isp.InputThresholds.load(profile_dir, 2)
    out = tmp_path / "m.gguf"
    code, stdout, err = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-silu"), "--profile", profile_dir,
                                "--outtype", "f32", "-o", out, "-q", "--ours-only", "--input-thresholds")
    assert code == 0, err
    assert "input sparsity: the profile's uniform thresholds" in stdout
    fields = read_fields(out)
    assert list(fields[names.KEY_INPUT_SPARSITY_LEVELS]) == pytest.approx(table.levels)
    assert list(fields[names.KEY_INPUT_THRESHOLDS]) == pytest.approx(table.flat_thresholds())
    tensors = {k: v[1] for k, v in read_tensors(out).items()}
    for i in range(2):
        for base, transposed in (("attn_q", names.ATTN_Q_T), ("attn_k", names.ATTN_K_T), ("attn_v", names.ATTN_V_T),
                                 ("attn_output", names.ATTN_OUTPUT_T), (names.FFN_GATE, names.FFN_GATE_T),
                                 (names.FFN_UP, names.FFN_UP_T)):
            # the same matrix transposed: the rope permutation and the profile's neuron order included
            assert np.array_equal(tensors[f"blk.{i}.{transposed}.weight"], tensors[f"blk.{i}.{base}.weight"].T)
    plain = tmp_path / "plain.gguf"
    code, stdout, err = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-silu"), "--profile", profile_dir,
                                "--outtype", "f32", "-o", plain, "-q", "--ours-only", "--no-input-thresholds")
    assert code == 0, err
    assert names.KEY_INPUT_THRESHOLDS not in read_fields(plain)
    assert not any(name.endswith("_t.weight") and "down" not in name for name in read_tensors(plain))


def test_bad_allocation_is_one_line(tiny_model_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "profile", "-m", tiny_model_dir("llama-silu"), "--tokens", "256", "-o",
                           tmp_path / "p", "--input-allocation", "best")
    assert_one_line_error(code, err, "--input-allocation")
