"""Decode speed and memory of the engine with and without a memory budget (docs/engine.md, "Models larger than
memory"): one process per run, a prompt of random tokens, then greedy decode steps one token at a time; prints one
JSON line with tokens/s, the disk tier's counters per token and the process's peak RSS (VmHWM).

Run it under a memory limit of your own making (a cgroup; docs/bench.md has the commands used), once with
--memory-budget and once without it (and no limit) for the ratio.

Examples:

  python scripts/measure_disk_tier.py relu7b.q4_0.powerinfer.gguf --memory-budget 1.4 -t 2
  python scripts/measure_disk_tier.py relu7b.q4_0.powerinfer.gguf -t 2      # every row mapped
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import powerinfer_engine as engine


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--memory-budget", type=float, default=None, help="GiB (default: none given: the engine's default)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="default: 2")
    ap.add_argument("--sparse-mode", default="predictor", help="default: predictor")
    ap.add_argument("--n-prompt", type=int, default=16, help="default: 16")
    ap.add_argument("--n-gen", type=int, default=32, help="decode steps timed (default: 32)")
    ap.add_argument("--ctx", type=int, default=64, help="default: 64")
    ap.add_argument("--kv-type", default="f16", help="default: f16")
    ap.add_argument("--seed", type=int, default=0, help="default: 0")
    args = ap.parse_args()

    t0 = time.perf_counter()
    with engine.Model(args.model, threads=args.threads, sparse_mode=args.sparse_mode, ctx_size=args.ctx,
                      kv_type=args.kv_type, memory_budget=args.memory_budget, gpu="off") as m:
        open_seconds = time.perf_counter() - t0
        rng = np.random.default_rng(args.seed)
        vocab = m.n_vocab
        logits = m.eval(rng.integers(3, vocab, size=args.n_prompt).tolist())
        m.reset_stats()
        tok = int(np.argmax(logits[-1]))
        t1 = time.perf_counter()
        for _ in range(args.n_gen):
            tok = int(np.argmax(m.eval([tok])[-1]))
        seconds = time.perf_counter() - t1
        stats = m.stats()
    disk = stats["disk"]
    n = args.n_gen
    n_ff = m.info["n_ff"]
    selected = sum(l["predicted_density"] * n_ff for l in stats["layers"] if np.isfinite(l["predicted_density"]))
    out = {"model": args.model, "memory_budget_gib": args.memory_budget, "threads": args.threads,
           "sparse_mode": args.sparse_mode, "open_seconds": round(open_seconds, 2),
           "decode_tokens_per_second": round(n / seconds, 3), "selected_neurons_per_token": round(selected, 1),
           "peak_rss_gib": round(peak_rss_bytes() / 2**30, 3),
           "seconds_per_token": {k: round(v / n, 4) for k, v in stats["phases"].items()}}
    if disk is not None:
        out.update({"disk_bytes_per_token": disk["bytes"] / n, "disk_reads_per_token": disk["reads"] / n,
                    "cache_hit_rate": disk["cache_hits"] / max(1.0, disk["cache_hits"] + disk["cache_misses"]),
                    "misses_per_token": disk["cache_misses"] / n, "io_wait_per_token": disk["io_wait_seconds"] / n,
                    "resident_gib": disk["resident_bytes"] / 2**30, "budget_gib": disk["budget_bytes"] / 2**30})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
