"""`pi-tools train-predictor`: per-layer activation predictors from a profile directory."""
from __future__ import annotations

from pathlib import Path

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages.options import DEFAULT_TRAIN_THREADS


def train_predictor(
    profile_dir: Path = typer.Argument(..., metavar="PROFILE_DIR", help="Profile directory written by 'pi-tools profile'."),
    out: Path = typer.Option(None, "--out", "-o",
                             help="Predictor directory to write [default: PROFILE_DIR-predictors]; "
                                  "with --evaluate, the existing predictor directory to measure."),
    rank: str = typer.Option("auto", "--rank",
                             help="'auto': per layer, the smallest rank that meets --target-recall, under "
                                  "--max-predictor-fraction; or one fixed rank N <= n_embd for every layer."),
    target_recall: float = typer.Option(None, "--target-recall", callback=flags.within(limits.SHARE),
                                        help="Held-out recall each layer's threshold is calibrated to "
                                             "[default: 0.99 for ReLU-family profiles, 0.95 for SiLU/GELU "
                                             "(thresholded) ones]."),
    max_density_ratio: float = typer.Option(1.3, "--max-density-ratio", callback=flags.within(limits.AT_LEAST_ONE),
                                            help="Density budget: a rank is enough (--rank auto) when the target "
                                                 "recall is reached predicting at most this many times the true "
                                                 "density and leaving out at least 1/this of the inactive "
                                                 "neurons; also the budget of the rec@bud column."),
    max_predictor_fraction: float = typer.Option(0.10, "--max-predictor-fraction", callback=flags.within(limits.FRACTION),
                                                 help="Cap on all predictors' parameters as a fraction of the FFN "
                                                      "weights of the trained layers (--rank auto)."),
    epochs: int = typer.Option(8, "--epochs", help="Most epochs per predictor (early stopping on held-out "
                                                   "recall usually ends sooner)."),
    device: str = typer.Option("cpu", "--device", help="Torch device for training: cpu, cuda, cuda:N, mps."),
    layers: str = typer.Option(None, "--layers", help="Layers to train or evaluate, e.g. '0-3,7' [default: all]."),
    evaluate: bool = typer.Option(False, "--evaluate",
                                  help="Do not train: measure the predictors in --out (ours or PowerInfer's "
                                       "published model_{i}.pt) on every row of PROFILE_DIR."),
    report: Path = typer.Option(None, "--report", help="With --evaluate, also write the metrics as JSON here."),
    held_out: float = typer.Option(0.2, "--held-out", callback=flags.within(limits.SHARE), help="Fraction of calibration sequences held out."),
    threads: int = typer.Option(DEFAULT_TRAIN_THREADS, "--threads", "-t",
                                help="CPU threads for torch (small matrices: more threads than free cores "
                                     "only add contention)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split, initialisation and batch order."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
):
    """Train PowerInfer activation predictors, one fc2(relu(fc1(x))) per layer, from a profile.

    Rows are split into train / held-out by calibration sequence; each predictor is trained with
    class-weighted BCE and AdamW, stopped early on held-out recall, and its logit threshold is
    calibrated on held-out rows to reach --target-recall. Writes OUT/model_{i}.pt (PowerInfer's
    state dict), OUT/config.json (thresholds, ranks) and OUT/report.json, and prints a table.

    Memory: one layer's rows at a time (--max-samples of the profile x (2 n_embd + n_ff / 8) bytes as stored,
    about 4 n_embd + n_ff bytes a row once loaded) and the predictors of the layer being trained; each layer's
    choice goes to the output directory at once. The bar shows each layer's training time and the ETA.

    Examples:

      pi-tools train-predictor smollm2-profile --out smollm2-predictors

      pi-tools train-predictor prof --rank 64 --layers 0-3 --target-recall 0.99

      pi-tools train-predictor test-profile --out smollm2-predictors --evaluate --report eval.json
    """
    from powerinfer_tools import stages
    from powerinfer_tools.stages.predictors.predictor_training import format_table, predictor_verdict

    opts = stages.PredictorOptions(out=out, rank=rank, target_recall=target_recall,
                                   max_density_ratio=max_density_ratio, max_predictor_fraction=max_predictor_fraction,
                                   epochs=epochs, device=device, layers=layers, held_out=held_out, threads=threads,
                                   seed=seed, force=force)
    if evaluate:
        if out is None:
            raise UserError("--evaluate needs --out DIR: the predictor directory to measure")
        result = stages.evaluate_predictors(profile_dir, out, opts, report)
    else:
        result = stages.train_predictors(profile_dir, opts)
    typer.echo(format_table(result.layers))
    for warning in result.warnings:
        typer.echo(warning, err=True)
    if not evaluate:
        typer.echo(f"wrote {len(result.layers)} predictors to {result.path}")
    typer.echo(f"verdict: {predictor_verdict(result.layers)}")
