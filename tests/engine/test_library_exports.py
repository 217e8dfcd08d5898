"""The libraries export their C API and nothing else (docs/engine.md, "Linking: what the libraries export"). The engine
exported its C++ symbols and used the libstdc++ of whatever loaded it: built by another g++ than that libstdc++'s,
every open crashed inside the stream code that read the cgroup limit (issue 53)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import powerinfer_engine as engine
from powerinfer_engine._lib import _SIGNATURES, _TESTING_SIGNATURES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not shutil.which("nm"), reason="no nm (binutils) here")


def exported(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def libraries() -> dict[str, Path]:
    found = {"engine": engine.library_path()}
    for kind in ("emulated", "cuda"):
        path = engine.device_library_path(kind)
        if path is not None and path.is_file():
            found[kind] = path
    return found


def test_the_engine_exports_its_c_api_and_nothing_else():
    assert exported(engine.library_path()) == set(_SIGNATURES) | set(_TESTING_SIGNATURES)


@pytest.mark.parametrize("kind", ["emulated", "cuda"])
def test_a_device_library_exports_only_its_entry_point(kind):
    path = engine.device_library_path(kind)
    if path is None or not path.is_file():
        pytest.skip(f"no {kind} device library built here")
    assert exported(path) == {"pi_device_api_get"}


def test_no_library_needs_the_cxx_runtime_of_the_process():
    """libstdc++ and libgcc_s are linked in, where the compiler has them to link (setup.py's probe; Fedora's g++
    needs libstdc++-static)."""
    static = subprocess.run([shutil.which("c++") or "g++", "-print-file-name=libstdc++.a"], capture_output=True,
                            text=True).stdout.strip()
    if not Path(static).is_absolute():
        pytest.skip("no libstdc++.a here: setup.py links libstdc++ dynamically")
    for name, path in libraries().items():
        assert not [n for n in needed(path) if n.startswith(("libstdc++", "libgcc_s"))], (name, needed(path))


def test_the_engine_sources_use_no_iostreams():
    """The crash was in stream code; C stdio reads the engine's few text files (the fuzz target may print)."""
    uses = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in sorted((ROOT / "csrc").rglob("*"))
            if p.suffix in (".h", ".cpp", ".cu", ".inc") and "fuzz" not in p.parts
            for line in p.read_text().splitlines()
            if re.search(r"#include\s*<\w*stream>|std::(cout|cerr|clog|\w*stream)\b", line)]
    assert not uses, uses
