"""Bamboo (Mistral layout with dReLU): a = relu(gate x) * relu(up x), as PowerInfer's `bamboo` arch.

transformers has no Bamboo class, and we never run remote code: the checkpoint loads into Mistral's
class and `prepare` swaps each MLP's forward for the dReLU one.
"""
from __future__ import annotations

import types

import torch

from powerinfer_tools.models.arch.llama_family import LlamaFamily, is_bamboo


def _drelu_forward(self, x):
    return self.down_proj(self.act_tap(torch.relu(self.gate_proj(x)) * torch.relu(self.up_proj(x))))


class Bamboo(LlamaFamily):
    name = "bamboo"
    powerinfer_arch = "bamboo"
    description = "Bamboo / Mistral with dReLU"
    activation = "drelu"

    @classmethod
    def matches(cls, config) -> bool:
        return is_bamboo(config)

    def model_class(self):
        from transformers import MistralForCausalLM
        return MistralForCausalLM

    def prepare(self, model) -> None:
        for layer in self.layers(model):
            mlp = layer.mlp
            if not hasattr(mlp, "act_tap"):
                mlp.act_tap = torch.nn.Identity()
                mlp.forward = types.MethodType(_drelu_forward, mlp)

    def activation_module(self, layer):
        return layer.mlp.act_tap
