"""What each stage takes and what it gives back: plain dataclasses whose defaults are the CLI's.

Kept free of torch, numpy and typer so that naming a stage's options costs nothing: the CLI builds them from
its flags, the default model's build and the notebooks build them by hand (see powerinfer_tools.stages).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from powerinfer_tools.core.numbers import Range

MIB = 1024**2
# The context run, chat, serve and plan default to: the model's trained one (GGUF <arch>.context_length), at most
# CTX_CAP tokens (llama-server's default), so a long prompt fits without a flag while the KV cache stays bounded.
# The engine applies the same rule to ctx_size 0 (csrc/engine/engine.cpp, kDefaultCtx).
CTX_CAP = 4096
TRAINED_CTX_UNKNOWN = 2048  # a file without <arch>.context_length: the engine's assumption (csrc/model/model.cpp)
PERPLEXITY_WINDOW = 512  # perplexity's -c is a window length, as llama.cpp's perplexity's
CTX_SIZE_HELP = (f"Context length in tokens (the KV cache). Default: the model's trained context "
                 f"(<arch>.context_length in the file), at most {CTX_CAP}.")
# The KV cache's element types, and the one every command and the LLM open with: f16, as llama.cpp's and
# PowerInfer's (half f32's memory; its effect on perplexity is bounded in tests/runtime/test_kv_type.py). The
# engine binding's own default stays f32, the exact path its logits tests compare with transformers. q8_0 on
# request (llama.cpp's --cache-type-k/v q8_0): 32 int8 and an f16 scale per block, 34 bytes per 32 elements.
KV_ELEMENT_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}
KV_TYPES = tuple(KV_ELEMENT_BYTES)
DEFAULT_KV_TYPE = "f16"
KV_TYPE_HELP = ("KV cache type: f16 (llama.cpp's default: half the memory of f32 and of what each generated token "
                "reads of it at a long context), f32 (logits within float rounding of transformers) or q8_0 "
                "(llama.cpp's --cache-type-k/v q8_0: about half f16's memory; perplexity within 0.5 % of f16's, "
                "docs/engine.md).")
GPU_MODES = ("auto", "on", "off")  # --gpu
SYNTHETIC_EXPONENT = 0.9  # the power law of placement's synthetic counts (described there): plan's default
DEFAULT_RESERVE_BYTES = 256 * MIB  # PowerInfer leaves 256 MiB free when it sizes the budget itself
DEFAULT_TRAIN_THREADS = max(1, (os.cpu_count() or 2) // 2)  # small matrices: more threads only add contention

# What the float options may be: the CLI checks each as it parses it (cli/flags.py: within), the stages again for
# callers of the API. A GiB or MiB figure is held below 2**20 of its unit, far past any device's memory.
PLAN_BUDGET_GIB = Range(0, 2**20, unit=" GiB")                    # 0: an all-CPU plan
DEVICE_BUDGET_GIB = Range(0, 2**20, low_open=True, unit=" GiB")   # what the hot tier may take on the device
MEMORY_BUDGET_GIB = Range(0, 2**20, low_open=True, unit=" GiB")   # what the engine may hold in RAM
RESERVE_MIB = Range(0, 2**20, unit=" MiB")
SHARE = Range(0, 1, low_open=True, high_open=True)   # a target sparsity or recall, a held-out share
FRACTION = Range(0, 1, low_open=True)                # a cap on a share, top-p's mass
LEARNING_RATE = Range(0, 1, low_open=True)
SHIFT_BUDGET = Range(0, 1, high_open=True)
SPARSITY_LEVEL = Range(0, 1, high_open=True)
POSITIVE = Range(0, low_open=True)                   # a time, a penalty factor
AT_LEAST_ONE = Range(1)
CTX_SIZE = Range(1, unit=" tokens")
NON_NEGATIVE = Range(0)                              # a temperature (0: greedy)
EXPONENT = Range(0, 16)                              # the assumed power law's: 16 puts every neuron past 0.01


@dataclass
class ProfileOptions:
    model: str
    out: Path
    calib: list[Path] = field(default_factory=list)
    tokens: int = 32768
    seq_len: int | None = None   # default: min(512, the model's context length)
    batch: int = 4
    device: str = "cpu"
    dtype: str = "float32"
    load: str = "auto"           # 'layer' (one decoder layer in memory at a time), 'whole', or auto: by free memory
    target_sparsity: list[float] | None = None   # one value, or one per layer
    max_samples: int = 8192
    seed: int = 0
    force: bool = False
    resume: bool = False
    input_allocation: str = "none"  # input sparsity's thresholds (stages/profiling/input_sparsity.py): "uniform", "greedy"
    threads: int | None = None      # the engine's threads (an expert profile); the CLI sets torch's


@dataclass
class PredictorOptions:
    out: Path | None = None                  # default: PROFILE_DIR-predictors
    rank: str | int = "auto"                 # 'auto' (per layer, under max_predictor_fraction) or one rank
    target_recall: float | None = None       # default: 0.99 for ReLU-family profiles, 0.95 for thresholded ones
    max_density_ratio: float = 1.3
    max_predictor_fraction: float = 0.10
    epochs: int = 8
    device: str = "cpu"
    layers: str | None = None                # e.g. '0-3,7'; default: all
    held_out: float = 0.2
    threads: int = DEFAULT_TRAIN_THREADS
    seed: int = 0
    force: bool = False


def default_ctx_size(trained: int | None) -> int:
    """The context a model runs with when none is asked for: its trained context, at most CTX_CAP."""
    return min(trained or TRAINED_CTX_UNKNOWN, CTX_CAP)


@dataclass
class PlanOptions:
    vram_budget_gib: float
    out: Path | None = None                  # the gpu-index file; default: MODEL.generated.gpuidx beside the model
    ctx_size: int | None = None              # default: default_ctx_size of the model's trained context
    min_layer_neurons: str | int = "auto"
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    offload_output: bool = True
    dense: str = "all"
    time_limit: float = 20.0
    granularity: str | int = 1
    memory_budget_gib: float | None = None   # with it, the three-tier plan (GPU, memory, disk) beside the model

    def solver_options(self) -> dict:
        """The keyword arguments of placement.plan_for_model (and of the dry run's plan_from_config), but the memory
        budget (plan_for_model's only)."""
        return dict(ctx_size=self.ctx_size, min_layer_neurons=self.min_layer_neurons,
                    reserve_bytes=self.reserve_bytes, offload_output=self.offload_output, dense=self.dense,
                    time_limit=self.time_limit, granularity=self.granularity)


@dataclass
class ConvertOptions:
    model: str
    out: Path
    outtype: str = "f16"
    predictors: Path | None = None
    profile: Path | None = None
    order_neurons: bool = True
    powerinfer_compatible: bool = True
    progress: bool = True
    input_sparsity: bool = False  # the profile's input thresholds and the transposed copies they need


@dataclass
class SparsifyOptions:
    model: str
    out: Path
    calib: list[Path] = field(default_factory=list)
    self_tokens: int = 0          # with calib: also train on this many tokens the model writes itself
    activation: str = "relu"      # the student's: relu (gate only) or drelu (gate and up; the Bamboo form)
    target_sparsity: float = 0.85
    tokens: int = 262144          # end-to-end (phase 2) training tokens
    local_tokens: int = 32768     # tokens whose FFN inputs and outputs phase 1 caches
    local_epochs: int = 4
    seq_len: int = 256
    batch: int = 4
    lr: float = 1e-4
    local_lr: float = 1e-3
    eval_tokens: int = 16384
    shift_budget: float = 0.01    # relative perplexity the FATReLU threshold may cost (0: stay plain ReLU)
    device: str = "auto"
    dtype: str = "auto"
    grad_checkpointing: bool = False
    checkpoint_minutes: float = 5.0
    seed: int = 0
    force: bool = False
    resume: bool = False


@dataclass
class TrainedPredictors:
    """A predictor directory trained (or measured, with evaluate_predictors) and its per-layer results."""

    path: Path
    layers: list            # predictor_training.LayerResult, one per layer
    warnings: list[str]     # for stderr: useless layers, thresholds measured against another profile


@dataclass
class PlanFiles:
    """A placement and the files it was written to: the gpu index and its JSON summary (and with a memory budget,
    the three-tier plan beside the model)."""

    plan: object            # placement.Plan
    gpuidx: Path
    summary: Path
    tiers: Path | None = None


@dataclass
class Converted:
    path: Path
    summary: dict           # conversion.convert_model's summary (arch, types, bytes, seconds, ...)


@dataclass
class Sparsified:
    path: Path
    report: dict | None     # what OUT/sparsify.json holds (None in the other processes of accelerate launch)
