"""`pi-tools plan`: choose the hot neurons for a VRAM budget and write PowerInfer's gpu-index file."""
from __future__ import annotations

from pathlib import Path

import typer

from powerinfer_tools import placement


def plan(
    profile: Path = typer.Option(..., "--profile", help="Profile directory from `pi-tools profile` "
                                 "(reads DIR/activation/activation_{i}.pt)."),
    model: Path = typer.Option(..., "--model", "-m", help="Converted model file (MODEL.powerinfer.gguf): "
                               "its tensor types and shapes give the bytes."),
    vram_budget: float = typer.Option(..., "--vram-budget", help="GiB of VRAM to use; 0 gives an all-CPU plan."),
    ctx_size: int = typer.Option(placement.DEFAULT_CTX_SIZE, "--ctx-size", "-c",
                                 help="Context length the KV cache is sized for."),
    out: Path = typer.Option(None, "--out", "-o", help="Output gpu-index file (default: MODEL.generated.gpuidx "
                             "beside the model, where PowerInfer's engine looks); a JSON summary goes to OUT.json."),
    min_layer_neurons: str = typer.Option("auto", "--min-layer-neurons",
                                          help="A layer that offloads anything offloads at least this many "
                                          "neurons: 'auto' (from the split-overhead cost model) or N."),
    reserve_mib: float = typer.Option(placement.DEFAULT_RESERVE_BYTES / placement.MIB, "--reserve-mib",
                                      help="VRAM kept free for the CUDA context and scratch buffers."),
    offload_output: bool = typer.Option(True, "--offload-output/--no-offload-output",
                                        help="Put the output head on the GPU (PowerInfer does)."),
    dense: str = typer.Option("all", "--dense", help="'all': every layer's attention, predictor and KV cache go "
                              "to VRAM first, as PowerInfer's engine does; 'with-ffn': only for layers that "
                              "place neurons."),
    time_limit: float = typer.Option(20.0, "--time-limit", help="Seconds for the MILP; past it the best plan "
                                     "found is used and the proved bound reported."),
):
    """Place the hottest FFN neurons on the GPU within a VRAM budget (an exact MILP, HiGHS).

    Maximises the activations served from the GPU, counting bytes at the model file's quantization.

    Examples:

      pi-tools plan --profile prof --model smollm2.powerinfer.gguf --vram-budget 0.5

      pi-tools plan --profile prof -m model.powerinfer.gguf --vram-budget 8 -c 2048 -o model.gpuidx
    """
    result = placement.plan_for_model(profile, model, vram_budget * placement.GIB, ctx_size=ctx_size,
                                      min_layer_neurons=min_layer_neurons,
                                      reserve_bytes=int(reserve_mib * placement.MIB),
                                      offload_output=offload_output, dense=dense, time_limit=time_limit)
    out, summary = write_plan(result, out or placement.default_gpuidx_path(model))
    report(result)
    typer.echo(f"wrote {out} and {summary}")


def write_plan(result: placement.Plan, out: Path) -> tuple[Path, Path]:
    """The gpu-index file and its JSON summary (OUT.json)."""
    summary = Path(f"{out}.json")
    placement.write_gpuidx(result, out)
    placement.write_summary(result, summary)
    return Path(out), summary


def report(result: placement.Plan) -> None:
    """Print the budget breakdown and each layer's GPU share."""
    s = result.summary()
    typer.echo("VRAM budget breakdown:")
    for line in placement.breakdown_lines(result):
        typer.echo(line)
    solver = s["solver"]
    typer.echo(f"solver: {solver['method']}, {solver['seconds']:.2f} s"
               + (f", {solver['iterations']} MILP rounds" if solver.get("iterations") else "")
               + (" (time limit hit: best plan found)" if solver.get("timed_out") else ""))
    typer.echo(f"GPU neurons {s['gpu_neurons']}/{s['neurons']}, activations served from GPU "
               f"{100 * s['served_fraction']:.1f}%")
    typer.echo(f"  {'layer':>5} {'gpu/n_ff':>13} {'min':>6} {'served':>7}")
    for layer in s["layers"]:
        typer.echo(f"  {layer['layer']:>5} {layer['gpu_neurons']:>6}/{layer['n_ff']:<6} {layer['min_neurons']:>6} "
                   f"{100 * layer['served_fraction']:>6.1f}%")
