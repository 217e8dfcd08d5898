"""Every config field transformers' class reads that changes what a model computes, per architecture family, and
the values this toolkit computes the same way: a converted file must compute the checkpoint's model or not be
written. One table per family; `check` refuses the first field outside it with one line (convert, its dry run,
profile: every path that takes an adapter from `arch.for_config`).

Fields a family's table leaves out are ones its transformers class does not read (pretraining_tp, softcapping,
query_pre_attn_scalar for Llama) or ones the adapter matches on (hidden_act). docs/formats.md lists the tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from powerinfer_tools.core.errors import UserError

MISSING = object()


@dataclass(frozen=True)
class Field:
    """A config field (`rope_parameters.rope_type`: a key of a dict field) and the values computed as transformers
    computes them: `accepts(value, config)`; `supported` says which, in the refusal and in docs/formats.md."""

    path: str
    accepts: Callable[[Any, Any], bool]
    supported: str

    def value(self, config) -> Any:
        obj = config
        for part in self.path.split("."):
            obj = obj.get(part, MISSING) if isinstance(obj, dict) else getattr(obj, part, MISSING)
            if obj is MISSING:
                return MISSING
        return obj


def one_of(path: str, *values) -> Field:
    """A field whose value (or absence) must be one of `values`; MISSING among them accepts an absent field."""
    shown = ", ".join("absent" if v is MISSING else repr(v) for v in values)
    return Field(path, lambda v, c: v in values, shown)


def any_value(path: str, how: str) -> Field:
    """A field computed at every value: listed so that the table is the whole audit (docs/formats.md)."""
    return Field(path, lambda v, c: True, how)


def _head_dim_is_split(value, config) -> bool:
    return value in (MISSING, None) or value == config.hidden_size // config.num_attention_heads


def _yarn_betas_ordered(value, config) -> bool:
    """YaRN's ramp rises from beta_fast's correction dim to beta_slow's: beta_fast above beta_slow, each at
    transformers' default (32, 1) where 0 or absent."""
    slow = (getattr(config, "rope_parameters", None) or {}).get("beta_slow")
    return ((value if value is not MISSING else None) or 32) > (slow or 1)


# YaRN (transformers' _compute_yarn_parameters, static: the same frequencies at every sequence length) as llama.cpp's
# keys carry it, which the engine computes it from (csrc/model/model.cpp, read_rope_scaling)
YARN_FIELDS = (
    one_of("rope_parameters.truncate", True, MISSING),  # llama.cpp's correction dims are always rounded outwards
    Field("rope_parameters.beta_fast", _yarn_betas_ordered,
          "above beta_slow (32 and 1 where absent), written as rope.scaling.yarn_beta_fast and yarn_beta_slow"),
    any_value("rope_parameters.attention_factor", "transformers' attention factor (this, or from factor, mscale and "
              "mscale_all_dim) written as rope.scaling.yarn_attn_factor where it is not 0.1 ln(factor) + 1"),
    any_value("rope_parameters.original_max_position_embeddings", "written as rope.scaling.original_context_length"),
)

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")

LLAMA_FIELDS = (
    Field("rope_parameters.rope_type", lambda v, c: v is MISSING or v in ROPE_TYPES,
          "default; linear (rope.scaling.factor); llama3 (rope_freqs.weight); yarn (rope.scaling.*: below); dynamic "
          "(the default frequencies, transformers' within max_position_embeddings, written as "
          "attention.sliding_window = max_position_embeddings so that the engine's context is capped there)"),
    *YARN_FIELDS,
    one_of("rope_parameters.partial_rotary_factor", 1.0, None, MISSING),
    Field("head_dim", _head_dim_is_split, "hidden_size / num_attention_heads"),
    any_value("sliding_window", "written as attention.sliding_window; the engine's context is capped at it"),
    any_value("attention_bias", "q/k/v/o biases written and added"),
    any_value("mlp_bias", "gate/up/down biases written and added"),
    any_value("tie_word_embeddings", "output.weight is the embedding when tied"),
)

LAYER_TYPES = ("full_attention", "sliding_attention")

