#!/usr/bin/env python3
"""The profile's speed limit on this machine: a decoder layer's matrix multiplies timed alone, at the shapes and
dtype `pi-tools profile` runs them (batch x seq-len tokens against each projection of the model's config), and
the tokens/s that rate allows for the whole model's layers. A profile's `tokens_per_second` (profile.json) is then
read against it.

  python scripts/profile_bound.py --model relu7b --dtype float32 --batch 4 --seq-len 512 [--profile prof7b]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerinfer_tools import models  # noqa: E402
from powerinfer_tools.models import arch  # noqa: E402


def projections(config) -> list[tuple[int, int]]:
    """(out, in) of one llama-family layer's matrices."""
    d, f = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = d // heads * (getattr(config, "num_key_value_heads", None) or heads)
    return [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a llama-family HF directory (only its config is read)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", type=Path, help="a profile of the model: its tokens/s against the bound")
    args = ap.parse_args()
    source = models.resolve(args.model)
    config = models.load_config(source)
    n_layer = arch.for_config(config).dims().n_layer
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.batch * args.seq_len, config.hidden_size, dtype=dtype)
    seconds, flops = 0.0, 0
    for out_dim, in_dim in projections(config):
        w = torch.randn(out_dim, in_dim, dtype=dtype)
        inp = x if in_dim == config.hidden_size else torch.randn(x.shape[0], in_dim, dtype=dtype)
        torch.nn.functional.linear(inp, w)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            torch.nn.functional.linear(inp, w)
            times.append(time.perf_counter() - t)
        seconds += statistics.median(times)
        flops += 2 * x.shape[0] * out_dim * in_dim
    rate = flops / seconds
    layer_tok_s = x.shape[0] / seconds
    bound = layer_tok_s / n_layer
    result = {"threads": torch.get_num_threads(), "dtype": args.dtype, "gflop_per_s": rate / 1e9,
              "gflop_per_token": flops / x.shape[0] * n_layer / 1e9, "bound_tokens_per_s": bound}
    if args.profile:
        meta = json.loads((args.profile / "profile.json").read_text())
        result["profile_tokens_per_s"] = meta["tokens_per_second"]
        result["share_of_bound"] = meta["tokens_per_second"] / bound
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
