#!/usr/bin/env python3
"""Random-weight checkpoints in the exact shapes of ReluLLaMA-7B / -13B (ReLU Llamas, or SiLU) and of Llama-3.1-8B
and Qwen3-8B (SiLU, their RoPE, q/k norms and vocabulary sizes), made here (no download), with a profile and
predictors that select a chosen share of each layer's neurons.

The model: sharded f16 safetensors, one shard per layer (built one tensor at a time, so the memory it
needs is about one layer whatever the model's size), config.json (hidden_act relu) and a SentencePiece
BPE tokenizer trained on the project's calibration text (fewer pieces than the vocabulary when the text
runs out of merges; the converter pads the rest).

Its ReLU neurons are hot and cold as a trained model's (`power_law_gates`): every embedding row carries one
shared direction u, and gate row j leans on u by its own amount b_j, so neuron j fires with its own rate
p_j = Phi(b_j / (0.02 sqrt 2)) (placement's power law, scaled to a mean 1 - --model-sparsity) whatever the token;
the rest of the gate row is low-rank plus noise, so a predictor of moderate rank can tell which cold neurons fire
for which token. The attention and down projections are small against the embeddings, so u's share of every
layer's input, and with it each neuron's rate, holds from the first layer to the last. `pi-tools profile` finds
the skew (docs/bench.md, "7B and 13B"); nothing in the profile is synthesized.

The profile: activation counts following placement's synthetic power law (the placement benchmark's),
per layer, for `plan` and neuron order.

The predictors: fc2(relu(fc1 x)) with no biases, built so that neuron j is predicted active (logit > 0)
with probability p_j for any input x: fc1 rows are iid N(0, 1/n_embd), fc2[j] = g_j + c_j * 1 with
g_j iid N(0, 1). Given h = relu(fc1 x), g_j . h ~ N(0, |h|^2) and sum(h) / |h| ~= sqrt(rank / pi)
(half-normal moments), so logit_j > 0 <=> g_j . h / |h| > -c_j sqrt(rank / pi), which holds with
probability p_j when c_j = Phi^-1(p_j) sqrt(pi / rank). The sign of a logit does not depend on the
scale of x (the predictor is positively homogeneous), so the share holds in every layer of a random
model whose residual grows from layer to layer, and at threshold 0, which is PowerInfer's default
(LLAMA_SPARSE_PRED_THRESHOLD): both engines select the same rows. p_j follows the profile's power law,
scaled to the mean 1 - sparsity.

Usage:
  python scripts/synthetic_llama.py model --shape 7b --out runs/relu7b
  python scripts/synthetic_llama.py model --shape 70b --layers 2 --out /tmp/relu70b-2   # 70B's layer width
  python scripts/synthetic_llama.py predictors --shape 7b --sparsity 0.9 --out runs/pred-s90
  python scripts/synthetic_llama.py profile --shape 7b --out runs/prof
  python scripts/synthetic_llama.py model --shape 2b --act silu --out /tmp/silu2b   # for sparsify's speed
  python scripts/synthetic_llama.py model --shape llama3-8b --out /tmp/llama3-8b   # SiLU, llama3 RoPE, 128k vocab
  python scripts/synthetic_llama.py model --shape qwen3-8b --out /tmp/qwen3-8b     # q/k norms, 152k vocab
  python scripts/synthetic_llama.py model --shape qwen3-30b-a3b --layers 8 --out /tmp/a3b-8

--shape qwen3-30b-a3b is Qwen3-30B-A3B's mixture of SiLU experts with every weight iid N(0, 0.02^2): no expert
is built hotter than another, but over text its routing is not uniform (measured in docs/profile.md, "Experts":
past the first layer random attention averages the context, so a token mostly takes the previous token's
experts). It measures the engines' speed, not what a cache of experts earns.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = Path(os.environ.get("PI_DATA", ROOT.parent / "shared" / "data"))  # text: PI_DATA, else ../shared/data
TOKENIZER_TEXT = ("wikitext-2-valid.txt", "tinyshakespeare.txt")  # calibration text only, never the test split


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    vocab: int = 32000
    n_ctx: int = 4096
    n_kv: int | None = None   # grouped-query attention's KV heads (default: n_head)
    # config.json's family: "llama" (Llama 2's layout), "llama3" (Llama 3.1's RoPE base and llama3 scaling),
    # "qwen3" (per-head q/k RMSNorm, its RoPE base), "qwen3-moe" (Qwen3-MoE: qwen3's attention, n_expert experts of
    # n_ff neurons, top_k per token); their real models are SiLU, the Llama 2 shapes ReLU
    family: str = "llama"
    head_dim: int | None = None   # default: n_embd / n_head
    act: str = "relu"
    n_expert: int = 0
    top_k: int = 0


SHAPES = {
    "7b": Shape(4096, 11008, 32, 32),    # ReluLLaMA-7B (Llama-2-7B's shape)
    "13b": Shape(5120, 13824, 40, 40),   # ReluLLaMA-13B
    "70b": Shape(8192, 28672, 80, 64, n_kv=8),   # ReluLLaMA-70B (Llama-2-70B's shape)
    "llama3-8b": Shape(4096, 14336, 32, 32, vocab=128256, n_ctx=131072, n_kv=8, family="llama3", act="silu"),
    "qwen3-8b": Shape(4096, 12288, 36, 32, vocab=151936, n_ctx=40960, n_kv=8, family="qwen3", head_dim=128,
                      act="silu"),
    "2b": Shape(2048, 5632, 20, 16),     # >= 2 GB of weights: a model past the small ones, below 7B
    "tiny": Shape(128, 512, 3, 4, vocab=600, n_ctx=512),  # tests
    # Qwen3-30B-A3B: 48 layers of 128 experts (768 neurons each), top-8; 32 query and 4 KV heads of 128
    "qwen3-30b-a3b": Shape(2048, 768, 48, 32, vocab=151936, n_ctx=4096, n_kv=4, family="qwen3-moe", head_dim=128,
                           act="silu", n_expert=128, top_k=8),
    "tiny-moe": Shape(128, 64, 2, 4, vocab=600, n_ctx=512, n_kv=2, family="qwen3-moe", head_dim=32, act="silu",
                      n_expert=8, top_k=2),  # tests
    # 7B's attention and KV cache (4 GiB in f32 at 4096 positions), a token FFN and vocabulary: the engine's
    # open time at 7B's context (scripts/measure_engine_open.py) without 7B's conversion
    "7b-attention": Shape(4096, 256, 32, 32, vocab=1024),
}


def shape_of(name: str, layers: int | None = None) -> Shape:
    shape = SHAPES[name]
    return replace(shape, n_layer=layers) if layers else shape


GATE_STD = 0.02
GATE_NOISE = 0.2     # share of a gate row's variance that is full-rank noise; the rest lies in a low-rank subspace


def power_law_gates(shape: Shape, sparsity: float, u: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One layer's gate [n_ff, n_embd]: row j = r_j + b_j u with r_j ~ GATE_STD (low-rank + GATE_NOISE noise) and
    b_j = GATE_STD sqrt(2) Phi^-1(p_j). An input x = RMSNorm(n + sqrt(d) u) has u.x ~ sqrt(d/2) and r_j.x ~
    N(0, GATE_STD^2 d), so P(gate_j x > 0) = p_j; the hottest neurons sit at random positions."""
    from scipy.stats import norm

    d, f = shape.n_embd, shape.n_ff
    rank = max(8, d // 16)
    basis = torch.linalg.qr(torch.randn(d, rank, generator=gen))[0]
    low_rank = (torch.randn(f, rank, generator=gen) * (d / rank) ** 0.5) @ basis.T
    rows = GATE_STD * ((1 - GATE_NOISE) ** 0.5 * low_rank + GATE_NOISE ** 0.5 * torch.randn(f, d, generator=gen))
    rates = np.clip(selection_rates(shape, sparsity), 1e-4, 1 - 1e-4)
    lean = torch.from_numpy(GATE_STD * 2 ** 0.5 * norm.ppf(rates)).float()[torch.randperm(f, generator=gen)]
    return rows + lean[:, None] * u[None, :]


def build_model(out: Path, shape: Shape, seed: int = 0, progress: bool = True, act: str | None = None,
                sparsity: float | None = 0.9) -> int:
    """Write the checkpoint, tokenizer included; returns its weight bytes. act silu: a SiLU Llama of the shape,
    what `pi-tools sparsify` starts from (its speed at the shape: scripts/gpu_check.sh sparsify). `sparsity`: the
    ReLU model's mean FFN sparsity through power_law_gates; None: every weight iid N(0, 0.02^2), no hot neurons.
    act None: the shape's own."""
    out.mkdir(parents=True, exist_ok=True)
    act = act or shape.act
    gen = torch.Generator().manual_seed(seed)
    d, f, n_kv = shape.n_embd, shape.n_ff, shape.n_kv or shape.n_head
    d_head = shape.head_dim or d // shape.n_head
    q, kv = d_head * shape.n_head, d_head * n_kv
    skewed = sparsity is not None and act == "relu"
    # power-law model: residual additions small against the embeddings (their share of the norm per layer)
    out_std = 7.7 / d * (32 / shape.n_layer) ** 0.5 if skewed else 0.02
    u = torch.randn(d, generator=gen)
    u /= u.norm()
    shards, index, total = [], {}, 0

    def shard(tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        name = f"model-{len(shards) + 1:05d}-of-{shape.n_layer + 2:05d}.safetensors"
        save_file({k: v.to(torch.float16).contiguous() for k, v in tensors.items()}, out / name,
                  metadata={"format": "pt"})
        shards.append(name)
        for k, v in tensors.items():
            index[k] = name
            total += v.numel() * 2

    def rand(*dims: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*dims, generator=gen) * std

    def ones() -> torch.Tensor:
        return torch.ones(d)

    embed = (torch.randn(shape.vocab, d, generator=gen) + d ** 0.5 * u) if skewed else rand(shape.vocab, d)
    shard({"model.embed_tokens.weight": embed})
    del embed
    for i in tqdm(range(shape.n_layer), desc="layers", unit="layer", disable=not progress):
        p = f"model.layers.{i}."
        tensors = {p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
                   p + "self_attn.q_proj.weight": rand(q, d), p + "self_attn.k_proj.weight": rand(kv, d),
                   p + "self_attn.v_proj.weight": rand(kv, d), p + "self_attn.o_proj.weight": rand(d, q, std=out_std)}
        if shape.n_expert:
            tensors |= {p + "mlp.gate.weight": rand(shape.n_expert, d)}
            for e in range(shape.n_expert):
                x = f"{p}mlp.experts.{e}."
                tensors |= {x + "gate_proj.weight": rand(f, d), x + "up_proj.weight": rand(f, d),
                            x + "down_proj.weight": rand(d, f)}
        else:
            tensors |= {p + "mlp.gate_proj.weight": power_law_gates(shape, sparsity, u, gen) if skewed else rand(f, d),
                        p + "mlp.up_proj.weight": rand(f, d), p + "mlp.down_proj.weight": rand(d, f, std=out_std)}
        if shape.family in ("qwen3", "qwen3-moe"):  # per-head RMSNorm weights, not all 1 (a norm read from the wrong place shows)
            tensors |= {p + "self_attn.q_norm.weight": 1 + rand(d_head, std=0.1),
                        p + "self_attn.k_norm.weight": 1 + rand(d_head, std=0.1)}
        shard(tensors)
        del tensors
    shard({"model.norm.weight": ones(), "lm_head.weight": rand(shape.vocab, d)})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}))
    (out / "config.json").write_text(json.dumps(config(shape, act), indent=1))
    build_tokenizer(out, shape.vocab)
    return total