# Qwen2 and Qwen3 (transformers' Qwen2Attention/Qwen3Attention): use_sliding_window, sliding_window and
# max_window_layers act through layer_types, which the config derives from them when config.json has none
QWEN2_FIELDS = (  # q/k/v biases always, o without: the checkpoint's tensors
    one_of("rope_parameters.rope_type", "default", "yarn", MISSING),  # yarn: Qwen2.5's long-context configs
    *YARN_FIELDS,
    one_of("rope_parameters.partial_rotary_factor", 1.0, None, MISSING),
    any_value("head_dim", "written as attention.key_length/value_length (q/k/v width n_head * head_dim)"),
    Field("layer_types", lambda v, c: v in (MISSING, None) or all(t in LAYER_TYPES for t in v),
          "full_attention; sliding_attention (use_sliding_window) written as attention.sliding_window, the engine's "
          "context capped at it"),
    any_value("tie_word_embeddings", "output.weight is the embedding when tied"),
)
QWEN3_FIELDS = QWEN2_FIELDS + (any_value("attention_bias", "q/k/v/o biases written and added"),)

# Mixtures of experts (transformers' Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, OlmoeSparseMoeBlock): the router's
# top num_experts_per_tok, renormalised as norm_topk_prob says (Mixtral always); the fields of its training loss act
# only in training
MOE_TRAINING_ONLY = (
    any_value("router_aux_loss_coef", "acts only in training (the load-balancing loss)"),
    any_value("output_router_logits", "acts only in training (the router's logits for that loss)"),
)
QWEN3_MOE_FIELDS = (
    one_of("rope_parameters.rope_type", "default", MISSING),
    one_of("rope_parameters.partial_rotary_factor", 1.0, None, MISSING),
    any_value("head_dim", "written as attention.key_length/value_length (q/k/v width n_head * head_dim)"),
    any_value("sliding_window", "every layer's where use_sliding_window (the config drops it otherwise), written as "
                                "attention.sliding_window, the engine's context capped at it"),
    any_value("attention_bias", "q/k/v/o biases written and added"),
    any_value("tie_word_embeddings", "output.weight is the embedding when tied"),
    Field("num_experts", lambda v, c: isinstance(v, int) and v >= 1, "1 or more (0 makes every layer a dense MLP)"),
    Field("mlp_only_layers", lambda v, c: not v, "[] (every layer a mixture of experts, as llama.cpp's qwen3moe)"),
    one_of("decoder_sparse_step", 1, MISSING),
    any_value("norm_topk_prob", "written as expert_weights_norm"),
) + MOE_TRAINING_ONLY
# Mixtral: Llama's attention without biases (MixtralAttention has none); its router always renormalises the top k
MIXTRAL_FIELDS = tuple(f for f in LLAMA_FIELDS if f.path not in ("attention_bias", "mlp_bias")) + (
    any_value("router_jitter_noise", "acts only in training (noise on the router's input)"),
) + MOE_TRAINING_ONLY
OLMOE_FIELDS = (  # q and k RMS-normed over the whole projection: the class's own, not a field
    one_of("rope_parameters.rope_type", "default", MISSING),
    one_of("rope_parameters.partial_rotary_factor", 1.0, None, MISSING),
    one_of("clip_qkv", None, MISSING),
    any_value("attention_bias", "q/k/v/o biases written and added"),
    any_value("tie_word_embeddings", "output.weight is the embedding when tied"),
    any_value("norm_topk_prob", "written as expert_weights_norm"),
) + MOE_TRAINING_ONLY


def _rotary_dims_even(value, config) -> bool:
    """A partial_rotary_factor whose rotated dims per head are a positive even count (RoPE rotates pairs)."""
    if value in (MISSING, None):
        return True
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 0.0 < float(value) <= 1.0 and int(head * float(value)) % 2 == 0 and int(head * float(value)) > 0


