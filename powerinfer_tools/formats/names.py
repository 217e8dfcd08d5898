"""The file format's vocabulary, spelled once: the tensor names, metadata keys and architecture names a
PowerInfer file and a gpu-index file hold, and the FFN modes the engine runs (`--sparse-mode`).

The engine spells the same names in csrc/include/pi_names.h; tests/formats/test_names.py keeps the two equal
(and the engine's mode numbers, engine/_lib.py and pi_engine.h, in this order). Layout: docs/formats.md.
"""
from __future__ import annotations

# ---- architectures --------------------------------------------------------------------------------------
GPU_INDEX_ARCH = "generic.gpu_index"          # general.architecture of a gpu-index file (.gpuidx)

# ---- metadata keys --------------------------------------------------------------------------------------
KEY_ARCHITECTURE = "general.architecture"
KEY_FFN_ACTIVATION = "powerinfer.ffn_activation"              # relu, silu, gelu, ...
KEY_ACTIVATION_THRESHOLDS = "powerinfer.activation_thresholds"  # per layer: |a| above it is active (0: ReLU)
KEY_SPARSE_THRESHOLD = "powerinfer.sparse_threshold"          # PowerInfer's one predictor threshold
KEY_PREDICTOR_THRESHOLDS = "powerinfer.predictor_thresholds"  # per layer logit thresholds (ours)
KEY_PREDICTOR_USEFUL = "powerinfer.predictor_useful"          # per layer: better than chance (auto mode)
KEY_NEURON_ORDER = "powerinfer_tools.neuron_order"            # FFN neurons' source indices (neuron_order.py)
# Input sparsity (stages/profiling/input_sparsity.py): the model-wide shares of inputs zeroed that thresholds were
# calibrated for, and per share, layer and INPUT_SITES site the |x| at or below which an input is zeroed
KEY_INPUT_SPARSITY_LEVELS = "powerinfer.input_sparsity_levels"
KEY_INPUT_THRESHOLDS = "powerinfer.input_thresholds"             # [level][layer][site], flattened
KEY_VRAM_CAPACITY = "split.vram_capacity"                     # gpu index: bytes its GPU neurons take
KEY_GPU_INDEX_BLOCK_COUNT = "generic.gpu_index.block_count"   # gpu index: layers

# ---- the `{arch}.` hyperparameter keys the engine computes (llama.cpp's names: gguf-py's Keys): it refuses a file
# with any other key under its architecture's prefix (softcapping, shared experts, yarn_log_multiplier, ...), which
# ignoring would run as another model. rope.scaling.original_context_length is YaRN's and longrope's original
# context (a linear scaling's description only), .finetuned a description; attention.key_length/value_length must
# equal embedding_length / head_count but where the architecture's heads have a width of their own ---------------
ARCH_KEYS = (
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "attention.sliding_window",
    "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "tensor_data_layout", "attention.scale",
    "rope.freq_base_swa", "rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_weights_norm",
)
ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE (llama.cpp's): per rotated pair, what its frequency is divided by
# longrope (Phi-3 128k, llama.cpp's): per rotated pair, the frequency's divisor within the original context (short)
# and past it (long); the engine computes the short ones and runs no longer context (docs/formats.md)
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"

# ---- tensors: blk.N.<name>.weight|bias ------------------------------------------------------------------
ATTN_Q_NORM = "attn_q_norm"  # qwen3: RMSNorm of each query (key) head, before RoPE (gguf-py's names)
ATTN_K_NORM = "attn_k_norm"
POST_ATTENTION_NORM = "post_attention_norm"  # gemma3: RMSNorm of attention's output (gguf-py's names)
POST_FFW_NORM = "post_ffw_norm"  # gemma3: RMSNorm of the FFN's output
FFN_NORM = "ffn_norm"
FFN_GATE = "ffn_gate"
FFN_UP = "ffn_up"
FFN_DOWN = "ffn_down"        # llama.cpp's down projection [n_embd rows]
FFN_DOWN_T = "ffn_down_t"    # PowerInfer's: transposed, one row per neuron, so a sparse step reads whole rows
# A mixture of experts, as llama.cpp stores it: the router [n_expert, n_embd] and the experts' matrices stacked in
# 3-D tensors (gguf-py's shapes: gate/up [n_expert, n_ff_exp, n_embd], down [n_expert, n_embd, n_ff_exp])
FFN_GATE_INP = "ffn_gate_inp"
FFN_GATE_EXPS = "ffn_gate_exps"
FFN_UP_EXPS = "ffn_up_exps"
FFN_DOWN_EXPS = "ffn_down_exps"
PREDICTOR_FC1 = "fc1"        # predictor: fc2(relu(fc1(x))); also the keys of PowerInfer's model_{i}.pt
PREDICTOR_FC2 = "fc2"
# Input sparsity's transposed copies (row i = input i's weights), which a decode step reads only where input i
# is not zeroed, as the down projection reads ffn_down_t; written where the profile has input thresholds
ATTN_Q_T = "attn_q_t"
ATTN_K_T = "attn_k_t"
ATTN_V_T = "attn_v_t"
ATTN_QKV_T = "attn_qkv_t"    # falcon's fused q/k/v
ATTN_OUTPUT_T = "attn_output_t"
FFN_GATE_T = "ffn_gate_t"
FFN_UP_T = "ffn_up_t"
GPU_IDX = "gpu_idx"          # gpu index: i32 [n_ff], 1 = the neuron is on the GPU
GPU_BUCKET = "gpu_bucket"    # gpu index: the GPU neurons' indices, sorted

# ---- input sparsity's sites: the inputs a layer's matrices share (q/k/v, o, gate/up, down), one threshold each -
INPUT_SITES = ("qkv", "o", "gate_up", "down")

# ---- neuron bundles: the cold FFN read from disk (formats/neuron_bundles.py, csrc/model/disk_tier.h) ----------
NEURON_BUNDLES_SUFFIX = ".neurons"  # beside the model: model.gguf -> model.gguf.neurons
NEURON_BUNDLES_MAGIC = "PINB"
# the three-tier plan beside the model (formats/tier_plan.py, csrc/model/tier_plan.h): model.gguf -> model.gguf.tiers
TIER_PLAN_SUFFIX = ".tiers"
TIER_PLAN_MAGIC = "PITP"

# ---- FFN modes: the --sparse-mode values, numbered as the engine's pi_ffn_mode --------------------------
FFN_MODES = ("dense", "gate", "predictor", "auto", "oracle")


def weight(name: str) -> str:
    """fc1 -> fc1.weight: a tensor's weight as a layer (or a predictor's state dict) names it."""
    return f"{name}.weight"


def bias(name: str) -> str:
    return f"{name}.bias"


def layer_tensor(layer: int, name: str, part: str | None = "weight") -> str:
    """(3, ffn_down_t) -> blk.3.ffn_down_t.weight; part None for a gpu index's blk.3.gpu_idx."""
    return f"blk.{layer}.{name}" + (f".{part}" if part else "")
