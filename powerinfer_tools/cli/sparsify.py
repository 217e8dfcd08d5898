"""`pi-tools sparsify`."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.stages import options as limits


def sparsify(
    model: str = typer.Option(..., "--model", "-m", help="SiLU Llama-family model: HF directory, .gguf file, "
                              "or 'smollm2'."),
    out: Path = typer.Option(..., "--out", "-o", help="Output Hugging Face model directory (ReLU Llama)."),
    calib: Optional[List[Path]] = typer.Option(None, "--calib", help="Training text file (repeatable; never the "
                                               "evaluation text). Without it: text the model generates itself."),
    self_tokens: int = typer.Option(0, "--self-tokens", help="With --calib: also train on this many tokens of text "
                                    "the model writes itself (a second kind of text, so the result is not fitted "
                                    "to one corpus; slow on a CPU: about 0.02 CPU-s a token)."),
    activation: str = typer.Option("relu", "--activation", help="The student's activation: relu (on the gate: "
                                   "relu(gate x) * up x; written as a ReLU Llama) or drelu (on gate and up: "
                                   "relu(gate x) * relu(up x), TurboSparse's dReLU; written as a Bamboo model, no "
                                   "threshold shift)."),
    target_sparsity: float = typer.Option(0.85, "--target-sparsity", callback=flags.within(limits.SHARE), help="Share of exact-zero FFN activations "
                                          "each layer is steered to."),
    tokens: int = typer.Option(262144, help="End-to-end distillation tokens (0: layer-local phase only)."),
    local_tokens: int = typer.Option(32768, "--local-tokens", help="Tokens whose FFN inputs/outputs the "
                                     "layer-local phase trains on."),
    local_epochs: int = typer.Option(4, "--local-epochs", help="Passes over them per layer (0: skip the phase)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training sequence."),
    batch: int = typer.Option(4, help="Sequences per step (per process under accelerate launch)."),
    lr: float = typer.Option(1e-4, callback=flags.within(limits.LEARNING_RATE), help="End-to-end learning rate (AdamW, warm-up then cosine)."),
    local_lr: float = typer.Option(1e-3, "--local-lr", callback=flags.within(limits.LEARNING_RATE), help="Layer-local learning rate (Adam)."),
    eval_tokens: int = typer.Option(16384, "--eval-tokens", help="Tokens held out of the calibration text to "
                                    "measure the result (at most a tenth of it)."),
    shift_budget: float = typer.Option(0.01, "--shift-budget", callback=flags.within(limits.SHIFT_BUDGET), help="Relative perplexity (on training rows) the "
                                       "last step may spend raising ReLU's cut-off to a FATReLU threshold for "
                                       "more zeros; 0 keeps plain ReLU, which transformers loads by itself."),
    device: str = typer.Option("auto", help="auto (a GPU when there is one), cpu or cuda."),
    dtype: str = typer.Option("auto", help="Compute type: auto (bfloat16 on a GPU that has it, float32 on the "
                              "CPU), float32 or bfloat16. Weights are trained in float32."),
    grad_checkpointing: bool = typer.Option(False, "--grad-checkpointing/--no-grad-checkpointing",
                                            help="Recompute activations in the backward pass (less memory)."),
    checkpoint_minutes: float = typer.Option(5.0, "--checkpoint-minutes", callback=flags.within(limits.POSITIVE), help="Minutes between checkpoints."),
    seed: int = typer.Option(0, help="Random seed (data order, data-free generation)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run with the same options, bit "
                                "for bit."),
):
    """Turn a SiLU model into a genuinely sparse ReLU-family model: SiLU -> ReLU on the gate (or dReLU, on gate
    and up), then distillation from the original (layer-local, then end-to-end KL) under an L1 penalty on the
    FFN activations that is steered, per layer, to the target sparsity. Writes a Llama checkpoint with
    hidden_act relu (or a Bamboo one for dReLU) that profile, train-predictor and convert take as it is, plus OUT/sparsify.json (per-layer sparsity, held-out perplexity
    against the original, tokens, time). Ctrl-C saves a checkpoint; --resume continues from it. Under accelerate
    launch it trains data-parallel, one process per GPU (docs/sparsify.md).

    Examples:

      pi-tools sparsify -m smollm2 --calib wikitext-2-valid.txt -o smollm2-relu

      pi-tools sparsify -m ./Llama-3.2-1B --calib a.txt --target-sparsity 0.9 --device cuda -o llama-relu

      pi-tools sparsify -m smollm2 --calib wiki.txt --self-tokens 24576 --seq-len 512 -o smollm2-relu

      pi-tools sparsify -m smollm2 --calib wiki.txt --activation drelu -o smollm2-drelu   # a Bamboo-form model

      pi-tools sparsify -m smollm2 --calib wiki.txt -o smollm2-relu --resume   # after Ctrl-C

      accelerate launch -q --multi_gpu --num_processes 4 -m powerinfer_tools sparsify -m ./Llama-3.2-1B --calib a.txt -o llama-relu   # 4 GPUs, data-parallel
    """
    from powerinfer_tools import stages

    opts = stages.SparsifyOptions(model=model, out=out, calib=list(calib or []), self_tokens=self_tokens,
                                  activation=activation, target_sparsity=target_sparsity,
                                  tokens=tokens, local_tokens=local_tokens, local_epochs=local_epochs,
                                  seq_len=seq_len, batch=batch, lr=lr, local_lr=local_lr, eval_tokens=eval_tokens,
                                  shift_budget=shift_budget, device=device, dtype=dtype,
                                  grad_checkpointing=grad_checkpointing, checkpoint_minutes=checkpoint_minutes,
                                  seed=seed, force=force, resume=resume)
    report = stages.sparsify(opts).report
    if report is not None:   # None in the other processes of a run under accelerate launch
        print_summary(report)
        typer.echo(f"wrote {out}")


def print_summary(report: dict) -> None:
    held = report["held_out"]
    typer.echo(f"\n{'layer':>5} {'sparsity':>9}")
    for i, s in enumerate(report["layer_sparsity"]):
        typer.echo(f"{i:>5} {s:>9.3f}")
    shift = report["threshold_shift"]
    if shift["threshold"] > 0:
        typer.echo(f"FATReLU threshold {shift['threshold']:.4g}: sparsity {shift['sparsity_relu']:.3f} -> "
                   f"{shift['sparsity_shifted']:.3f} for perplexity {shift['perplexity_relu']:.3f} -> "
                   f"{shift['perplexity_shifted']:.3f} on the calibration rows")
    typer.echo(f"mean FFN sparsity {report['sparsity']:.3f} (target {report['target_sparsity']}); held-out "
               f"perplexity {held['perplexity_sparsified']:.3f} vs {held['perplexity_original']:.3f} original "
               f"({held['perplexity_ratio']:.3f}x) on {held['tokens']} tokens; "
               f"{report['tokens_seen']['end_to_end']} end-to-end tokens in {report['train_seconds']:.0f} s")
