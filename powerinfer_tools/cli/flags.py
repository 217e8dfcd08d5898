"""Flag spellings shared by the commands, as llama.cpp's tools spell them (-t threads, -p prompt, -c/--ctx-size,
-f file, -n tokens to predict), each defined once."""
from __future__ import annotations

import functools
import inspect
import random
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import typer

from powerinfer_tools.core.numbers import Range
from powerinfer_tools.stages.options import (DEVICE_BUDGET_GIB, FRACTION, MEMORY_BUDGET_GIB, NON_NEGATIVE, POSITIVE,
                                             SPARSITY_LEVEL)

DEFAULT_SPARSE_MODE = "auto"   # run, perplexity: the cheapest mode per layer, what a user runs
THREADS_HELP = "Threads. Default: all cores."


def gpu_option():
    """--gpu: where the hot tier runs (run, perplexity, bench)."""
    return typer.Option("auto", "--gpu", help="Hot tier (the --gpuidx / --vram-budget neurons), and before it the "
                        "output head and the layers' attention and KV cache, on a CUDA GPU within the budget: auto "
                        "(when a device and the CUDA library are there, else the CPU, said on stderr), on (or fail "
                        "saying what is missing), off. Without a device the GPU index is ignored: --sparse-mode "
                        "computes every neuron on the CPU.")


def gpuidx_option():
    """--gpuidx: the hot tier's neurons (run, perplexity, chat, serve)."""
    return typer.Option(None, "--gpuidx", help="GPU index (.gpuidx from 'pi-tools plan'): its neurons form the hot "
                        "tier on the GPU, computed densely without the predictor (without a GPU it is ignored, said "
                        "on stderr). Default: MODEL.generated.gpuidx when it sits beside the model (as PowerInfer's "
                        "main finds it; said on stderr); 'none' for no index.")


def model_option():
    """-m/--model: every model file the engine opens, or the embedded default (run, perplexity, chat, serve)."""
    return typer.Option(..., "--model", "-m", help="Model file: one written by 'pi-tools convert', a PowerInfer "
                        "GGUF, or a llama.cpp GGUF (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K to q6_K; the "
                        "types the kernels do not compute with are decoded to q8_0 at load); or 'smollm2' (the "
                        "embedded default, built through the pipeline on first use).")


def profile_option():
    """--profile: what a plan for --vram-budget is solved from."""
    return typer.Option(None, "--profile", help="Profile directory, to solve a plan for --vram-budget (known for "
                        "'smollm2').")


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


def memory_budget_option():
    """--memory-budget: what the engine may hold in RAM (run, chat, serve, perplexity, bench)."""
    return typer.Option(None, "--memory-budget", callback=within(MEMORY_BUDGET_GIB), help="GiB of RAM the engine may "
                        "hold: the attention, head, predictors, KV cache and buffers, then the most often active FFN "
                        "neurons; the rest are read from MODEL.neurons when the predictor selects them (convert "
                        "--neuron-bundles writes it). Default: the machine's memory or the cgroup's limit, where "
                        "MODEL.neurons is there and the FFN would not fit it. Best in --sparse-mode predictor. A "
                        "mixture of experts keeps a cache of whole experts in the budget and reads the others from "
                        "MODEL itself (by default where its experts would not fit).")


def ctx_size_option(what: str = ""):
    """-c/--ctx-size: the context (KV cache) of run, chat, serve and plan, one default for all (options.CTX_SIZE_HELP);
    `what`: how the command uses it."""
    from powerinfer_tools.stages.options import CTX_SIZE_HELP

    return typer.Option(None, "--ctx-size", "-c", help=f"{CTX_SIZE_HELP} {what}".strip())


def sparse_mode_option():
    return typer.Option(DEFAULT_SPARSE_MODE, "--sparse-mode", help="FFN mode: dense (exact), gate (gate exactly, then "
                        "only active neurons), predictor (PowerInfer), auto (cheapest per layer: dense, the exact model, where "
                        "sparsity does not pay), oracle (true mask; "
                        "for testing), input (dense with --input-sparsity, default 0.25: every matrix's smallest "
                        "inputs zeroed and their weight rows skipped; SiLU models, no training).")


