"""The embedded default, ready to run: SmolLM2 through the real pipeline, built once into the cache.

`pi-tools run -m smollm2` needs a PowerInfer file with predictors. The first time, this runs the same
subcommands a user would (profile on self-generated text, train-predictor, convert) into
`cache_dir()/pipeline/smollm2/`; later runs find the file and start at once. Each step's output is
written atomically, so an interrupted first run simply resumes at the first missing step.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
from pathlib import Path

from powerinfer_tools import default_model
from powerinfer_tools.default_model import cache_dir

RECIPE_VERSION = 1            # bump when the recipe below changes, so old caches are not reused
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


def _step(title: str, args: list[str]) -> None:
    """Run one subcommand with its reports on stderr: stdout belongs to the command that asked for the model
    (`pi-tools run ... | head` must see only the generated text, and a closed pipe must not stop a build)."""
    from powerinfer_tools.cli import app

    print(f"pi-tools: {title}: pi-tools {' '.join(args)}", file=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):
        app(args=args, standalone_mode=False)


def build(model: str = default_model.NAME, outtype: str = "q8_0", tokens: int = PROFILE_TOKENS,
          rank: int = PREDICTOR_RANK) -> Path:
    """Path of a model's PowerInfer file with predictors, built through the pipeline on first use."""
    from powerinfer_tools.atomic import output_lock

    final = model_file(model, outtype)
    if final.is_file():
        return final
    with output_lock(final, wait=True):  # concurrent first runs: one builds, the others wait for it
        return final if final.is_file() else _build(model, outtype, tokens, rank, final)


def _build(model: str, outtype: str, tokens: int, rank: int, final: Path) -> Path:
    root = model_dir(model)
    profile, predictors = root / "profile", root / "predictors"
    print(f"pi-tools: first use of '{model}': building {final.name} through the pipeline "
          "(about 12 CPU-minutes, once; later runs start at once)", file=sys.stderr)
    if not (profile / "profile.json").is_file():
        from powerinfer_tools.profile import partial_dir

        # an interrupted first run's profile continues where it stopped
        again = "--resume" if (partial_dir(profile) / "identity.json").is_file() else "--force"
        _step("1/3 profile (data-free)", ["profile", "-m", model, "--tokens", str(tokens), "--seq-len",
                                          str(PROFILE_SEQ_LEN), "-o", str(profile), again])
    if not (predictors / "config.json").is_file():
        _step("2/3 train-predictor", ["train-predictor", str(profile), "-o", str(predictors), "--rank", str(rank),
                                      "--force"])
    _step("3/3 convert", ["convert", "-m", model, "-p", str(predictors), "--profile", str(profile),
                          "-t", outtype, "-o", str(final)])
    return final
