"""How `pi-tools` ends when a run does not go to plan. Usage errors (an unknown option, a missing argument, a
value of the wrong type) end as click's usage message and exit status 2 in every subcommand, whichever click
typer brings (typer >= 0.2x carries its own copy, whose exceptions are not click's); Ctrl-C ends as one line and
130 even when native code turns the KeyboardInterrupt into another exception. Never a traceback."""
from __future__ import annotations

import os
import signal

import pytest

from cli_helpers import run_cli, subcommands


def test_version(capsys):
    from powerinfer_tools import __version__

    code, out, err = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"powerinfer-tools {__version__}" and not err


def test_every_subcommand_is_checked():
    """The list below comes from the app: it holds the commands a hand-kept list once left out."""
    assert {"sparsify", "chat", "serve", "profile", "run"} <= set(subcommands())


@pytest.mark.parametrize("command", subcommands())
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


def test_ctrl_c_that_native_code_turns_into_another_error_is_an_interruption(monkeypatch, capsys, tmp_path):
    """What safetensors' get_tensor did under a real Ctrl-C in `convert` (seen in a stress run): the interrupt
    landed inside torch and came out as "ValueError: could not determine the shape of object type
    'torch.storage.UntypedStorage'"."""
    from powerinfer_tools.formats import describe as inspect_mod

    def native_call(*_a, **_kw):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered to this process
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")
        raise AssertionError("SIGINT did not interrupt")

    monkeypatch.setattr(inspect_mod, "describe", native_call)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    # Ctrl-C's usual handler, as in a terminal: a job started in the background (`.ci/run &`) ignores SIGINT
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = run_cli(capsys, "inspect", path)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the CLI's handler is gone again
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and err.strip() == "pi-tools: interrupted"