# Phi-3/Phi-4 (transformers' Phi3Attention, Phi3RotaryEmbedding): longrope (Phi-3 128k, Phi-4-mini; rope_scaling
# "su"/"yarn", which the config renames longrope) divides each pair's frequency by short_factor within
# original_max_position_embeddings and by long_factor past it; dropouts (resid_pdrop, embd_pdrop, attention_dropout)
# act only in training
PHI3_FIELDS = (
    Field("rope_parameters.rope_type", lambda v, c: v in (MISSING, "default", "longrope"),
          "default; longrope (short_factor, long_factor as rope_factors_short/long.weight, the attention factor as "
          "rope.scaling.attn_factor: the engine computes the short factors, transformers' within "
          "original_max_position_embeddings, and caps its context there)"),
    Field("rope_parameters.partial_rotary_factor", _rotary_dims_even,
          "in (0, 1] with an even number of rotated dims, written as rope.dimension_count"),
    Field("head_dim", _head_dim_is_split, "hidden_size / num_attention_heads"),
    any_value("sliding_window", "written as attention.sliding_window; the engine's context is capped at it"),
    any_value("tie_word_embeddings", "output.weight is the embedding when tied"),
)

def _gemma3_layer_types(value, config) -> bool:
    """The engine's (and llama.cpp's) layers: five sliding-window ones in six, the sixth global."""
    n = config.num_hidden_layers
    return list(value) == ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]


# Gemma 3 text (transformers' Gemma3Attention, Gemma3RotaryEmbedding, Gemma3TextScaledWordEmbedding, Gemma3RMSNorm):
# the embedding's sqrt(hidden_size), the norms' 1 + w and the GeGLU are the class's own, not fields
GEMMA3_FIELDS = (
    one_of("rope_parameters.full_attention.rope_type", "default", "linear"),
    one_of("rope_parameters.sliding_attention.rope_type", "default"),
    one_of("rope_parameters.full_attention.partial_rotary_factor", 1.0, None, MISSING),
    one_of("rope_parameters.sliding_attention.partial_rotary_factor", 1.0, None, MISSING),
    Field("layer_types", _gemma3_layer_types,
          "sliding_attention but for every sixth layer (sliding_window_pattern 6), as llama.cpp's gemma3"),
    any_value("sliding_window", "written as attention.sliding_window; the local layers attend within it"),
    Field("query_pre_attn_scalar", lambda v, c: isinstance(v, (int, float)) and v > 0,
          "a positive number, written as attention.scale"),
    one_of("final_logit_softcapping", None, MISSING),
    one_of("attn_logit_softcapping", None, MISSING),
    one_of("use_bidirectional_attention", False, None, MISSING),
    any_value("head_dim", "written as attention.key_length/value_length"),
    any_value("attention_bias", "q/k/v/o biases written and added"),
    any_value("tie_word_embeddings", "output.weight is the embedding when tied"),
)

FALCON_FIELDS = (
    one_of("rope_parameters.rope_type", "default", MISSING),
    one_of("alibi", False),
    Field("parallel_attn", lambda v, c: bool(v) or bool(c.new_decoder_architecture),
          "True, or new_decoder_architecture"),
    one_of("activation", "relu", "gelu"),
    any_value("num_ln_in_parallel_attn", "one or two layer norms, as the checkpoint's tensors are"),
    any_value("bias", "biases written and added where the checkpoint has them"),
)

OPT_FIELDS = (
    one_of("do_layer_norm_before", True),
    Field("word_embed_proj_dim", lambda v, c: v in (MISSING, None, c.hidden_size), "hidden_size"),
    one_of("_remove_final_layer_norm", False, MISSING),
    one_of("layer_norm_elementwise_affine", True, MISSING),
    one_of("enable_bias", True, MISSING),
    one_of("tie_word_embeddings", True, MISSING),
    one_of("activation_function", "relu", "gelu"),
)


def check(config, fields: tuple[Field, ...]) -> None:
    """UserError naming the first field whose value this toolkit would not compute as transformers does."""
    for f in fields:
        value = f.value(config)
        if not f.accepts(value, config):
            shown = "absent" if value is MISSING else repr(value)
            raise UserError(f"config field {f.path} = {shown} is not supported for {config.model_type} "
                            f"(supported: {f.supported}): converting would compute another model")
