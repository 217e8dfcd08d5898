"""The embedded default, ready to run: SmolLM2 through the real pipeline, built once into the cache.

`pi-tools run -m smollm2` needs a PowerInfer file with predictors. The first time, this runs the same
stages a user would (powerinfer_tools.stages: profile on self-generated text, train_predictors, convert) into
`cache_dir()/pipeline/smollm2/`; later runs find the file and start at once. Each step's output is
written atomically, so an interrupted first run simply resumes at the first missing step.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

from powerinfer_tools.models import default_model
from powerinfer_tools.models.default_model import cache_dir

RECIPE_VERSION = 2            # bump when the recipe below changes, so old caches are not reused
PROFILE_TOKENS = 4096         # data-free: 16 self-generated sequences of 256 tokens
PROFILE_SEQ_LEN = 256         # short sequences: generation cost grows with their length
PREDICTOR_RANK = 32           # 2.5% of SmolLM2's FFN weights


def model_dir(model: str = default_model.NAME) -> Path:
    """Cache directory of a model's pipeline outputs: named for the default, hashed for a path."""
    if model == default_model.NAME:
        name = model
    else:
        resolved = str(Path(model).expanduser().resolve())
        name = f"{Path(resolved).name}-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"
    return cache_dir() / "pipeline" / name / f"recipe-{RECIPE_VERSION}"


def model_file(model: str = default_model.NAME, outtype: str = "q8_0") -> Path:
    return model_dir(model) / f"{Path(model).name}.{outtype}.powerinfer.gguf"


def _step(title: str, out: Path, report: Path, run: Callable[[], list[str]]) -> None:
    """Run one stage into `out`: its title on stderr (stdout belongs to the command that asked for the model:
    `pi-tools run ... | head` must see only the generated text, and a closed pipe must not stop a build), its
    report (tables a first-time user did not ask for) appended to `report` beside the model."""
    print(f"pi-tools: {title} -> {out}", file=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):  # the stages' own notes (resuming, data-free) go along
        lines = run()
    with open(report, "a", encoding="utf-8") as f:
        f.write(f"== {title} -> {out}\n" + "".join(line + "\n" for line in lines))


def build(model: str = default_model.NAME, outtype: str = "q8_0", tokens: int = PROFILE_TOKENS,
          rank: int = PREDICTOR_RANK) -> Path:
    """Path of a model's PowerInfer file with predictors, built through the pipeline on first use."""
    from powerinfer_tools.core.atomic import output_lock
    from powerinfer_tools.core.progress import terminal_only

    final = model_file(model, outtype)
    if final.is_file():
        return final
    with output_lock(final, wait=True), terminal_only():  # concurrent first runs: one builds, the others wait
        return final if final.is_file() else _build(model, outtype, tokens, rank, final)


def _build(model: str, outtype: str, tokens: int, rank: int, final: Path) -> Path:
    from powerinfer_tools import stages
    from powerinfer_tools.stages.conversion.conversion import summary_lines as convert_lines
    from powerinfer_tools.stages.predictors.predictor_training import format_table
    from powerinfer_tools.stages.profiling.profiling import partial_dir, summary_lines as profile_lines

    root = model_dir(model)
    profile, predictors, report = root / "profile", root / "predictors", root / "build-report.txt"
    print(f"pi-tools: first use of '{model}': building {final.name} through the pipeline "
          f"(a few CPU-minutes, once; later runs start at once; the stages' reports go to {report})", file=sys.stderr)
    if not (profile / "profile.json").is_file():
        # an interrupted first run's profile continues where it stopped
        resume = (partial_dir(profile) / "identity.json").is_file()
        opts = stages.ProfileOptions(model=model, out=profile, tokens=tokens, seq_len=PROFILE_SEQ_LEN,
                                     resume=resume, force=not resume)
        _step("1/3 profile (data-free)", profile, report, lambda: profile_lines(stages.profile(opts).meta))
    if not (predictors / "config.json").is_file():
        def train() -> list[str]:
            trained = stages.train_predictors(profile, stages.PredictorOptions(out=predictors, rank=rank, force=True))
            return [format_table(trained.layers), *trained.warnings,
                    f"wrote {len(trained.layers)} predictors to {trained.path}"]
        _step("2/3 train-predictor", predictors, report, train)
    convert = stages.ConvertOptions(model=model, out=final, outtype=outtype, predictors=predictors, profile=profile)
    _step("3/3 convert", final, report, lambda: convert_lines(stages.convert(convert).summary))
    return final
