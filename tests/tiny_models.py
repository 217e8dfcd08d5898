"""Tiny random-weight models of every supported architecture, saved as Hugging Face directories.

Each comes with a real tokenizer trained on a slice of tiny-shakespeare: SentencePiece for the
Llama family (as Llama checkpoints ship; Phi-3's in its tokenizer.json shape, Gemma's as GemmaTokenizer, each with
its chat template), byte-level BPE for Falcon, OPT and Qwen (Qwen's with its own pre-tokenizer, ChatML special tokens
and chat template).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

DATA = next((p for p in (Path(__file__).resolve().parents[1].parent / "shared" / "data", Path("/work/shared/data"))
             if p.is_dir()), Path("/work/shared/data"))
KINDS = ("llama-relu", "llama-silu", "prosparse", "bamboo", "falcon", "falcon7b", "opt")
QWEN_KINDS = ("qwen2", "qwen3")  # every feature on: q/k/v(/o) biases, tied head; qwen3 heads normed, head_dim 32
FAMILY_KINDS = ("phi3", "gemma3")  # fused projections and partial rotary; GELU, four norms, sliding-window layers
# those families with ReLU in place of their SiLU or GELU, as `pi-tools sparsify` writes them
RELU_FAMILY_KINDS = ("qwen2-relu", "qwen3-relu", "phi3-relu", "gemma3-relu")
# mixtures of experts, every feature on: 8 experts; Qwen3-MoE top 4 renormalised, experts 32 wide beside a dense width
# of 128 (expert_feed_forward_length), heads 32 wide, biases, q/k norms per head, a tied head; Mixtral top 2 (SiLU or
# ReLU experts); OLMoE top 4 not renormalised, biases, q/k norms over the whole projection
MOE_KINDS = ("qwen3-moe", "mixtral", "mixtral-relu", "olmoe")
N_EXPERT, MOE_FF = 8, 32
# the router's weights wider than the others: the experts a token takes by a clear margin, so that a quantized file's
# rounding rarely moves a token to another expert (which moves its logits by far more than the rounding)
ROUTER_STD = 0.5
HIDDEN, N_FF, N_LAYER, N_HEAD, N_KV = 64, 256, 2, 4, 2
PHI3_ROTARY = 0.75  # Phi-4-mini's partial_rotary_factor: RoPE turns the first 12 of each head's 16 dims
# Gemma 3's structure at a small scale: heads 24 wide (not 64 / 4), a window of 32 positions (well inside a 300-token
# test), local and global RoPE bases apart; N_LAYER layers slide (the first five in six do), GEMMA3_LAYERS (5 sliding,
# 1 global, as the real pattern) for tests/arch/test_gemma3.py
GEMMA3 = dict(head_dim=24, sliding_window=32, query_pre_attn_scalar=20)
GEMMA3_LAYERS = 6
GEMMA_CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + "
              "message['content'] + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<start_of_turn>model\n' }}{% endif %}")
# Phi-3's chat template (its tokenizer_config.json's, without the system turn)
PHI3_CHAT = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
QWEN3_HEAD_DIM = 32  # not HIDDEN / N_HEAD: q/k/v are N_HEAD * 32 wide, as Qwen3-0.6B's 16 heads of 128 beside 1024
# Qwen2's tokenizer.json splits text with this before its byte-level BPE (llama.cpp's "qwen2" pre-tokenizer)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# FATReLU's threshold of the tiny ProSparse model (the released ones use 0.01): large enough against these
# gate values (std ~0.6) that a third of the positive ones fall below it, so ignoring it changes the output
PROSPARSE_THRESHOLD = 0.25


def training_text() -> str:
    """A slice of tiny-shakespeare, or (without the shared data) deterministic pseudo-words."""
    path = DATA / "tinyshakespeare.txt"
    if path.is_file():
        return path.read_text()[:200_000]
    import random

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    words = ["".join(rng.choice(letters[:rng.randint(8, 26)]) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    return "\n".join(" ".join(rng.choice(words) for _ in range(20)) for _ in range(2000))


def _spm_tokenizer(out: Path, chat_template: str | None = None, symbols: tuple[str, ...] = ()) -> int:
    """SentencePiece BPE with byte fallback; `symbols`: special tokens the vocabulary holds besides <unk>, <s>, </s>."""
    import sentencepiece as spm

    work = out / ".spm"
    work.mkdir(parents=True, exist_ok=True)
    (work / "text.txt").write_text(training_text())
    spm.SentencePieceTrainer.train(input=str(work / "text.txt"), model_prefix=str(work / "sp"), vocab_size=384,
                                   model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, user_defined_symbols=list(symbols), minloglevel=2)
    shutil.copy(work / "sp.model", out / "tokenizer.model")
    shutil.rmtree(work)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, **({"chat_template": chat_template} if chat_template else {})}))
    return 384


def _phi3_tokenizer(out: Path) -> int:
    """SentencePiece in Phi-3's tokenizer.json shape: the prefix space from a normalizer (Prepend, Replace), no
    Metaspace pre-tokenizer, as transformers' GGUF builder rebuilds a phi3 file's; Phi-3's chat template."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    n = _spm_tokenizer(out, PHI3_CHAT)
    tok = AutoTokenizer.from_pretrained(out)
    tok.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                             normalizers.Replace(" ", "\u2581")])
    tok.backend_tokenizer.pre_tokenizer = None
    tok.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return n


