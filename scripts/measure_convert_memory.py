#!/usr/bin/env python3
"""Peak memory of `pi-tools convert` on a synthetic Llama model of >= 2 GB of weights.

Builds (once) a random f16 Llama-shaped checkpoint in sharded safetensors (one shard per layer, so
building it needs little memory either) plus random predictors, converts it under /usr/bin/time -v
and reports the peak RSS against the model size and the largest tensor. Streaming works if the peak
is the interpreter's baseline plus about one float32 copy of the largest tensor, not the model.

Usage: python scripts/measure_convert_memory.py --work /tmp/synthetic [--layers 20] [--outtype f16]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

HIDDEN, N_FF, VOCAB, HEADS = 2048, 5632, 32000, 16


def build_model(out: Path, layers: int) -> int:
    """Write the checkpoint; returns its weight bytes."""
    from tiny_models import _spm_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards, index, total = [], {}, 0

    def shard(tensors: dict[str, torch.Tensor]):
        nonlocal total
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(tensors, out / name)
        shards.append(name)
        for k, v in tensors.items():
            index[k] = name
            total += v.numel() * v.element_size()

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.float16)

    shard({"model.embed_tokens.weight": rand(VOCAB, HIDDEN)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard({p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.float16),
               p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.float16),
               **{p + f"self_attn.{x}_proj.weight": rand(HIDDEN, HIDDEN) for x in "qkvo"},
               p + "mlp.gate_proj.weight": rand(N_FF, HIDDEN), p + "mlp.up_proj.weight": rand(N_FF, HIDDEN),
               p + "mlp.down_proj.weight": rand(HIDDEN, N_FF)})
    shard({"model.norm.weight": torch.ones(HIDDEN, dtype=torch.float16), "lm_head.weight": rand(VOCAB, HIDDEN)})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": N_FF, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "hidden_act": "relu", "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}))
    _spm_tokenizer(out)
    return total


def build_predictors(out: Path, layers: int, rank: int = 128) -> None:
    from convert_helpers import write_predictors

    write_predictors(out, layers, HIDDEN, N_FF, rank=rank)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/pi-synthetic"))
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--outtype", default="f16")
    args = ap.parse_args()
    model, pred, out = args.work / "model", args.work / "pred", args.work / f"model.{args.outtype}.powerinfer.gguf"
    if not (model / "config.json").is_file():
        t = time.time()
        build_model(model, args.layers)
        build_predictors(pred, args.layers)
        print(f"built synthetic model in {time.time() - t:.0f} s")
    weight_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "powerinfer_tools", "convert", "-m", str(model),
           "--predictors", str(pred), "--outtype", args.outtype, "-o", str(out), "-q"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(result.stderr[-2000:])
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", result.stderr).group(1)
    largest_f32 = VOCAB * HIDDEN * 4
    print(result.stdout.strip())
    print(f"source weights: {weight_bytes / 2**30:.2f} GiB in {len(list(model.glob('*.safetensors')))} shards; "
          f"output {out.stat().st_size / 2**30:.2f} GiB ({args.outtype})")
    print(f"peak RSS: {peak_kb / 2**20:.2f} GiB; largest tensor in float32: {largest_f32 / 2**20:.0f} MiB; "
          f"wall {wall}")


if __name__ == "__main__":
    main()
