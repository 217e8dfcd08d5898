"""Outputs that cannot be written (a read-only file system, errno 30) and prompts that are not UTF-8: one line
on stderr and exit status 1, never a traceback."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from cli_helpers import assert_one_line_error, profiled, run_cli
from engine_helpers import converted  # noqa: F401
from tiny_models import DATA


@pytest.fixture
def read_only(tmp_path):
    """An empty directory on a file system mounted read-only (a tmpfs, `mount -o ro`): writes there fail with
    EROFS from the kernel, even as root (who passes any chmod). Skipped where this process may not mount."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "pi-tools-test-ro", str(ro)],
                             capture_output=True, text=True) if shutil.which("mount") else None
    if mounted is None or mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip() if mounted else 'no mount'}")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


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
    assert_one_line_error(code, err, "cannot write", str(read_only), "Read-only file system")
    assert list(read_only.iterdir()) == []
