"""How much predictor mode's result depends on rounding: transformers with a predictor directory's masks, with
the FFN activations fed to the down projection kept float32 (our engine) or rounded to float16 (PowerInfer's CPU
axpy converts them, ggml.c `ggml_compute_forward_mul_mat_axpy`), in predictor mode and with every neuron
computed (dense). docs/formats.md, "Checked against PowerInfer's binaries", explains what the gap shows.

    python scripts/predictor_rounding.py --model smollm2-relu --predictors pred \
        --text ../shared/data/wikitext-2-raw-test.txt --ctx 128 --chunks 8

Per variant: perplexity over `--chunks` windows of `--ctx` tokens (every token after each window's first), and
for the float16 rows in predictor mode the share of (token, neuron) decisions of the predictor that differ from
the float32 run's.
"""
from __future__ import annotations

import argparse

import torch

from powerinfer_tools import models
from powerinfer_tools.models import arch as arch_mod
from powerinfer_tools.runtime import evaluate
from powerinfer_tools.stages.profiling import calibration
from powerinfer_tools.stages.predictors.predictor import read_predictor_dir


@torch.no_grad()
def run(model, adapter, predictors, seqs: torch.Tensor, predict: bool, round_f16: bool):
    """(perplexity, per-layer masks [tokens, n_ff] or None) with the variant's masks and rounding."""
    layers = model.model.layers
    residual, masks = {}, {i: [] for i in range(len(layers))}

    def on_input(i, x):
        residual[i] = x

    def on_activation(i, a):
        logits = predictors.models[i](residual[i].float())
        mask = logits > predictors.thresholds[i]
        masks[i].append(mask.reshape(-1, mask.shape[-1]))
        return a * mask

    handles = arch_mod.install_taps(adapter, model, on_input=on_input, on_activation=on_activation) if predict else []
    if round_f16:
        for layer in layers:
            handles.append(layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: (args[0].half().float(),)))
    try:
        ppl = evaluate.perplexity(model, adapter, seqs)
    finally:
        for h in handles:
            h.remove()
    return ppl, ({i: torch.cat(m) for i, m in masks.items()} if predict else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF ReLU llama directory (pi-tools sparsify's output)")
    ap.add_argument("--predictors", required=True, help="its predictor directory (pi-tools train-predictor)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()

    source = models.resolve(args.model)
    model, adapter = models.load_model(source)
    predictors = read_predictor_dir(args.predictors)
    for layer in model.model.layers:  # the file's down projection: f16 in every file PowerInfer runs
        layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data.half().float()
    seqs = calibration.sequences_from_text(models.load_tokenizer(source), [calibration.read_text(args.text)],
                                           args.ctx, args.ctx * args.chunks)
    print(f"{seqs.shape[0]} windows of {seqs.shape[1]} tokens")
    print("| mode | activations into the down projection | perplexity | vs float32 | decisions flipped |")
    print("|---|---|---:|---:|---:|")
    for predict in (False, True):
        base, base_masks = run(model, adapter, predictors, seqs, predict, False)
        f16, f16_masks = run(model, adapter, predictors, seqs, predict, True)
        mode = "predictor" if predict else "dense"
        flipped = ""
        if predict:
            flips = sum(int((base_masks[i] != f16_masks[i]).sum()) for i in base_masks)
            total = sum(m.numel() for m in base_masks.values())
            flipped = f"{flips / total:.2e} ({flips} of {total})"
        print(f"| {mode} | float32 | {base:.3f} | | |")
        print(f"| {mode} | float16 | {f16:.3f} | {100 * (f16 / base - 1):+.2f} % | {flipped} |", flush=True)


if __name__ == "__main__":
    main()
