"""convert folds per-layer predictor thresholds into fc2 (conversion.ThresholdFold): PowerInfer compares every
layer's predictor logits with the one powerinfer.sparse_threshold (skipping a neuron whose logit is below it,
ggml.c), so a file of the default pipeline, whose train-predictor calibrates a threshold a layer, had PowerInfer
select other neurons than our engine. Checked here by PowerInfer's rule computed on the file's own fc1/fc2
against ours on the predictors as trained; scripts/check_powerinfer_interop.py runs PowerInfer itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from convert_helpers import read_fields, read_tensors, write_predictors
from engine_helpers import random_tokens
from tiny_models import HIDDEN, N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.stages.conversion.conversion import convert_model, summary_lines


def powerinfer_masks(path, x: np.ndarray) -> list[np.ndarray]:
    """Per layer, the neurons PowerInfer computes for inputs x [n, n_embd]: fc2 relu(fc1 x) not below the file's
    one sparse_threshold."""
    tensors, threshold = read_tensors(path), read_fields(path)["powerinfer.sparse_threshold"]
    return [np.maximum(x @ tensors[f"blk.{i}.fc1.weight"][1].T, 0) @ tensors[f"blk.{i}.fc2.weight"][1].T >= threshold
            for i in range(N_LAYER)]


def trained_masks(pred, thresholds, x: np.ndarray) -> list[np.ndarray]:
    """Per layer, the neurons our engine computes by the predictors as trained: logit above the layer's threshold."""
    masks = []
    for i, t in enumerate(thresholds):
        state = torch.load(pred / f"model_{i}.pt", weights_only=True)
        fc1, fc2 = state["fc1.weight"].numpy(), state["fc2.weight"].numpy()
        masks.append(np.maximum(x @ fc1.T, 0) @ fc2.T > t)
    return masks


def convert(tiny_model_dir, tmp_path, thresholds, compatible=True):
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF, thresholds=thresholds)
    out = tmp_path / ("file.gguf" if compatible else "ours-only.gguf")
    summary = convert_model(str(tiny_model_dir("llama-relu")), out, outtype="f32", predictors_dir=pred,
                            progress=False, powerinfer_compatible=compatible)
    return pred, out, summary


@pytest.mark.parametrize("thresholds", [[0.5, 3.0], [-0.4, -2.5]])
def test_powerinfer_selects_our_neurons_in_a_folded_file(thresholds, tiny_model_dir, tmp_path):
    pred, path, summary = convert(tiny_model_dir, tmp_path, thresholds)
    fields = read_fields(path)
    common = fields["powerinfer.sparse_threshold"]
    assert common * thresholds[0] > 0 and list(fields["powerinfer.predictor_thresholds"]) == [common] * N_LAYER
    assert summary["predictor_threshold_note"] == ""
    x = np.random.default_rng(0).standard_normal((256, HIDDEN)).astype(np.float32)
    theirs, ours = powerinfer_masks(path, x), trained_masks(pred, thresholds, x)
    for i in range(N_LAYER):
        assert 0.02 < ours[i].mean() < 0.98, (i, ours[i].mean())   # thresholds that select part of the neurons
        assert (theirs[i] != ours[i]).mean() == 0, (i, (theirs[i] != ours[i]).mean())


def test_unfolded_thresholds_select_other_neurons_in_powerinfer(tiny_model_dir, tmp_path):
    """Without the fold (--ours-only keeps the per-layer thresholds as trained), PowerInfer's one threshold
    selects other neurons in the layer whose threshold it is not: what the fold repairs."""
    thresholds = [0.5, 3.0]
    pred, path, _ = convert(tiny_model_dir, tmp_path, thresholds, compatible=False)
    assert list(read_fields(path)["powerinfer.predictor_thresholds"]) == pytest.approx(thresholds)
    x = np.random.default_rng(0).standard_normal((256, HIDDEN)).astype(np.float32)
    theirs, ours = powerinfer_masks(path, x), trained_masks(pred, thresholds, x)
    assert (theirs[1] != ours[1]).mean() > 0.01


def test_our_engine_computes_the_same_on_the_folded_file(tiny_model_dir, tmp_path):
    """The same neurons in every layer (the densities), the same logits within the f16 down projection that a
    PowerInfer-compatible file stores (POWERINFER_DOWN_T_OUTTYPE) and --ours-only does not."""
    _, folded, _ = convert(tiny_model_dir, tmp_path, [0.5, 3.0])
    _, unfolded, _ = convert(tiny_model_dir, tmp_path, [0.5, 3.0], compatible=False)
    tokens = random_tokens(24, 384, seed=9)
    runs = []
    for path in (folded, unfolded):
        with engine.Model(path, threads=1, sparse_mode="predictor") as m:
            runs.append((m.eval(tokens), m.stats()))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-2, atol=2e-3)
    for a, b in zip(runs[0][1]["layers"], runs[1][1]["layers"]):
        assert a["predicted_density"] == pytest.approx(b["predicted_density"], abs=1e-9), (a, b)


def test_thresholds_of_both_signs_are_kept_and_said(tiny_model_dir, tmp_path):
    thresholds = [-0.5, 0.7]
    _, path, summary = convert(tiny_model_dir, tmp_path, thresholds)
    assert list(read_fields(path)["powerinfer.predictor_thresholds"]) == pytest.approx(thresholds)
    note = summary["predictor_threshold_note"]
    assert "do not share a sign" in note and "PowerInfer" in note
    assert f"note: {note}" in summary_lines(summary)
