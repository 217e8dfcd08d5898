"""Qwen2/Qwen2.5 and Qwen3 (SiLU, thresholded like llama-silu): Llama's block with NeoX RoPE (llama.cpp's qwen2
and qwen3 rotate pairs i, i + d/2, HF's own order, so q/k rows are written as they are), q/k/v biases (Qwen2;
Qwen3's attention_bias) and, in Qwen3, an RMSNorm of each query and key head before RoPE (attn_q_norm,
attn_k_norm) with heads of their own width (head_dim, not hidden_size / num_attention_heads).

Files name their architecture qwen2-silu / qwen3-silu, as llama-silu (docs/formats.md); a user's llama.cpp qwen2 or
qwen3 GGUF runs as it is. The ReLU variants (`pi-tools sparsify`'s output: hidden_act relu) are qwen2 / qwen3, which
PowerInfer does not know."""
from powerinfer_tools.formats import names
from powerinfer_tools.models.arch.config_fields import QWEN2_FIELDS, QWEN3_FIELDS
from powerinfer_tools.models.arch.llama_family import BLOCK_TENSORS, LlamaFamily, layer_types_window


class Qwen2(LlamaFamily):
    name = "qwen2"
    powerinfer_arch = "qwen2"
    model_type = "qwen2"
    description = "Qwen2/Qwen2.5 with SiLU, thresholded"
    activation = "silu"
    hidden_acts = ("silu", "swish")
    in_powerinfer = False
    config_fields = QWEN2_FIELDS
    rope_adjacent = False

    def sliding_window(self) -> int | None:
        return layer_types_window(self.config)


class Qwen3(Qwen2):
    name = "qwen3"
    powerinfer_arch = "qwen3"
    model_type = "qwen3"
    description = "Qwen3 with SiLU, thresholded"
    config_fields = QWEN3_FIELDS
    block_tensors = {**BLOCK_TENSORS, names.ATTN_Q_NORM: "self_attn.q_norm", names.ATTN_K_NORM: "self_attn.k_norm"}


class Qwen2Relu(Qwen2):
    name = "qwen2-relu"
    description = "Qwen2/Qwen2.5 with ReLU (pi-tools sparsify)"
    activation = "relu"
    hidden_acts = ("relu",)


class Qwen3Relu(Qwen3):
    name = "qwen3-relu"
    description = "Qwen3 with ReLU (pi-tools sparsify)"
    activation = "relu"
    hidden_acts = ("relu",)
