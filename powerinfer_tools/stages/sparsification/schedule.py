"""What both training phases share: the rule that steers each layer's L1 weight toward the sparsity wanted
of it, and the seeded data order (a generator per phase, layer and epoch, so a resumed run takes the same rows)."""
from __future__ import annotations

import math

import torch

LAMBDA_RANGE = (1e-6, 1e3)
LAMBDA_GAIN = 0.5     # per step: lambda *= exp(gain * (wanted - measured sparsity))


def steer(lam: float, measured: float, wanted: float) -> float:
    """The L1 weight's next value: up while the layer is less sparse than wanted, down while more."""
    lo, hi = LAMBDA_RANGE
    return min(hi, max(lo, lam * math.exp(LAMBDA_GAIN * (wanted - measured))))


def generator(seed: int, *keys: int) -> torch.Generator:
    g = torch.Generator()
    value = seed
    for key in keys:
        value = value * 1_000_003 + key
    g.manual_seed(value & 0x7FFF_FFFF_FFFF_FFFF)
    return g
