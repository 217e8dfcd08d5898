"""Damage is refused, never a result (issue 55): an interrupted profile's work files (killed for real, SIGKILL in
layer 3 of 8) each checked against the digest written with it on --resume; a full disk during a profile is one line
and leaves nothing that the next run does not resume or remove; train-predictor and convert refuse a damaged
profile (its JSON, its thresholds, its shards, its input thresholds) in one line."""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import tiny_models
from cli_helpers import profiled, run_cli
from tiny_models import DATA, make_tiny
from powerinfer_tools.formats import names
from powerinfer_tools.stages.profiling import input_sparsity as isp
from powerinfer_tools.stages.profiling.profile_files import profile_digest

ROOT = Path(__file__).resolve().parents[2]
TEXT = DATA / "tinyshakespeare.txt"
LAYER_ARGS = ["--calib", str(TEXT), "--tokens", "16384", "--seq-len", "256", "--batch", "8", "--load", "layer",
              "-t", "1", "--max-samples", "1024"]
KILL_AT_LAYER_3 = """
import os, signal, sys
from powerinfer_tools.models import layerwise
from powerinfer_tools.cli import main
real = layerwise.LayerwiseModel.run_layer
def run_layer(lw, i, inputs):
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(lw, i, inputs)
layerwise.LayerwiseModel.run_layer = run_layer
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory) -> Path:
    """The tiny llama-relu with 8 layers, as the issue's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "N_LAYER", 8)
        return make_tiny("llama-relu", tmp_path_factory.mktemp("tiny8") / "tiny8")


