"""The student's activation (`--activation`): what replaces SiLU (GELU: Gemma 3), what the L1 penalty acts on, and the
form the result is written in. The gate and up projections and the activation module are the family adapter's
(llama_family.py: Phi-3's are fused, Gemma 3's config names its activation hidden_activation).

- relu: ReLU on the gate, the gated form kept: h = relu(gate x) * (up x). A neuron is inactive when its gate is
  <= 0; the penalty acts on relu(gate x). Written as the source's family with ReLU (a ReLU Llama, or ProSparse's
  FATReLU after the shift, which has a Llama's form only; Qwen2, Qwen3, Phi-3 and Gemma 3 stay plain ReLU).
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
from powerinfer_tools.models.arch.llama_family import LlamaFamily
from powerinfer_tools.stages.sparsification import threshold_shift

ACTIVATIONS = ("relu", "drelu")


@dataclass(frozen=True)
class StudentForm:
    activation: str        # one of ACTIVATIONS
    adapter: LlamaFamily   # the teacher's

    @property
    def unshifted(self) -> str | None:
        """Why the FATReLU threshold shift does not apply to this form, or None where it does: only ReLU has a
        threshold form the files carry, ProSparse's, which is a Llama's."""
        if self.activation == "drelu":
            return "dReLU: the Bamboo form carries no threshold"
        if self.adapter.powerinfer_arch != "llama":
            return f"{self.adapter.name}: the FATReLU form (ProSparse's) is a Llama's; the model stays plain ReLU"
        return None

    @property
    def shifts(self) -> bool:
        return self.unshifted is None

    def ffn(self, mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, h) of a gated FFN on x: a the penalised activation (the one the model's taps see), h the down
        projection's input."""
        gate, up = self.adapter.gate_up(mlp, x)
        gate = F.relu(gate)
        if self.activation == "drelu":
            h = gate * F.relu(up)
            return h, h
        return gate, gate * up

    @torch.no_grad()
    def baseline(self, mlp, x: torch.Tensor) -> tuple[float, float]:
        """(scale, sparsity) of the original FFN `mlp` on x: the mean magnitude of its counterpart of the
        penalised activation (act(gate x), times up x for dReLU), which makes all layers' L1 terms comparable,
        and the share of zeros a plain swap to this activation gives."""
        gate, up = self.adapter.gate_up(mlp, x)
        act = getattr(mlp, self.adapter.act_attr)(gate)
        original = act * up if self.activation == "drelu" else act
        return float(original.abs().mean()) or 1.0, float((self.ffn(mlp, x)[0] == 0).float().mean())

    def make(self, teacher):
        """(student, its adapter): a trainable float copy of the teacher with this activation. A model read from
        a GGUF file carries transformers' GGUF quantizer (its weights already dequantized at load): the copy
        drops it, so that it is saved as the plain float checkpoint it is."""
        student = copy.deepcopy(teacher)
        student.hf_quantizer = None
        student.is_quantized = False
        if hasattr(student.config, "quantization_config"):
            del student.config.quantization_config
        setattr(student.config, self.adapter.act_key, "relu")
        for p in student.parameters():
            p.requires_grad_(True)  # the teacher's are frozen
        if self.activation == "drelu":
            student_adapter = Bamboo(student.config)
            student_adapter.prepare(student)   # each MLP's forward: relu(gate x) * relu(up x), tapped
            return student, student_adapter
        threshold_shift.set_threshold(self.adapter, student, 0.0)  # ReLU on every gate
        return student, self.adapter

    def config_fields(self, threshold: float) -> dict:
        """What config.json says of this form: ReLU (threshold 0), FATReLU at `threshold`, or Bamboo's
        (`model_type: bamboo` as Bamboo's own checkpoints and PowerInfer's convert.py have it, every position
        attended to: no sliding window)."""
        if self.activation == "drelu":
            return {"model_type": "bamboo", "architectures": ["BambooForCausalLM"], "hidden_act": "relu",
                    "sliding_window": None}
        if threshold > 0:
            return {"hidden_act": "fatrelu", "hidden_act_param": threshold}
        return {self.adapter.act_key: "relu"}
