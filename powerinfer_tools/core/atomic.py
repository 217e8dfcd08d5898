"""Atomic outputs: build under a temporary name beside the target, rename on success.

An interrupted or failed run leaves the previous output (or nothing) under the final name,
never a half-written file.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from powerinfer_tools.core.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temporary_prefix(final: Path, pid: int | None = None) -> str:
    """Temporaries of `final` carry the writer's process id, so a rerun can tell the ones of a killed run."""
    return f".{final.name}.{os.getpid() if pid is None else pid}."


def remove_stale_temporaries(final: Path) -> None:
    """Remove what runs writing `final` that were killed (SIGKILL, the OOM killer) left behind: temporaries
    whose process is gone. Those of a run still going are kept."""
    pattern = re.compile(re.escape(f".{final.name}.") + r"(\d+)\..*\.tmp")
    with contextlib.suppress(OSError):
        for entry in final.parent.iterdir():
            match = pattern.fullmatch(entry.name)
            if match and not _alive(int(match.group(1))):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


@contextlib.contextmanager
def naming_output(final: Path):
    """An output that cannot even be started (a read-only directory, no permission) is reported under its own
    name, not the temporary one beside it."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"cannot write {final}: {exc.strerror}") from None


@contextlib.contextmanager
def atomic_file(final: str | os.PathLike):
    """Yield a temporary path in the target's directory; move it to `final` if the block succeeds."""
    final = Path(final)
    if final.is_dir():
        raise UserError(f"output path {final} is a directory")
    with naming_output(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(final)
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(final), suffix=".tmp", dir=final.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
    try:
        yield Path(tmp)
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def check_output_dir(final: Path, force: bool) -> None:
    """Refuse an existing non-empty directory unless `force` (then it is replaced on success)."""
    if final.exists() and not final.is_dir():
        raise UserError(f"output path {final} exists and is not a directory")
    if final.is_dir() and any(final.iterdir()) and not force:
        raise UserError(f"output directory {final} exists and is not empty (use --force to replace it)")


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place, replacing `final` (renames only; no copy)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, force: bool = False):
    """Yield a temporary directory beside `final`; it replaces `final` only if the block succeeds."""
    final = Path(final)
    check_output_dir(final, force)
    with naming_output(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(final)
        tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(final), suffix=".tmp", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; output directories get the usual permissions
    try:
        yield tmp
        for path in tmp.rglob("*"):  # writers that go through a temporary file of their own leave it 0600
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o666 & ~_umask())
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def output_lock(final: str | os.PathLike, wait: bool):
    """Hold an exclusive lock on `final` (fcntl.flock of a lock file beside it, released however the process
    ends, and removed when the run lets go): two runs writing one output take turns with `wait`, or the later is
    refused in one line. Without flock (Windows) runs are not locked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    final = Path(final)
    lock_path = final.parent / f".{final.name}.lock"
    with naming_output(final):
        final.parent.mkdir(parents=True, exist_ok=True)
    while True:
        with naming_output(final):
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                os.close(fd)
                raise UserError(f"another pi-tools run is writing {final} (it holds {lock_path}): wait for it to "
                                "finish or choose another output") from None
            print(f"pi-tools: another run is building {final.name}; waiting for it", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        # the holder before us removes the file as it lets go: a lock on a removed file locks nothing, try again
        try:
            held = os.stat(lock_path)
        except FileNotFoundError:
            held = None
        mine = os.fstat(fd)
        if held is not None and (held.st_dev, held.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:  # removed while still held, so no run is left holding a file that is gone from the directory
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)
