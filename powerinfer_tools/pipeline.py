"""The embedded default, ready to run: SmolLM2 through the real pipeline, built once into the cache.

`pi-tools run -m smollm2` needs a PowerInfer file with predictors. The first time, this runs the same
subcommands a user would (profile on self-generated text, train-predictor, convert) into
`cache_dir()/smollm2-powerinfer/`; later runs find the file and start at once. Each step's output is
written atomically, so an interrupted first run simply resumes at the first missing step.
"""
from __future__ import annotations

import sys
from pathlib import Path

from powerinfer_tools import default_model
from powerinfer_tools.default_model import cache_dir

RECIPE_VERSION = 1            # bump when the recipe below changes, so old caches are not reused
PROFILE_TOKENS = 4096         # data-free: 8 self-generated sequences of 512 tokens
PREDICTOR_RANK = 32           # 2.5% of SmolLM2's FFN weights


def default_model_dir() -> Path:
    return cache_dir() / "smollm2-powerinfer" / f"recipe-{RECIPE_VERSION}"


def default_model_file(outtype: str = "q8_0") -> Path:
    return default_model_dir() / f"smollm2.{outtype}.powerinfer.gguf"


def _step(title: str, args: list[str]) -> None:
    from powerinfer_tools.cli import app

    print(f"pi-tools: {title}: pi-tools {' '.join(args)}", file=sys.stderr)
    app(args=args, standalone_mode=False)


def build_default_model(outtype: str = "q8_0") -> Path:
    """Path of the default model's PowerInfer file, building it on first use."""
    final = default_model_file(outtype)
    if final.is_file():
        return final
    root = default_model_dir()
    profile, predictors = root / "profile", root / "predictors"
    print(f"pi-tools: first use of '{default_model.NAME}': building {final.name} through the pipeline "
          "(a few minutes, once; later runs start at once)", file=sys.stderr)
    if not (profile / "profile.json").is_file():
        _step("1/3 profile (data-free)", ["profile", "-m", default_model.NAME, "--tokens", str(PROFILE_TOKENS),
                                          "-o", str(profile), "--force"])
    if not (predictors / "config.json").is_file():
        _step("2/3 train-predictor", ["train-predictor", str(profile), "-o", str(predictors),
                                      "--rank", str(PREDICTOR_RANK), "--force"])
    _step("3/3 convert", ["convert", "-m", default_model.NAME, "-p", str(predictors), "--profile", str(profile),
                          "-t", outtype, "-o", str(final)])
    return final
