"""Quality against FFN activation sparsity, measured in transformers on the same evaluation windows:
training-free thresholds of a SiLU/GELU model (what `pi-tools profile --target-sparsity` calibrates) next to
models made sparse by `pi-tools sparsify` (exact zeros of ReLU).

    python scripts/sparsity_quality.py --model smollm2 --calib ../shared/data/wikitext-2-valid.txt \
        --eval ../shared/data/wikitext-2-raw-test.txt --eval ../shared/data/tinyshakespeare.txt \
        --targets 0.3,0.5,0.7,0.85,0.9 --sparsified smollm2-relu85 --eval-tokens 16384

Thresholds are calibrated on --calib, perplexity is measured on each --eval (never the calibration text).
Sparsity is measured on the first --eval text's windows: the share of activations at or below the layer's
threshold (thresholded rows) or exactly zero (sparsified models), over all layers and tokens.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from powerinfer_tools.stages.profiling import calibration
from powerinfer_tools.runtime import evaluate
from powerinfer_tools import models
from powerinfer_tools.stages.profiling.profiling import calibrate_thresholds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--eval", required=True, action="append", help="evaluation text (repeatable)")
    ap.add_argument("--targets", default="0.2,0.25,0.3,0.5")
    ap.add_argument("--sparsified", action="append", default=[], help="a `pi-tools sparsify` output (repeatable)")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    source = models.resolve(args.model)
    model, adapter = models.load_model(source)
    tok = models.load_tokenizer(source)
    evals = {Path(p).name: calibration.sequences_from_text(tok, [calibration.read_text(p)], args.seq_len,
                                                           args.eval_tokens) for p in args.eval}
    n_layer = adapter.dims().n_layer
    first = next(iter(evals.values()))
    rows = [("original", model, adapter, None)]
    if args.targets:
        calib = calibration.sequences_from_text(tok, [calibration.read_text(args.calib)], args.seq_len,
                                                args.calib_tokens)
        for target in [float(t) for t in args.targets.split(",") if float(t) > 0]:
            thresholds = calibrate_thresholds(model, adapter, calib, [target] * n_layer, 4, 0)
            rows.append((f"thresholds at {target:g}", model, adapter, thresholds))
    for directory in args.sparsified:
        sparse, sparse_adapter = models.load_model(models.resolve(directory))
        rows.append((f"sparsify {Path(directory).name}", sparse, sparse_adapter, None))

    base: dict[str, float] = {}   # the original's perplexity per text: the first row
    print(f"({', '.join(f'{name}: {s.numel()} tokens' for name, s in evals.items())}, windows of {args.seq_len})")
    print(f"| model | FFN sparsity | {' | '.join(f'{name} ppl | vs original' for name in evals)} |")
    print("|---|---:|" + "---:|---:|" * len(evals))
    for label, m, a, thresholds in rows:
        dims = a.dims()
        inactive = torch.zeros(dims.n_layer, dtype=torch.float64)   # counted on the first text
        cells = []
        for k, (name, seqs) in enumerate(evals.items()):
            ppl = evaluate.perplexity(m, a, seqs, thresholds, inactive=inactive if k == 0 else None)
            base.setdefault(name, ppl)
            cells.append(f"{ppl:.3f} | {ppl / base[name]:.3f}x")
        sparsity = float(inactive.sum()) / (first.numel() * dims.n_ff * dims.n_layer)
        print(f"| {label} | {sparsity:.3f} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