def config(shape: Shape, act: str) -> dict:
    """config.json of the shape's family, with the fields the real model's config sets (Llama-3.1-8B's and
    Qwen3-8B's, as published on the Hugging Face Hub)."""
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.n_embd,
            "intermediate_size": shape.n_ff, "num_hidden_layers": shape.n_layer,
            "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_kv or shape.n_head,
            "hidden_act": act, "max_position_embeddings": shape.n_ctx, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "vocab_size": shape.vocab, "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": 1,
            "eos_token_id": 2}
    if shape.family == "llama3":
        return base | {"rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}
    if shape.family == "qwen3-moe":  # every layer sparse, the top-k weights renormalised
        return base | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "rms_norm_eps": 1e-6,
                       "rope_theta": 1000000.0, "head_dim": shape.head_dim or shape.n_embd // shape.n_head,
                       "num_experts": shape.n_expert, "num_experts_per_tok": shape.top_k,
                       "moe_intermediate_size": shape.n_ff, "norm_topk_prob": True, "decoder_sparse_step": 1,
                       "mlp_only_layers": [], "attention_bias": False}
    if shape.family == "qwen3":
        return base | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6,
                       "rope_theta": 1000000.0, "head_dim": shape.head_dim or shape.n_embd // shape.n_head,
                       "attention_bias": False, "use_sliding_window": False}
    return base


