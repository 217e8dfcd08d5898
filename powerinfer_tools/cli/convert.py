"""`pi-tools convert`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages.options import KV_ELEMENT_BYTES
from powerinfer_tools.core.errors import UserError


def convert(
    model: str = typer.Option(..., "--model", "-m", help="HF model directory, llama .gguf file, or 'smollm2'. "
                              "With --dry-run: a bundled config name (relullama-70b, relufalcon-40b, opt-30b, "
                              "bamboo-7b, ...), a config.json, or a model directory."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output file (conventionally "
                                       "NAME.powerinfer.gguf). Not used with --dry-run."),
    predictors: Optional[Path] = typer.Option(
        None, "--predictors", help="Predictor directory from train-predictor (model_{i}.pt + config.json). "
                                         "Without it the file has no predictors (dense / gate-only engine modes)."),
    profile: Optional[Path] = typer.Option(
        None, "--profile", help="Profile directory: its per-layer activation thresholds (SiLU/GELU models) are "
                                "stored as powerinfer.activation_thresholds. ReLU models store 0."),
    order_neurons: bool = typer.Option(
        True, "--order-neurons/--source-order", help="With --profile: store each layer's FFN neurons hottest first "
                                                    "in blocks of 16, spread over the layer (the order is recorded "
                                                    "in the file), so the rows a sparse step reads come in runs. "
                                                    "--source-order keeps the model's order."),
    outtype: Optional[str] = typer.Option(None, "--outtype", help="Weight type: f32, f16, q8_0 or q4_0 "
                                          "(default f16; with --dry-run f16,q8_0,q4_0, a comma-separated list). "
                                          "Norms and biases stay f32; predictors take the weight type too; "
                                          "a q4_0 file's output head (the embedding, where tied) and predictor "
                                          "fc1 are q8_0, as llama.cpp's quantizer keeps its head above 4 bits. "
                                          "k-quants (q4_k_m, ...), q4_1, q5_0, q5_1 and bf16 are not written: "
                                          "the engine reads such files (llama.cpp's) but decodes them at load to "
                                          "q8_0 (bf16 to f16), so they would only be smaller on disk."),
    powerinfer_compatible: bool = typer.Option(
        True, "--powerinfer-compatible/--ours-only", help="Store ffn_down_t as PowerInfer's sparse kernels read "
        "it: f16 in f32 and q8_0 files (PowerInfer reads those rows as f16 whatever their type; f16 and q4_0 "
        "files are unchanged), and with --vram-budget place GPU neurons in the multiples PowerInfer's CUDA build "
        "takes (plan --granularity powerinfer). --ours-only keeps ffn_down_t in the outtype and places any count, "
        "for this toolkit's engine alone, and stores a tied output head once (as token_embd), as a SiLU/GELU "
        "model's file always does (PowerInfer refuses those by name)."),
    input_thresholds: bool = typer.Option(
        False, "--input-thresholds/--no-input-thresholds", help="With a --profile that has input thresholds "
        "(profile --input-allocation): store them, and q/k/v/o/gate/up a second time transposed, what `run "
        "--input-sparsity SHARE` reads (SmolLM2: +75% of the layers' bytes, which is why it is off by default; "
        "the mode's speeds per CPU: docs/bench.md, 'Input sparsity')."),
    neuron_bundles: bool = typer.Option(
        False, "--neuron-bundles/--no-neuron-bundles", help="Also write OUT.neurons: each FFN neuron's gate, up and "
        "down rows again as one page-aligned bundle (hottest first by --profile's counts), which the engine reads "
        "the cold neurons from when the model does not fit its memory budget (`run --memory-budget`; "
        "docs/engine.md, \"Models larger than memory\"). OUT itself is unchanged (PowerInfer reads it as ever); "
        "the sidecar adds about the FFN's size on disk."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    vram_budget: Optional[float] = typer.Option(
        None, "--vram-budget", callback=flags.within(limits.PLAN_BUDGET_GIB), help="GiB of VRAM: after writing the model, place its hot neurons (as `pi-tools "
                                    "plan` does, with its defaults) and write OUT.generated.gpuidx beside it. "
                                    "Needs --profile."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write nothing: report the file's size by part and "
                                 "outtype, and the KV cache, from the model's config alone (no weights needed)."),
    predictor_rank: Optional[int] = typer.Option(
        None, "--predictor-rank", help="With --dry-run: the predictors' rank (default: train-predictor's cap, "
                                       "10% of the FFN parameters); 0 for a file without predictors."),
):
    """Convert a model (+ predictors) to a PowerInfer GGUF (magic PWRI) that PowerInfer and `pi-tools run` load.

    Tensors are read, transformed and written one at a time, so memory stays near the largest tensor.
    The file appears under its final name only when complete. --dry-run sizes the file from the config alone.

    Examples:

      pi-tools convert -m smollm2 --predictors smollm2-pred --profile smollm2-profile --outtype q8_0 -o smollm2.powerinfer.gguf

      pi-tools convert -m ./ReluLLaMA-7B --predictors ./ReluLLaMA-7B-pred --outtype q4_0 -o relullama.q4_0.powerinfer.gguf

      pi-tools convert -m ./tiny-llama --outtype f32 -o dense.gguf   # no predictors: dense / gate-only use

      pi-tools convert -m smollm2 --predictors pred --profile prof --outtype q4_0 -o s.powerinfer.gguf --vram-budget 0.5

      pi-tools convert -m ./ReluLLaMA-7B --predictors pred --profile prof --outtype q4_0 -o r.gguf --neuron-bundles

      pi-tools convert --dry-run -m relullama-70b              # sizes at f16, q8_0, q4_0; nothing written
    """
    if dry_run:
        if predictors is not None or profile is not None or vram_budget is not None or out is not None or neuron_bundles:
            raise UserError("--dry-run sizes the file from the config alone: drop --out/--predictors/--profile/"
                            "--vram-budget (for a VRAM plan: pi-tools plan --dry-run)")
        from powerinfer_tools.stages.conversion.dry_run import DEFAULT_OUTTYPES

        outtypes = [t.strip().lower() for t in (outtype or ",".join(DEFAULT_OUTTYPES)).split(",") if t.strip()]
        report_sizes(model, outtypes, predictor_rank)
        return
    if predictor_rank is not None:
        raise UserError("--predictor-rank only applies with --dry-run (a conversion takes the ranks of --predictors)")
    if out is None:
        raise UserError("--out is required (or --dry-run to only report sizes)")
    from powerinfer_tools import models, stages
    from powerinfer_tools.models import arch
    from powerinfer_tools.stages.placement import placement
    from powerinfer_tools.stages.conversion.conversion import summary_lines

    if neuron_bundles:  # a file whose neurons the sidecar cannot bundle is refused before it is written
        arch.for_neurons(models.load_config(models.resolve(model)))

    if vram_budget is not None:
        if profile is None:
            raise UserError("--vram-budget needs --profile (its activation counts decide the hot neurons)")
        from powerinfer_tools.stages.profiling.profiling import activation_dir

        activation_dir(profile)  # fail before converting, not after
    converted = stages.convert(stages.ConvertOptions(
        model=model, out=out, outtype=outtype or "f16", predictors=predictors, profile=profile,
        order_neurons=order_neurons, powerinfer_compatible=powerinfer_compatible, progress=not quiet,
        input_sparsity=input_thresholds))
    summary = converted.summary
    if summary["thresholded"] and profile is None and not summary["experts"]:
        typer.echo(f"note: {summary['arch']} is thresholded but no --profile was given: activation thresholds "
                   "stored as 0 (every neuron counts as active)", err=True)
    typer.echo("\n".join(summary_lines(summary)))
    typer.echo(f"wrote {out}")
    if neuron_bundles:
        from powerinfer_tools.formats import neuron_bundles as bundles

        frequencies = placement.profile_frequencies(profile, out) if profile is not None else None
        typer.echo(f"wrote {bundles.write(out, frequencies, progress=not quiet)}")
    if vram_budget is not None:
        try:
            written = stages.plan(profile, out, stages.PlanOptions(
                vram_budget_gib=vram_budget, granularity="powerinfer" if powerinfer_compatible else 1))
        except UserError as exc:
            raise UserError(f"wrote {out}, but no GPU plan: {exc}") from None
        typer.echo("\n".join(placement.report_lines(written.plan)))
        typer.echo(f"wrote {written.gpuidx} and {written.summary}")


def report_sizes(model: str, outtypes: list[str], predictor_rank: int | None) -> None:
    """The dry run's table: file bytes by part for each outtype, then the KV cache by context size."""
    from powerinfer_tools.stages.conversion import dry_run
    from powerinfer_tools.stages.placement import placement

    config_model = dry_run.load(model)
    reports = [dry_run.size_report(config_model, t, predictor_rank) for t in outtypes]
    first = reports[0]
    typer.echo(dry_run.describe(config_model, first))
    typer.echo(f"predictors: {dry_run.predictor_note(config_model, reports)}")
    rows = [("FFN (gate/up/down)", "ffn"), ("attention, norms, biases", "attention"), ("predictors", "predictors"),
            ("output head + norm", "output"), ("token/position embeddings", "embeddings"),
            ("header + padding", "header")]
    typer.echo(f"  {'':<26}" + "".join(f"{r.outtype:>12}" for r in reports))
    for label, key in rows:
        typer.echo(f"  {label:<26}" + "".join(f"{placement.human_bytes(r.parts()[key]):>12}" for r in reports))
    typer.echo(f"  {'file':<26}" + "".join(f"{placement.human_bytes(r.file_bytes):>12}" for r in reports))
    if first.vocab_estimated:
        typer.echo(f"  (header: vocabulary estimated at {dry_run.VOCAB_BYTES_PER_TOKEN} bytes per token; "
                   "everything else exact)")
    contexts = sorted({512, 2048, first.context_length or 2048})
    # the engine's cache is f16 (llama.cpp's and PowerInfer's type) unless run with --kv-type f32 or q8_0
    def kv(c: int, kv_type: str) -> str:
        return placement.human_bytes(first.kv_cache_bytes(c) * KV_ELEMENT_BYTES[kv_type] / placement.KV_BYTES_PER_VALUE)

    typer.echo("KV cache, any outtype (f16, the default / --kv-type f32 / --kv-type q8_0): " + ", ".join(
        f"ctx {c}: {kv(c, 'f16')} / {kv(c, 'f32')} / {kv(c, 'q8_0')}" for c in contexts))
    typer.echo("dry run: nothing written")
