"""Outputs built under a temporary name: what a killed run left (SIGKILL runs no cleanup) is removed by the
next run writing the same output, unless its writer still runs; directories get the usual permissions."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from powerinfer_tools.core.atomic import atomic_dir, atomic_file


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rerun_removes_stale_temporaries_of_its_own_output(tmp_path):
    stale_file = tmp_path / f".m.gguf.{dead_pid()}.k3j2.tmp"
    stale_file.write_bytes(b"x" * 1000)
    stale_dir = tmp_path / f".pred.{dead_pid()}.a8f1.tmp"
    stale_dir.mkdir()
    (stale_dir / "model_0.pt").write_bytes(b"x")
    running = tmp_path / f".m.gguf.{os.getpid()}.zz01.tmp"  # a run still going: kept
    running.write_bytes(b"y")
    other = tmp_path / f".other.gguf.{dead_pid()}.q1.tmp"  # another output's: not ours to judge
    other.write_bytes(b"z")
    with atomic_file(tmp_path / "m.gguf") as tmp:
        tmp.write_bytes(b"new")
    with atomic_dir(tmp_path / "pred") as tmp:
        (tmp / "model_0.pt").write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.gguf", "pred", running.name, other.name])


def test_directories_get_the_usual_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "pred") as tmp:
            (tmp / "model_0.pt").write_bytes(b"new")
        with atomic_file(tmp_path / "m.gguf") as tmp:
            tmp.write_bytes(b"new")
    finally:
        os.umask(mask)
    assert (tmp_path / "pred").stat().st_mode & 0o777 == 0o755  # mkdtemp's 0700 before
    assert (tmp_path / "m.gguf").stat().st_mode & 0o777 == 0o644


def test_a_second_profile_to_one_output_is_refused_while_the_first_runs(tmp_path, capsys):
    """Two `profile --force` to one output shared its partial directory (FileExistsError, a traceback)."""
    from cli_helpers import assert_one_line_error, run_cli

    from powerinfer_tools.core.atomic import output_lock

    out = tmp_path / "prof"
    with output_lock(out, wait=False):  # what the first run holds
        code, _, err = run_cli(capsys, "profile", "-m", "/no/such/model", "-o", out, "--force")
    assert_one_line_error(code, err, f"another pi-tools run is writing {out}")
    assert not out.exists()


def test_two_first_runs_share_one_build(tmp_path, monkeypatch):
    """`pi-tools run -m smollm2` twice at once on a fresh cache: the later waits for the first's build."""
    import threading
    import time

    from powerinfer_tools.runtime import default_build as pipeline

    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", str(tmp_path))
    builds = []

    def slow_build(model, outtype, tokens, rank, final):
        builds.append(model)
        time.sleep(0.5)
        final.write_bytes(b"built")
        return final

    monkeypatch.setattr(pipeline, "_build", slow_build)
    results = []
    runs = [threading.Thread(target=lambda: results.append(pipeline.build("smollm2"))) for _ in range(2)]
    for r in runs:
        r.start()
    for r in runs:
        r.join(timeout=60)
    assert builds == ["smollm2"] and results == [pipeline.model_file("smollm2")] * 2


def test_the_lock_file_goes_with_the_run(tmp_path):
    from powerinfer_tools.core.atomic import output_lock

    out = tmp_path / "prof"
    with output_lock(out, wait=False):
        assert (tmp_path / ".prof.lock").exists()
    assert not list(tmp_path.iterdir())  # nothing left beside the output
    with pytest.raises(KeyboardInterrupt):
        with output_lock(out, wait=False):
            raise KeyboardInterrupt
    assert not list(tmp_path.iterdir())


def test_runs_that_wait_take_turns_though_each_removes_the_lock_file(tmp_path):
    """Several processes contending for one output: each holds it alone (the removed file's waiters try again on
    the new one), and no lock file is left."""
    script = (
        "import sys, time\n"
        "from powerinfer_tools.core.atomic import output_lock\n"
        "log = open(sys.argv[2], 'a')\n"
        "for _ in range(5):\n"
        "    with output_lock(sys.argv[1], wait=True):\n"
        "        log.write('in\\n'); log.flush(); time.sleep(0.01); log.write('out\\n'); log.flush()\n")
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out"), str(log)],
                              stderr=subprocess.DEVNULL) for _ in range(4)]
    assert all(p.wait(60) == 0 for p in procs)
    assert log.read_text() == "in\nout\n" * 20  # never two inside at once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]