def build_tokenizer(out: Path, vocab: int) -> int:
    """SentencePiece BPE with byte fallback, as Llama's, trained on the calibration text; returns its size."""
    import sentencepiece as spm

    text = "".join((DATA / name).read_text() for name in TOKENIZER_TEXT if (DATA / name).is_file())
    if not text:
        sys.exit(f"no calibration text under {DATA} to train a tokenizer on")
    work = out / ".spm"
    work.mkdir(parents=True, exist_ok=True)
    (work / "text.txt").write_text(text)
    spm.SentencePieceTrainer.train(input=str(work / "text.txt"), model_prefix=str(work / "sp"), vocab_size=vocab,
                                   hard_vocab_limit=False, model_type="bpe", byte_fallback=True, unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=2)
    shutil.copy(work / "sp.model", out / "tokenizer.model")
    shutil.rmtree(work)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))
    return spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).get_piece_size()


def selection_rates(shape: Shape, sparsity: float) -> np.ndarray:
    """Per neuron (hottest first) the probability of being predicted active: placement's power law scaled to
    the mean 1 - sparsity (capped at 1)."""
    from powerinfer_tools.stages.placement import placement

    rate = placement.power_law_rates(shape.n_ff)
    target = (1.0 - sparsity) * shape.n_ff
    low, high = 0.0, shape.n_ff / rate.min()  # bisect the scale: sum(min(1, scale * rate)) is monotone in it
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if np.minimum(1.0, rate * mid).sum() < target else (low, mid)
    return np.minimum(1.0, rate * high)


