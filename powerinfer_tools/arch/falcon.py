"""Falcon (Falcon-40B's new decoder architecture and the older 7B layout): plain FFN
a = act(dense_h_to_4h x); PowerInfer feeds Falcon's predictor the layer input."""
from __future__ import annotations

from powerinfer_tools.arch.base import Arch, Dims

FALCON_MODEL_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")


class Falcon(Arch):
    name = "falcon"
    gguf_arch = "falcon"
    description = "Falcon (new decoder architecture as Falcon-40B, or 7B layout), ReLU-fied"
    gated = False

    @classmethod
    def matches(cls, config) -> bool:
        return config.model_type in FALCON_MODEL_TYPES

    @property
    def activation(self) -> str:
        act = str(getattr(self.config, "activation", "gelu")).lower()
        return "relu" if act == "relu" else "gelu"

    def dims(self) -> Dims:
        c = self.config
        n_ff = getattr(c, "ffn_hidden_size", None) or 4 * c.hidden_size
        return Dims(c.num_hidden_layers, c.hidden_size, n_ff)

    def layers(self, model):
        return list(model.transformer.h)

    def activation_module(self, layer):
        return layer.mlp.act

    def predictor_input_module(self, layer):
        return layer
