"""Falcon (Falcon-40B's new decoder architecture and the older 7B layout): plain FFN
a = act(dense_h_to_4h x); PowerInfer feeds Falcon's predictor the layer input."""
from __future__ import annotations

from functools import partial

import numpy as np

from powerinfer_tools.models.arch.base import Arch, Dims, TensorMap, optional_maps, rope_theta
from powerinfer_tools.models.arch.config_fields import FALCON_FIELDS
from powerinfer_tools.formats import names

FALCON_MODEL_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")


def qkv_grouped_to_contiguous(data: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """Falcon fuses QKV as n_kv groups of (n_head/n_kv queries, 1 key, 1 value) heads; PowerInfer's
    falcon kernels (tensor_data_layout "jploski") want all queries, then all keys, then all values.
    The 7B layout (one group: queries, k, v) and per-head q/k/v triples are special cases."""
    groups = data.reshape(n_kv, n_head // n_kv + 2, data.shape[0] // (n_head + 2 * n_kv), *data.shape[1:])
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return np.concatenate([q.reshape(-1, *data.shape[1:]), k.reshape(-1, *data.shape[1:]),
                           v.reshape(-1, *data.shape[1:])])


def n_kv_heads(config) -> int:
    """KV heads as transformers' Falcon attention counts them (multi-query 7B: one)."""
    if config.new_decoder_architecture or not config.multi_query:
        return config.num_kv_heads or config.num_attention_heads
    return 1


class Falcon(Arch):
    name = "falcon"
    powerinfer_arch = "falcon"
    description = "Falcon (new decoder architecture as Falcon-40B, or 7B layout), ReLU-fied"
    gated = False
    config_fields = FALCON_FIELDS  # rotary embeddings and parallel attention (7B/40B/180B layouts)

    @classmethod
    def matches(cls, config) -> bool:
        return config.model_type in FALCON_MODEL_TYPES

    @property
    def activation(self) -> str:
        act = str(getattr(self.config, "activation", "gelu")).lower()
        return "relu" if act == "relu" else "gelu"

    def dims(self) -> Dims:
        c = self.config
        n_ff = getattr(c, "ffn_hidden_size", None) or 4 * c.hidden_size
        return Dims(c.num_hidden_layers, c.hidden_size, n_ff)

    def layers(self, model):
        return list(model.transformer.h)

    def activation_module(self, layer):
        return layer.mlp.act

    def predictor_input_module(self, layer):
        return layer

    def input_modules(self, layer):
        a, m = layer.self_attention, layer.mlp
        return dict(zip(names.INPUT_SITES, ([a.query_key_value], [a.dense], [m.dense_h_to_4h], [m.dense_4h_to_h])))

    def tensor_maps(self, available):
        c = self.config
        qkv = partial(qkv_grouped_to_contiguous, n_head=c.num_attention_heads, n_kv=n_kv_heads(c))
        maps = [TensorMap("token_embd.weight", "transformer.word_embeddings.weight")]
        for i in range(c.num_hidden_layers):
            p, b = f"transformer.h.{i}.", f"blk.{i}."
            norms = (("attn_norm", "ln_mlp"), ("attn_norm_2", "ln_attn")) if f"{p}ln_attn.weight" in available \
                else (("attn_norm", "input_layernorm"),)
            for ours, theirs in norms:
                maps += [TensorMap(f"{b}{ours}.weight", f"{p}{theirs}.weight")]
                maps += optional_maps(available, [(f"{b}{ours}.bias", f"{p}{theirs}.bias")])
            maps += [TensorMap(f"{b}attn_qkv.weight", f"{p}self_attention.query_key_value.weight", qkv)]
            if f"{p}self_attention.query_key_value.bias" in available:
                maps += [TensorMap(f"{b}attn_qkv.bias", f"{p}self_attention.query_key_value.bias", qkv)]
            maps += [TensorMap(f"{b}attn_output.weight", f"{p}self_attention.dense.weight"),
                     TensorMap(f"{b}ffn_up.weight", f"{p}mlp.dense_h_to_4h.weight"),
                     TensorMap(f"{b}{names.FFN_DOWN_T}.weight", f"{p}mlp.dense_4h_to_h.weight", transpose=True)]
            maps += optional_maps(available, [(f"{b}attn_output.bias", f"{p}self_attention.dense.bias"),
                                              (f"{b}ffn_up.bias", f"{p}mlp.dense_h_to_4h.bias"),
                                              (f"{b}{names.FFN_DOWN_T}.bias", f"{p}mlp.dense_4h_to_h.bias")])
        head = "lm_head.weight" if "lm_head.weight" in available else "transformer.word_embeddings.weight"
        return maps + [TensorMap("output_norm.weight", "transformer.ln_f.weight"),
                       TensorMap("output_norm.bias", "transformer.ln_f.bias"), TensorMap("output.weight", head)]

    def write_hparams(self, writer) -> None:
        c = self.config
        writer.add_context_length(c.max_position_embeddings)
        writer.add_tensor_data_layout("jploski")  # QKV stored as q heads, k heads, v heads
        writer.add_embedding_length(c.hidden_size)
        writer.add_feed_forward_length(self.dims().n_ff)
        writer.add_block_count(c.num_hidden_layers)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(n_kv_heads(c))
        writer.add_layer_norm_eps(float(c.layer_norm_epsilon))
        writer.add_rope_freq_base(rope_theta(c))
