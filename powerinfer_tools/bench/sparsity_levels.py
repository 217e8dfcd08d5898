"""Per-layer thresholds that put a model's FFN at a chosen sparsity, for speed measurements.

Speed at a given FFN sparsity is the engine's business, quality at that sparsity the model's; to
measure the first on any model, the thresholds are recalibrated per sparsity level: one forward pass of
the source model (transformers) over calibration tokens records each layer's activations |a| and
predictor inputs; the level-s activation threshold of a layer is the s-quantile of its |a|, and the
level-s predictor threshold is the s-quantile of its predictor logits fc2(relu(fc1 x)) computed with
the predictor weights stored in the model file (what the engine evaluates).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer_tools.models import arch as arch_mod
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_io import open_reader

MAX_VALUES_PER_LAYER = 1 << 20  # |a| values kept per layer (a uniform sample beyond this)


@dataclass
class ActivationSample:
    """What one calibration pass saw, per layer."""

    abs_activation: list[np.ndarray]   # sampled |a| values (float32)
    predictor_input: list[np.ndarray]  # [tokens, n_embd] float32
    thresholded: bool                  # the model's rule is |a| > t (SiLU/GELU), not a != 0


@torch.no_grad()
def collect(model, adapter: arch_mod.Arch, seqs: torch.Tensor, seed: int = 0) -> ActivationSample:
    """Run `seqs` [n_seq, seq_len] through the model once, recording activations and predictor inputs."""
    n_layer = adapter.dims().n_layer
    acts: list[list[torch.Tensor]] = [[] for _ in range(n_layer)]
    inputs: list[list[torch.Tensor]] = [[] for _ in range(n_layer)]
    handles = arch_mod.install_taps(
        adapter, model,
        on_input=lambda i, x: inputs[i].append(x.detach().reshape(-1, x.shape[-1]).float().cpu()),
        on_activation=lambda i, a: acts[i].append(a.detach().reshape(-1).abs().float().cpu()))
    try:
        for row in seqs:
            model(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    gen = torch.Generator().manual_seed(seed)
    sampled = []
    for layer in acts:
        values = torch.cat(layer)
        if values.numel() > MAX_VALUES_PER_LAYER:
            values = values[torch.randint(0, values.numel(), (MAX_VALUES_PER_LAYER,), generator=gen)]
        sampled.append(values.numpy())
    return ActivationSample(sampled, [torch.cat(x).numpy() for x in inputs], adapter.thresholded)


def activation_thresholds(sample: ActivationSample, sparsity: float) -> list[float]:
    """Per-layer |a| thresholds below which a share `sparsity` of the activations falls."""
    _check_level(sparsity)
    if not sample.thresholded:
        raise UserError("the model's activation is ReLU-family (active means a != 0): its gate-mode sparsity is "
                        "fixed by the model, no threshold sets it")
    return [float(np.quantile(values, sparsity)) if sparsity > 0 else 0.0 for values in sample.abs_activation]


def predictor_weights(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(fc1 [rank, n_embd], fc2 [n_ff, rank]) float32 per layer, as stored in a PowerInfer file."""
    import gguf

    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    weights, layer = [], 0
    while f"blk.{layer}.fc1.weight" in tensors:
        pair = []
        for name in (f"blk.{layer}.fc1.weight", f"blk.{layer}.fc2.weight"):
            t = tensors[name]
            pair.append(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        weights.append((pair[0], pair[1]))
        layer += 1
    if not weights:
        raise UserError(f"{path} has no predictors (blk.N.fc1/fc2): predictor mode needs a file converted "
                        "with --predictors")
    return weights


def predictor_logits(sample: ActivationSample, weights: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Per layer, the predictor logits [tokens, n_ff] of the calibration tokens."""
    if len(weights) != len(sample.predictor_input):
        raise UserError(f"the file has predictors for {len(weights)} layers, the model has "
                        f"{len(sample.predictor_input)}")
    return [np.maximum(x @ fc1.T, 0.0) @ fc2.T for x, (fc1, fc2) in zip(sample.predictor_input, weights)]


def predictor_thresholds(logits: list[np.ndarray], sparsity: float) -> list[float]:
    """Per-layer logit thresholds above which a share 1 - `sparsity` of the neurons is selected."""
    _check_level(sparsity)
    return [float(np.quantile(values, sparsity)) for values in logits]


def _check_level(sparsity: float) -> None:
    if not 0.0 <= sparsity < 1.0:
        raise UserError(f"sparsity must be in [0, 1), got {sparsity}")
