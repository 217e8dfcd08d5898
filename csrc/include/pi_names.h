// The file format's vocabulary as the engine spells it: tensor names, metadata keys, architecture names and
// the FFN modes (pi_ffn_mode's names, in its order). The same names, once, in Python:
// powerinfer_tools/formats/names.py; tests/formats/test_names.py keeps the two equal, name for name
// (KEY_FFN_ACTIVATION there is kKeyFfnActivation here). Layout: docs/formats.md.
#pragma once

namespace pi::names {

// ---- architectures ----
inline constexpr char kGpuIndexArch[] = "generic.gpu_index";
// neuron bundles: the cold FFN read from disk (model/disk_tier.h)
inline constexpr char kNeuronBundlesSuffix[] = ".neurons";
inline constexpr char kNeuronBundlesMagic[] = "PINB";
// the three-tier plan beside the model: per layer, its neurons on the GPU and in memory (model/tier_plan.h)
inline constexpr char kTierPlanSuffix[] = ".tiers";
inline constexpr char kTierPlanMagic[] = "PITP";

// ---- metadata keys ----
inline constexpr char kKeyArchitecture[] = "general.architecture";
inline constexpr char kKeyFfnActivation[] = "powerinfer.ffn_activation";
inline constexpr char kKeyActivationThresholds[] = "powerinfer.activation_thresholds";
inline constexpr char kKeySparseThreshold[] = "powerinfer.sparse_threshold";
inline constexpr char kKeyPredictorThresholds[] = "powerinfer.predictor_thresholds";
inline constexpr char kKeyPredictorUseful[] = "powerinfer.predictor_useful";
inline constexpr char kKeyNeuronOrder[] = "powerinfer_tools.neuron_order";
inline constexpr char kKeyInputSparsityLevels[] = "powerinfer.input_sparsity_levels";
inline constexpr char kKeyInputThresholds[] = "powerinfer.input_thresholds";
inline constexpr char kKeyVramCapacity[] = "split.vram_capacity";
inline constexpr char kKeyGpuIndexBlockCount[] = "generic.gpu_index.block_count";

// ---- the `{arch}.` hyperparameter keys the engine computes (llama.cpp's names): any other key under the
// architecture's prefix is refused at load (names.py says why) ----
inline constexpr const char *kArchKeys[] = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "attention.sliding_window",
    "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "tensor_data_layout", "attention.scale",
    "rope.freq_base_swa", "rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_weights_norm",
};
inline constexpr char kRopeFreqs[] = "rope_freqs.weight";  // llama3 RoPE: per rotated pair, its frequency's divisor
// longrope (Phi-3 128k): per-pair divisors within the original context (short, computed) and past it (long, checked)
inline constexpr char kRopeFactorsLong[] = "rope_factors_long.weight";
inline constexpr char kRopeFactorsShort[] = "rope_factors_short.weight";

// ---- tensors: blk.N.<name>.weight|bias ----
inline constexpr char kAttnQNorm[] = "attn_q_norm";  // qwen3: RMSNorm of each query head, before RoPE
inline constexpr char kAttnKNorm[] = "attn_k_norm";
inline constexpr char kPostAttentionNorm[] = "post_attention_norm";  // gemma3: RMSNorm of attention's output
inline constexpr char kPostFfwNorm[] = "post_ffw_norm";              // gemma3: RMSNorm of the FFN's output
inline constexpr char kFfnNorm[] = "ffn_norm";
inline constexpr char kFfnGate[] = "ffn_gate";
inline constexpr char kFfnUp[] = "ffn_up";
inline constexpr char kFfnDown[] = "ffn_down";
inline constexpr char kFfnDownT[] = "ffn_down_t";
// a mixture of experts (llama.cpp's): the router, and the experts' matrices stacked in 3-D tensors
inline constexpr char kFfnGateInp[] = "ffn_gate_inp";
inline constexpr char kFfnGateExps[] = "ffn_gate_exps";
inline constexpr char kFfnUpExps[] = "ffn_up_exps";
inline constexpr char kFfnDownExps[] = "ffn_down_exps";
inline constexpr char kPredictorFc1[] = "fc1";
inline constexpr char kPredictorFc2[] = "fc2";
inline constexpr char kAttnQT[] = "attn_q_t";
inline constexpr char kAttnKT[] = "attn_k_t";
inline constexpr char kAttnVT[] = "attn_v_t";
inline constexpr char kAttnQkvT[] = "attn_qkv_t";
inline constexpr char kAttnOutputT[] = "attn_output_t";
inline constexpr char kFfnGateT[] = "ffn_gate_t";
inline constexpr char kFfnUpT[] = "ffn_up_t";
inline constexpr char kGpuIdx[] = "gpu_idx";
inline constexpr char kGpuBucket[] = "gpu_bucket";

// ---- input sparsity's sites, in the order of powerinfer.input_thresholds' innermost axis ----
inline constexpr const char *kInputSites[] = {"qkv", "o", "gate_up", "down"};
inline constexpr int kInputSiteCount = sizeof(kInputSites) / sizeof(kInputSites[0]);

// ---- FFN modes: index = pi_ffn_mode ----
inline constexpr const char *kFfnModes[] = {"dense", "gate", "predictor", "auto", "oracle"};
inline constexpr int kFfnModeCount = sizeof(kFfnModes) / sizeof(kFfnModes[0]);

}  // namespace pi::names
