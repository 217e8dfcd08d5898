"""OPT: pre-LN decoder, plain ReLU FFN with biases (fc1/fc2 directly on the layer); the predictor
input is the residual after attention (input of final_layer_norm)."""
from __future__ import annotations

from powerinfer_tools.models.arch.base import Arch, Dims, TensorMap
from powerinfer_tools.models.arch.config_fields import OPT_FIELDS
from powerinfer_tools.formats import names

# llama.cpp block tensor -> OPT module inside `model.decoder.layers.N.` (each has weight and bias)
BLOCK_TENSORS = {
    "attn_norm": "self_attn_layer_norm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj", "ffn_norm": "final_layer_norm",
    "ffn_up": "fc1", names.FFN_DOWN_T: "fc2",
}


class Opt(Arch):
    name = "opt"
    powerinfer_arch = "opt"
    description = "OPT (ReLU)"
    gated = False
    config_fields = OPT_FIELDS  # pre-LayerNorm, no embedding projection: OPT-125m, 1.3b and larger but 350m

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

    def input_modules(self, layer):
        a = layer.self_attn
        return dict(zip(names.INPUT_SITES, ([a.q_proj, a.k_proj, a.v_proj], [a.out_proj], [layer.fc1], [layer.fc2])))

    def tensor_maps(self, available):
        """No `output.weight`: PowerInfer's OPT loader uses `token_embd` as the head (OPT ties them) and
        rejects a file with tensors it does not create. `position_embd` keeps OPT's 2 offset rows."""
        c = self.config
        d = "model.decoder."
        maps = [TensorMap("token_embd.weight", f"{d}embed_tokens.weight"),
                TensorMap("position_embd.weight", f"{d}embed_positions.weight")]
        for i in range(c.num_hidden_layers):
            for ours, theirs in BLOCK_TENSORS.items():
                src = f"{d}layers.{i}.{theirs}"
                maps += [TensorMap(f"blk.{i}.{ours}.weight", f"{src}.weight", transpose=ours == names.FFN_DOWN_T),
                         TensorMap(f"blk.{i}.{ours}.bias", f"{src}.bias")]
        return maps + [TensorMap("output_norm.weight", f"{d}final_layer_norm.weight"),
                       TensorMap("output_norm.bias", f"{d}final_layer_norm.bias")]

    def write_hparams(self, writer) -> None:
        c = self.config
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_block_count(c.num_hidden_layers)
        writer.add_feed_forward_length(c.ffn_dim)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(c.num_attention_heads)
        writer.add_layer_norm_eps(1e-5)  # transformers' OPT uses nn.LayerNorm's default
