"""Damaged libraries are refused before they are mapped (engine/library_check.py for the engine library ctypes
loads, csrc/backend/library_check.cpp for the device libraries the engine dlopens): a truncated copy was a
SIGBUS, four zeroed bytes in the program headers a SIGSEGV, libc as the engine library a ctypes traceback. Every
load happens in a child process, so that a crash is seen as the child's signal instead of ending pytest."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import converted, write_gpuidx  # noqa: F401
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_engine.library_check import check_library

ROOT = Path(__file__).resolve().parents[2]

OPEN_EACH = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import powerinfer_engine as engine
model, gpuidx, gpu = sys.argv[1:4]
for library in sys.argv[4:]:
    try:
        with engine.Model(model, threads=1, gpuidx=gpuidx, gpu=gpu, gpu_library=library) as m:
            print(json.dumps([library, "opened", m.info["gpu"]["reason"] or ""]), flush=True)
    except engine.EngineError as exc:
        print(json.dumps([library, "refused", str(exc)]), flush=True)
"""


def mutants(src: Path, out: Path, every_header_word: bool) -> dict[str, Path]:
    """Copies of the library `src`: cut short at several lengths, and with four bytes zeroed at offset 64 (the
    first program header) or, with `every_header_word`, at each word of the ELF and program headers."""
    data = src.read_bytes()
    [phoff], (phentsize, phnum) = struct.unpack_from("<Q", data, 32), struct.unpack_from("<HH", data, 54)
    cuts = {64, 4096, 200_000, len(data) // 2, len(data) - 1}
    zeroed = range(0, phoff + phentsize * phnum, 4) if every_header_word else [64]
    made = {}
    for n in sorted(c for c in cuts if c < len(data)):
        made[f"cut at {n}"] = data[:n]
    for at in zeroed:
        made[f"zeroed at {at}"] = data[:at] + bytes(4) + data[at + 4:]
    out.mkdir(exist_ok=True)
    paths = {}
    for i, (name, body) in enumerate(made.items()):
        paths[name] = out / f"lib{i}.so"
        paths[name].write_bytes(body)
    return paths


def open_in_child(model: Path, gpuidx: Path, gpu: str, libraries: dict[str, Path]) -> dict[str, tuple[str, str]]:
    env = dict(os.environ, PI_EMULATED_DEVICE_MIB="512")
    env.pop("PI_EMULATED_DEVICES", None)
    done = subprocess.run([sys.executable, "-c", OPEN_EACH, str(model), str(gpuidx), gpu,
                           *map(str, libraries.values())], capture_output=True, text=True, timeout=600, env=env)
    results = {Path(p): (what, why) for p, what, why in map(json.loads, done.stdout.splitlines())}
    by_path = {path: name for name, path in libraries.items()}
    next_one = next((name for name, path in libraries.items() if path not in results), None)
    assert done.returncode == 0, f"{gpu}: the child died ({done.returncode}) loading {next_one}: {done.stderr[-1500:]}"
    return {by_path[p]: r for p, r in results.items()}


@pytest.fixture(scope="module")
def gpuidx(tmp_path_factory):
    hot = [np.random.default_rng(3 + i).random(N_FF) < 0.5 for i in range(N_LAYER)]
    return write_gpuidx(tmp_path_factory.mktemp("hot") / "hot.gpuidx", hot)


def test_a_damaged_device_library_is_refused_and_auto_runs_on_the_cpu(converted, gpuidx, tmp_path):
    model = converted("llama-relu", "q8_0")
    libraries = mutants(engine.device_library_path("emulated"), tmp_path / "libs", every_header_word=True)
    for gpu in ("auto", "on"):
        results = open_in_child(model, gpuidx, gpu, libraries)
        assert len(results) == len(libraries)
        for name, (what, why) in results.items():
            if gpu == "auto":
                assert what == "opened", (name, why)
            else:
                assert what == "opened" or why.startswith("gpu on: cannot load the device library"), (name, why)
            if name.startswith("cut") or name == "zeroed at 64":
                assert "cannot load the device library" in why and "\n" not in why, (name, why)
                assert "lies past its end" in why or not name.startswith("cut"), (name, why)


def test_an_intact_copy_of_the_device_library_loads(converted, gpuidx, tmp_path):
    copy = tmp_path / "copy.so"
    shutil.copy(engine.device_library_path("emulated"), copy)
    [(what, why)] = open_in_child(converted("llama-relu", "q8_0"), gpuidx, "on", {"copy": copy}).values()
    assert what == "opened" and why == "", why


def inspect_with_engine(library: Path, model: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PI_ENGINE_LIB=str(library), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "powerinfer_tools", "inspect", str(model)], capture_output=True,
                          text=True, timeout=300, env=env)


