"""Quality cost of a uniform activation-sparsity target (SiLU/GELU models), measured in transformers.

    python scripts/sparsity_quality.py --model smollm2 --calib ../shared/data/wikitext-2-valid.txt \
        --eval ../shared/data/wikitext-2-raw-test.txt --targets 0,0.2,0.25,0.3,0.5 --eval-tokens 8192

Thresholds are calibrated on --calib, perplexity is measured on --eval (never the same text).
"""
from __future__ import annotations

import argparse

from powerinfer_tools import calibration, evaluate, models
from powerinfer_tools.profile import calibrate_thresholds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--targets", default="0,0.2,0.25,0.3,0.5")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    source = models.resolve(args.model)
    model, adapter = models.load_model(source)
    tok = models.load_tokenizer(source)
    calib = calibration.sequences_from_text(tok, [calibration.read_text(args.calib)], args.seq_len, args.calib_tokens)
    evals = calibration.sequences_from_text(tok, [calibration.read_text(args.eval)], args.seq_len, args.eval_tokens)
    n_layer = adapter.dims().n_layer
    base = evaluate.perplexity(model, adapter, evals)
    print(f"{'target':>7} {'ppl':>9} {'vs dense':>9}   ({evals.numel()} eval tokens)")
    print(f"{'dense':>7} {base:>9.3f} {'':>9}")
    for target in [float(t) for t in args.targets.split(",") if float(t) > 0]:
        thresholds = calibrate_thresholds(model, adapter, calib, [target] * n_layer, 4, 0)
        ppl = evaluate.perplexity(model, adapter, evals, thresholds)
        print(f"{target:>7.2f} {ppl:>9.3f} {100 * (ppl / base - 1):>+8.1f}%")


if __name__ == "__main__":
    main()
