"""Running `pi-tools` in-process the way a user's shell would, and checking its one-line errors."""
from __future__ import annotations

from powerinfer_tools.cli import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `pi-tools ARGS`; output printed before the call is dropped."""
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit status 1 and exactly one stderr line, `pi-tools: error: ...`, naming every needle."""
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pi-tools: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
