"""Every float option of every command, found by typer's own description of the app (so an option added later
is swept too), given inf, nan, a negative and a huge value: each is refused in one line that names the flag,
before any slow work, or is accepted where the value means something (VALID). `--local-lr inf` used to train
a NaN model and exit 0."""
from __future__ import annotations

import typing

import pytest
import typer.main
from cli_helpers import run_cli

from powerinfer_tools.cli.app import app

VALUES = ["inf", "nan", "-1", "1e30"]
# values with a meaning: a checkpoint or search time limit of "never", a temperature that only flattens, a
# penalty that all but bans a repeat, a density budget of "no limit"
VALID = {("sparsify", "--checkpoint-minutes", "1e30"), ("plan", "--time-limit", "1e30"),
         ("run", "--temp", "1e30"), ("run", "--repeat-penalty", "1e30"),
         ("chat", "--temp", "1e30"), ("chat", "--repeat-penalty", "1e30"),
         ("train-predictor", "--max-density-ratio", "1e30")}


def float_options() -> list[tuple[str, str, list]]:
    """(command, flag, the command's other required arguments) for each float option of the app."""
    found = []
    for name, command in typer.main.get_command(app).commands.items():
        required = [p for p in command.params if p.required]
        for param in command.params:
            annotation = param.type_descriptor.annotation
            if annotation is float or float in typing.get_args(annotation):
                found.append((name, param.opts[0], [p for p in required if p is not param]))
    return found


def placeholders(required: list, tmp_path) -> list[str]:
    """Values for the other required arguments: paths that do not exist (a flag checked first meets them after)."""
    args = []
    for param in required:
        value = "1" if param.type_descriptor.annotation in (float, int) else str(tmp_path / f"missing-{param.name}")
        args += [value] if not param.opts[0].startswith("-") else [param.opts[0], value]
    return args


def test_the_sweep_finds_the_float_options():
    flags = {(c, f) for c, f, _ in float_options()}
    assert {("sparsify", "--local-lr"), ("run", "--vram-budget"), ("plan", "--reserve-mib"),
            ("train-predictor", "--target-recall")} <= flags
    assert len(flags) >= 20


@pytest.mark.parametrize("command,flag,required", float_options(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("value", VALUES)
def test_a_float_option_out_of_range_is_one_line(command, flag, required, value, tmp_path, capsys):
    code, _, err = run_cli(capsys, command, *placeholders(required, tmp_path), flag, value)
    lines = err.strip().splitlines()
    assert "Traceback" not in err and code != 0 and len(lines) == 1, (code, err[-2000:])
    if (command, flag, value) in VALID:
        assert flag not in lines[0], lines[0]  # accepted: the run stops at the missing model instead
    else:
        assert code == 1 and lines[0].startswith("pi-tools: error: ") and flag in lines[0], lines[0]
