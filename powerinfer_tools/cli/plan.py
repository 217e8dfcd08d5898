"""`pi-tools plan`: choose the hot neurons for a VRAM budget and write PowerInfer's gpu-index file."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages.options import DEFAULT_RESERVE_BYTES, MIB, SYNTHETIC_EXPONENT
from powerinfer_tools.core.errors import UserError

if TYPE_CHECKING:
    from powerinfer_tools.stages.placement import placement  # numpy and the solver: loaded when a plan is made

def plan(
    model: str = typer.Option(..., "--model", "-m", help="Converted model file (MODEL.powerinfer.gguf): its tensor "
                              "types and shapes give the bytes. With --dry-run: a bundled config name "
                              "(relullama-70b, relufalcon-40b, opt-30b, bamboo-7b, ...), a config.json or a model "
                              "directory."),
    vram_budget: float = typer.Option(..., "--vram-budget", callback=flags.within(limits.PLAN_BUDGET_GIB), help="GiB of VRAM to use, on the GPU the plan is for (a machine without one runs the model without the plan); 0 gives an all-CPU plan."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Profile directory from `pi-tools profile` "
                                           "(reads DIR/activation/activation_{i}.pt; a bare directory of them, as "
                                           "PowerInfer publishes, works too). Optional with --dry-run."),
    ctx_size: Optional[int] = flags.ctx_size_option("The plan sizes the KV cache for it (run, chat and serve default "
                                                    "to the same, and find the plan). With --dry-run: the config's "
                                                    "max_position_embeddings, at most the same cap."),
    out: Path = typer.Option(None, "--out", "-o", help="Output gpu-index file (default: MODEL.generated.gpuidx "
                             "beside the model, where PowerInfer's engine looks); a JSON summary goes to OUT.json. "
                             "With --dry-run: the JSON summary only, and only when given."),
    min_layer_neurons: str = typer.Option("auto", "--min-layer-neurons",
                                          help="A layer that offloads anything offloads at least this many "
                                          "neurons: 'auto' (from the split-overhead cost model) or N."),
    reserve_mib: float = typer.Option(DEFAULT_RESERVE_BYTES / MIB, "--reserve-mib", callback=flags.within(limits.RESERVE_MIB),
                                      help="VRAM kept free for the CUDA context and scratch buffers."),
    offload_output: bool = typer.Option(True, "--offload-output/--no-offload-output",
                                        help="Put the output head on the GPU (PowerInfer does)."),
    dense: str = typer.Option("all", "--dense", help="'all': every layer's attention, predictor and KV cache go "
                              "to VRAM first, as PowerInfer's engine does; 'with-ffn': only for layers that "
                              "place neurons."),
    time_limit: float = typer.Option(20.0, "--time-limit", callback=flags.within(limits.POSITIVE), help="Seconds for the MILP; past it the best plan "
                                     "found is used and the proved bound reported."),
    granularity: str = typer.Option("1", "--granularity", help="Each layer puts 0, a multiple of N, or all of its "
                                    "neurons on the GPU. 'powerinfer': what PowerInfer's CUDA build takes, 256 "
                                    "when the file's down projection is q4_0, else 32 (this engine takes any N)."),
    memory_budget: Optional[float] = typer.Option(
        None, "--memory-budget", callback=flags.within(limits.MEMORY_BUDGET_GIB), help="GiB of memory the engine may hold (its --memory-budget): places each layer's "
        "neurons across GPU, memory and disk by one program and writes MODEL.tiers beside the model, whose counts "
        "the engine's disk tier then holds in memory. Needs the neuron bundles (convert --neuron-bundles) and "
        "--granularity 1; the engine is opened at this budget to learn its room. For a mixture of experts (with "
        "its expert profile): each layer's experts on the device (--vram-budget above 0: its most selected that the "
        "room left after the device's head and attention holds), pinned experts and cache slots. Default: no memory "
        "tier."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Plan for a model not converted (or downloaded) yet: "
                                 "bytes from its config's shapes at --outtype; counts from --profile, else an "
                                 "assumed power law (labelled as such). Writes nothing unless --out."),
    outtype: str = typer.Option("q4_0", "--outtype", help="With --dry-run: the weight type the model would be "
                                "converted to (f32, f16, q8_0, q4_0)."),
    predictor_rank: Optional[int] = typer.Option(
        None, "--predictor-rank", help="With --dry-run: the predictors' rank (default: train-predictor's cap, 10% "
                                       "of the FFN parameters); 0 for none."),
    exponent: float = typer.Option(SYNTHETIC_EXPONENT, "--power-law-exponent", callback=flags.within(limits.EXPONENT),
                                   help="With --dry-run and no --profile: exponent a of the assumed activation "
                                   "rate min(1, 0.01 (rank/n_ff)^-a); larger is more skewed."),
):
    """Place the hottest FFN neurons on the GPU within a VRAM budget (an exact MILP, HiGHS).

    Maximises the activations served from the GPU, counting bytes at the model file's quantization.
    --dry-run does the same from a model's config alone, before converting or downloading it.

    Examples:

      pi-tools plan --profile prof --model smollm2.powerinfer.gguf --vram-budget 0.5

      pi-tools plan --profile prof -m model.powerinfer.gguf --vram-budget 8 -c 2048 -o model.gpuidx

      pi-tools plan --dry-run -m relufalcon-40b --outtype q4_0 --vram-budget 24

      pi-tools plan --profile prof -m model.q4_0.powerinfer.gguf --vram-budget 8 --granularity powerinfer

      pi-tools plan --profile prof -m model.q4_0.gguf --vram-budget 0 --memory-budget 0.4 -c 256

      pi-tools plan --profile moe-prof -m qwen3-moe.q4_0.gguf --vram-budget 0 --memory-budget 8

      pi-tools plan --profile moe-prof -m mixtral.q4_0.gguf --vram-budget 12 --memory-budget 16

      pi-tools plan --dry-run -m ./ReluLLaMA-70B --profile ./ReluLLaMA-70B-PowerInfer-GGUF/activation --vram-budget 12
    """
    from powerinfer_tools import stages
    from powerinfer_tools.stages.placement import placement

    opts = stages.PlanOptions(vram_budget_gib=vram_budget, out=out, ctx_size=ctx_size,
                              min_layer_neurons=min_layer_neurons, reserve_bytes=int(reserve_mib * MIB),
                              offload_output=offload_output, dense=dense, time_limit=time_limit,
                              granularity=granularity, memory_budget_gib=memory_budget)
    if dry_run and memory_budget is not None:
        raise UserError("--memory-budget needs a converted model with its neuron bundles, not --dry-run")
    if dry_run:
        from powerinfer_tools.stages.conversion import dry_run as dry

        config_model = dry.load(model)
        result = dry.plan_from_config(config_model, outtype.lower(), vram_budget * placement.GIB, profile,
                                      predictor_rank, exponent, **opts.solver_options())
        report_dry_run(config_model, result)
        if out is not None:
            placement.write_summary(result.plan, out, extra={"dry_run": dry_run_summary(result)})
            typer.echo(f"wrote {out}")
        return
    if predictor_rank is not None:
        raise UserError("--predictor-rank only applies with --dry-run (a converted file has its predictors)")
    if profile is None:
        raise UserError("--profile is required (its activation counts decide the hot neurons), except with --dry-run")
    from powerinfer_tools.stages.profiling.expert_profile import mixture_file

    if mixture_file(model) is not None:
        plan_experts(profile, model, opts)
        return
    written = stages.plan(profile, model, opts)
    report(written.plan)
    typer.echo(f"wrote {written.gpuidx} and {written.summary}" + (f" and {written.tiers}" if written.tiers else ""))
    if not _nvidia_gpu_visible() and not (vram_budget == 0 and memory_budget is not None):
        typer.echo(f"pi-tools: warning: no NVIDIA GPU is visible here: this plan is for another machine, one with "
                   f"{vram_budget:g} GiB of GPU memory to give (--vram-budget); here run, perplexity, chat and serve "
                   "ignore it and compute every neuron on the CPU by --sparse-mode (predictor: the predictor in every "
                   "layer)", err=True)


def plan_experts(profile: Path, model: str, opts) -> None:
    """A mixture of experts: its experts across memory and disk, written into MODEL.tiers."""
    from powerinfer_tools.stages.placement import expert_tiers

    if opts.memory_budget_gib is None:
        raise UserError("a mixture of experts is placed across a device, memory and disk: give --memory-budget (and "
                        "--vram-budget, 0 for no device)")
    dense_only = (("--out", opts.out, None), ("--granularity", str(opts.granularity), "1"),
                  ("--dense", opts.dense, "all"), ("--min-layer-neurons", opts.min_layer_neurons, "auto"),
                  ("--reserve-mib", opts.reserve_bytes, DEFAULT_RESERVE_BYTES),
                  ("--no-offload-output", opts.offload_output, True))
    for name, given, default in dense_only:
        if given != default:
            raise UserError(f"{name} applies to the neurons of dense FFNs; a mixture's plan places experts "
                            "(leave it out)")
    result = expert_tiers.plan_experts(profile, model, opts.vram_budget_gib * 2**30, opts.memory_budget_gib,
                                       opts.ctx_size, opts.time_limit)
    typer.echo("\n".join(result.summary_lines()))
    typer.echo(f"wrote {expert_tiers.write(result)}")


def _nvidia_gpu_visible() -> bool:
    """An NVIDIA device as the driver shows it (Linux: /proc/driver/nvidia/gpus, /dev/nvidia0)."""
    import os

    gpus = "/proc/driver/nvidia/gpus"
    return (os.path.isdir(gpus) and bool(os.listdir(gpus))) or os.path.exists("/dev/nvidia0")


def dry_run_summary(result) -> dict:
    """What the dry run assumed, for the JSON summary."""
    r = result.report
    return {"outtype": r.outtype, "predictor_rank": r.predictor_rank, "file_bytes": r.file_bytes,
            "parts_bytes": r.parts(), "activation_counts": result.assumption or "profile"}


def report_dry_run(config_model, result) -> None:
    from powerinfer_tools.stages.conversion import dry_run
    from powerinfer_tools.stages.placement import placement

    r = result.report
    typer.echo(f"dry run (nothing converted): {dry_run.describe(config_model, r)}")
    typer.echo(f"{r.outtype} file {placement.human_bytes(r.file_bytes)}; "
               f"predictors: {dry_run.predictor_note(config_model, [r])}")
    if result.assumption:
        typer.echo(result.assumption)
    report(result.plan)
    if result.assumption:
        typer.echo("(served shares above follow from the ASSUMED counts, not from a profile of this model)")


def report(result: placement.Plan) -> None:
    """Print the budget breakdown and each layer's GPU share."""
    from powerinfer_tools.stages.placement import placement

    typer.echo("\n".join(placement.report_lines(result)))