def test_a_damaged_engine_library_is_one_line(converted, tmp_path):
    model = converted("llama-relu")
    libraries = mutants(engine.library_path(), tmp_path / "libs", every_header_word=False)
    libraries["libc"] = Path(next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/aarch64-linux-gnu/libc.so.6",
                                                "/usr/lib64/libc.so.6", "/lib64/libc.so.6") if Path(p).exists()))
    libraries["the device library"] = engine.device_library_path("emulated")
    libraries["text"] = tmp_path / "notes.so"
    libraries["text"].write_text("not a library\n")
    for name, library in libraries.items():
        done = inspect_with_engine(library, model)
        assert done.returncode == 1, (name, done.returncode, done.stderr[-1500:])
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, (name, done.stderr[-1500:])
        assert done.stderr.startswith(f"pi-tools: error: {library} cannot be the engine library: "), (name, done.stderr)
    assert "lacks pi_last_error" in inspect_with_engine(libraries["libc"], model).stderr
    assert inspect_with_engine(engine.library_path(), model).returncode == 0


LOAD_EACH_ZEROED_WORD = f"""
import _ctypes, ctypes, os, struct, sys
sys.path.insert(0, {str(ROOT)!r})
from powerinfer_engine._lib import _SIGNATURES
from powerinfer_engine.library_check import LibraryRefused, check_library
source, scratch = sys.argv[1:3]
data = open(source, "rb").read()
[phoff], (phentsize, phnum) = struct.unpack_from("<Q", data, 32), struct.unpack_from("<HH", data, 54)
for at in range(0, phoff + phentsize * phnum, 4):
    print(at, end=" ", flush=True)   # the last one printed is the one a crash happened on
    path = f"{{scratch}}/lib{{at}}.so"
    with open(path, "wb") as f:
        f.write(data[:at] + bytes(4) + data[at + 4:])
    try:
        check_library(path, list(_SIGNATURES))
        _ctypes.dlclose(ctypes.CDLL(path)._handle)
    except (LibraryRefused, OSError):
        pass
    os.remove(path)   # one copy on disk at a time, none left mapped
print("done")
"""


def test_the_engine_library_with_any_header_word_zeroed_is_refused_or_loads(tmp_path):
    """Each word of the engine library's ELF header and program headers zeroed in turn: the check refuses the
    copy or the loader takes it (or says why not); none crashes the process that loads it."""
    done = subprocess.run([sys.executable, "-c", LOAD_EACH_ZEROED_WORD, str(engine.library_path()), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    last = done.stdout.split()[-1] if done.stdout.split() else "before the first"
    assert done.returncode == 0 and last == "done", f"died ({done.returncode}) at offset {last}: {done.stderr[-1500:]}"


def test_every_library_this_process_loaded_passes_the_check():
    """No false refusals: the shared libraries the interpreter has mapped (numpy's, torch's when imported, the
    engine's, libc) pass, as the loader took them."""
    from powerinfer_engine._lib import lib

    lib()  # the engine library mapped too
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if len(line.split()) >= 6 and ".so" in Path(line.split()[-1]).name}
    assert len(loaded) > 5, loaded
    for path in sorted(loaded):
        if Path(path).is_file():
            check_library(path, [])


def test_run_with_a_truncated_device_library_falls_back_to_the_cpu_saying_why(converted, gpuidx, tmp_path):
    """`pi-tools run --gpu auto` with PI_GPU_LIBRARY naming a cut copy (it was a SIGBUS): the text on the CPU, and
    one line on stderr saying why; `--gpu on`: one line and exit 1."""
    cut = tmp_path / "cut.so"
    cut.write_bytes(engine.device_library_path("emulated").read_bytes()[:4096])
    env = dict(os.environ, PI_GPU_LIBRARY=str(cut), PYTHONPATH=str(ROOT))
    args = [sys.executable, "-m", "powerinfer_tools", "run", "-m", str(converted("llama-relu", "q8_0")), "--gpuidx",
            str(gpuidx), "-p", "hi", "-n", "2", "--temp", "0", "-t", "1"]
    auto = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert auto.returncode == 0, auto.stderr[-1500:]
    assert f"pi-tools: no GPU for the GPU index (cannot load the device library {cut}: its " in auto.stderr, auto.stderr
    assert "lies past its end" in auto.stderr
    on = subprocess.run([*args, "--gpu", "on"], capture_output=True, text=True, timeout=300, env=env)
    assert on.returncode == 1 and on.stderr.count("\n") == 1 and "gpu on: cannot load the device library" in on.stderr
