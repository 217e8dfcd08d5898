"""Every command's --help keeps what its help texts say: '[default: ...]' written into a help text (rich markup
took it for a tag and dropped it), no value type for a flag (<bool>), arguments named as the texts name them."""
from __future__ import annotations

import pytest

from cli_helpers import run_cli, subcommands


@pytest.mark.parametrize("command", subcommands())
def test_help_shows_defaults_and_no_flag_types(command, capsys):
    code, out, err = run_cli(capsys, command, "--help")
    assert code == 0, err
    assert "<bool>" not in out
    usage = out.strip().splitlines()[0]
    arguments = usage.split(f" {command} [OPTIONS]", 1)[1]
    assert arguments == arguments.upper(), usage  # PROFILE_DIR, as the texts name it, not {profile_dir}
    assert "[default: " in out or command == "report"  # report's options have no defaults


def test_train_predictor_help_keeps_its_written_defaults(capsys):
    code, out, _ = run_cli(capsys, "train-predictor", "--help")
    assert code == 0
    assert "PROFILE_DIR" in out.splitlines()[0]
    text_of_options = " ".join(out.split())  # wrapped lines joined
    for text in ("Predictor directory to write [default: PROFILE_DIR-predictors];",
                 "calibrated to [default: 0.99 for ReLU-family profiles, 0.95 for SiLU/GELU (thresholded) ones].",
                 "e.g. '0-3,7' [default: all]."):
        assert text in text_of_options
