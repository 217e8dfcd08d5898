"""Mixtures of experts (issue 67): Qwen3-MoE, Mixtral (SiLU experts, or ReLU ones: TurboSparse's kind) and OLMoE.
Llama's block with the FFN replaced by a router (a softmax over the experts, each token's top num_experts_per_tok,
their weights divided by their sum where the family does so) and gated experts, written as llama.cpp writes them:
architectures qwen3moe, llama and olmoe (-silu appended for SiLU experts, as for every thresholded file:
docs/formats.md), the router as ffn_gate_inp (kept f32, as llama.cpp's quantizer keeps it), the experts' gate, up and
down stacked into the 3-D ffn_gate_exps, ffn_up_exps and ffn_down_exps, and expert_count, expert_used_count,
expert_feed_forward_length (Qwen3-MoE, whose intermediate_size is a dense MLP's) and expert_weights_norm.

A checkpoint holds its experts one module each (as transformers saves them: mlp.experts.N.gate_proj, Mixtral's
block_sparse_moe.experts.N.w1) or fused (transformers 5's own parameters: mlp.experts.gate_up_proj, the gate's rows
then the up's, and mlp.experts.down_proj): convert reads either.

The experts have no neurons for a neuron profile to count or a predictor to select (yet): the neuron-level stages
refuse these adapters in one line. `profile` of the converted file records the engine's routing instead
(stages/expert_profile.py)."""
from __future__ import annotations

from dataclasses import dataclass

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names
from powerinfer_tools.models.arch.base import Dims, TensorMap
from powerinfer_tools.models.arch.config_fields import MIXTRAL_FIELDS, OLMOE_FIELDS, QWEN3_MOE_FIELDS
from powerinfer_tools.models.arch.llama_family import BLOCK_TENSORS, LlamaFamily

# Llama's block without its dense FFN, which the experts replace
ATTENTION_BLOCK = {k: v for k, v in BLOCK_TENSORS.items() if k not in (names.FFN_GATE, names.FFN_UP, names.FFN_DOWN)}
QK_NORMS = {names.ATTN_Q_NORM: "self_attn.q_norm", names.ATTN_K_NORM: "self_attn.k_norm"}


@dataclass(frozen=True)
class ExpertNames:
    """Where a checkpoint keeps a layer's router and experts, under `model.layers.N.`: the router module; the experts
    one module each (`{module}.experts.{e}.{gate|up|down}`); transformers 5's fused parameters (mlp.experts.*)."""

    router: str
    module: str
    gate: str
    up: str
    down: str


