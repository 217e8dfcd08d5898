"""`pi-tools perplexity`."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.names import FFN_MODES
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE, KV_TYPE_HELP
from powerinfer_tools.stages.options import PERPLEXITY_WINDOW


def perplexity(
    model: str = flags.model_option(),
    text_file: Path = typer.Option(..., "--file", "-f", help="UTF-8 text to score."),
    ctx: int = typer.Option(PERPLEXITY_WINDOW, "--ctx-size", "-c", help="Window length in tokens, as llama.cpp's "
                            "perplexity's -c: the text is scored in windows of this many tokens (each starts with BOS "
                            "when the model has one; windows do not overlap), and the KV cache holds one window. Not "
                            "run's context: that defaults to the model's."),
    chunks: int = typer.Option(0, "--chunks", help="Windows to score; 0 = as many as the text fills."),
    sparse_mode: str = typer.Option(flags.DEFAULT_SPARSE_MODE, "--sparse-mode",
                                    help=f"FFN mode: {', '.join(FFN_MODES)}, or input (dense with --input-sparsity)."),
    input_sparsity: Optional[float] = flags.input_sparsity_option(),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help=flags.THREADS_HELP),
    kv_type: str = typer.Option(DEFAULT_KV_TYPE, "--kv-type", help=KV_TYPE_HELP),
    gpuidx: Optional[Path] = flags.gpuidx_option(),
    vram_budget: Optional[float] = flags.vram_budget_option(),
    gpu: str = flags.gpu_option(),
    profile: Optional[Path] = flags.profile_option(),
    memory_budget: Optional[float] = flags.memory_budget_option(),
    recall: bool = typer.Option(False, "--recall", help="In predictor mode, also compute the true activation masks "
                                                         "and report the predictor's recall (slower)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
):
    """Perplexity of a converted model on a text file with the bundled engine, in the chosen FFN mode
    (each token's own sparsity mask applies), with tokens/s and the measured FFN density.

    Windows are cut as `pi-tools profile` cuts calibration text, so the number is comparable with the
    transformers reference (powerinfer_tools.runtime.evaluate.perplexity) on the same windows.

    Examples:

      pi-tools perplexity -m smollm2.f32.powerinfer.gguf -f wikitext-2-raw-test.txt -c 512 --chunks 32

      pi-tools perplexity -m smollm2.q8_0.powerinfer.gguf -f wikitext-2-raw-test.txt --sparse-mode gate --json

      pi-tools perplexity -m smollm2.q8_0.powerinfer.gguf -f wikitext-2-raw-test.txt -c 2048 --kv-type f16

      pi-tools perplexity -m smollm2.q8_0.powerinfer.gguf -f wikitext-2-raw-test.txt --sparse-mode input --input-sparsity 0.25

      pi-tools perplexity -m relu7b.q4_0.powerinfer.gguf -f wiki.txt --vram-budget 4 --profile prof --gpu on
    """
    from powerinfer_tools.runtime import inference
    from powerinfer_tools.stages.profiling.calibration import read_text, sequences_from_text

    if ctx < 2:
        raise UserError("--ctx-size must be at least 2")
    if chunks < 0:
        raise UserError("--chunks must be >= 0")
    target = inference.resolve_model_file(model, gpuidx, vram_budget, profile, ctx)
    text = read_text(text_file, role="evaluation")
    tokenizer = inference.load_tokenizer(target.model)
    n_tokens = ctx * chunks if chunks else len(text)  # len(text) bounds the token count from above
    windows = sequences_from_text(tokenizer, [text], ctx, n_tokens, length_option="--ctx-size").numpy()
    started = time.perf_counter()
    with inference.open_engine(target, threads=threads, sparse_mode=sparse_mode, ctx_size=ctx,
                               recall_check=recall, kv_type=kv_type, gpu=gpu, vram_budget_gib=vram_budget,
                               input_sparsity=input_sparsity, memory_budget_gib=memory_budget) as llm:
        result = inference.perplexity(llm, windows, progress=not quiet)
        stats = llm.stats()
    seconds = time.perf_counter() - started
    result.update({"model": str(target.model), "sparse_mode": sparse_mode, "kv_type": kv_type, "ctx": ctx,
                   "input_sparsity": stats["input_sparsity"]["share"],
                   "seconds": round(seconds, 2),
                   "tokens_per_second": stats["prompt_tokens_per_second"], "density": stats["density"],
                   "recall": stats["recall"], "threads": llm.info["threads"], "gpu": llm.info["gpu"]["used"]})
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"perplexity {result['perplexity']:.4f} over {result['tokens']} predicted tokens "
               f"({result['windows']} windows of {ctx}), mode {sparse_mode}"
               + (f", input sparsity {result['input_sparsity']:g}" if result["input_sparsity"] else ""))
    line = f"{result['tokens_per_second']:.1f} tokens/s with {result['threads']} threads"
    if result["density"] is not None:
        line += f", FFN density {result['density']:.3f}"
    if result["recall"] is not None:
        line += f", predictor recall {result['recall']:.4f}"
    typer.echo(line)