@pytest.fixture(scope="module")
def killed(tiny8, tmp_path_factory) -> Path:
    """The work directory a layer-by-layer profile left when it was SIGKILLed in layer 3."""
    out = tmp_path_factory.mktemp("killed") / "prof"
    proc = subprocess.run([sys.executable, "-c", KILL_AT_LAYER_3, "profile", "-m", str(tiny8), "-o", str(out),
                           *LAYER_ARGS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    work = out.parent / f".{out.name}.partial"
    assert (work / "layer_checkpoint.pt").is_file() and not out.exists()
    return work


def assert_error_line(code: int, stderr: str, *needles: str) -> None:
    """Exit 1 and one error line naming every needle, no traceback (progress bars before it aside)."""
    errors = [line for line in stderr.splitlines() if line.startswith("pi-tools: error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert all(needle in errors[0] for needle in needles), errors[0]


def zip_entry_start(path: Path, suffix: str) -> int:
    """Offset in `path` (a torch.save zip) of the stored bytes of the entry whose name ends with `suffix`."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def flip(path: Path, n: int, at: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2 if at is None else at
    for k in range(at, at + n):
        raw[k] ^= 0xFF
    path.write_bytes(bytes(raw))


SHARD = "samples/layer_1/shard_0000.safetensors"   # of a layer finished before the kill
DAMAGE = {
    "hidden cut by a byte": ("hidden_1.bin", lambda p: os.truncate(p, p.stat().st_size - 1)),
    "hidden deleted": ("hidden_1.bin", Path.unlink),
    "hidden cut to half": ("hidden_1.bin", lambda p: os.truncate(p, p.stat().st_size // 2)),
    "hidden 4 bytes flipped": ("hidden_1.bin", lambda p: flip(p, 4)),
    "hidden 4096 bytes flipped": ("hidden_1.bin", lambda p: flip(p, 4096)),
    **{f"checkpoint data/{k} flipped": ("layer_checkpoint.pt",
                                        lambda p, k=k: flip(p, 1, zip_entry_start(p, f"data/{k}")))
       for k in (0, 3, 5)},
    "finished shard truncated": (SHARD, lambda p: os.truncate(p, p.stat().st_size - 8)),
    "finished shard flipped": (SHARD, lambda p: flip(p, 1)),
    "finished shard deleted": (SHARD, Path.unlink),
    "inputs data/2 flipped": ("inputs.pt", lambda p: flip(p, 1, zip_entry_start(p, "data/2"))),
    "identity not JSON": ("identity.json", lambda p: p.write_text("{not json")),
    # the next layer's input (checked against its digest) and its output (opened for writing) as directories
    **{f"{name} a directory": (name, lambda p: (p.unlink(missing_ok=True), p.mkdir()))
       for name in ("hidden_1.bin", "hidden_0.bin")},
    "hidden_0.bin a FIFO": ("hidden_0.bin", lambda p: (p.unlink(missing_ok=True), os.mkfifo(p))),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_resume_is_refused_in_one_line(case, tiny8, killed, tmp_path, capsys):
    out = tmp_path / "prof"
    work = tmp_path / ".prof.partial"
    shutil.copytree(killed, work)
    name, damage = DAMAGE[case]
    damage(work / name)
    code, _, stderr = run_cli(capsys, "profile", "-m", tiny8, "-o", out, *LAYER_ARGS, "--resume")
    assert_error_line(code, stderr, Path(name).name, "--force")
    assert not out.exists()


def test_the_killed_profile_resumes_to_the_uninterrupted_one(tiny8, killed, tmp_path, capsys):
    """The digests refuse damage only: the intact work of the killed run resumes at layer 3 to the same profile."""
    out, straight = tmp_path / "prof", tmp_path / "straight"
    shutil.copytree(killed, tmp_path / ".prof.partial")
    code, stdout, stderr = run_cli(capsys, "profile", "-m", tiny8, "-o", out, *LAYER_ARGS, "--resume")
    assert code == 0, stderr
    assert "at layer 3 of 8" in stdout
    code, _, stderr = run_cli(capsys, "profile", "-m", tiny8, "-o", straight, *LAYER_ARGS)
    assert code == 0, stderr
    a, b = (json.loads((d / "profile.json").read_text()) for d in (out, straight))
    assert a["layers"] == b["layers"] and a["sha256"] == b["sha256"]
    for i in range(8):
        for kind in ("activation", "magnitude"):
            x, y = (torch.load(d / kind / f"{kind}_{i}.pt", weights_only=True) for d in (out, straight))
            assert torch.equal(x, y), (kind, i)


# ---- a full disk -------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root may mount one; skipped where it may not)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_disk_full_while_profiling_on_a_small_tmpfs(tiny8, small_disk, capsys):
    """Full while writing the rows: one line, the work kept for --resume, which finishes once there is room. Full
    while writing the inputs (nothing resumable yet): one line and nothing left on the disk."""
    out = small_disk / "prof"
    args = ["--calib", TEXT, "--seq-len", "256", "--batch", "8", "-t", "1", "-o", out]
    code, _, stderr = run_cli(capsys, "profile", "-m", tiny8, "--tokens", "2048", *args)
    assert_error_line(code, stderr, "disk full", "--resume")
    assert not out.exists() and (small_disk / ".prof.partial" / "identity.json").is_file()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    code, stdout, stderr = run_cli(capsys, "profile", "-m", tiny8, "--tokens", "2048", *args, "--resume")
    assert code == 0 and "resuming" in stdout, stderr
    shutil.rmtree(out)
    subprocess.run(["mount", "-o", "remount,size=2m", str(small_disk)], check=True)

    code, _, stderr = run_cli(capsys, "profile", "-m", tiny8, "--tokens", "262144", *args)
    assert_error_line(code, stderr, "disk full", "nothing was kept")
    assert list(small_disk.iterdir()) == []


def test_disk_full_while_profiling_injected(tiny8, tmp_path, capsys, monkeypatch):
    """The same with ENOSPC injected (anywhere a tmpfs cannot be mounted): while writing the inputs, nothing is left;
    while writing a shard, the work is kept and resumes."""
    out = tmp_path / "prof"
    args = ["-m", tiny8, "--calib", TEXT, "--tokens", "2048", "--seq-len", "256", "--batch", "8", "-t", "1", "-o", out]
    real_save, real_write = torch.save, Path.write_bytes

    def full(*_, **__):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    code, _, stderr = run_cli(capsys, "profile", *args)
    assert_error_line(code, stderr, "disk full", "nothing was kept")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch, "save", real_save)

    monkeypatch.setattr(Path, "write_bytes", full)
    code, _, stderr = run_cli(capsys, "profile", *args)
    assert_error_line(code, stderr, "disk full", "--resume")
    monkeypatch.setattr(Path, "write_bytes", real_write)
    code, stdout, stderr = run_cli(capsys, "profile", *args, "--resume")
    assert code == 0 and "resuming" in stdout, stderr


# ---- train-predictor and convert ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def relu_profile(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("relu_profile")
    return profiled(tiny_model_dir("llama-relu"), root / "prof", TEXT, 2048, 64, "-t", "1")


def edited_profile(source: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "prof"
    shutil.copytree(source, copy)
    edit(copy)
    return copy


def set_profile_json(value):
    return lambda d: (d / "profile.json").write_text(json.dumps(value))


def resigned(d: Path, meta: dict) -> None:
    """profile.json with `meta` and the digest of it, as a profile that wrote these values would have it: the values
    themselves must be refused."""
    (d / "profile.json").write_text(json.dumps({**meta, "digest": profile_digest(meta)}))


def set_thresholds(value, sign: bool = True):
    def edit(d):
        meta = {**json.loads((d / "profile.json").read_text()), "thresholds": value}
        resigned(d, meta) if sign else (d / "profile.json").write_text(json.dumps(meta))
    return edit


@pytest.mark.parametrize("edit,needle", [
    (set_profile_json([]), "not an object"),
    (set_thresholds([math.nan, 0.0]), "finite"),
    (set_thresholds([0.0]), "finite"),
    (set_thresholds([0.25, 0.5], sign=False), "changed after 'pi-tools profile' wrote it"),
    (lambda d: flip(d / "samples" / "layer_0" / "shard_0000.safetensors", 64), "shard_0000.safetensors"),
    (lambda d: (d / "samples" / "layer_0" / "shard_0000.safetensors").unlink(), "shard_0000.safetensors"),
    (lambda d: flip(d / "magnitude" / "magnitude_0.pt", 1, zip_entry_start(d / "magnitude" / "magnitude_0.pt",
                                                                          "data/0")), "magnitude_0.pt"),
], ids=["profile.json []", "NaN threshold", "one threshold of two", "thresholds edited by hand", "shard flipped",
        "shard deleted", "magnitudes flipped"])
def test_train_predictor_refuses_a_damaged_profile(relu_profile, tmp_path, capsys, edit, needle):
    profile = edited_profile(relu_profile, tmp_path, edit)
    out = tmp_path / "pred"
    code, _, stderr = run_cli(capsys, "train-predictor", profile, "--out", out, "--threads", "1", "--epochs", "1")
    assert_error_line(code, stderr, needle)
    assert not out.exists()


def input_table(n_layer: int, threshold=0.5) -> dict:
    table = isp.InputThresholds("uniform", [0.1], [[[0.1] * len(names.INPUT_SITES)] * n_layer],
                                [[[threshold] * len(names.INPUT_SITES)] * n_layer], 64)
    return json.loads(json.dumps(table.__dict__))


def write_input_table(value):
    """An input-sparsity table with its digest recorded, as a profile that wrote these values would have it: the
    values themselves must be refused."""
    def edit(d):
        (d / isp.FILE).write_text(json.dumps(value))
        meta = json.loads((d / "profile.json").read_text())
        meta["sha256"][isp.FILE] = hashlib.sha256((d / isp.FILE).read_bytes()).hexdigest()
        resigned(d, meta)
    return edit


INPUT = ["--input-thresholds"]


@pytest.mark.parametrize("edit,args,needle", [
    (write_input_table(input_table(2, 1e300)), INPUT, "float32"),
    (write_input_table({**input_table(2), "thresholds": None}), INPUT, "thresholds"),
    (lambda d: None, INPUT, "input_sparsity.json does not exist"),
    (None, INPUT, "no --profile"),
    (set_profile_json([]), [], "not an object"),
    (set_thresholds([math.nan, 0.0]), [], "finite"),
    (set_thresholds([0.25, 0.5], sign=False), [], "changed after 'pi-tools profile' wrote it"),
    (lambda d: flip(d / "activation" / "activation_1.pt", 1, zip_entry_start(d / "activation" / "activation_1.pt",
                                                                             "data/0")), [], "activation_1.pt"),
], ids=["thresholds 1e300", "thresholds null", "no input thresholds in the profile", "no profile",
        "profile.json []", "NaN threshold", "thresholds edited by hand", "activation counts flipped"])
def test_convert_refuses_missing_or_damaged_profile_files(tiny_model_dir, relu_profile, tmp_path, capsys, edit, args,
                                                         needle):
    """Each would otherwise be a traceback, a file converted from damaged numbers, or one without the input sparsity
    asked for (exit 0, and a later `run --sparse-mode input` fails)."""
    profile = ["--profile", edited_profile(relu_profile, tmp_path, edit)] if edit is not None else []
    out = tmp_path / "m.gguf"
    code, _, stderr = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-relu"), *profile, "--outtype", "f32",
                              "-o", out, "-q", "--ours-only", *args)
    assert_error_line(code, stderr, needle)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == (["prof"] if profile else [])
