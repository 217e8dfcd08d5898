"""Phi-3 and Phi-4 (transformers' Phi3ForCausalLM; SiLU, thresholded like llama-silu): Llama's block with NeoX RoPE
over the first partial_rotary_factor of each head (Phi-4-mini: 0.75), q/k/v fused in qkv_proj and gate/up in
gate_up_proj (gate rows first). The file splits them into llama.cpp's attn_q/attn_k/attn_v and ffn_gate/ffn_up, the
tensors every stage (tiers, predictor, input sparsity) reads; the engine also runs a user's llama.cpp phi3 GGUF,
whose attn_qkv and fused ffn_up it reads as row views. Files name their architecture phi3-silu (docs/formats.md); the
ReLU variant's (`pi-tools sparsify`'s output) is phi3, which PowerInfer does not know."""
from powerinfer_tools.formats import names
from powerinfer_tools.models.arch.config_fields import PHI3_FIELDS
from powerinfer_tools.models.arch.llama_family import BLOCK_TENSORS, LlamaFamily, head_dim, kv_heads

FUSED = {"attn_q": "self_attn.qkv_proj", "attn_k": "self_attn.qkv_proj", "attn_v": "self_attn.qkv_proj",
         "ffn_gate": "mlp.gate_up_proj", "ffn_up": "mlp.gate_up_proj"}


class Phi3(LlamaFamily):
    name = "phi3"
    powerinfer_arch = "phi3"
    model_type = "phi3"
    description = "Phi-3/Phi-4 with SiLU, thresholded"
    activation = "silu"
    hidden_acts = ("silu", "swish")
    act_attr = "activation_fn"
    in_powerinfer = False
    config_fields = PHI3_FIELDS
    rope_adjacent = False
    block_tensors = {**BLOCK_TENSORS, **FUSED}

    def source_rows(self, tensor: str) -> tuple[int, int] | None:
        c = self.config
        q, kv, ff = c.num_attention_heads * head_dim(c), kv_heads(c) * head_dim(c), c.intermediate_size
        return {"attn_q": (0, q), "attn_k": (q, q + kv), "attn_v": (q + kv, q + 2 * kv),
                "ffn_gate": (0, ff), "ffn_up": (ff, 2 * ff)}.get(tensor)

    def gate_up(self, mlp, x):
        return mlp.gate_up_proj(x).chunk(2, dim=-1)

    def input_modules(self, layer):
        a, m = layer.self_attn, layer.mlp
        return dict(zip(names.INPUT_SITES, ([a.qkv_proj], [a.o_proj], [m.gate_up_proj], [m.down_proj])))


class Phi3Relu(Phi3):
    name = "phi3-relu"
    description = "Phi-3/Phi-4 with ReLU (pi-tools sparsify)"
    activation = "relu"
    hidden_acts = ("relu",)
