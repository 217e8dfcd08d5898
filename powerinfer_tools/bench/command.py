"""`pi-tools bench`."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.stages import options as limits
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.stages.options import DEFAULT_KV_TYPE, GPU_MODES, KV_TYPES


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _levels(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in _csv(value))
    except ValueError:
        raise UserError(f"--sweep-levels takes comma-separated numbers, got {value!r}") from None


def _wait_policy(value: str | None) -> str | None:
    from powerinfer_tools.bench.runners import OMP_WAIT_POLICIES

    if value is not None and value.lower() not in OMP_WAIT_POLICIES:
        raise UserError(f"--llamacpp-wait must be one of {', '.join(OMP_WAIT_POLICIES)}, got {value!r}")
    return value.lower() if value else None


N_PROMPT = 512


def bench(
    model: str = typer.Option(..., "--model", "-m", help="Source model: HF directory, llama .gguf file, or "
                                                         "'smollm2'. Both engines' files are built from it."),
    outtype: str = typer.Option("q4_0", "--outtype", help="Weight type of both files: q4_0, q8_0, f16, f32."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="Threads for every engine. Default: all "
                                          "cores."),
    repeats: int = typer.Option(5, "--repeats", "-r", help="Interleaved rounds of the main table."),
    modes: str = typer.Option("dense,gate,predictor,auto", "--modes", help="Our FFN modes, comma-separated; also "
                              "input (dense with --input-sparsity; needs a --profile with input thresholds) and MODE+input (e.g. "
                              "predictor+input: that FFN mode with input sparsity on attention)."),
    input_sparsity: float = typer.Option(0.25, "--input-sparsity", callback=flags.within(limits.SPARSITY_LEVEL), help="The input mode's share of every matrix's "
                                         "inputs zeroed (run --input-sparsity)."),
    peers: str = typer.Option("llama.cpp,torch", "--peers", help="Other engines: llama.cpp, torch; '' for none."),
    predictors: Optional[Path] = typer.Option(None, "--predictors", help="Predictor directory "
                                              "(train-predictor) to convert with; without it no predictor mode."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Profile directory whose activation thresholds "
                                           "the file stores (the main table's sparsity unless --sparsity) and whose "
                                           "activation counts order its neurons, as convert does."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", callback=flags.within(limits.SPARSITY_LEVEL), help="Run the main table at this FFN sparsity "
                                             "(thresholds recalibrated on the source model in float32, refused "
                                             "where it does not fit in memory) instead of the file's thresholds."),
    sweep_sparsity: bool = typer.Option(False, "--sweep-sparsity", help="Also time the sparse modes' generation "
                                        "at each --sweep-levels FFN sparsity."),
    sweep_levels: str = typer.Option("0.3,0.5,0.7,0.8,0.9,0.95", "--sweep-levels", help="Sparsity levels."),
    sweep_repeats: int = typer.Option(3, "--sweep-repeats", help="Interleaved rounds per sweep level."),
    # no -p/-n: those are run's and chat's prompt and reply length (llama.cpp's main); the long names are llama-bench's
    n_prompt: int = typer.Option(N_PROMPT, "--n-prompt", help="Prompt tokens (pp), as llama-bench's --n-prompt."),
    n_gen: int = typer.Option(128, "--n-gen", help="Generated tokens (tg), as llama-bench's --n-gen."),
    depth: int = typer.Option(0, "--depth", "-d", help="Tokens of the text already in the cache when tg starts "
                              "(not timed), as llama-bench's -d: generation at a long context."),
    batch: int = typer.Option(512, "--batch", "-b", help="Our engine's prompt batch size."),
    kv_type: str = typer.Option(DEFAULT_KV_TYPE, "--kv-type", help="Our engine's KV cache type, f16 (llama.cpp's "
                                "too), f32 or q8_0 (llama.cpp's --cache-type-k/v q8_0); matters at a long --depth."),
    gpu: str = flags.gpu_option(),
    gpu_attention: bool = typer.Option(True, "--gpu-attention/--gpu-ffn-only", help="With a device: the layers' "
                                       "attention and KV cache on it first, as PowerInfer places them (default), "
                                       "or only the hot tier there."),
    gpuidx: Optional[Path] = typer.Option(None, "--gpuidx", help="Our hot tier's neurons (a .gpuidx for the bench's "
                                          "file: same neuron order); without it, --vram-budget solves one."),
    vram_budget: Optional[float] = typer.Option(None, "--vram-budget", callback=flags.within(limits.DEVICE_BUDGET_GIB), help="GiB: solve the hot tier for this budget "
                                                "from --profile (for the bench's file, cached beside it) and give the "
                                                "GPU at most that much."),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text whose tokens are fed (e.g. "
                                        "WikiText-2's validation split). Default: text our engine writes itself from "
                                        "the bench's file (dense, sampled from a fixed seed; no float32 copy of "
                                        "the model)."),
    ppl_file: Optional[Path] = typer.Option(None, "--ppl-file", help="UTF-8 text (e.g. WikiText-2's test split) on "
                                            "which every row's perplexity is measured after the timed rounds, "
                                            "each engine on its own file and our engine in each mode, so that a "
                                            "speed is read beside what it costs in quality. Default: none "
                                            "measured."),
    ppl_chunks: int = typer.Option(4, "--ppl-chunks", help="Windows of --ppl-file to score (our engine scores a "
                                   "window as one batch, llama.cpp a token at a time: about its tg speed)."),
    ppl_ctx: int = typer.Option(512, "--ppl-ctx", help="Tokens a perplexity window (as pi-tools perplexity's -c)."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="Where the built files are cached, "
                                            "rebuilt when the inputs or this toolkit's version change "
                                            "(default: ~/.cache/powerinfer-tools/bench)."),
    peer_python: Optional[str] = typer.Option(None, "--peer-python", help="Python with llama-cpp-python to run "
                                              "the llama.cpp peer (default: this Python)."),
    llamacpp_wait: Optional[str] = typer.Option(None, "--llamacpp-wait", help="OMP_WAIT_POLICY of the llama.cpp "
                                                "peer: active or passive. Default: both, and every run counts the "
                                                "faster (spinning collapses on an oversubscribed machine)."),
    memory_limit: Optional[float] = typer.Option(None, "--memory-limit", callback=flags.within(limits.DEVICE_BUDGET_GIB),
                                                 help="GiB: run each engine alone in a "
                                                 "memory cgroup of this size (made and removed here; needs root), "
                                                 "the page cache dropped before each: llama.cpp repacked and mapped "
                                                 "only, ours in each mode at its defaults (its disk tier turns on where "
                                                 "the FFN does not fit) and at --memory-budget. Prints "
                                                 "peak memory, OOM kills and what a token reads from the disk. "
                                                 "Default: no limit."),
    memory_budget: Optional[float] = typer.Option(None, "--memory-budget", callback=flags.within(limits.DEVICE_BUDGET_GIB),
                                                  help="GiB our disk tier may hold under "
                                                  "--memory-limit, in rows of its own. Default: only the engine's "
                                                  "own rule (the limit less what the process holds)."),
    first_token: bool = typer.Option(False, "--first-token", help="Instead of the tables: the time to the first "
                                     "token from a fresh process, `pi-tools run -m FILE -p PROMPT -n 1 --temp 0` "
                                     "against llama-cpp-python's Llama(FILE) streaming one token, --repeats "
                                     "alternated rounds after one untimed each (--peers llama.cpp)."),
    json_out: Optional[Path] = typer.Option(None, "--json-out", help="Write the full record (samples, machine, "
                                            "byte model) as JSON."),
    png: Optional[Path] = typer.Option(None, "--png", help="Draw the sweep (tokens/s vs sparsity) as PNG."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write every table (as --verbose "
                                            "prints them) to this file."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every table: the machine, CPU time, bytes "
                                 "per token against the byte model, where a token's time goes, the sweep."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
):
    """Benchmark prompt processing (pp) and generation (tg) tokens/s: our engine in each FFN mode against
    llama.cpp (llama-cpp-python) and transformers, same weights, same quantization, same threads.

    Both model files are built from --model at --outtype (cached in --work-dir): our PowerInfer file,
    and a plain GGUF for llama.cpp holding the same tensor bytes (ffn_down requantized from the same
    source, as llama.cpp lays it out). Repeats are interleaved and ratios paired per round. Each run of
    ours is set against a byte model of what a token reads (predicted speedup over dense, achieved /
    predicted, and achieved / the limit of the measured memory bandwidth). Prints one table, llama-bench's size
    (engine, FFN mode, sparsity, pp and tg tokens/s, tg against llama.cpp); --verbose prints every table.

    Examples:

      pi-tools bench -m smollm2 --outtype q4_0 --predictors smollm2-pred --peer-python ~/bench-venv/bin/python

      pi-tools bench -m smollm2 --outtype q8_0 --modes dense,gate --peers llama.cpp --sweep-sparsity --png sweep.png

      pi-tools bench -m smollm2 --sparsity 0.5 --repeats 9 --json-out bench.json

      pi-tools bench -m smollm2 --modes dense --peers llama.cpp --depth 2048   # tg128 @ d2048

      pi-tools bench -m smollm2 --modes dense,gate --peers llama.cpp --ppl-file wikitext-2-raw-test.txt -t 2

      pi-tools bench -m smollm2 --profile prof --modes dense,input --input-sparsity 0.25 --peers llama.cpp -t 2

      pi-tools bench -m relu7b --predictors pred --profile prof --modes predictor,predictor+input --peers '' -t 2

      pi-tools bench -m smollm2 --modes dense --peers llama.cpp --depth 2048 --kv-type f16   # both caches f16

      pi-tools bench -m relu7b --predictors pred --profile prof --modes predictor --peers '' --vram-budget 4 --gpu on

      pi-tools bench -m smollm2 --outtype q8_0 --first-token --peers llama.cpp -t 2 --repeats 7

      sudo pi-tools bench -m relu7b --modes dense,predictor --peers llama.cpp --memory-limit 1.5 --repeats 2 -t 2
    """
    from powerinfer_tools.bench.harness import BenchOptions, run_bench
    from powerinfer_tools.bench.report import plot_sweep, render_markdown, render_summary, write_json

    if png is not None and not sweep_sparsity:
        raise UserError("--png draws the sparsity sweep: add --sweep-sparsity")
    if kv_type not in KV_TYPES:
        raise UserError(f"--kv-type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}")
    if gpu not in GPU_MODES:
        raise UserError(f"unknown --gpu {gpu!r} (choose from {', '.join(GPU_MODES)})")
    if vram_budget is not None and profile is None and gpuidx is None:
        raise UserError("--vram-budget solves the hot tier from --profile: give --profile DIR (or --gpuidx FILE)")
    if threads is None:
        from powerinfer_tools.bench.machine import usable_cores

        threads = usable_cores()
    opts = BenchOptions(model=model, outtype=outtype.lower(), threads=threads, repeats=repeats, modes=_csv(modes),
                        input_sparsity=input_sparsity,
                        peers=_csv(peers), sparsity=sparsity, sweep=sweep_sparsity, sweep_levels=_levels(sweep_levels),
                        sweep_repeats=sweep_repeats, n_prompt=n_prompt, n_gen=n_gen, depth=depth, batch=batch,
                        kv_type=kv_type, gpu=gpu, gpu_attention=gpu_attention, gpuidx=gpuidx, vram_budget=vram_budget,
                        predictors=predictors, profile=profile, text=text, ppl_file=ppl_file,
                        ppl_chunks=ppl_chunks, ppl_ctx=ppl_ctx, work_dir=work_dir,
                        peer_python=peer_python, llamacpp_wait=_wait_policy(llamacpp_wait), progress=not quiet,
                        memory_limit=memory_limit, memory_budget=memory_budget, first_token=first_token,
                        command="pi-tools " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "")
    record = run_bench(opts)
    table = render_markdown(record)
    typer.echo(table if verbose else render_summary(record))
    if markdown is not None:
        from powerinfer_tools.core.atomic import atomic_file

        with atomic_file(markdown) as tmp:
            tmp.write_text(table)
    if json_out is not None:
        write_json(record, json_out)
        typer.echo(f"wrote {json_out}")
    if png is not None:
        plot_sweep(record, png)
        typer.echo(f"wrote {png}")
