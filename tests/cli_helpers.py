"""Running `pi-tools` in-process the way a user's shell would, and checking its one-line errors."""
from __future__ import annotations

import io

from powerinfer_tools.cli import main

# what a process that ends or goes on cleanly never prints
BROKEN = ("Traceback", "Exception ignored", "Fatal Python error", "double free")


def subcommands() -> list[str]:
    """Every subcommand `pi-tools` has, read from the typer app itself (a hand-kept list misses new ones)."""
    import typer

    from powerinfer_tools.cli.app import app

    return sorted(typer.main.get_command(app).commands)


def profiled(model_dir, out, calib, tokens: int, seq_len: int, *extra: str):
    """`out`, a profile of `model_dir` on `calib` made by `pi-tools profile` (for module fixtures)."""
    main(["profile", "-m", str(model_dir), "--calib", str(calib), "--tokens", str(tokens), "--seq-len", str(seq_len),
          "-o", str(out), *extra])
    return out


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


def recorded(child):
    """`child`, a pexpect.spawn, keeping a copy of all it reads: each `expect` consumes what it matched and what
    came before, so `child.before` after the last one holds only the end of the output."""
    child.logfile_read = io.StringIO()
    return child


def assert_whole_output_clean(child) -> None:
    """Nothing in all that a `recorded` child printed, from its start, is a traceback or an "Exception ignored"
    notice."""
    out = child.logfile_read.getvalue()
    broken = [b for b in BROKEN if b in out]
    assert not broken, (broken, out[-4000:])


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit status 1 and exactly one stderr line, `pi-tools: error: ...`, naming every needle."""
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pi-tools: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def interrupt_profile_at_forward(monkeypatch, n: int):
    """Makes `pi-tools profile` raise KeyboardInterrupt (Ctrl-C) in its n-th model forward; returns a
    function that puts the real profiling pass back."""
    from powerinfer_tools.stages.profiling import profiling as profile_mod

    real_pass = profile_mod.profile_pass
    calls = {"n": 0}

    def interrupted_pass(model, *a, **kw):
        def hook(*_):
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
        handle = model.register_forward_pre_hook(hook)
        try:
            return real_pass(model, *a, **kw)
        finally:
            handle.remove()

    monkeypatch.setattr(profile_mod, "profile_pass", interrupted_pass)
    return lambda: monkeypatch.setattr(profile_mod, "profile_pass", real_pass)
