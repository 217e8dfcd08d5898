"""ProSparse-Llama2 (`model_type: sparsellama`): Llama-2 whose FFN activation is FATReLU, the gate's value
where it exceeds a small threshold t (`hidden_act_param`, 0.01 in the released 7B/13B) and 0 elsewhere.

transformers has no such class and we never run remote code: the checkpoint (Llama tensor names) loads
into Llama's class built with ReLU, and `prepare` swaps each MLP's activation for FATReLU. Files carry
`ffn_activation = fatrelu` and t in every layer's activation threshold, which our engine applies;
PowerInfer runs these models as plain ReLU (neurons with 0 < gate <= t count as active there).
"""
from __future__ import annotations

import copy

import torch

from powerinfer_tools.models.arch.llama_family import LLAMA_MODEL_TYPES, LlamaFamily, hidden_act

MODEL_TYPE = "sparsellama"


class ProSparse(LlamaFamily):
    name = "prosparse"
    description = "ProSparse-Llama2 (FATReLU: the gate where it exceeds a threshold)"
    activation = "fatrelu"

    @classmethod
    def matches(cls, config) -> bool:
        return config.model_type in LLAMA_MODEL_TYPES + (MODEL_TYPE,) and hidden_act(config) == "fatrelu"

    @property
    def threshold(self) -> float:
        return float(getattr(self.config, "hidden_act_param", 0.0) or 0.0)

    def rule_thresholds(self) -> list[float]:
        return [self.threshold] * self.dims().n_layer

    def build_config(self):
        config = copy.deepcopy(self.config)
        config.hidden_act = "relu"  # the class's own activation, replaced in prepare
        return config

    def model_class(self):
        from transformers import LlamaForCausalLM
        return LlamaForCausalLM

    def prepare(self, model) -> None:
        for layer in self.layers(model):  # FATReLU is torch's Threshold: x where x > t, else 0
            if not isinstance(layer.mlp.act_fn, torch.nn.Threshold):
                layer.mlp.act_fn = torch.nn.Threshold(self.threshold, 0.0)