def neuron_permutation(shape: Shape, layer: int, seed: int = 0) -> np.ndarray:
    """Source position of the layer's k-th hottest neuron: hot neurons scattered as in a trained model."""
    return np.random.default_rng([seed, layer]).permutation(shape.n_ff)


def build_predictors(out: Path, shape: Shape, sparsity: float, rank: int = 128, seed: int = 0) -> Path:
    """A predictor directory (docs/formats.md) whose layers predict a share 1 - `sparsity` of neurons active."""
    from scipy.stats import norm

    from powerinfer_tools.core.atomic import atomic_file

    out.mkdir(parents=True, exist_ok=True)
    rates = selection_rates(shape, sparsity)
    shift = torch.tensor(norm.ppf(np.clip(rates, 1e-6, 1 - 1e-6)) * np.sqrt(np.pi / rank), dtype=torch.float32)
    for i in range(shape.n_layer):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        fc1 = torch.randn(rank, shape.n_embd, generator=gen) / shape.n_embd ** 0.5
        fc2 = torch.randn(shape.n_ff, rank, generator=gen)
        fc2[torch.from_numpy(neuron_permutation(shape, i, seed))] += shift[:, None]
        with atomic_file(out / f"model_{i}.pt") as tmp:
            torch.save({"fc1.weight": fc1, "fc2.weight": fc2}, tmp)
    (out / "config.json").write_text(json.dumps({
        "format": "powerinfer-tools.predictors/1", "sparse_threshold": 0.0, "synthetic_sparsity": sparsity,
        "layers": [{"layer": i, "rank": rank, "threshold": 0.0} for i in range(shape.n_layer)]}, indent=1))
    return out


