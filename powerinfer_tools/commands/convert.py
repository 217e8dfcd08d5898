"""`pi-tools convert`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def convert(
    model: str = typer.Option(..., "--model", "-m", help="HF model directory, llama .gguf file, or 'smollm2'."),
    out: Path = typer.Option(..., "--out", "-o", help="Output file (conventionally NAME.powerinfer.gguf)."),
    predictors: Optional[Path] = typer.Option(
        None, "--predictors", "-p", help="Predictor directory from train-predictor (model_{i}.pt + config.json). "
                                         "Without it the file has no predictors (dense / gate-only engine modes)."),
    profile: Optional[Path] = typer.Option(
        None, "--profile", help="Profile directory: its per-layer activation thresholds (SiLU/GELU models) are "
                                "stored as powerinfer.activation_thresholds. ReLU models store 0."),
    outtype: str = typer.Option("f16", "--outtype", "-t", help="Weight type: f32, f16, q8_0 or q4_0. Norms and "
                                                                "biases stay f32; predictors f32 (f16 unless f32)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
):
    """Convert a model (+ predictors) to a PowerInfer GGUF (magic PWRI) that PowerInfer and `pi-tools run` load.

    Tensors are read, transformed and written one at a time, so memory stays near the largest tensor.
    The file appears under its final name only when complete.

    Examples:

      pi-tools convert -m smollm2 -p smollm2-pred --profile smollm2-profile -t q8_0 -o smollm2.powerinfer.gguf

      pi-tools convert -m ./ReluLLaMA-7B -p ./ReluLLaMA-7B-pred -t q4_0 -o relullama.q4_0.powerinfer.gguf

      pi-tools convert -m ./tiny-llama -t f32 -o dense.gguf   # no predictors: dense / gate-only use
    """
    from powerinfer_tools.convert import convert_model

    summary = convert_model(model, out, outtype=outtype.lower(), predictors_dir=predictors, profile_dir=profile,
                            progress=not quiet)
    if summary["thresholded"] and profile is None:
        typer.echo(f"note: {summary['arch']} is thresholded but no --profile was given: activation thresholds "
                   "stored as 0 (every neuron counts as active)", err=True)
    types = ", ".join(f"{n} {k}" for k, n in sorted(summary["types"].items()))
    typer.echo(f"{summary['arch']} -> {summary['gguf_arch']} {summary['outtype']}: {summary['tensors']} tensors "
               f"({types}){', with predictors' if summary['predictors'] else ', no predictors'}")
    typer.echo(f"bytes: {_mib(summary['bytes_in'])} in the source -> {_mib(summary['bytes_out'])} written "
               f"({summary['bytes_out'] / max(summary['bytes_in'], 1):.2f}x) in {summary['seconds']:.1f} s")
    typer.echo(f"wrote {out}")
