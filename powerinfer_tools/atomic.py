"""Atomic outputs: build under a temporary name beside the target, rename on success.

An interrupted or failed run leaves the previous output (or nothing) under the final name,
never a half-written file.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from powerinfer_tools.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
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
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