def build_profile(out: Path, shape: Shape, tokens: int = 1 << 16, seed: int = 0) -> Path:
    """A profile directory (docs/formats.md) of power-law counts, the same hot neurons as the predictors'."""
    from powerinfer_tools.stages.placement import placement

    (out / "activation").mkdir(parents=True, exist_ok=True)
    hottest_first = placement.synthetic_counts([shape.n_ff] * shape.n_layer, tokens=tokens)
    layers = []
    for i, counts in enumerate(hottest_first):
        by_source = np.zeros(shape.n_ff, dtype=np.int64)
        by_source[neuron_permutation(shape, i, seed)] = counts.astype(np.int64)
        torch.save(torch.from_numpy(by_source), out / "activation" / f"activation_{i}.pt")
        layers.append({"layer": i, "sparsity": float(1.0 - counts.sum() / (tokens * shape.n_ff))})
    (out / "profile.json").write_text(json.dumps({
        "format": "powerinfer-tools.profile/1",
        "model": {"source": "synthetic", "arch": "llama-relu", "gguf_arch": "llama", "model_type": "llama",
                  "activation": "relu", "n_layer": shape.n_layer, "n_embd": shape.n_embd, "n_ff": shape.n_ff},
        "rule": "nonzero", "thresholds": [0.0] * shape.n_layer, "target_sparsity": None, "tokens": tokens,
        "synthetic": "placement.synthetic_counts", "layers": layers}, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("model", "predictors", "profile"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b", help="default: 7b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (default: all)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sparsity", type=float, default=0.9, help="predictors: share predicted inactive (default 0.9)")
    ap.add_argument("--rank", type=int, default=128, help="predictors: rank (default 128)")
    ap.add_argument("--act", choices=("relu", "silu"), default=None,
                    help="model: FFN activation (default: the shape's, relu for the Llama 2 shapes, silu for the 8Bs and the "
                         "mixture)")
    ap.add_argument("--model-sparsity", default="0.9",
                    help="model: the ReLU model's mean FFN sparsity, hot and cold neurons by a power law "
                         "(power_law_gates), or 'iid' for plain random weights (default 0.9)")
    args = ap.parse_args()
    shape = shape_of(args.shape, args.layers)
    if args.what == "model":
        try:
            sparsity = None if args.model_sparsity == "iid" else float(args.model_sparsity)
        except ValueError:
            sys.exit(f"--model-sparsity takes a number in [0, 1) or 'iid', got {args.model_sparsity!r}")
        if sparsity is not None and not 0.0 <= sparsity < 1.0:
            sys.exit(f"--model-sparsity must be in [0, 1), got {sparsity}")
        if shape.n_expert and args.act == "relu":
            sys.exit(f"--shape {args.shape} is a mixture of SiLU experts (Qwen3-MoE's): --act relu is refused")
        total = build_model(args.out, shape, act=args.act, sparsity=sparsity)
        print(f"{args.out}: {total / 2**30:.2f} GiB of f16 weights in {shape.n_layer + 2} shards")
    elif args.what == "predictors":
        if not 0.0 <= args.sparsity < 1.0:
            sys.exit(f"--sparsity must be in [0, 1), got {args.sparsity}")
        build_predictors(args.out, shape, args.sparsity, args.rank)
    else:
        build_profile(args.out, shape)


if __name__ == "__main__":
    main()