def _gemma_tokenizer(out: Path) -> int:
    """SentencePiece as GemmaTokenizer (no prefix space: Gemma's), Gemma's chat template; <pad> and <mask> in the
    vocabulary, as Gemma's has them (GemmaTokenizer adds them past it otherwise)."""
    n = _spm_tokenizer(out, GEMMA_CHAT, ("<pad>", "<mask>"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GemmaTokenizer"}))
    return n


def _bpe_tokenizer(out: Path, style: str = "gpt2") -> int:
    """Byte-level BPE: GPT-2's pre-tokenizer (OPT), Falcon's, which also splits off runs of punctuation and numbers
    in groups of three digits (what llama.cpp calls the "falcon" pre-tokenizer), or Qwen's (QWEN_SPLIT: single
    digits), with ChatML's special tokens and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special, names = ["<|endoftext|>", "<pad>"], dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                                      pad_token="<pad>")  # OPT's pad id is 1
    if style == "falcon":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Punctuation("contiguous"), pre_tokenizers.ByteLevel(add_prefix_space=False),
            pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), "isolated")])
    elif style == "qwen":  # as Qwen's tokenizer.json: no BOS, ChatML's end of turn ends a reply
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        names = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # numbers and runs of punctuation, so that the vocabulary has merges on which pre-tokenizers differ
    numbers = " ".join(f"{(i * 7919) % 100003}, {i}.{i * 31 % 997}!!" for i in range(3000))
    tok.train_from_iterator([training_text(), numbers], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.save_pretrained(out)
    return len(fast)


def _config(kind: str, vocab: int, n_ff: int = N_FF, **overrides):
    """The kind's config, with `overrides` (config fields) set on top of its own."""
    from transformers import (FalconConfig, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig,
                              OPTConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=N_LAYER, num_attention_heads=N_HEAD,
                  max_position_embeddings=256)
    if kind in ("llama-relu", "llama-silu", "prosparse"):
        cls, own = LlamaConfig, dict(intermediate_size=n_ff, num_key_value_heads=N_KV,
                                     hidden_act="silu" if kind == "llama-silu" else "relu", rope_theta=10000.0,
                                     rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    elif kind == "bamboo":
        cls, own = MistralConfig, dict(intermediate_size=n_ff, num_key_value_heads=N_KV, hidden_act="relu",
                                       rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None,
                                       architectures=["BambooForCausalLM"], bos_token_id=1, eos_token_id=2)
    elif kind == "falcon":
        cls, own = FalconConfig, dict(num_kv_heads=N_KV, new_decoder_architecture=True, parallel_attn=True,
                                      bias=False, activation="relu", ffn_hidden_size=n_ff, bos_token_id=0,
                                      eos_token_id=0)
    elif kind == "falcon7b":
        cls, own = FalconConfig, dict(multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                      bias=False, activation="relu", ffn_hidden_size=n_ff, bos_token_id=0,
                                      eos_token_id=0)
    elif kind in QWEN_KINDS:
        cls, own = Qwen2Config, dict(intermediate_size=n_ff, num_key_value_heads=N_KV, hidden_act="silu",
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                     max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                     use_sliding_window=False, sliding_window=None, eos_token_id=2)  # <|im_end|>
        if kind == "qwen3":
            cls, own = Qwen3Config, {**own, "head_dim": QWEN3_HEAD_DIM, "attention_bias": True}
    elif kind == "phi3":  # Phi-4-mini's shape: partial rotary, a tied head; fused qkv_proj and gate_up_proj
        cls, own = Phi3Config, dict(intermediate_size=n_ff, num_key_value_heads=N_KV, hidden_act="silu",
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": PHI3_ROTARY},
                                    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                    sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    elif kind == "gemma3":
        cls, own = Gemma3TextConfig, dict(intermediate_size=n_ff, num_key_value_heads=N_KV, **GEMMA3,
                                          hidden_activation="gelu_pytorch_tanh", max_position_embeddings=512,
                                          rms_norm_eps=1e-6, rope_theta=10000.0, rope_local_base_freq=100.0,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0},
                                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    elif kind == "qwen3-moe":
        cls, own = Qwen3MoeConfig, dict(intermediate_size=n_ff // 2, moe_intermediate_size=MOE_FF, num_experts=N_EXPERT,
                                        num_experts_per_tok=4, norm_topk_prob=True, num_key_value_heads=N_KV,
                                        head_dim=QWEN3_HEAD_DIM, attention_bias=True, max_position_embeddings=512,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                        rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2)
    elif kind in ("mixtral", "mixtral-relu"):
        act = "relu" if kind == "mixtral-relu" else "silu"
        cls, own = MixtralConfig, dict(intermediate_size=MOE_FF * 2, num_local_experts=N_EXPERT, num_experts_per_tok=2,
                                       num_key_value_heads=N_KV, hidden_act=act,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                       max_position_embeddings=512, rms_norm_eps=1e-5, sliding_window=None,
                                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    elif kind == "olmoe":
        cls, own = OlmoeConfig, dict(intermediate_size=MOE_FF, num_experts=N_EXPERT, num_experts_per_tok=4,
                                     norm_topk_prob=False, num_key_value_heads=N_KV, attention_bias=True,
                                     max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                     pad_token_id=None, eos_token_id=2)
    elif kind == "opt":
        cls, own = OPTConfig, dict(ffn_dim=n_ff, word_embed_proj_dim=HIDDEN, do_layer_norm_before=True,
                                   activation_function="relu", bos_token_id=0, eos_token_id=0, pad_token_id=1)
    else:
        raise ValueError(kind)
    return cls(**{**common, **own, **overrides})


def make_tiny(kind: str, out: Path, seed: int = 0, n_ff: int = N_FF, **overrides) -> Path:
    """Write a tiny random model of `kind` (see KINDS) with its tokenizer into `out`; n_ff FFN neurons;
    `overrides`: config fields (rope_parameters, sliding_window, ...) set on top of the kind's own."""
    from transformers import AutoModelForCausalLM, MistralForCausalLM

    if kind in RELU_FAMILY_KINDS:
        family = kind.removesuffix("-relu")
        act_key = "hidden_activation" if family == "gemma3" else "hidden_act"
        return make_tiny(family, out, seed, n_ff, **{act_key: "relu", **overrides})
    out.mkdir(parents=True, exist_ok=True)
    own_tokenizer = {"phi3": _phi3_tokenizer, "gemma3": _gemma_tokenizer}
    vocab = (own_tokenizer[kind](out) if kind in own_tokenizer else _spm_tokenizer(out)
             if kind in ("llama-relu", "llama-silu", "prosparse", "bamboo", "mixtral", "mixtral-relu")
             else _bpe_tokenizer(out, "qwen" if kind in (*QWEN_KINDS, "qwen3-moe", "olmoe") else
                                 "falcon" if kind.startswith("falcon") else "gpt2"))
    config = _config(kind, vocab, n_ff, **overrides)
    torch.manual_seed(seed)
    model_class = MistralForCausalLM if kind == "bamboo" else AutoModelForCausalLM
    model = model_class._from_config(config) if kind == "bamboo" else model_class.from_config(config)
    with torch.no_grad():  # wider weights than the 0.02 init so activations and logits are not all tiny
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and the experts' stacked ones
                p.normal_(0.0, ROUTER_STD if name.endswith("mlp.gate.weight") and kind in MOE_KINDS else 0.08)
        for name, p in model.named_parameters():
            # transformers starts biases at 0, norms at 1 (Gemma's at 0): values that count
            if kind in (*QWEN_KINDS, "phi3", "gemma3", *MOE_KINDS) and p.dim() == 1:
                p.normal_(*((0.0, 0.1) if name.endswith(".bias") else (1.0, 0.2)))
    model.save_pretrained(out, safe_serialization=True)
    if kind == "bamboo":  # save_pretrained names the Mistral class; a Bamboo checkpoint names its own
        cfg = json.loads((out / "config.json").read_text())
        cfg["architectures"] = ["BambooForCausalLM"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if kind == "prosparse":  # a Llama checkpoint saved with ReLU, declared as ProSparse's config.json does
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(model_type="sparsellama", architectures=["SparseLlamaForCausalLM"], hidden_act="fatrelu",
                   hidden_act_param=PROSPARSE_THRESHOLD)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
