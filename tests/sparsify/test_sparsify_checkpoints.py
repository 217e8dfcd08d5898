"""sparsify's checkpoint as a hostile user meets it: a second run on the same output (it deleted the first's
checkpoint), checkpoints damaged or made by hand (each was a traceback, a half-trained model published with
exit 0, a layer silently skipped, or a flipped bit loaded as a weight), and a file that is not a checkpoint."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from cli_helpers import assert_one_line_error, run_cli
from test_sparsify import SMALL, _interrupt_at
from powerinfer_tools.stages import sparsification as sparsify
from powerinfer_tools.stages.sparsification import layer_local
from powerinfer_tools.stages.sparsification.state import _digest

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_run_on_one_output_is_refused_and_the_first_keeps_its_checkpoint(tiny_model_dir, calib, tmp_path,
                                                                                    capsys):
    out = tmp_path / "out"
    args = ["sparsify", "-m", str(tiny_model_dir("llama-silu")), "--calib", str(calib), "-o", str(out), *SMALL]
    first = subprocess.Popen([sys.executable, "-m", "powerinfer_tools", *args, "--local-epochs", "400"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 300
        while not sparsify.partial_dir(out).is_dir():   # the first run is training
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.1)
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, "another pi-tools run is writing", str(out))
        assert sparsify.partial_dir(out).is_dir()
        first.send_signal(signal.SIGINT)   # Ctrl-C: the first saves its checkpoint and stops
        _, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130 and "Traceback" not in first_err, first_err[-2000:]
    assert (sparsify.partial_dir(out) / "checkpoint.pt").is_file()


@pytest.fixture(scope="module")
def interrupted(tiny_model_dir, calib, tmp_path_factory):
    """(the arguments of a run, the checkpoint it left when Ctrl-C stopped it in its first layer)."""
    out = tmp_path_factory.mktemp("interrupted") / "out"
    args = ("sparsify", "-m", str(tiny_model_dir("llama-silu")), "--calib", str(calib), "-o", str(out), *SMALL)
    with pytest.MonkeyPatch.context() as m:
        _interrupt_at(m, layer_local, "local_step", 3)
        from powerinfer_tools.cli import main
        with pytest.raises(SystemExit) as stopped:
            main(list(args))
    assert stopped.value.code == 130
    return args, (sparsify.partial_dir(out) / "checkpoint.pt").read_bytes()


def rewritten(blob: dict, change) -> dict:
    """A checkpoint made by hand: `blob` changed, with the checksum made again to match."""
    blob = dict(blob)
    change(blob)
    blob.pop("digest", None)
    blob["digest"] = _digest(blob)
    return blob


def state_with(**fields):
    def change(blob):
        blob["state"] = json.dumps({**json.loads(blob["state"]), **fields})
    return change


def set_field(name, value):
    def change(blob):
        blob[name] = value
    return change


def reshaped_embedding(blob):
    blob["student"] = dict(blob["student"])
    blob["student"]["model.embed_tokens.weight"] = blob["student"]["model.embed_tokens.weight"][:, :8].clone()


HAND_MADE = {
    "phase 7": (state_with(phase=7), "is in phase 7"),
    "phase 3 part-way": (state_with(phase=3, layer=1), "at layer 1 in phase 3"),
    "layer 999": (state_with(layer=999), "at layer 999"),
    "layer negative": (state_with(layer=-1), "has layer -1, not a count"),
    "step a string": (state_with(step="3"), "has step '3', not a count"),
    "lambda a string": (state_with(lam="x"), "lam that is not 2 numbers"),
    "lambda with nan": (state_with(lam=[float("nan"), 0.01]), "lam that is not 2 numbers"),
    "state a number": (set_field("state", 5), "its state is int, not str"),
    "state not json": (set_field("state", "{"), "is not JSON"),
    "state missing a field": (set_field("state", json.dumps({"phase": 1})), "does not have the fields"),
    "identity a list": (set_field("identity", [1]), "its identity is list, not str"),
    "identity not an object": (set_field("identity", "[1]"), "its options are not a JSON object"),
    "student a list": (set_field("student", []), "its student is list, not dict"),
    "student missing a weight": (lambda b: b.update(student={}), "student weights are not this model's"),
    "student weight reshaped": (reshaped_embedding, "student weight model.embed_tokens.weight"),
    "optimizer a tensor": (set_field("optimizer", torch.zeros(2)), "its optimizer is Tensor, not dict"),
}


@pytest.mark.parametrize("case", list(HAND_MADE))
def test_a_hand_made_checkpoint_is_checked_field_by_field(case, interrupted, tmp_path, capsys):
    args, saved = interrupted
    work = sparsify.partial_dir(Path(args[args.index("-o") + 1]))
    change, needle = HAND_MADE[case]
    blob = torch.load(io.BytesIO(saved), weights_only=True)
    try:
        torch.save(rewritten(blob, change), work / "checkpoint.pt")
        code, _, err = run_cli(capsys, *args, "--resume")
    finally:
        (work / "checkpoint.pt").write_bytes(saved)
    # the student's weights are checked once the model is loaded: after transformers' progress bar
    assert_one_line_error(code, err.split("it/s]\n")[-1], "is damaged", needle)


def tensor_data_offset(path: Path, member: str) -> int:
    """Where the bytes of zip member `member` start in `path` (torch.save stores them uncompressed)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return info.header_offset + 30 + name_len + extra_len


def test_a_flipped_bit_in_the_weights_is_found(interrupted, capsys):
    args, saved = interrupted
    path = sparsify.partial_dir(Path(args[args.index("-o") + 1])) / "checkpoint.pt"
    with zipfile.ZipFile(path) as archive:
        data = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    at = tensor_data_offset(path, data.filename) + data.file_size // 2
    damaged = bytearray(saved)
    damaged[at] ^= 0x40
    try:
        path.write_bytes(bytes(damaged))
        code, _, err = run_cli(capsys, *args, "--resume")
    finally:
        path.write_bytes(saved)
    assert_one_line_error(code, err, "is damaged", "do not match the checksum")


def test_a_file_that_is_not_a_checkpoint_says_so(interrupted, capsys):
    args, saved = interrupted
    path = sparsify.partial_dir(Path(args[args.index("-o") + 1])) / "checkpoint.pt"
    try:
        path.write_text("phase: 2\nlayer: 0\n")
        code, _, err = run_cli(capsys, *args, "--resume")
    finally:
        path.write_bytes(saved)
    assert_one_line_error(code, err, "is not a sparsify checkpoint")
    assert "could run code" not in err


def test_the_saved_checkpoint_resumes(interrupted, capsys):
    """The checks pass what sparsify itself wrote: the run continues from it to the end."""
    args, saved = interrupted
    out = Path(args[args.index("-o") + 1])
    code, stdout, err = run_cli(capsys, *args, "--resume")
    assert code == 0 and "resuming" in stdout, err
    shutil.rmtree(out)
    sparsify.partial_dir(out).mkdir(parents=True, exist_ok=True)
    (sparsify.partial_dir(out) / "checkpoint.pt").write_bytes(saved)
