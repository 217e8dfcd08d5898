"""Flag spellings shared by the commands, as llama.cpp's tools spell them (-t threads, -p prompt, -c/--ctx-size,
-f file, -n tokens to predict), and the toolkit's older spellings kept as deprecated aliases: given, they still
work and say so in one line on stderr."""
from __future__ import annotations

import typer

from powerinfer_tools.core.numbers import Range
from powerinfer_tools.stages.options import DEVICE_BUDGET_GIB

DEFAULT_SPARSE_MODE = "auto"   # run, perplexity: the cheapest mode per layer, what a user runs
THREADS_HELP = "Threads. Default: all cores."


def gpu_option():
    """--gpu: where the hot tier runs (run, perplexity, bench)."""
    return typer.Option("auto", "--gpu", help="Hot tier (the --gpuidx / --vram-budget neurons) on a CUDA GPU: auto "
                        "(when a device and the CUDA library are there, else the CPU, said on stderr), on (or fail "
                        "saying what is missing), off.")


def within(allowed: Range):
    """A typer callback holding a float option to `allowed` as it is parsed, before the command starts: one line
    naming the flag (core/numbers.py), whatever else is wrong with the command line."""
    def check(param: typer.CallbackParam, value):
        return allowed.check(param.opts[0], value)
    return check


def vram_budget_option():
    """--vram-budget: the plan's budget, and the device memory the hot tier may take at run time."""
    return typer.Option(None, "--vram-budget", callback=within(DEVICE_BUDGET_GIB), help="GiB of VRAM, as PowerInfer's --vram-budget: without --gpuidx, "
                        "reuse the plan cached beside the model for this budget or solve one from --profile; on a "
                        "GPU, the most the hot tier takes there, layer after layer (the rest stay on the CPU). "
                        "Default: the device's free memory.")


def deprecated(value, old: str, new: str):
    """`value` of a deprecated spelling `old` (None when not given), with the note that `new` replaces it."""
    if value is not None:
        typer.echo(f"pi-tools: {old} is deprecated: use {new}", err=True)
    return value


def either(value, alias_value, alias: str, new: str):
    """The value of the new spelling, or of its deprecated alias when that was given (noted)."""
    alias_value = deprecated(alias_value, alias, new)
    return value if alias_value is None else alias_value


def outtype_alias():
    """-t, which meant the weight type in convert and plan: -t is threads in llama.cpp's tools."""
    return typer.Option(None, "-t", hidden=True, help="Deprecated: --outtype.")


def predictors_alias():
    """-p, which meant the predictor directory in convert and report: -p is the prompt in llama.cpp's tools."""
    return typer.Option(None, "-p", hidden=True, help="Deprecated: --predictors.")
