"""Outputs built under a temporary name: what a killed run left (SIGKILL runs no cleanup) is removed by the
next run writing the same output, unless its writer still runs; directories get the usual permissions."""
from __future__ import annotations

import os
import subprocess
import sys

from powerinfer_tools.atomic import atomic_dir, atomic_file


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rerun_removes_stale_temporaries_of_its_own_output(tmp_path):
    stale_file = tmp_path / f".m.gguf.{dead_pid()}.k3j2.tmp"
    stale_file.write_bytes(b"x" * 1000)
    stale_dir = tmp_path / f".pred.{dead_pid()}.a8f1.tmp"
    stale_dir.mkdir()
    (stale_dir / "model_0.pt").write_bytes(b"x")
    running = tmp_path / f".m.gguf.{os.getpid()}.zz01.tmp"  # a run still going: kept
    running.write_bytes(b"y")
    other = tmp_path / f".other.gguf.{dead_pid()}.q1.tmp"  # another output's: not ours to judge
    other.write_bytes(b"z")
    with atomic_file(tmp_path / "m.gguf") as tmp:
        tmp.write_bytes(b"new")
    with atomic_dir(tmp_path / "pred") as tmp:
        (tmp / "model_0.pt").write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.gguf", "pred", running.name, other.name])


def test_directories_get_the_usual_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "pred") as tmp:
            (tmp / "model_0.pt").write_bytes(b"new")
        with atomic_file(tmp_path / "m.gguf") as tmp:
            tmp.write_bytes(b"new")
    finally:
        os.umask(mask)
    assert (tmp_path / "pred").stat().st_mode & 0o777 == 0o755  # mkdtemp's 0700 before
    assert (tmp_path / "m.gguf").stat().st_mode & 0o777 == 0o644
