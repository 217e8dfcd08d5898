"""Predictors that predict nothing: found and reported by train-predictor, left out by auto mode.

A SiLU profile at the default 0.2 sparsity is 80 % dense. Scored at 1.3 x that density (more than every
neuron), any predictor, one that marks every neuron active included, reaches a perfect recall, so the rank
search took the smallest rank after one epoch: a predictor whose hidden layer is dead on most rows (logits
0, AUC 0.5, threshold just below 0). On text like the calibration text it selects every neuron; on other
text, where its hidden layer wakes up, it drops neurons at random.
"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

import powerinfer_engine as engine
from cli_helpers import profiled, run_cli
from convert_helpers import read_fields
from engine_helpers import converted, engine_prompt_then_decode, max_rel_err, random_tokens, rewrite  # noqa: F401
from tiny_models import DATA, N_LAYER

from powerinfer_tools.stages.predictors.predictor import density_budget, recall_at_density
from powerinfer_tools.stages.predictors.usefulness import MAX_USEFUL_DENSITY, MIN_USEFUL_AUC


@pytest.fixture(scope="module")
def silu_profile(tiny_model_dir, tmp_path_factory):
    """The tiny SiLU model profiled as the README's pipeline does: default (0.2) sparsity."""
    return profiled(tiny_model_dir("llama-silu"), tmp_path_factory.mktemp("silu_profile") / "prof",
                    DATA / "wikitext-2-valid.txt", tokens=4096, seq_len=128)


def test_a_predictor_marking_everything_does_not_meet_a_dense_layers_budget():
    labels = torch.rand(2000, 64, generator=torch.Generator().manual_seed(0)) < 0.8
    constant = torch.zeros(labels.shape)
    budget = density_budget(float(labels.float().mean()), 1.3)
    assert budget < 0.9  # not 1.3 x 0.8 >= 1: it must leave out a share of the inactive neurons
    assert recall_at_density(constant, labels, budget) < 0.9
    assert density_budget(0.1, 1.3) == pytest.approx(0.13)  # sparse layers: the ratio alone, as before


def test_default_pipeline_predictors_are_useful_or_reported(silu_profile, tmp_path, capsys):
    """A SiLU profile at about 80 % density: a predictor ranks its neurons well above chance, but at the recall
    asked it marks more than half of them active, where a sparse step saves less than choosing them costs. Every
    layer is then reported not useful, and the verdict says what to run instead."""
    out = tmp_path / "pred"
    code, stdout, stderr = run_cli(capsys, "train-predictor", silu_profile, "-o", out, "--threads", "1")
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for layer, entry in zip(report["layers"], config["layers"]):
        assert entry["useful"] == layer["useful"]
        saves = layer["auc"] >= MIN_USEFUL_AUC and layer["predicted_density"] <= MAX_USEFUL_DENSITY
        assert layer["useful"] == saves, layer
        if not layer["useful"]:
            assert f"layer(s) {layer['layer']}" in stderr or "predict nothing useful" in stderr
    assert all(layer["auc"] >= MIN_USEFUL_AUC for layer in report["layers"])  # a ranking was learned...
    assert not any(layer["useful"] for layer in report["layers"])  # ...that cannot save work at this density
    assert "predictors predicts anything useful: run gate or dense mode" in stdout + stderr


def test_a_useless_predictor_is_reported(silu_profile, tmp_path, capsys):
    """Predictors whose hidden layer is dead (fc1 0): AUC 0.5 and every neuron predicted active."""
    out = tmp_path / "dead"
    out.mkdir()
    n_embd, n_ff = 64, 256
    for i in range(N_LAYER):
        torch.save({"fc1.weight": torch.zeros(8, n_embd), "fc2.weight": torch.randn(n_ff, 8)}, out / f"model_{i}.pt")
    (out / "config.json").write_text(json.dumps({"sparse_threshold": -1e-3}))
    code, stdout, stderr = run_cli(capsys, "train-predictor", silu_profile, "-o", out, "--evaluate",
                                   "--report", tmp_path / "eval.json")
    assert code == 0, stderr
    assert "warning: the predictors of layer(s) 0-1 predict nothing useful" in stderr
    assert "evaluation AUC 0.500" in stderr and "predicted density 1.000 (useful up to 0.5) vs true 0.8" in stderr
    assert not any(layer["useful"] for layer in json.loads((tmp_path / "eval.json").read_text())["layers"])


