"""Profiling overhead: profiled tokens/s vs a plain transformers forward over the same tokens.

    python scripts/bench_profile_overhead.py --model smollm2 --calib ../shared/data/wikitext-2-valid.txt \
        --tokens 8192 --repeats 3

Prints the median time of each over the repeats (interleaved) and the ratio (target >= 0.8x).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from powerinfer_tools.stages.profiling import calibration
from powerinfer_tools import models
from powerinfer_tools.stages.profiling.profiling import profile_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-samples", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    source = models.resolve(args.model)
    model, adapter = models.load_model(source)
    seqs = calibration.sequences_from_text(models.load_tokenizer(source), [calibration.read_text(args.calib)],
                                           args.seq_len, args.tokens)
    n_layer = adapter.dims().n_layer
    thresholds = [0.05] * n_layer
    chosen = np.sort(np.random.default_rng(0).choice(seqs.numel(), min(args.max_samples, seqs.numel()), replace=False))
    plain, profiled = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            for start in range(0, len(seqs), args.batch):
                model(input_ids=seqs[start:start + args.batch], use_cache=False)
        plain.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            _, elapsed = profile_pass(model, adapter, seqs, thresholds, args.batch, chosen, Path(tmp))
        profiled.append(elapsed)
    n = seqs.numel()
    tp, tq = statistics.median(plain), statistics.median(profiled)
    print(f"tokens {n}, threads {torch.get_num_threads()}, repeats {args.repeats}")
    print(f"plain forward   : median {tp:.2f} s  ({n / tp:.0f} tok/s)  runs {[round(t, 2) for t in plain]}")
    print(f"profiled forward: median {tq:.2f} s  ({n / tq:.0f} tok/s)  runs {[round(t, 2) for t in profiled]}")
    print(f"profiled / plain throughput: {tp / tq:.3f}x")


if __name__ == "__main__":
    main()
