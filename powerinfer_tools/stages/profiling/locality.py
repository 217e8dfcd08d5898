"""Activation locality of a profiled model: how few neurons serve most activations, layer by layer.

PowerInfer pays off when a small "hot" set of neurons covers most activations (they go to the GPU)
and the rest are rarely needed. The evidence is the curve of cumulative activation share against
the share of neurons, hottest first: a power law bends sharply up, a uniform model is the diagonal.
Everything here works from the raw per-neuron counts (activation_{i}.pt), the data PowerInfer's own
tools consume, so the numbers can be checked against profile.json's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer_tools.stages.profiling.profiling import load_activation_counts, load_profile, skew
from powerinfer_tools.stages.predictors.usefulness import ENOUGH_SPARSITY

COVERAGE_TARGETS = (0.8, 0.9)   # activation shares for which we report the neurons needed
# What the verdict calls locality: the hottest 10 % serving under a fifth of activations is close to none (10 %
# is none). Enough sparsity is the predictors' rule (stages/predictors/usefulness.py).
ENOUGH_HOT10 = 0.2


def cumulative_share(counts: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(neuron share, activation share) of the k hottest neurons for k = 0..n: the power-law curve."""
    ordered = np.sort(counts.double().numpy())[::-1]
    total = ordered.sum()
    activation = np.concatenate([[0.0], np.cumsum(ordered) / total if total > 0 else np.zeros(len(ordered))])
    neurons = np.arange(len(ordered) + 1) / len(ordered)
    return neurons, activation


def neuron_share_for(counts: torch.Tensor, activation_share: float) -> float:
    """Smallest share of neurons (hottest first) whose activations reach `activation_share` of all."""
    neurons, activation = cumulative_share(counts)
    if activation[-1] == 0:
        return 0.0
    k = int(np.searchsorted(activation, activation_share - 1e-12, side="left"))
    return float(neurons[min(k, len(neurons) - 1)])


def sparsity(counts: torch.Tensor, tokens: int) -> float:
    """Share of (token, neuron) pairs that were inactive: 1 - mean activation frequency."""
    return 1.0 - float(counts.sum()) / (tokens * len(counts))


@dataclass
class LayerLocality:
    layer: int
    sparsity: float
    hot: dict[str, float]                 # hot10 / hot20 / hot50, as profile.skew computes them
    neurons_for: dict[float, float]       # activation share -> share of neurons needed for it
    neuron_share: np.ndarray              # the curve, x
    activation_share: np.ndarray          # the curve, y


@dataclass
class Locality:
    profile: dict                         # profile.json as written by `pi-tools profile`
    layers: list[LayerLocality]


def layer_locality(layer: int, counts: torch.Tensor, tokens: int) -> LayerLocality:
    neurons, activation = cumulative_share(counts)
    return LayerLocality(layer=layer, sparsity=sparsity(counts, tokens), hot=skew(counts),
                         neurons_for={s: neuron_share_for(counts, s) for s in COVERAGE_TARGETS},
                         neuron_share=neurons, activation_share=activation)


def analyse(directory: str | Path) -> Locality:
    """Locality of every layer of a profile directory, recomputed from its activation counts."""
    profile = load_profile(directory)
    n_layer, n_ff = int(profile["model"]["n_layer"]), int(profile["model"]["n_ff"])
    counts = load_activation_counts(directory, n_layer, [n_ff] * n_layer)  # 257 counts for 256 neurons: refused
    tokens = int(profile["tokens"])
    return Locality(profile, [layer_locality(i, c, tokens) for i, c in enumerate(counts)])


def profile_verdict(profile: dict) -> str:
    """The verdict on a profile (profile.json's contents) that `report` gives, from the layers' mean sparsity and
    hottest-10% share: what `profile` ends with."""
    layers = profile["layers"]
    return verdict(profile["model"].get("activation", "relu"), float(np.mean([row["sparsity"] for row in layers])),
                   float(np.mean([row["hot10"] for row in layers])))


def verdict(activation: str, sparsity: float, hot10: float) -> str:
    """What a profile's numbers mean for running the model, in plain words: whether the sparse modes and a GPU
    hot tier can help, and what to do when they cannot."""
    if activation not in ("relu", "relu2", "fatrelu", "drelu"):
        sparse = (f"This {activation.upper()} model has no exact zeros: its {sparsity:.0%} sparsity is what the "
                  "thresholds chosen while profiling cut away, and every point of it costs quality (measure "
                  "perplexity in gate mode first). Run it dense, or make it really sparse with 'pi-tools "
                  "sparsify' (docs/sparsify.md).")
    elif sparsity < ENOUGH_SPARSITY:
        sparse = (f"Only {sparsity:.0%} of the FFN neurons are inactive for a token: the sparse modes save less "
                  "than choosing the active ones costs here, so run it dense ('auto' decides per layer).")
    else:
        sparse = (f"{sparsity:.0%} of the FFN neurons are inactive for a token: the sparse modes (gate, predictor, "
                  "auto) skip that share of the FFN's weights.")
    if hot10 < ENOUGH_HOT10:
        local = (f"Almost no locality: the hottest 10% of neurons serve {hot10:.0%} of activations (10% would be "
                 "none), so a GPU hot tier serves little more than its share of the neurons.")
    else:
        local = (f"The hottest 10% of neurons serve {hot10:.0%} of activations: a GPU hot tier of that size takes "
                 "that share of the FFN's work.")
    return f"{sparse} {local}"
