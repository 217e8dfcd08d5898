"""Gemma 3, text only (transformers' Gemma3ForCausalLM, model_type gemma3_text; GELU, thresholded like llama-silu):
Llama's block with a GeGLU FFN (tanh-approximated GELU), NeoX RoPE, heads of their own width (head_dim), per-head
q/k RMSNorms, an RMSNorm after attention and after the FFN besides the two before them, the embedding scaled by
sqrt(hidden_size), scores by query_pre_attn_scalar^-1/2, and five sliding-window layers in six (local: a window of
sliding_window positions, RoPE base rope_local_base_freq) beside global ones (rope_theta, maybe linear scaling).

As llama.cpp's converter does, every RMSNorm weight w is written as 1 + w (Gemma's norm multiplies by 1 + w), so the
engine's RMSNorm computes it; the tensors take gguf-py's MODEL_ARCH.GEMMA3 names. Files name their architecture
gemma3-gelu (docs/formats.md); a user's llama.cpp gemma3 GGUF runs as it is. The ReLU variant (`pi-tools sparsify`'s
output: hidden_activation relu, a = relu(gate x) times up x) is gemma3, which PowerInfer does not know."""
from powerinfer_tools.formats import names
from powerinfer_tools.models.arch.config_fields import GEMMA3_FIELDS
from powerinfer_tools.models.arch.llama_family import BLOCK_TENSORS, LlamaFamily, layer_types_window, rope_parameters

GEMMA3_BLOCK = {**BLOCK_TENSORS, names.ATTN_Q_NORM: "self_attn.q_norm", names.ATTN_K_NORM: "self_attn.k_norm",
                names.POST_ATTENTION_NORM: "post_attention_layernorm", names.FFN_NORM: "pre_feedforward_layernorm",
                names.POST_FFW_NORM: "post_feedforward_layernorm"}
NORMS = ("attn_norm", names.ATTN_Q_NORM, names.ATTN_K_NORM, names.POST_ATTENTION_NORM, names.FFN_NORM,
         names.POST_FFW_NORM, "output_norm")


def plus_one(data):
    return data + 1.0


class Gemma3(LlamaFamily):
    name = "gemma3"
    powerinfer_arch = "gemma3"
    model_type = "gemma3_text"
    description = "Gemma 3 (text) with GELU, thresholded"
    activation = "gelu"
    act_key = "hidden_activation"
    hidden_acts = ("gelu_pytorch_tanh",)
    in_powerinfer = False
    config_fields = GEMMA3_FIELDS
    rope_adjacent = False
    block_tensors = GEMMA3_BLOCK

    def transforms(self) -> dict:
        return dict.fromkeys(NORMS, plus_one)

    def global_rope(self) -> dict:
        return rope_parameters(self.config)["full_attention"]

    def predictor_input_module(self, layer):
        return layer.pre_feedforward_layernorm  # its input: the residual entering the FFN block

    def sliding_window(self) -> int | None:
        return layer_types_window(self.config)

    def write_hparams(self, writer) -> None:
        super().write_hparams(writer)
        c = self.config  # llama.cpp's gemma3 reads neither key: it takes 10000 and 1/sqrt(head_dim) (27B: below)
        writer.add_rope_freq_base_swa(float(rope_parameters(c)["sliding_attention"]["rope_theta"]))
        writer.add_attention_scale(float(c.query_pre_attn_scalar) ** -0.5)


class Gemma3Relu(Gemma3):
    name = "gemma3-relu"
    description = "Gemma 3 (text) with ReLU (pi-tools sparsify)"
    activation = "relu"
    hidden_acts = ("relu",)
