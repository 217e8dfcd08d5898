#!/usr/bin/env python
"""docs/bench.md's table of what a token would read from the disk when a model is larger than memory: arithmetic
on `pi-tools convert --dry-run`'s sizes (stages/conversion/dry_run.size_report, the same numbers) and an assumed activation
law, not a run.

For each model and memory size M: the parts every token reads whole (attention, predictors, output head) and the
KV cache at --ctx stay in memory, with --overhead GiB for the process (Python, work buffers); the FFN neurons get
what is left, hottest first, the same share of every layer. A token then reads from the disk the rows of the
neurons that fire and are not in memory: per layer, neuron_bytes x the sum of the firing rates of the cold ones.
The rates are the dry run's synthetic power law (placement.power_law_rates, what `plan --dry-run` assumes without
a profile). Beside it, llama.cpp mapping the file: each token touches every weight in the same order, which the
kernel's least-recently-used page cache serves worst, so it reads what does not fit, about the whole file
(docs/bench.md measures this on the 7B shape).

    python scripts/disk_read_table.py [--models relullama-7b,relufalcon-40b,relullama-70b] [--memory 16,20]
                                      [--outtype q4_0] [--predictor-rank 512] [--ctx 2048] [--overhead 0.5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerinfer_tools.stages.conversion import dry_run  # noqa: E402
from powerinfer_tools.stages.placement import placement

GIB = 2**30


def row(report: dict, memory_gib: float, ctx: int, overhead_gib: float) -> dict:
    r = report
    c = r.costs
    parts = r.parts()
    always = parts["attention"] + parts["predictors"] + parts["output"] + r.kv_cache_bytes(ctx)
    room = memory_gib * GIB - overhead_gib * GIB - always
    share = float(np.clip(room / parts["ffn"], 0.0, 1.0)) if room > 0 else 0.0
    cold_bytes = hot_bytes = active = cold_active = 0.0
    for n, nb in zip(c.n_ff, c.neuron_bytes):
        rates = placement.power_law_rates(int(n))
        hot = int(share * n)
        active += rates.sum()
        cold_active += rates[hot:].sum()
        cold_bytes += float(nb) * rates[hot:].sum()
        hot_bytes += float(nb) * rates[:hot].sum()
    return {"file": r.file_bytes, "always": always, "ffn": parts["ffn"], "share": share if room > 0 else None,
            "active": active / c.n_ff.sum(), "cold_active": cold_active / max(active, 1e-9),
            "memory_read": always + hot_bytes, "disk": cold_bytes if room > 0 else None,
            "mmap_disk": max(0.0, r.file_bytes - (memory_gib - overhead_gib) * GIB)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="relullama-7b,relufalcon-40b,relullama-70b")
    ap.add_argument("--memory", default="16,20", help="GiB of memory the engine may use (default 16,20)")
    ap.add_argument("--outtype", default="q4_0")
    ap.add_argument("--predictor-rank", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--overhead", type=float, default=0.5, help="GiB for the process itself (default 0.5)")
    args = ap.parse_args()
    print(f"{args.outtype}, predictors of rank {args.predictor_rank}, KV cache f32 at ctx {args.ctx}, "
          f"{args.overhead:g} GiB for the process; arithmetic, not a run\n")
    print("| model | file GiB | memory GiB | FFN GiB | FFN share in memory | neurons firing | of them cold | "
          "from memory GiB/token (KV at full context) | from disk MiB/token | llama.cpp mmap: from disk MiB/token "
          "(the file less memory: the least) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        report = dry_run.size_report(dry_run.load(name), args.outtype, args.predictor_rank)
        for memory in (float(m) for m in args.memory.split(",")):
            x = row(report, memory, args.ctx, args.overhead)
            fits = x["file"] + report.kv_cache_bytes(args.ctx) <= (memory - args.overhead) * GIB
            disk = "0 (fits)" if fits else ("does not fit" if x["disk"] is None else f"{x['disk'] / 2**20:.0f}")
            print(f"| {name} | {x['file'] / GIB:.1f} | {memory:g} | {x['ffn'] / GIB:.1f} | "
                  + (f"{x['share']:.0%}" if x["share"] is not None else "–") + f" | {x['active']:.1%} | "
                  f"{x['cold_active']:.0%} | {x['memory_read'] / GIB:.2f} | {disk} | "
                  + ("0 (fits)" if fits else f"{x['mmap_disk'] / 2**20:.0f}") + " |")


if __name__ == "__main__":
    main()