class MoeFamily(LlamaFamily):
    experts = True
    activation = "silu"
    hidden_acts = ("silu", "swish")
    block_tensors = ATTENTION_BLOCK
    expert_names = ExpertNames("mlp.gate", "mlp", "gate_proj", "up_proj", "down_proj")
    expert_ff_key = False  # the experts' width written as expert_feed_forward_length (else as feed_forward_length)

    def n_expert(self) -> int:
        return int(self.config.num_experts)

    def expert_ff(self) -> int:
        return int(self.config.intermediate_size)

    def norm_topk(self) -> bool:
        return bool(self.config.norm_topk_prob)

    def dims(self) -> Dims:
        c = self.config
        return Dims(c.num_hidden_layers, c.hidden_size, self.expert_ff())

    def tensor_maps(self, available):
        maps = super().tensor_maps(available)  # the attention blocks, then output_norm and output
        experts = [m for i in range(self.config.num_hidden_layers) for m in self.expert_maps(i, available)]
        return maps[:-2] + experts + maps[-2:]

    def expert_maps(self, i: int, available) -> list[TensorMap]:
        n, f, x = self.n_expert(), self.expert_ff(), self.expert_names
        layer, blk = f"model.layers.{i}.", f"blk.{i}."
        maps = [TensorMap(f"{blk}{names.FFN_GATE_INP}.weight", f"{layer}{x.router}.weight")]
        fused = f"{layer}mlp.experts."
        if f"{fused}gate_up_proj" in available:
            return maps + [TensorMap(f"{blk}{names.FFN_GATE_EXPS}.weight", f"{fused}gate_up_proj", rows=(0, f)),
                           TensorMap(f"{blk}{names.FFN_UP_EXPS}.weight", f"{fused}gate_up_proj", rows=(f, 2 * f)),
                           TensorMap(f"{blk}{names.FFN_DOWN_EXPS}.weight", f"{fused}down_proj")]
        for ours, part in ((names.FFN_GATE_EXPS, x.gate), (names.FFN_UP_EXPS, x.up), (names.FFN_DOWN_EXPS, x.down)):
            each = tuple(f"{layer}{x.module}.experts.{e}.{part}.weight" for e in range(n))
            maps.append(TensorMap(f"{blk}{ours}.weight", each[0], experts=each))
        return maps

    def write_hparams(self, writer) -> None:
        super().write_hparams(writer)
        writer.add_expert_count(self.n_expert())
        writer.add_expert_used_count(int(self.config.num_experts_per_tok))
        if self.expert_ff_key:
            writer.add_expert_feed_forward_length(self.expert_ff())
        writer.add_expert_weights_norm(self.norm_topk())

    # ---- hook points: experts have no neurons a profile counts (yet) -------------------------------------------
    def _no_neurons(self, *_):
        raise no_neurons(self.name)

    activation_module = predictor_input_module = input_modules = _no_neurons


def no_neurons(name: str) -> UserError:
    """The one-line refusal of a stage that works on FFN neurons (profile, sparsify, predictors, input sparsity, neuron
    bundles)."""
    return UserError(f"{name} is a mixture of experts: profiles, predictors, sparsifying, input sparsity and neuron "
                     "bundles work on the neurons of dense FFNs and are not implemented for experts in this version")


class NeoxMoe(MoeFamily):
    """llama.cpp's NeoX-RoPE mixtures (qwen3moe, olmoe): q/k rows as they are, q and k RMS-normed before RoPE."""

    rope_adjacent = False
    block_tensors = {**ATTENTION_BLOCK, **QK_NORMS}


class Qwen3Moe(NeoxMoe):
    name = "qwen3-moe"
    powerinfer_arch = "qwen3moe"
    model_type = "qwen3_moe"
    description = "Qwen3-MoE (SiLU experts)"
    config_fields = QWEN3_MOE_FIELDS
    expert_ff_key = True

    def expert_ff(self) -> int:
        return int(self.config.moe_intermediate_size)


class Mixtral(MoeFamily):
    name = "mixtral"
    powerinfer_arch = "llama"
    model_type = "mixtral"
    description = "Mixtral (SiLU experts, top-k renormalised)"
    config_fields = MIXTRAL_FIELDS
    expert_names = ExpertNames("block_sparse_moe.gate", "block_sparse_moe", "w1", "w3", "w2")

    def n_expert(self) -> int:
        return int(self.config.num_local_experts)

    def norm_topk(self) -> bool:
        return True

    def expert_maps(self, i: int, available) -> list[TensorMap]:
        """Saved checkpoints name the router block_sparse_moe.gate; transformers 5's own parameters mlp.gate."""
        maps = super().expert_maps(i, available)
        legacy = f"model.layers.{i}.{self.expert_names.router}.weight"
        return maps if legacy in available else [TensorMap(maps[0].name, f"model.layers.{i}.mlp.gate.weight"),
                                                 *maps[1:]]


class MixtralRelu(Mixtral):
    name = "mixtral-relu"
    description = "Mixtral with ReLU experts (TurboSparse's kind), computed gate first"
    activation = "relu"
    hidden_acts = ("relu",)


class Olmoe(NeoxMoe):
    name = "olmoe"
    powerinfer_arch = "olmoe"
    model_type = "olmoe"
    description = "OLMoE (SiLU experts; q and k RMS-normed over the whole projection)"
    config_fields = OLMOE_FIELDS
