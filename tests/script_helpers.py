"""Running the maintained scripts (scripts/) as their documentation does, at a tiny size: each prints what it
measured, and the tests read that back. Their timings mean nothing at this size; that they run does."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tiny_models import DATA

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import synthetic_llama  # noqa: E402  (a script, not the product)

synthetic_llama.DATA = DATA  # the tests' text wherever this checkout is (the script: PI_DATA or ../shared/data)
TINY = synthetic_llama.shape_of("tiny")


def script_env(**extra: str) -> dict:
    """This test run's environment for a script: its Python first on the PATH (a shell script calls python3), the
    text where synthetic_llama.py looks for it."""
    env = dict(os.environ, PI_DATA=str(DATA), **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_script(name: str, *args, timeout: float = 300, **extra_env: str) -> str:
    """The stdout of scripts/NAME ARGS (a .sh through bash, a .py through this Python), from the checkout's root;
    the test fails with the script's stderr if it exits non-zero."""
    cmd = ["bash"] if name.endswith(".sh") else [sys.executable]
    done = subprocess.run([*cmd, str(SCRIPTS / name), *map(str, args)], cwd=ROOT, env=script_env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@dataclass(frozen=True)
class Synthetic:
    """synthetic_llama.py's tiny shape: the checkpoint, its profile and predictors (at 90 % predicted sparsity), and
    the q4_0 file `convert` writes from them, its neuron bundles beside it."""
    model: Path
    profile: Path
    predictors: Path
    gguf: Path


def build_synthetic(root: Path) -> Synthetic:
    from powerinfer_tools.cli import main

    model, gguf = root / "model", root / "m.q4_0.powerinfer.gguf"
    synthetic_llama.build_model(model, TINY, progress=False)
    profile = synthetic_llama.build_profile(root / "prof", TINY)
    predictors = synthetic_llama.build_predictors(root / "pred", TINY, 0.9, rank=32)
    main(["convert", "-m", str(model), "--predictors", str(predictors), "--profile", str(profile), "--outtype", "q4_0",
          "--neuron-bundles", "-o", str(gguf), "-q"])
    return Synthetic(model, profile, predictors, gguf)


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table's body rows in `text` (the rows after a |---| line)."""
    rows, body = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            body = False
        elif body:
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        else:
            body = line.startswith("|---")
    return rows
