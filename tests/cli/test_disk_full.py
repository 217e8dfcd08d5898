"""A full disk is one line, 'disk full', and exit 1 in every command that writes, whichever library met it
(torch.save, safetensors, numpy, matplotlib, gguf-py): each command runs with its output on a tmpfs filled to
the last byte, mounted in a private user and mount namespace (unshare -rm, no root needed; skipped where the
kernel allows no such namespace)."""
from __future__ import annotations

import errno
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error
from convert_helpers import write_predictors
from placement_fixtures import write_model
from predictor_data import write_profile

from powerinfer_tools.core.errors import write_failure

ROOT = Path(__file__).resolve().parents[2]


def _namespaces_work(mount: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k none {mount}"],
                           capture_output=True)
    return probe.returncode == 0


def run_on_full_disk(mount: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`pi-tools ARGS` with a full tmpfs at `mount` (outputs go there; inputs are read from elsewhere)."""
    script = (f"mount -t tmpfs -o size=256k none {mount} && (cat /dev/zero > {mount}/filler 2>/dev/null; true) && "
              f"exec {shlex.quote(sys.executable)} -m powerinfer_tools {' '.join(map(shlex.quote, args))}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(mount.parent),
                                         "TQDM_DISABLE": "1",  # no bars: the error is then all of stderr
                                         "POWERINFER_TOOLS_CACHE": str(mount.parent / "cache")})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("disk_full")
    mount = root / "full"
    mount.mkdir()
    if not _namespaces_work(mount):
        pytest.skip("no user+mount namespace here (unshare -rm) to mount a small tmpfs in")
    profile = write_profile(root / "profile", n_layer=2, n_embd=32, n_ff=128, rows=512)
    return {"mount": mount, "profile": profile, "model": tiny_model_dir("llama-relu"),
            "pi_model": write_model(root / "m.powerinfer.gguf", 2, 128, "Q8_0"),
            "predictors": write_predictors(root / "pred", 2, 32, 128, rank=8), "text": ROOT / "README.md"}


COMMANDS = {
    "profile": lambda i: ["profile", "-m", i["model"], "--calib", i["text"], "--tokens", "128", "--seq-len", "32",
                          "--max-samples", "64", "-o", i["mount"] / "prof"],
    "train-predictor": lambda i: ["train-predictor", i["profile"], "-o", i["mount"] / "pred", "--rank", "4",
                                  "--epochs", "1", "--threads", "1"],
    "train-predictor --evaluate --report": lambda i: ["train-predictor", i["profile"], "-o", i["predictors"],
                                                      "--evaluate", "--threads", "1", "--report",
                                                      i["mount"] / "eval.json"],
    "plan": lambda i: ["plan", "--profile", i["profile"], "-m", i["pi_model"], "--vram-budget", "1", "-o",
                       i["mount"] / "x.gpuidx"],
    "report": lambda i: ["report", i["profile"], "-o", i["mount"] / "r.html"],
    "convert": lambda i: ["convert", "-m", i["model"], "--outtype", "f32", "-o", i["mount"] / "m.gguf", "-q"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_full_disk_is_one_line(inputs, command):
    done = run_on_full_disk(inputs["mount"], [str(a) for a in COMMANDS[command](inputs)])
    assert_one_line_error(done.returncode, done.stderr, "disk full")


@pytest.mark.parametrize("exc,full", [
    (OSError(errno.ENOSPC, "No space left on device", "x.pt"), True),
    (OSError("589824 requested and 442208 written"), True),  # numpy's tofile, errno dropped
    (RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: "
                  "file write failed"), True),
    (OSError(errno.EACCES, "Permission denied", "x.pt"), False),
    (ValueError("No space left on device"), False),
])
def test_write_failure_recognises_a_full_disk(exc, full):
    assert bool(write_failure(exc)) == full
