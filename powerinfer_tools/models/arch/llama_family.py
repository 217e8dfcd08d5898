"""Shared parts of the Llama-family adapters (Llama, Mistral, Bamboo, Qwen2, Qwen3): gated FFN in `layer.mlp`,
predictor input = the residual entering the FFN block (input of post_attention_layernorm). A family differs in
data: its block tensors, how its RoPE pairs dimensions, its config table."""
from __future__ import annotations

from functools import partial

import numpy as np

from powerinfer_tools.models.arch.base import Arch, Dims, TensorMap, rope_theta
from powerinfer_tools.models.arch.config_fields import LLAMA_FIELDS
from powerinfer_tools.formats import names

LLAMA_MODEL_TYPES = ("llama", "mistral")

# llama.cpp block tensor -> Hugging Face module inside `model.layers.N.`
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def rope_to_adjacent(data: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder each head's rows from HF's rotate-half RoPE order (pairs i, i+d/2) to the adjacent
    pairs (2i, 2i+1) that llama.cpp's RoPE rotates, as llama.cpp's converter does for q and k."""
    return data.reshape(n_heads, 2, data.shape[0] // n_heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def rope_to_half(data: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of rope_to_adjacent: read a llama.cpp q/k back in HF order."""
    return data.reshape(n_heads, data.shape[0] // n_heads // 2, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def llamacpp_to_hf(name: str, config) -> tuple[str, object]:
    """For a tensor of a llama.cpp GGUF (e.g. the default SmolLM2): the HF tensor name and the
    reorder that brings its data back to the HF layout (None when it is already)."""
    stem, _, suffix = name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}", None
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in BLOCK_TENSORS:
        return "", None
    hf = f"model.layers.{parts[1]}.{BLOCK_TENSORS[parts[2]]}.{suffix}"
    heads = {"attn_q": config.num_attention_heads, "attn_k": kv_heads(config)}.get(parts[2])
    return hf, (partial(rope_to_half, n_heads=heads) if heads else None)


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dims(config) -> int:
    """The dimensions of each head that RoPE rotates, the first ones (partial_rotary_factor: Phi-4-mini's 0.75)."""
    return int(head_dim(config) * float(rope_parameters(config).get("partial_rotary_factor") or 1.0))


def rope_parameters(config) -> dict:
    """transformers 5's standardized RoPE parameters (rope_type, rope_theta, factor, ...) of a config."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def llama3_rope_factors(config) -> np.ndarray:
    """llama3 RoPE scaling as llama.cpp stores it (rope_freqs.weight): per rotated pair, what its frequency is
    divided by. Computed from transformers' own frequencies, default and llama3, so the file's are the class's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return (plain.double() / scaled.double()).float().numpy()


def rope_attention_factor(config, rope_type: str) -> float:
    """What transformers multiplies cos and sin by for a RoPE type (YaRN's, longrope's): its own init function's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return float(ROPE_INIT_FUNCTIONS[rope_type](config)[1])


class LlamaFamily(Arch):
    powerinfer_arch = "llama"
    gated = True
    config_fields = LLAMA_FIELDS
    block_tensors = BLOCK_TENSORS
    # llama.cpp's llama RoPE rotates adjacent pairs (2i, 2i+1), so its q/k rows are permuted from HF's rotate-half
    # order (rope_to_adjacent); NeoX-RoPE families (qwen2, qwen3: pairs i, i + d/2) keep HF's rows
    rope_adjacent = True
    model_type = ""            # the config's model_type of a family matched by it and hidden_acts
    act_key = "hidden_act"     # the config field naming the FFN activation (Gemma 3: hidden_activation)
    hidden_acts: tuple[str, ...] = ()  # its values the adapter matches (families that match by it)
    act_attr = "act_fn"        # the MLP's activation module (Phi-3: activation_fn)

    @classmethod
    def matches(cls, config) -> bool:
        return bool(cls.model_type) and config.model_type == cls.model_type and cls.acts_as(config)

    @classmethod
    def acts_as(cls, config) -> bool:
        """Whether config's activation is one this adapter computes (hidden_acts)."""
        return hidden_act(config, cls.act_key) in cls.hidden_acts

    def dims(self) -> Dims:
        c = self.config
        return Dims(c.num_hidden_layers, c.hidden_size, c.intermediate_size)

    def layers(self, model):
        return list(model.model.layers)

    def activation_module(self, layer):
        return getattr(layer.mlp, self.act_attr)

    def set_activation(self, layer, module) -> None:
        """Replace the layer's FFN activation module (sparsify's ReLU, the threshold shift's FATReLU)."""
        setattr(layer.mlp, self.act_attr, module)

    def gate_up(self, mlp, x):
        """(gate x, up x) of the layer's gated FFN `mlp`, before the activation: what sparsify's student trains."""
        return mlp.gate_proj(x), mlp.up_proj(x)

    def predictor_input_module(self, layer):
        return layer.post_attention_layernorm

    def input_modules(self, layer):
        a, m = layer.self_attn, layer.mlp
        return dict(zip(names.INPUT_SITES, ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj],
                                            [m.down_proj])))

    def transforms(self) -> dict:
        """What a tensor's data goes through on its way into the file, by its llama.cpp name (TensorMap.reorder)."""
        c = self.config
        return {"attn_q": partial(rope_to_adjacent, n_heads=c.num_attention_heads),
                "attn_k": partial(rope_to_adjacent, n_heads=kv_heads(c))} if self.rope_adjacent else {}

    def global_rope(self) -> dict:
        """The RoPE parameters (rope_type, rope_theta, factor, ...) of the layers that attend to the whole context."""
        return rope_parameters(self.config)

    def tensor_maps(self, available):
        c = self.config
        rope = self.transforms()
        maps = [TensorMap("token_embd.weight", "model.embed_tokens.weight")]
        for i in range(c.num_hidden_layers):
            for ours, theirs in self.block_tensors.items():
                src = f"model.layers.{i}.{theirs}"
                name = f"blk.{i}.{names.FFN_DOWN_T if ours == names.FFN_DOWN else ours}"
                rows = self.source_rows(ours)
                maps.append(TensorMap(f"{name}.weight", f"{src}.weight", rope.get(ours), ours == names.FFN_DOWN, rows))
                if f"{src}.bias" in available:  # attention_bias / mlp_bias checkpoints
                    maps.append(TensorMap(f"{name}.bias", f"{src}.bias", rope.get(ours), rows=rows))
        tied = getattr(c, "tie_word_embeddings", False) or "lm_head.weight" not in available
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        return maps + [TensorMap("output_norm.weight", "model.norm.weight", rope.get("output_norm")),
                       TensorMap("output.weight", head)]

    def source_rows(self, tensor: str) -> tuple[int, int] | None:
        """The rows of its source module that block tensor `tensor` is (a fused projection's part), or None: all."""
        return None

    def write_hparams(self, writer) -> None:
        c = self.config
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_block_count(c.num_hidden_layers)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_rope_dimension_count(rotary_dims(c))
        if head_dim(c) != c.hidden_size // c.num_attention_heads:  # heads of their own width (qwen3), as llama.cpp
            writer.add_key_length(head_dim(c))
            writer.add_value_length(head_dim(c))
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(kv_heads(c))
        writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
        rope = self.global_rope()
        writer.add_rope_freq_base(float(rope.get("rope_theta") or rope_theta(c)))
        self.write_rope_scaling(writer, rope)
        window = self.sliding_window()  # the engine runs no context longer than the window
        if rope.get("rope_type") == "dynamic":  # the default frequencies up to max_position_embeddings, not past it
            window = min(window or c.max_position_embeddings, c.max_position_embeddings)
        if window:
            writer.add_sliding_window(window)

    def write_rope_scaling(self, writer, rope: dict) -> None:
        """llama.cpp's rope.scaling.* keys for the RoPE type, which the engine computes it from (csrc/model/model.cpp,
        read_rope_scaling); llama3's and longrope's per-pair factors are computed_tensors."""
        import gguf
        from transformers.modeling_rope_utils import yarn_get_mscale

        kind = rope.get("rope_type")
        if kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
        elif kind == "yarn":  # transformers' factor where the config has none (_compute_yarn_parameters)
            factor = rope.get("factor") or self.config.max_position_embeddings / rope["original_max_position_embeddings"]
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(factor))
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            if rope.get("beta_fast"):
                writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
            if rope.get("beta_slow"):
                writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
            attention = rope_attention_factor(self.config, "yarn")
            if attention != yarn_get_mscale(factor):  # the config's attention_factor, or mscale / mscale_all_dim
                writer.add_rope_scaling_yarn_attn_factor(attention)
        elif kind == "longrope":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            writer.add_rope_scaling_attn_factors(rope_attention_factor(self.config, "longrope"))

    def sliding_window(self) -> int | None:
        """The window of the layers that slide (Mistral: all of them), or None."""
        return getattr(self.config, "sliding_window", None)

    def computed_tensors(self) -> dict[str, np.ndarray]:
        rope = rope_parameters(self.config)
        if rope.get("rope_type") == "llama3":
            return {names.ROPE_FREQS: llama3_rope_factors(self.config)}
        if rope.get("rope_type") == "longrope":  # as llama.cpp's phi3 converter writes them
            return {names.ROPE_FACTORS_LONG: np.asarray(rope["long_factor"], np.float32),
                    names.ROPE_FACTORS_SHORT: np.asarray(rope["short_factor"], np.float32)}
        return {}


def hidden_act(config, key: str = "hidden_act") -> str:
    """The config's FFN activation, lower case (`key`: the field naming it; Gemma 3's is hidden_activation)."""
    return str(getattr(config, key, "")).lower()


def layer_types_window(config) -> int | None:
    """The sliding window of a config whose layer_types name sliding_attention layers (Qwen2/Qwen3, Gemma 3), or None."""
    return config.sliding_window if "sliding_attention" in (getattr(config, "layer_types", None) or ()) else None


def is_bamboo(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return config.model_type == "bamboo" or any("bamboo" in a.lower() for a in archs)
