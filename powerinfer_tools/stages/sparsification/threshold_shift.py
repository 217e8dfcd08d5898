"""Activation threshold shifting: the last step of sparsify, ReLU's cut-off raised from 0 to a calibrated t.

A trained ReLU model still has many small positive activations that add little to the FFN's output. FATReLU
(ProSparse, arXiv:2402.13516) zeroes every activation <= t; the largest t whose perplexity stays within a
relative budget of the ReLU model's buys extra exact zeros, and so fewer rows to read, almost for free. One t
for every layer, as ProSparse's checkpoints carry it (`hidden_act: fatrelu`, `hidden_act_param: t`), so the
result is the ProSparse form that every stage already reads (arch/prosparse.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from powerinfer_tools.runtime import evaluate

GRID_OCTAVES = 12     # candidates t = top / 2**k, k = GRID_OCTAVES..0, tried from the smallest up
REFINE_STEPS = 3      # then bisection (geometric) between the last accepted and the first refused t


@dataclass
class Shift:
    threshold: float          # 0.0: no t kept the budget; the model stays plain ReLU
    perplexity_relu: float
    perplexity_shifted: float
    sparsity_relu: float
    sparsity_shifted: float
    tried: list[tuple[float, float, float]]  # (t, perplexity, sparsity) of every candidate, in search order


def set_threshold(adapter, model, t: float) -> None:
    """Every layer's gate activation: ReLU (t = 0) or FATReLU at t (torch's Threshold: x where x > t, else 0)."""
    for layer in adapter.layers(model):
        adapter.set_activation(layer, torch.nn.Threshold(t, 0.0) if t > 0 else torch.nn.ReLU())


def _measure(model, adapter, seqs: torch.Tensor, batch: int, t: float) -> tuple[float, float]:
    """(perplexity, mean share of exact-zero activations) with every layer cut at t."""
    set_threshold(adapter, model, t)
    ppl, sparsity = evaluate.perplexity_and_sparsity(model, adapter, seqs, batch)
    return ppl, sum(sparsity) / len(sparsity)


@torch.no_grad()
def _top_activation(model, adapter, seqs: torch.Tensor) -> float:
    """The median positive activation on a few rows: a cut there would halve the active neurons, far beyond
    any budget, so it bounds the search from above."""
    from powerinfer_tools.models import arch as arch_mod

    set_threshold(adapter, model, 0.0)
    samples: list[torch.Tensor] = []

    def keep(i, a):
        positive = a[a > 0].float()
        samples.append(positive[torch.randperm(len(positive), generator=torch.Generator().manual_seed(i))[:4096]])

    handles = arch_mod.install_taps(adapter, model, on_activation=keep)
    try:
        model(input_ids=seqs[:1].to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return float(torch.cat(samples).median())


def calibrate(model, adapter, seqs: torch.Tensor, budget: float, batch: int) -> Shift:
    """The largest t (searched on a geometric grid, then refined) with perplexity(t) <= (1 + budget) x
    perplexity(ReLU) on `seqs`, which must not be the text the result is evaluated on. Leaves the model cut
    at the chosen t."""
    base_ppl, base_sparsity = _measure(model, adapter, seqs, batch, 0.0)
    limit = base_ppl * (1.0 + budget)
    tried: list[tuple[float, float, float]] = []
    best = (0.0, base_ppl, base_sparsity)
    refused = None
    if budget > 0:
        top = _top_activation(model, adapter, seqs)
        for k in range(GRID_OCTAVES, -1, -1):
            t = top / 2 ** k
            ppl, sparsity = _measure(model, adapter, seqs, batch, t)
            tried.append((t, ppl, sparsity))
            if ppl > limit:
                refused = t
                break
            best = (t, ppl, sparsity)
        for _ in range(REFINE_STEPS if refused is not None and best[0] > 0 else 0):
            t = (best[0] * refused) ** 0.5
            ppl, sparsity = _measure(model, adapter, seqs, batch, t)
            tried.append((t, ppl, sparsity))
            if ppl > limit:
                refused = t
            else:
                best = (t, ppl, sparsity)
    set_threshold(adapter, model, best[0])
    return Shift(threshold=best[0], perplexity_relu=base_ppl, perplexity_shifted=best[1],
                 sparsity_relu=base_sparsity, sparsity_shifted=best[2], tried=tried)
