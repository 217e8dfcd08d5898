"""Outputs that cannot be written (a read-only file system, errno 30) and prompts that are not UTF-8: one line
on stderr and exit status 1, never a traceback."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, profiled, run_cli
from engine_helpers import converted  # noqa: F401
from tiny_models import DATA


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A directory in which creating a file or directory fails as on a read-only mount (EROFS)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(real):
        def call(path, *args, **kwargs):
            if Path(os.fsdecode(path)).resolve().is_relative_to(ro.resolve()) and not Path(path).exists():
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", refuse(real_open))
    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    return ro


@pytest.fixture(scope="module")
def profile_dir(tiny_model_dir, tmp_path_factory):
    return profiled(tiny_model_dir("llama-relu"), tmp_path_factory.mktemp("ro_profile") / "prof",
                    DATA / "tinyshakespeare.txt", tokens=512, seq_len=64)


@pytest.mark.parametrize("command", ["profile", "convert", "plan", "report"])
def test_a_read_only_output_is_one_line(command, read_only, profile_dir, tiny_model_dir, converted, capsys):
    model = tiny_model_dir("llama-relu")
    args = {"profile": ["profile", "-m", model, "--calib", DATA / "tinyshakespeare.txt", "--tokens", "256",
                        "--seq-len", "64", "-o", read_only / "prof"],
            "convert": ["convert", "-m", model, "--outtype", "f32", "-q", "-o", read_only / "m.gguf"],
            "plan": ["plan", "-m", converted("llama-relu"), "--vram-budget", "0.3", "--profile", profile_dir,
                     "-o", read_only / "m.gpuidx"],
            "report": ["report", profile_dir, "-o", read_only / "r.html"]}[command]
    code, _, err = run_cli(capsys, *args)
    last = err.strip().splitlines()[-1:]  # after transformers' "Loading weights" bar, where a model is loaded
    assert_one_line_error(code, "\n".join(last), "cannot write", str(read_only), "Read-only file system")
    assert "Traceback" not in err
    assert list(read_only.iterdir()) == []
