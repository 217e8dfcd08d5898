"""Reference perplexity in transformers, dense or sparsified by per-layer activation thresholds.

This is what the engine's perplexity is compared with, and how a sparsity target's quality cost is
measured before converting anything.
"""
from __future__ import annotations

import math

import torch

from powerinfer_tools.core.progress import progress_bar
from powerinfer_tools.models import arch as arch_mod


@torch.no_grad()
def perplexity(model, adapter, seqs: torch.Tensor, thresholds: list[float] | None = None, batch: int = 4,
               inactive: torch.Tensor | None = None) -> float:
    """exp(mean NLL) over non-overlapping windows `seqs` [n, L], every token but each window's first
    predicted; with `thresholds`, activations with |a| <= t are zeroed (the sparse engine's rule). `inactive`
    (one value per layer), if given, gets each layer's count of inactive activations added to it."""
    handles = []
    if thresholds is not None or inactive is not None:
        def sparsify(i, a):
            active = arch_mod.is_active(adapter, a, thresholds[i] if thresholds is not None else 0.0)
            if inactive is not None:
                inactive[i] += float(active.numel() - active.sum())
            return a * active if thresholds is not None else None
        handles = arch_mod.install_taps(adapter, model, on_activation=sparsify)
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    try:
        for start in progress_bar(range(0, len(seqs), batch), desc="perplexity", unit="batch", leave=False):
            ids = seqs[start:start + batch].to(device)
            logits = model(input_ids=ids, use_cache=False).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
            nll += float(loss)
            count += ids[:, 1:].numel()
    finally:
        for h in handles:
            h.remove()
    return math.exp(nll / count)


def perplexity_and_sparsity(model, adapter, seqs: torch.Tensor, batch: int) -> tuple[float, list[float]]:
    """(perplexity over `seqs`, each layer's share of exact-zero FFN activations on them), in one pass."""
    dims = adapter.dims()
    inactive = torch.zeros(dims.n_layer, dtype=torch.float64)
    model.eval()
    ppl = perplexity(model, adapter, seqs, batch=batch, inactive=inactive)
    return ppl, (inactive / (seqs.numel() * dims.n_ff)).tolist()
