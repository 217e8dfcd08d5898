#!/usr/bin/env python3
"""Peak memory of `pi-tools convert` on a synthetic Llama model of >= 2 GB of weights.

Builds (once) a random f16 Llama-shaped checkpoint with scripts/synthetic_llama.py (sharded safetensors,
one shard per layer, so building it needs little memory either) plus its predictors, converts it under
/usr/bin/time -v and reports the peak RSS against the model size and the largest tensor. Streaming works if the peak
is the interpreter's baseline plus about one float32 copy of the largest tensor, not the model.

Usage: python scripts/measure_convert_memory.py --work /tmp/synthetic [--shape 2b|7b|13b] [--layers N] [--outtype f16]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import synthetic_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/pi-synthetic"))
    ap.add_argument("--shape", choices=sorted(synthetic_llama.SHAPES), default="2b", help="default: 2b")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--outtype", default="f16")
    args = ap.parse_args()
    shape = synthetic_llama.shape_of(args.shape, args.layers)
    model, pred, out = args.work / "model", args.work / "pred", args.work / f"model.{args.outtype}.powerinfer.gguf"
    if not (model / "config.json").is_file():
        t = time.time()
        synthetic_llama.build_model(model, shape)
        synthetic_llama.build_predictors(pred, shape, sparsity=0.5)
        print(f"built synthetic model in {time.time() - t:.0f} s")
    weight_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "powerinfer_tools", "convert", "-m", str(model),
           "--predictors", str(pred), "--outtype", args.outtype, "-o", str(out), "-q"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(result.stderr[-2000:])
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", result.stderr).group(1)
    largest_f32 = shape.vocab * shape.n_embd * 4
    print(result.stdout.strip())
    print(f"source weights: {weight_bytes / 2**30:.2f} GiB in {len(list(model.glob('*.safetensors')))} shards; "
          f"output {out.stat().st_size / 2**30:.2f} GiB ({args.outtype})")
    print(f"peak RSS: {peak_kb / 2**20:.2f} GiB; largest tensor in float32: {largest_f32 / 2**20:.0f} MiB; "
          f"wall {wall}")


if __name__ == "__main__":
    main()
