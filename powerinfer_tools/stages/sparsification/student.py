"""The student's activation (`--activation`): what replaces SiLU, what the L1 penalty acts on, and the form the
result is written in.

- relu: ReLU on the gate, the gated form kept: h = relu(gate x) * (up x). A neuron is inactive when its gate is
  <= 0; the penalty acts on relu(gate x). Written as a ReLU Llama (or ProSparse's FATReLU after the shift).
- drelu: TurboSparse's dReLU (arXiv:2406.05955), ReLU on both: h = relu(gate x) * relu(up x). A neuron is
  inactive when either is <= 0. The penalty acts on the product h itself, the value the engine tests for zero:
  its gradient reaches both projections (d/d gate = relu(up), d/d up = relu(gate)) and only on active neurons,
  so it pushes hardest on the smaller factor, the cheapest to bring to zero, and leaves neurons that one factor
  already switches off alone (a penalty on relu(gate) + relu(up) would keep pushing there, against the fit).
  Written in the Bamboo form (`model_type: bamboo`, Mistral's layout), which every stage and PowerInfer's
  `bamboo` architecture read; that form has no threshold, so the threshold shift does not apply.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from powerinfer_tools.models.arch.bamboo import Bamboo
from powerinfer_tools.stages import threshold_shift

ACTIVATIONS = ("relu", "drelu")


@dataclass(frozen=True)
class StudentForm:
    activation: str   # one of ACTIVATIONS

    @property
    def shifts(self) -> bool:
        """Whether the FATReLU threshold shift applies: only ReLU has a threshold form the files carry."""
        return self.activation == "relu"

    def ffn(self, mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, h) of a gated FFN on x: a the penalised activation (the one the model's taps see), h the down
        projection's input."""
        gate = F.relu(mlp.gate_proj(x))
        if self.activation == "drelu":
            h = gate * F.relu(mlp.up_proj(x))
            return h, h
        return gate, gate * mlp.up_proj(x)

    @torch.no_grad()
    def baseline(self, mlp, x: torch.Tensor) -> tuple[float, float]:
        """(scale, sparsity) of the original SiLU FFN `mlp` on x: the mean magnitude of its counterpart of the
        penalised activation (silu(gate x), times up x for dReLU), which makes all layers' L1 terms comparable,
        and the share of zeros a plain swap to this activation gives."""
        silu = F.silu(mlp.gate_proj(x))
        original = silu * mlp.up_proj(x) if self.activation == "drelu" else silu
        return float(original.abs().mean()) or 1.0, float((self.ffn(mlp, x)[0] == 0).float().mean())

    def make(self, teacher, adapter):
        """(student, its adapter): a trainable float copy of the teacher with this activation. A model read from
        a GGUF file carries transformers' GGUF quantizer (its weights already dequantized at load): the copy
        drops it, so that it is saved as the plain float checkpoint it is."""
        student = copy.deepcopy(teacher)
        student.hf_quantizer = None
        student.is_quantized = False
        if hasattr(student.config, "quantization_config"):
            del student.config.quantization_config
        student.config.hidden_act = "relu"
        for p in student.parameters():
            p.requires_grad_(True)  # the teacher's are frozen
        if self.activation == "drelu":
            student_adapter = Bamboo(student.config)
            student_adapter.prepare(student)   # each MLP's forward: relu(gate x) * relu(up x), tapped
            return student, student_adapter
        threshold_shift.set_threshold(adapter, student, 0.0)  # ReLU on every gate
        return student, adapter

    def config_fields(self, threshold: float) -> dict:
        """What config.json says of this form: ReLU (threshold 0), FATReLU at `threshold`, or Bamboo's
        (`model_type: bamboo` as Bamboo's own checkpoints and PowerInfer's convert.py have it, every position
        attended to: no sliding window)."""
        if self.activation == "drelu":
            return {"model_type": "bamboo", "architectures": ["BambooForCausalLM"], "hidden_act": "relu",
                    "sliding_window": None}
        if threshold > 0:
            return {"hidden_act": "fatrelu", "hidden_act_param": threshold}
        return {"hidden_act": "relu"}