def test_auto_mode_leaves_out_a_layers_useless_predictor(tmp_path, converted):
    """With a predictor that selects few neurons, auto runs predictor mode in every layer (test_engine_logits);
    marked not useful in layer 0 (as convert writes train-predictor's verdict), it never runs it there."""
    src = converted("llama-relu", "q8_0", predictors=True)
    sparse = {"powerinfer.predictor_thresholds": ([6.0] * N_LAYER, gguf.GGUFValueType.ARRAY)}
    marked = dict(sparse, **{"powerinfer.predictor_useful": ([False] + [True] * (N_LAYER - 1),
                                                             gguf.GGUFValueType.ARRAY)})
    tokens = random_tokens(24, 384)
    decode_modes = {}
    for name, fields, useful in (("all useful", sparse, [True] * N_LAYER),
                                 ("layer 0 useless", marked, [False] + [True] * (N_LAYER - 1))):
        path = rewrite(src, tmp_path / f"{len(decode_modes)}.gguf", fields=fields)
        with engine.Model(path, threads=2, sparse_mode="auto") as m:
            assert m.info["predictor_useful"] == useful
            m.eval(tokens[:16], all_logits=False)
            for t in tokens[16:]:
                m.eval([t], all_logits=False)
            decode_modes[name] = [set(layer["modes"]) for layer in m.stats()["layers"]]
    assert all("predictor" in modes for modes in decode_modes["all useful"])
    assert "predictor" not in decode_modes["layer 0 useless"][0]
    assert "predictor" in decode_modes["layer 0 useless"][1]


def test_convert_writes_which_predictors_are_useful(tiny_model_dir, tmp_path):
    from convert_helpers import write_predictors
    from powerinfer_tools.stages.conversion.conversion import convert_model

    pred = write_predictors(tmp_path / "pred", N_LAYER, 64, 256)
    config = json.loads((pred / "config.json").read_text())
    config["layers"][1]["useful"] = False
    (pred / "config.json").write_text(json.dumps(config))
    out = tmp_path / "m.gguf"
    convert_model(str(tiny_model_dir("llama-relu")), out, outtype="f32", predictors_dir=pred, progress=False)
    assert read_fields(out)["powerinfer.predictor_useful"] == [True, False]


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("dead", [False, True])
def test_predictor_decode_steps_agree_with_the_prompt_path(outtype, dead, tmp_path, converted):
    """Predictor mode one token at a time (the fused decode step) against the same tokens as one batch: with
    random predictors (threshold 0: about half selected), and with the dead one the default pipeline made (fc1 0:
    every logit exactly 0) at the threshold it was calibrated to, the float just below 0, where each logit
    counts as selected. q8_0: a batch multiplies its down projection in integers (q8_0 input and transposed weights)
    and a decode step in floats, so the decode rows are bounded by that rounding where every neuron is selected
    (random predictors turn it into other neurons: f32 compares those), and the prompt's rows, batches both ways,
    keep the same bits whatever the batch."""
    src = converted("llama-relu", outtype, predictors=True)
    threshold = float(np.nextafter(np.float32(0), np.float32(-1))) if dead else 0.0
    from convert_helpers import read_tensors

    fc1 = {f"blk.{i}.fc1.weight": (np.zeros_like(read_tensors(src)[f"blk.{i}.fc1.weight"][1]), None)
           for i in range(N_LAYER)} if dead else {}
    path = rewrite(src, tmp_path / "p.gguf", tensors=fc1, fields={
        "powerinfer.predictor_thresholds": ([threshold] * N_LAYER, gguf.GGUFValueType.ARRAY)})
    tokens = random_tokens(40, 384, seed=5)
    for threads in (1, 2):
        with engine.Model(path, threads=threads, sparse_mode="predictor", recall_check=True) as m:
            batch = m.eval(tokens)
            m.reset()
            steps = engine_prompt_then_decode(m, tokens, 8)
            stats = m.stats()
        if outtype == "f32":
            assert max_rel_err(steps, batch) <= 1e-5, (threads, max_rel_err(steps, batch))
        else:
            np.testing.assert_array_equal(steps[:8], batch[:8])
            if dead:  # measured 1.8e-2
                assert max_rel_err(steps, batch) <= 2.5e-2, (threads, max_rel_err(steps, batch))
        for layer in stats["layers"]:
            if dead:
                assert layer["predicted_density"] == 1.0 and layer["recall"] == 1.0
            else:
                assert 0.2 < layer["predicted_density"] < 0.8


def test_predictor_mode_on_useless_predictors_warns(tmp_path, converted, capsys):
    path = rewrite(converted("llama-relu", "q8_0", predictors=True), tmp_path / "p.gguf", fields={
        "powerinfer.predictor_useful": ([False, True], gguf.GGUFValueType.ARRAY)})
    code, _, err = run_cli(capsys, "run", "-m", path, "-p", "hi", "-n", "2", "-t", "2", "--sparse-mode", "predictor")
    assert code == 0, err
    assert "warning: train-predictor found the predictors of layer(s) 0 no better than chance" in err
    code, _, err = run_cli(capsys, "run", "-m", path, "-p", "hi", "-n", "2", "-t", "2", "--sparse-mode", "gate")
    assert "warning" not in err
