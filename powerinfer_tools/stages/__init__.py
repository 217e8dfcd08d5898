"""The pipeline as functions: [sparsify ->] profile -> train_predictors -> plan -> convert.

Each stage takes its options (stages.options: plain dataclasses whose defaults are the CLI's) and returns what
it wrote. `pi-tools` parses flags into these options, calls one stage and prints what comes back; the default
model's build (runtime/default_build.py) and the notebooks call the same functions. Nothing here reads argv,
prints to stdout or imports typer; progress bars go to stderr. The modules behind each stage are imported on
first call (they load torch).

Behind them, one folder per stage: profiling/ (profile, its calibration text, input thresholds, locality),
predictors/ (train-predictor), placement/ (plan), conversion/ (convert and its dry run), sparsification/ (sparsify);
report.py reads what they all wrote.

    from powerinfer_tools import stages

    profile = stages.profile(stages.ProfileOptions(model="smollm2", out=Path("prof"), tokens=4096))
    predictors = stages.train_predictors(profile, stages.PredictorOptions(rank=32))
    model = stages.convert(stages.ConvertOptions(model="smollm2", out=Path("s.powerinfer.gguf"), outtype="q8_0",
                                                 predictors=predictors.path, profile=profile.path))
    plan = stages.plan(profile.path, model.path, stages.PlanOptions(vram_budget_gib=0.5))
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from powerinfer_tools.stages.options import (ConvertOptions, Converted, PlanFiles, PlanOptions,  # noqa: F401
                                             PredictorOptions, ProfileOptions, Sparsified, SparsifyOptions,
                                             TrainedPredictors)

if TYPE_CHECKING:
    from powerinfer_tools.stages.predictors.predictor_training import ProfileDir


def profile(opts: ProfileOptions) -> ProfileDir:
    """Profile opts.model into opts.out (docs/profile.md): activation counts, thresholds, predictor rows."""
    from powerinfer_tools.stages.predictors import predictor_training
    from powerinfer_tools.stages.profiling import profiling

    return predictor_training.ProfileDir(Path(opts.out), profiling.run_profile(opts))


def read_profile(path: str | Path) -> ProfileDir:
    """A profile directory written earlier (by `profile`, or PowerInfer-style by hand)."""
    from powerinfer_tools.stages.predictors import predictor_training

    return predictor_training.read_profile(Path(path))


def train_predictors(profile: ProfileDir | str | Path, opts: PredictorOptions) -> TrainedPredictors:
    """One activation predictor per layer from a profile (docs/predictors.md), written to opts.out."""
    from powerinfer_tools.stages.predictors import predictor_training

    return predictor_training.train(_profile_dir(profile), opts)


def evaluate_predictors(profile: ProfileDir | str | Path, predictors: str | Path, opts: PredictorOptions,
                        report: str | Path | None = None) -> TrainedPredictors:
    """Measure an existing predictor directory on every row of a (separate, evaluation) profile."""
    from powerinfer_tools.stages.predictors import predictor_training

    return predictor_training.evaluate(_profile_dir(profile), Path(predictors), opts,
                                       Path(report) if report is not None else None)


def plan(profile: str | Path, model: str | Path, opts: PlanOptions) -> PlanFiles:
    """Place a converted model's hottest neurons on the GPU within a VRAM budget (docs/placement.md) and write
    the gpu-index file (opts.out, default beside the model where PowerInfer looks) with its JSON summary; with a
    memory budget also the three-tier plan beside the model, where the engine's disk tier looks (MODEL.tiers)."""
    from powerinfer_tools.stages.placement import placement

    result = placement.plan_for_model(profile, model, opts.vram_budget_gib * placement.GIB, **opts.solver_options(),
                                      memory_budget_gib=opts.memory_budget_gib)
    return placement.write_plan(result, opts.out or placement.default_gpuidx_path(model))


def convert(opts: ConvertOptions) -> Converted:
    """Write the PowerInfer GGUF of opts.model (+ predictors, thresholds, neuron order; docs/formats.md)."""
    from powerinfer_tools.stages.conversion import conversion

    summary = conversion.convert_model(opts.model, opts.out, outtype=opts.outtype.lower(),
                                       predictors_dir=opts.predictors, profile_dir=opts.profile,
                                       progress=opts.progress, order_neurons=opts.order_neurons,
                                       powerinfer_compatible=opts.powerinfer_compatible,
                                       input_sparsity=opts.input_sparsity)
    return Converted(Path(opts.out), summary)


def sparsify(opts: SparsifyOptions) -> Sparsified:
    """Turn a SiLU model into a sparse ReLU one by distillation (docs/sparsify.md), written to opts.out."""
    from powerinfer_tools.stages import sparsification

    return Sparsified(Path(opts.out), sparsification.run_sparsify(opts))


def _profile_dir(profile: ProfileDir | str | Path) -> ProfileDir:
    return read_profile(profile) if isinstance(profile, (str, Path)) else profile