def input_sparsity_option():
    return typer.Option(None, "--input-sparsity", callback=within(SPARSITY_LEVEL), help="Share of every matrix's inputs "
                        "zeroed (q/k/v, o, gate/up, down; the smallest by magnitude, at thresholds the profile "
                        "calibrated and the file holds) and of the weight bytes a generated token skips; e.g. 0.25. "
                        "With --sparse-mode dense or input on every matrix, with the other modes on attention's. "
                        "Default: off (0.25 with --sparse-mode input).")


def threads_option():
    return typer.Option(None, "--threads", "-t", help=THREADS_HELP)


def kv_type_option():

    from powerinfer_tools.stages.options import DEFAULT_KV_TYPE, KV_TYPE_HELP

    return typer.Option(DEFAULT_KV_TYPE, "--kv-type", help=KV_TYPE_HELP)


def temp_option():
    return typer.Option(0.8, "--temp", callback=within(NON_NEGATIVE), help="Sampling temperature; 0 = greedy.")


def top_k_option():
    return typer.Option(40, "--top-k", help="Keep the k most likely tokens; 0 = off.")


def top_p_option():
    return typer.Option(0.95, "--top-p", callback=within(FRACTION), help="Nucleus sampling mass; 1 = off.")


def repeat_penalty_option():
    return typer.Option(1.1, "--repeat-penalty", callback=within(POSITIVE), help="Penalty for recent tokens; 1 = off.")


def repeat_last_n_option():
    return typer.Option(64, "--repeat-last-n", help="How many recent tokens the penalty sees.")


def seed_option():
    return typer.Option(-1, "--seed", "-s", help="Sampling seed; -1 = random.")


@dataclass(frozen=True)
class EngineArgs:
    """The engine options of the commands that run a model (run, chat, serve), as one record."""

    threads: Optional[int]
    sparse_mode: str
    gpuidx: Optional[Path]
    vram_budget: Optional[float]
    gpu: str
    profile: Optional[Path]
    kv_type: str
    input_sparsity: Optional[float]
    memory_budget: Optional[float]

    def llm_options(self) -> dict:
        """The record as powerinfer_tools.LLM's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_ENGINE_OPTIONS = {"threads": threads_option, "sparse_mode": sparse_mode_option, "gpuidx": gpuidx_option,
                   "vram_budget": vram_budget_option, "gpu": gpu_option, "profile": profile_option,
                   "kv_type": kv_type_option, "input_sparsity": input_sparsity_option,
                   "memory_budget": memory_budget_option}


@dataclass(frozen=True)
class SamplingArgs:
    """The sampling options of the commands that generate (run, chat), as one record."""

    temp: float
    top_k: int
    top_p: float
    repeat_penalty: float
    repeat_last_n: int
    seed: int

    def sampling(self):
        """As powerinfer_tools.LLM's Sampling, a random seed drawn for -1."""
        from powerinfer_tools.runtime.llm import Sampling

        seed = self.seed if self.seed >= 0 else random.SystemRandom().randrange(2**32)
        return Sampling(self.temp, self.top_k, self.top_p, self.repeat_penalty, self.repeat_last_n, seed=seed)


_SAMPLING_OPTIONS = {"temp": temp_option, "top_k": top_k_option, "top_p": top_p_option,
                     "repeat_penalty": repeat_penalty_option, "repeat_last_n": repeat_last_n_option,
                     "seed": seed_option}


def _grouped(argument: str, record: type, options: dict):
    """A decorator giving a command the flags of `options` (each defined once, above); the command receives
    their values as one `record` in its argument named `argument`."""
    hints = typing.get_type_hints(record)

    def decorate(command):
        own = [p for name, p in inspect.signature(command).parameters.items() if name != argument]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option(), annotation=hints[name])
                 for name, option in options.items()]

        @functools.wraps(command)
        def with_group(**kwargs):
            grouped = record(**{name: kwargs.pop(name) for name in options})
            return command(**kwargs, **{argument: grouped})

        with_group.__signature__ = inspect.Signature(own + added)
        # typer resolves annotations through typing.get_type_hints: the added ones as real types
        with_group.__annotations__ = {**command.__annotations__, **{name: hints[name] for name in options}}
        return with_group

    return decorate


engine_options = _grouped("engine", EngineArgs, _ENGINE_OPTIONS)
sampling_options = _grouped("sampling", SamplingArgs, _SAMPLING_OPTIONS)
