"""`profile` and `train-predictor` end with a one-line verdict: the profile's the same that `report` gives (sparse
enough for the sparse modes, local enough for a GPU hot tier), the predictors' counting only those `report` marks
useful."""
from __future__ import annotations

import json

from cli_helpers import run_cli
from predictor_data import write_profile

from powerinfer_tools.stages.predictors import predictor_training as tp
from powerinfer_tools.stages.profiling.locality import analyse, profile_verdict
from powerinfer_tools.stages.report import locality_section


def verdict_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("verdict: ")]
    assert len(lines) == 1, stdout
    return lines[0].removeprefix("verdict: ")


def test_profile_ends_with_the_reports_verdict(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "prof"
    code, stdout, stderr = run_cli(capsys, "profile", "-m", tiny_model_dir("llama-relu"), "-o", out,
                                   "--tokens", "512", "--seq-len", "64", "--batch", "4")
    assert code == 0, stderr
    said = verdict_line(stdout)
    assert said == profile_verdict(json.loads((out / "profile.json").read_text()))
    assert said in locality_section(analyse(out)).intro  # report's words, on the same numbers


def result(layer: int, useful: bool, recall: float, density: float) -> tp.LayerResult:
    return tp.LayerResult(layer, 8, 100, 0.0, {"useful": useful, "recall": recall, "predicted_density": density})


def test_the_predictors_verdict_counts_only_useful_ones():
    mixed = [result(0, True, 0.99, 0.2), result(1, True, 0.97, 0.4), result(2, False, 0.5, 0.9)]
    assert tp.predictor_verdict(mixed) == ("2 of 3 layers' predictors are useful: predictor mode computes about 30% "
                                           "of their neurons at 98.0% held-out recall; auto mode runs the other 1 "
                                           "without theirs")
    assert tp.predictor_verdict(mixed[:2]).endswith("98.0% held-out recall")
    assert tp.predictor_verdict(mixed[2:]).startswith("none of the 1 layers' predictors predicts anything useful")


def test_train_predictor_ends_with_its_verdict(tmp_path, capsys):
    profile = write_profile(tmp_path / "prof", seed=1)
    code, stdout, stderr = run_cli(capsys, "train-predictor", profile, "--out", tmp_path / "pred", "--threads", "1",
                                   "--epochs", "2")
    assert code == 0, stderr
    assert " layers' predictors " in verdict_line(stdout)
