"""What every architecture adapter says: where the FFN lives, how its activation is defined, and
which tensor PowerInfer feeds the predictor.

Profiling, sparsified evaluation and the converter go through these two hook points only:
  * the *predictor input* of layer i (PowerInfer's convention for the architecture), and
  * the *activation module* of layer i, whose output is the per-neuron activation a[..., n_ff]
    that multiplies (gated FFN) or is (plain FFN) the input of the down projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ACTIVE_IF_NONZERO = ("relu", "drelu")


@dataclass(frozen=True)
class Dims:
    n_layer: int
    n_embd: int
    n_ff: int


class Arch:
    """Base adapter. Subclasses set the class attributes and the module accessors."""

    name: str = ""            # our id, e.g. "llama-relu"
    gguf_arch: str = ""       # architecture name in PowerInfer GGUF files
    description: str = ""
    gated: bool = True        # FFN has a gate projection

    def __init__(self, config):
        self.config = config

    # ---- identity -------------------------------------------------------------------------------
    @classmethod
    def matches(cls, config) -> bool:
        raise NotImplementedError

    @property
    def activation(self) -> str:
        """'relu', 'drelu' (exact zeros) or 'silu' / 'gelu' (sparsified by a calibrated threshold)."""
        raise NotImplementedError

    @property
    def thresholded(self) -> bool:
        """True when 'active' needs a calibrated |a| threshold rather than a != 0."""
        return self.activation not in ACTIVE_IF_NONZERO

    def dims(self) -> Dims:
        raise NotImplementedError

    def model_class(self):
        """The transformers class to load with, or None for AutoModelForCausalLM."""
        return None

    def prepare(self, model) -> None:
        """Adjust a freshly loaded model so that its forward is the architecture's (default: no-op)."""

    # ---- hook points ----------------------------------------------------------------------------
    def layers(self, model) -> list:
        raise NotImplementedError

    def activation_module(self, layer) -> torch.nn.Module:
        raise NotImplementedError

    def predictor_input_module(self, layer) -> torch.nn.Module:
        """Module whose *input* (first argument or hidden_states) is the predictor input."""
        raise NotImplementedError


def install_taps(adapter: Arch, model,
                 on_input: Callable[[int, torch.Tensor], None] | None = None,
                 on_activation: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None):
    """Register hooks; returns handles (call .remove()). on_activation may return a replacement."""
    handles = []
    for i, layer in enumerate(adapter.layers(model)):
        if on_input is not None:
            def pre_hook(module, args, kwargs, i=i):
                x = args[0] if args else kwargs["hidden_states"]
                on_input(i, x)
            handles.append(adapter.predictor_input_module(layer).register_forward_pre_hook(
                pre_hook, with_kwargs=True))
        if on_activation is not None:
            def post_hook(module, args, output, i=i):
                return on_activation(i, output)
            handles.append(adapter.activation_module(layer).register_forward_hook(post_hook))
    return handles


def is_active(adapter: Arch, a: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Boolean mask of active neurons: a != 0 for ReLU-family, |a| > threshold otherwise."""
    if adapter.thresholded:
        return a.abs() > threshold
    return a != 0
