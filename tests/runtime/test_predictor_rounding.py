"""scripts/predictor_rounding.py, the measure of how much predictor mode depends on rounding the activations into
the down projection (docs/formats.md): on a tiny ReLU llama its masks are the predictors', every-neuron masks give
the dense result, and f16 rounding moves the result by rounding's size only."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from powerinfer_tools import models
from powerinfer_tools.stages.predictors.predictor import Predictor, PredictorDir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import predictor_rounding  # noqa: E402


def _setup(tiny_model_dir, threshold: float):
    model, adapter = models.load_model(models.resolve(str(tiny_model_dir("llama-relu"))))
    dims = adapter.dims()
    torch.manual_seed(0)
    preds = {i: Predictor(dims.n_embd, 16, dims.n_ff) for i in range(dims.n_layer)}
    directory = PredictorDir(Path("."), preds, {i: threshold for i in preds}, None, None)
    seqs = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, adapter, directory, seqs


def test_every_neuron_predicted_is_dense(tiny_model_dir):
    model, adapter, predictors, seqs = _setup(tiny_model_dir, -math.inf)
    dense, none = predictor_rounding.run(model, adapter, predictors, seqs, predict=False, round_f16=False)
    all_on, masks = predictor_rounding.run(model, adapter, predictors, seqs, predict=True, round_f16=False)
    assert none is None
    assert all_on == dense
    assert set(masks) == set(range(len(model.model.layers)))
    assert all(bool(m.all()) and m.shape == (seqs.numel(), m.shape[1]) for m in masks.values())


def test_masks_follow_the_threshold_and_f16_rounding_is_small(tiny_model_dir):
    model, adapter, predictors, seqs = _setup(tiny_model_dir, 0.0)
    dense, _ = predictor_rounding.run(model, adapter, predictors, seqs, predict=False, round_f16=False)
    sparse, masks = predictor_rounding.run(model, adapter, predictors, seqs, predict=True, round_f16=False)
    rounded, rounded_masks = predictor_rounding.run(model, adapter, predictors, seqs, predict=True, round_f16=True)
    share = float(torch.cat(list(masks.values())).float().mean())
    assert 0.05 < share < 0.95          # a random predictor at 0 keeps some neurons and drops others
    assert sparse != dense
    assert abs(rounded / sparse - 1) < 1e-2 and rounded != sparse
    assert set(rounded_masks) == set(masks)
