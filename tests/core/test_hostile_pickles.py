"""A `.pt` file whose pickle would run code (here: create a marker directory) is refused with one line
and exit 1 wherever the toolkit reads one: activation counts, predictors, the profile checkpoint."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from convert_helpers import write_predictors
from powerinfer_tools.stages.profiling.profiling import partial_dir
from cli_helpers import interrupt_profile_at_forward, run_cli
from tiny_models import DATA, HIDDEN, N_FF, N_LAYER

TEXT = DATA / "tinyshakespeare.txt"

PROFILE_ARGS = ["--calib", str(TEXT), "--tokens", "512", "--seq-len", "64", "--batch", "1", "--max-samples", "64"]


class CreatesMarker:
    """Unpickling this calls os.makedirs(marker): what a hostile checkpoint could do with any function."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def plant(path, tmp_path, name: str):
    """Overwrite `path` with a code-running pickle; check that an unrestricted load would run it."""
    marker = tmp_path / f"ran-{name}"
    torch.save({"fc1.weight": CreatesMarker(marker)}, path)
    probe = tmp_path / f"probe-{name}"
    torch.save(CreatesMarker(probe), tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)  # the payload is live ...
    assert probe.is_dir()
    return marker  # ... so the real marker staying absent means the toolkit never ran it


def assert_refused(code, stderr, path, marker, why="refused"):
    assert code == 1, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and "%|" not in line]  # minus progress bars
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert str(path) in lines[0] and why in lines[0], lines[0]
    assert not marker.exists()


@pytest.fixture(scope="module")
def profile_dir(tiny_model_dir, tmp_path_factory):
    import contextlib
    import io

    from powerinfer_tools.cli import main

    out = tmp_path_factory.mktemp("pickles") / "profile"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(["profile", "-m", str(tiny_model_dir("llama-relu")), "-o", str(out), *PROFILE_ARGS])
        except SystemExit as exc:
            assert exc.code in (0, None)
    assert (out / "profile.json").is_file()
    return out


@pytest.mark.parametrize("digests", [True, False], ids=["our-profile", "without-digests"])
def test_activation_file(profile_dir, tmp_path, capsys, digests):
    """Our profile's digests refuse the planted file before it is read; a folder without them (PowerInfer's, an
    older profile) is read with weights_only, which refuses it."""
    import json

    profile = tmp_path / "profile"
    shutil.copytree(profile_dir, profile)
    if not digests:
        meta = json.loads((profile / "profile.json").read_text())
        meta.pop("sha256")
        meta.pop("digest")
        (profile / "profile.json").write_text(json.dumps(meta))
    path = profile / "activation" / "activation_1.pt"
    marker = plant(path, tmp_path, "activation")
    code, _, stderr = run_cli(capsys, "train-predictor", profile, "-o", tmp_path / "pred", "--epochs", "1")
    assert_refused(code, stderr, path, marker, "is damaged" if digests else "refused")
    assert not (tmp_path / "pred").exists()


def test_predictor_file(tiny_model_dir, tmp_path, capsys):
    preds = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF, rank=8)
    path = preds / "model_1.pt"
    marker = plant(path, tmp_path, "predictor")
    out = tmp_path / "m.gguf"
    code, _, stderr = run_cli(capsys, "convert", "-m", tiny_model_dir("llama-relu"), "--predictors", preds,
                              "-o", out, "-q")
    assert_refused(code, stderr, path, marker)
    assert not out.exists()


def test_profile_checkpoint(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from powerinfer_tools.stages.profiling import profiling as profile_mod

    monkeypatch.setattr(profile_mod, "CHECKPOINT_BATCHES", 2)
    restore = interrupt_profile_at_forward(monkeypatch, 4)  # Ctrl-C during the 4th forward, after a checkpoint
    out = tmp_path / "profile"
    args = ["profile", "-m", str(tiny_model_dir("llama-relu")), "-o", str(out), *PROFILE_ARGS]
    code, _, _ = run_cli(capsys, *args)
    path = partial_dir(out) / "checkpoint.pt"
    assert code == 130 and path.is_file()
    restore()
    marker = plant(path, tmp_path, "checkpoint")
    code, _, stderr = run_cli(capsys, *args, "--resume")
    assert_refused(code, stderr, path, marker)
    assert not out.exists()
