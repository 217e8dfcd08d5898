"""Shared parts of the Llama-family adapters (Llama, Mistral, Bamboo): gated FFN in `layer.mlp`,
predictor input = the residual entering the FFN block (input of post_attention_layernorm)."""
from __future__ import annotations

from powerinfer_tools.arch.base import Arch, Dims

LLAMA_MODEL_TYPES = ("llama", "mistral")


class LlamaFamily(Arch):
    gguf_arch = "llama"
    gated = True

    def dims(self) -> Dims:
        c = self.config
        return Dims(c.num_hidden_layers, c.hidden_size, c.intermediate_size)

    def layers(self, model):
        return list(model.model.layers)

    def activation_module(self, layer):
        return layer.mlp.act_fn

    def predictor_input_module(self, layer):
        return layer.post_attention_layernorm


def hidden_act(config) -> str:
    return str(getattr(config, "hidden_act", "")).lower()


def is_bamboo(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return config.model_type == "bamboo" or any("bamboo" in a.lower() for a in archs)
