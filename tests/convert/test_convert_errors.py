"""Bad input to `pi-tools convert`: one-line error, non-zero exit, and nothing (or the previous file)
under the output name -- including a disk that fills up or a run interrupted mid-write."""
from __future__ import annotations

import errno

import gguf
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from convert_helpers import write_predictors
from tiny_models import HIDDEN, N_FF, N_LAYER

from powerinfer_tools.cli import main


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def model(tiny_model_dir):
    return str(tiny_model_dir("llama-relu"))


def test_predictor_shape_mismatch(model, tmp_path, capsys):
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF + 8)  # wrong n_ff
    out = tmp_path / "out" / "m.gguf"
    code, _, err = run_cli(capsys, *["convert", "-m", model, "--predictors", str(pred), "-o", str(out)])
    assert_one_line_error(code, err, "model_0.pt", f"[{N_FF}, rank]")
    assert not out.exists()


def test_predictor_wrong_input_width(model, tmp_path, capsys):
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF)
    torch.save({"fc1.weight": torch.zeros(16, HIDDEN * 2), "fc2.weight": torch.zeros(N_FF, 16)},
               pred / "model_1.pt")
    code, _, err = run_cli(capsys, *["convert", "-m", model, "--predictors", str(pred), "-o", str(tmp_path / "m.gguf")])
    assert_one_line_error(code, err, "model_1.pt", "do not match")


def test_missing_predictor_layer(model, tmp_path, capsys):
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF)
    (pred / f"model_{N_LAYER - 1}.pt").unlink()
    code, _, err = run_cli(capsys, *["convert", "-m", model, "--predictors", str(pred), "-o", str(tmp_path / "m.gguf")])
    assert_one_line_error(code, err, f"layer {N_LAYER - 1} is missing")
    assert not (tmp_path / "m.gguf").exists()


def test_unknown_outtype(model, tmp_path, capsys):
    code, _, err = run_cli(capsys, *["convert", "-m", model, "--outtype", "q9_0", "-o", str(tmp_path / "m.gguf")])
    assert_one_line_error(code, err, "unknown outtype 'q9_0'", "q4_0")


@pytest.mark.parametrize("outtype", ["q4_k_m", "Q5_K_S", "q6_k", "q4_1", "bf16"])
def test_a_type_the_engine_only_decodes_is_not_written(outtype, model, tmp_path, capsys):
    """llama.cpp's k-quants and the like: the engine runs such files by decoding them at load, so convert says
    why it does not write them (and --help says so too)."""
    code, _, err = run_cli(capsys, *["convert", "-m", model, "--outtype", outtype, "-o", str(tmp_path / "m.gguf")])
    decoded = "f16" if outtype == "bf16" else "q8_0"
    assert_one_line_error(code, err, f"outtype '{outtype.lower()}' is not written", f"decodes them at load to {decoded}",
                          "q4_0 is the smallest that computes as stored")
    assert not (tmp_path / "m.gguf").exists()
    code, out, _ = run_cli(capsys, "convert", "--help")
    assert "k-quants (q4_k_m, ...)" in out and "not written" in out


def test_output_is_directory(model, tmp_path, capsys):
    code, _, err = run_cli(capsys, *["convert", "-m", model, "-o", str(tmp_path)])
    assert_one_line_error(code, err, "is a directory")


def test_profile_with_wrong_layer_count(model, tmp_path, capsys):
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "profile.json").write_text('{"thresholds": [0.1]}')
    code, _, err = run_cli(capsys, *["convert", "-m", model, "--profile", str(tmp_path / "prof"), "-o",
                         str(tmp_path / "m.gguf")])
    assert_one_line_error(code, err, f"{N_LAYER} per-layer values")


def _fail_on_third_tensor(monkeypatch, exc: BaseException):
    original = gguf.GGUFWriter.write_tensor_data
    calls = {"n": 0}

    def failing(self, tensor, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc
        return original(self, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    return calls


def test_disk_full_leaves_previous_file(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous version")
    calls = _fail_on_third_tensor(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    code, _, err = run_cli(capsys, *["convert", "-m", model, "--outtype", "f32", "-o", str(out), "-q"])
    assert calls["n"] == 3  # it failed mid-write, not before
    assert_one_line_error(code, err, "disk full")
    assert out.read_bytes() == b"previous version" and leftovers(tmp_path) == ["m.gguf"]


def test_interrupted_write_leaves_nothing(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "m.gguf"
    _fail_on_third_tensor(monkeypatch, KeyboardInterrupt())
    with pytest.raises(SystemExit) as exc:
        main(["convert", "-m", model, "--outtype", "q8_0", "-o", str(out), "-q"])
    assert exc.value.code == 130
    assert leftovers(tmp_path) == []
