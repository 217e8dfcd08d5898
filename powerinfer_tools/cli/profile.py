"""`pi-tools profile`."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.core.errors import UserError


def _parse_targets(value: Optional[str]) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--target-sparsity takes a number or a comma-separated list, got {value!r}") from None


def profile(
    model: str = typer.Option(..., "--model", "-m", help="HF model directory, .gguf file, or 'smollm2'."),
    out: Path = typer.Option(..., "--out", "-o", help="Output profile directory."),
    calib: Optional[List[Path]] = typer.Option(None, "--calib", help="Calibration text file (repeatable). "
                                               "Without it: data-free, on text the model generates itself."),
    tokens: int = typer.Option(32768, help="Tokens to profile."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence. Default: 512, or the "
                                          "model's context length if shorter."),
    batch: int = typer.Option(4, help="Sequences per forward pass."),
    device: str = typer.Option("cpu", help="cpu, cuda (with --load layer: one layer on the GPU at a time), or auto "
                                             "(the whole model, spread over GPUs and CPU by accelerate's device map)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    load: str = typer.Option("auto", "--load",
                             help="layer: one decoder layer in memory at a time, read from the model's files (a 7B-70B "
                                  "model on a 16-32 GB PC; needs --calib); whole: the whole model, as transformers "
                                  "loads it; auto: whole where its weights take at most half the free memory (of the "
                                  "GPU with --device cuda), else layer. Both give the same profile."),
    target_sparsity: Optional[str] = typer.Option(
        None, "--target-sparsity",
        help="SiLU/GELU models: fraction of activations below each layer's threshold; one value or one per "
             "layer, comma-separated. Default 0.2 (SmolLM2: +2.1% perplexity). Ignored for ReLU models."),
    max_samples: int = typer.Option(8192, "--max-samples", help="Predictor training rows kept per layer, "
                                     "2 x n_embd bytes each. More rows make better predictors (docs/sparsify.md, "
                                     "'What limits the predictors'); raise --tokens with them."),
    seed: int = typer.Option(0, help="Random seed (row sampling, data-free generation)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory, or an interrupted profile's kept work."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted profile of the same --out "
                                "with the same options (nothing is counted twice)."),
    input_allocation: str = typer.Option(
        "none", "--input-allocation",
        help="Input sparsity's thresholds (every matrix's small inputs zeroed; docs/profile.md, 'Input sparsity'), "
             "for shares 0.05 to 0.5: none (the default: the mode changes the model's output a little; its "
             "speeds per CPU in docs/bench.md, 'Input sparsity'), uniform (the same share at every input; SmolLM2 at 0.25: +0.5% perplexity), or "
             "greedy (TEAL's per-layer search, each layer's share spread over q/k/v, o, gate/up and down where it "
             "moves the layer's output least; SmolLM2 at 0.25: +2.9%, and minutes per layer). Needs --load whole."),
    threads: Optional[int] = flags.threads_option(),
):
    """Profile FFN activations on calibration text: per-neuron activation counts (PowerInfer's
    activation_{i}.pt), activation thresholds, and predictor training rows. A mixture of experts' GGUF: per layer
    how often the engine's router picks each expert and how soon it picks it again (experts.npz; docs/profile.md,
    "Experts"), from --calib text, --tokens, --seq-len and --threads.

    Examples:

      pi-tools profile -m smollm2 --calib wiki.txt --out smollm2-profile

      pi-tools profile -m ./ReluLLaMA-7B --calib a.txt --calib b.txt --tokens 65536 -o prof

      pi-tools profile -m smollm2 --target-sparsity 0.5 --tokens 4096 -o prof   # data-free

      pi-tools profile -m smollm2 --calib wiki.txt --input-allocation greedy -o prof

      pi-tools profile -m ./Llama-2-70b-relu --calib a.txt --tokens 4096 --load layer --dtype bfloat16 -o prof70

      pi-tools profile -m qwen3-30b-a3b.q4_0.gguf --calib wiki.txt --tokens 8192 -o moe-prof   # experts
    """
    from powerinfer_tools import stages
    from powerinfer_tools.stages.profiling.locality import profile_verdict
    from powerinfer_tools.stages.profiling.profiling import summary_lines

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if device not in ("cpu", "cuda", "auto"):
        raise UserError(f"--device must be cpu, cuda or auto, got {device!r}")
    if threads is not None:
        if threads < 1:
            raise UserError("--threads must be at least 1")
        import torch

        torch.set_num_threads(threads)
    opts = stages.ProfileOptions(model=model, out=out, calib=list(calib or []), tokens=tokens, seq_len=seq_len,
                                 batch=batch, device=device, dtype=dtype, load=load,
                                 target_sparsity=_parse_targets(target_sparsity), max_samples=max_samples, seed=seed,
                                 force=force, resume=resume, input_allocation=input_allocation, threads=threads)
    result = stages.profile(opts)
    if result.meta["rule"] == "experts":
        from powerinfer_tools.stages.profiling import expert_profile

        experts = expert_profile.load(out, result.meta)
        typer.echo("\n".join(expert_profile.summary_lines(experts, result.meta["tokens"])))
        typer.echo(f"wrote {out}")
        typer.echo(f"verdict: {expert_profile.verdict(experts)}")
        return
    typer.echo("\n".join(summary_lines(result.meta)))
    typer.echo(f"wrote {out}")
    typer.echo(f"verdict: {profile_verdict(result.meta)}")
