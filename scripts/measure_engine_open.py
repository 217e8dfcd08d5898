#!/usr/bin/env python3
"""Open time and peak memory of the engine on one file, per FFN mode, each mode in a fresh process.

For each mode: the wall time of `engine.Model(...)` (mapping, checks, packing, buffers), of one prompt
batch and of `--n-gen` decode steps, and the process's peak RSS (VmHWM) less its RSS before the model
opened, against file size + KV cache + work buffers (the engine's own figures). Run it twice: the
first run reads the file from disk, the second ("warm") finds it in the page cache.

Usage: python scripts/measure_engine_open.py model.powerinfer.gguf [--modes dense,predictor] [--ctx 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def one(path: str, mode: str, ctx: int, threads: int, n_prompt: int, n_gen: int, kv_type: str) -> dict:
    """Measure in this process (the child of `main`)."""
    sys.path.insert(0, str(ROOT))
    import powerinfer_engine as engine

    before = _status("VmRSS")
    t = time.perf_counter()
    model = engine.Model(path, threads=threads, sparse_mode=mode, ctx_size=ctx, kv_type=kv_type)
    opened = time.perf_counter() - t
    t = time.perf_counter()
    model.eval(list(range(10, 10 + n_prompt)), all_logits=False)
    prompt = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(n_gen):
        model.eval([100 + i], all_logits=False)
    gen = time.perf_counter() - t
    info = model.info
    return {"mode": mode, "open_s": opened, "prompt_s": prompt, "prompt_tokens": n_prompt, "gen_s": gen,
            "gen_tokens": n_gen, "file_bytes": os.path.getsize(path), "kv_cache_bytes": info["kv_cache_bytes"],
            "work_buffer_bytes": info["work_buffer_bytes"], "rss_before_bytes": before,
            "peak_rss_bytes": _status("VmHWM"), "ctx": ctx}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--modes", default="dense,predictor", help="default dense,predictor")
    ap.add_argument("--ctx", type=int, default=4096, help="KV cache positions (default 4096)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--n-gen", type=int, default=8)
    ap.add_argument("--kv-type", default="f32")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.file, args.modes, args.ctx, args.threads, args.n_prompt, args.n_gen, args.kv_type)))
        return
    for mode in args.modes.split(","):
        out = subprocess.run([sys.executable, __file__, args.file, "--child", "--modes", mode, "--ctx", str(args.ctx),
                              "--threads", str(args.threads), "--n-prompt", str(args.n_prompt),
                              "--n-gen", str(args.n_gen), "--kv-type", args.kv_type],
                             capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(out.stderr[-2000:])
        r = json.loads(out.stdout)
        budget = r["file_bytes"] + r["kv_cache_bytes"] + r["work_buffer_bytes"]
        held = r["peak_rss_bytes"] - r["rss_before_bytes"]
        print(f"{mode}: open {r['open_s']:.2f} s; prompt {r['prompt_tokens'] / r['prompt_s']:.1f} t/s; "
              f"decode {r['gen_tokens'] / r['gen_s']:.2f} t/s; peak RSS - before {held / 2**30:.2f} GiB vs "
              f"file {r['file_bytes'] / 2**30:.2f} + KV {r['kv_cache_bytes'] / 2**30:.2f} + work "
              f"{r['work_buffer_bytes'] / 2**30:.2f} GiB = {held / budget:.3f}x; ctx {r['ctx']}", flush=True)


if __name__ == "__main__":
    main()
