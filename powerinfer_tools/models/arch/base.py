"""What every architecture adapter says: where the FFN lives, how its activation is defined, and
which tensor PowerInfer feeds the predictor.

Profiling, sparsified evaluation and the converter go through these two hook points only:
  * the *predictor input* of layer i (PowerInfer's convention for the architecture), and
  * the *activation module* of layer i, whose output is the per-neuron activation a[..., n_ff]
    that multiplies (gated FFN) or is (plain FFN) the input of the down projection.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from powerinfer_tools.formats import gguf_io
from powerinfer_tools.models.arch.config_fields import Field

ACTIVE_IF_NONZERO = ("relu", "drelu", "fatrelu")


@dataclass(frozen=True)
class Dims:
    n_layer: int
    n_embd: int
    n_ff: int


@dataclass(frozen=True)
class TensorMap:
    """One tensor of the PowerInfer file and how it is made from a Hugging Face tensor.

    `rows` takes rows [start, stop) of the source first (one part of a fused tensor: Phi-3's qkv_proj, gate_up_proj;
    of each matrix of a 3-D one: transformers 5's experts.gate_up_proj);
    `reorder` permutes rows (shape unchanged: llama q/k rope order, Falcon's fused QKV);
    `transpose` stores the matrix transposed (`ffn_down_t`: row j = neuron j's output vector);
    `experts` names one source per expert (`source` is the first), stacked in order into llama.cpp's 3-D expert
    tensor (ffn_gate_exps: expert e's matrix at [e]).
    """

    name: str
    source: str
    reorder: Callable[[np.ndarray], np.ndarray] | None = None
    transpose: bool = False
    rows: tuple[int, int] | None = None
    experts: tuple[str, ...] = ()

    def sources(self) -> tuple[str, ...]:
        return self.experts or (self.source,)

    def apply(self, data: np.ndarray) -> np.ndarray:
        """The file's layout of `data`; a transposed *view* (the encoder copies it row block by block)."""
        if self.rows is not None:
            data = data[..., self.rows[0]:self.rows[1], :] if data.ndim > 1 else data[self.rows[0]:self.rows[1]]
        if self.reorder is not None:
            data = self.reorder(data)
        data = data.T if self.transpose else data
        return np.ascontiguousarray(data) if data.ndim > 2 else data  # the encoder reads 2-D views only

    def stacked(self, parts: list[np.ndarray]) -> np.ndarray:
        """The file's tensor from its sources' data, in sources() order."""
        return np.stack([self.apply(p) for p in parts]) if self.experts else self.apply(parts[0])

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The file's shape from its (first) source's."""
        if self.rows is not None:
            shape = (*shape[:-2], self.rows[1] - self.rows[0], shape[-1]) if len(shape) > 1 else \
                (self.rows[1] - self.rows[0],)
        shape = tuple(reversed(shape)) if self.transpose else tuple(shape)
        return (len(self.experts), *shape) if self.experts else shape


def optional_maps(available: Collection[str], pairs) -> list[TensorMap]:
    """TensorMaps for (file name, source name) pairs whose source exists (biases, optional norms)."""
    return [TensorMap(name, source) for name, source in pairs if source in available]


def rope_theta(config, default: float = 10000.0) -> float:
    """RoPE base frequency, from transformers 5's `rope_parameters` or the older `rope_theta`."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or default)


class Arch:
    """Base adapter. Subclasses set the class attributes and the module accessors."""

    name: str = ""            # our id, e.g. "llama-relu"
    powerinfer_arch: str = ""  # PowerInfer's name for the architecture (llama, bamboo, falcon, opt), else llama.cpp's
    in_powerinfer: bool = True  # PowerInfer's loader knows the architecture (not llama.cpp's later qwen2, phi3, ...)
    description: str = ""
    gated: bool = True        # FFN has a gate projection
    experts: bool = False     # a mixture of experts (moe.py): its FFN is experts, not neurons a profile counts
    config_fields: tuple[Field, ...] = ()  # the config fields that change the computation (config_fields.py)

    def __init__(self, config):
        self.config = config

    # ---- identity -------------------------------------------------------------------------------
    @classmethod
    def matches(cls, config) -> bool:
        raise NotImplementedError

    @property
    def activation(self) -> str:
        """'relu', 'drelu', 'fatrelu' (exact zeros) or 'silu' / 'gelu' (sparsified by a calibrated threshold)."""
        raise NotImplementedError

    @property
    def thresholded(self) -> bool:
        """True when 'active' needs a calibrated |a| threshold rather than a != 0."""
        return self.activation not in ACTIVE_IF_NONZERO

    @property
    def gguf_arch(self) -> str:
        """The file's general.architecture: PowerInfer's name, with the activation appended for a thresholded
        model (llama-silu): PowerInfer's sparse FFN computes ReLU only, and refuses an unknown architecture."""
        return gguf_io.thresholded_arch(self.powerinfer_arch, self.activation) if self.thresholded \
            else self.powerinfer_arch

    @property
    def powerinfer_runs(self) -> bool:
        """Whether PowerInfer runs the converted file: it knows the architecture and its sparse FFN, which computes
        ReLU only, is the model's (convert keeps such files compatible with it: docs/formats.md)."""
        return self.in_powerinfer and not self.thresholded

    def dims(self) -> Dims:
        raise NotImplementedError

    def model_class(self):
        """The transformers class to load with, or None for AutoModelForCausalLM."""
        return None

    def build_config(self):
        """The config to build that class with (an activation transformers lacks is swapped in by `prepare`)."""
        return self.config

    def rule_thresholds(self) -> list[float]:
        """Per layer, the threshold of a ReLU-family model's own rule, which its files carry: 0 (ReLU, dReLU)
        but for FATReLU. Thresholded models' thresholds are calibrated by a profile instead."""
        return [0.0] * self.dims().n_layer

    def prepare(self, model) -> None:
        """Adjust a freshly loaded model so that its forward is the architecture's (default: no-op)."""

    # ---- conversion to a PowerInfer GGUF ----------------------------------------------------------
    def tensor_maps(self, available: Collection[str]) -> list[TensorMap]:
        """The file's model tensors in write order; `available` = the source's tensor names, which
        decide optional tensors (biases, a second layer norm) and whether the output head is tied."""
        raise NotImplementedError

    def write_hparams(self, writer) -> None:
        """Write the `{arch}.*` hyperparameters PowerInfer's loader reads (gguf.GGUFWriter)."""
        raise NotImplementedError

    def computed_tensors(self) -> dict[str, np.ndarray]:
        """Tensors made from the config rather than the checkpoint (llama3 RoPE's rope_freqs), as f32 arrays."""
        return {}

    # ---- hook points ----------------------------------------------------------------------------
    def layers(self, model) -> list:
        raise NotImplementedError

    def activation_module(self, layer) -> torch.nn.Module:
        raise NotImplementedError

    def predictor_input_module(self, layer) -> torch.nn.Module:
        """Module whose *input* (first argument or hidden_states) is the predictor input."""
        raise NotImplementedError

    def input_modules(self, layer) -> dict[str, list[torch.nn.Module]]:
        """The layer's linear modules by the input they share, keyed by names.INPUT_SITES (q/k/v, the attention
        output projection, gate/up, down): what input sparsity (stages/profiling/input_sparsity.py) zeroes the small
        inputs of, one threshold per key."""
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
