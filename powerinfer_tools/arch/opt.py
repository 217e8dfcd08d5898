"""OPT: pre-LN decoder, plain ReLU FFN with biases (fc1/fc2 directly on the layer); the predictor
input is the residual after attention (input of final_layer_norm)."""
from __future__ import annotations

from powerinfer_tools.arch.base import Arch, Dims


class Opt(Arch):
    name = "opt"
    gguf_arch = "opt"
    description = "OPT (ReLU)"
    gated = False

    @classmethod
    def matches(cls, config) -> bool:
        return config.model_type == "opt"

    @property
    def activation(self) -> str:
        act = str(getattr(self.config, "activation_function", "relu")).lower()
        return "relu" if act == "relu" else "gelu"

    def dims(self) -> Dims:
        c = self.config
        return Dims(c.num_hidden_layers, c.hidden_size, c.ffn_dim)

    def layers(self, model):
        return list(model.model.decoder.layers)

    def activation_module(self, layer):
        return layer.activation_fn

    def predictor_input_module(self, layer):
        return layer.final_layer_norm
