"""Usage errors (an unknown option, a missing argument, a value of the wrong type) end as click's usage message
and exit status 2 in every subcommand, never a traceback, whichever click typer brings (typer >= 0.2x carries
its own copy, whose exceptions are not click's)."""
from __future__ import annotations

import pytest

from cli_helpers import run_cli

COMMANDS = ("profile", "train-predictor", "convert", "plan", "run", "perplexity", "bench", "inspect", "report")


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_option_is_a_usage_error(command, capsys):
    code, _, err = run_cli(capsys, command, "--no-such-option")
    assert code == 2
    assert "No such option: --no-such-option" in err and "Traceback" not in err


@pytest.mark.parametrize("args, needle", [(("run", "-m", "x", "-n", "many"), "Invalid value for '--n-predict'"),
                                          (("inspect", "--items", "3"), "Missing argument"),
                                          (("nonsense",), "No such command")])
def test_bad_values_and_missing_arguments_are_usage_errors(args, needle, capsys):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and needle in err and "Traceback" not in err
