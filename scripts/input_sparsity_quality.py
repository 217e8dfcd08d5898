"""Quality against input sparsity (TEAL-style, every matrix), measured in transformers: the uniform and the greedy
allocation of `pi-tools profile`'s input thresholds (stages/profiling/input_sparsity.py) at several model-wide shares,
against the dense model, on the same evaluation windows.

    python scripts/input_sparsity_quality.py --model smollm2 --calib ../shared/data/wikitext-2-valid.txt \
        --eval ../shared/data/wikitext-2-raw-test.txt --shares 0.25,0.4,0.5 --eval-tokens 16384

Thresholds are calibrated on --calib (never the evaluation text); perplexity is over non-overlapping windows of
--seq-len tokens of --eval.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from powerinfer_tools import models
from powerinfer_tools.runtime import evaluate
from powerinfer_tools.stages.profiling import calibration, input_sparsity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--shares", default="0.25,0.4,0.5")
    ap.add_argument("--allocations", default="uniform,greedy")
    ap.add_argument("--calib-tokens", type=int, default=input_sparsity.CALIBRATION_TOKENS)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dense-ppl", type=float, help="the dense model's perplexity on these windows, measured before")
    ap.add_argument("--save", type=Path, help="keep each allocation's table in SAVE/ALLOCATION (a profile directory "
                                               "that `pi-tools convert --profile` takes)")
    args = ap.parse_args()

    source = models.resolve(args.model)
    model, adapter = models.load_model(source)
    tok = models.load_tokenizer(source)
    calib = calibration.sequences_from_text(tok, [calibration.read_text(args.calib)], args.seq_len, args.calib_tokens)
    seqs = calibration.sequences_from_text(tok, [calibration.read_text(args.eval, "evaluation")], args.seq_len,
                                           args.eval_tokens)
    dense = args.dense_ppl or evaluate.perplexity(model, adapter, seqs)
    print(f"({seqs.numel()} tokens of {args.eval}, windows of {args.seq_len}; thresholds on {calib.numel()} tokens "
          f"of {args.calib})")
    print("| allocation | inputs zeroed (share of weight bytes) | perplexity | vs dense | calibration s |")
    print("|---|---:|---:|---:|---:|")
    print(f"| dense | 0 | {dense:.3f} | | |", flush=True)
    for allocation in args.allocations.split(","):
        t0 = time.perf_counter()
        shares = [float(s) for s in args.shares.split(",")]
        # the levels up to the largest share measured (the greedy search's cost grows with the last level)
        levels = tuple(b for b in input_sparsity.LEVELS if b <= max(shares) + 1e-9)
        table = input_sparsity.calibrate(model, adapter, calib, allocation, 4, 0, levels)
        took = time.perf_counter() - t0
        if args.save:
            out = args.save / allocation
            out.mkdir(parents=True, exist_ok=True)
            table.save(out)
            (out / "profile.json").write_text(json.dumps({"thresholds": [0.0] * adapter.dims().n_layer}))
        for share in shares:
            with input_sparsity.zeroed_inputs(adapter, model, table.at(share)):
                ppl = evaluate.perplexity(model, adapter, seqs)
            print(f"| {allocation} | {share:g} | {ppl:.3f} | {100 * (ppl / dense - 1):+.1f} % | {took:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
