"""The peers some scripts and the bench measure against, where this machine has them: never a test dependency, so a
test that needs one skips, naming the variable that supplies it."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def llama_cpp_python() -> str | None:
    """A Python with the real llama-cpp-python: $PI_BENCH_PEER_PYTHON, or this one when it has it; else None."""
    env = os.environ.get("PI_BENCH_PEER_PYTHON")
    if env:
        return env
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def powerinfer_build() -> Path | None:
    """A CPU build of PowerInfer (SJTU-IPADS/PowerInfer: bin/main, bin/perplexity, bin/quantize), named by
    $PI_POWERINFER_BUILD; else None."""
    env = os.environ.get("PI_POWERINFER_BUILD")
    return Path(env) if env else None
