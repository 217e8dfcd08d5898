"""The toolkit's progress bars: tqdm on stderr, with one switch for work a command does on the user's behalf
(the default model's first build inside `run`, `chat`, `serve`). Such bars belong on a terminal only, where
tqdm redraws them in place and they vanish when done: in a pipe or a log every redraw would be another line of
output the user did not ask for."""
from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

_terminal_only: ContextVar[bool] = ContextVar("progress_terminal_only", default=False)


def progress_bar(*args, **kwargs) -> tqdm:
    """tqdm(*args, **kwargs), or, inside `terminal_only()`, a bar that is off when stderr is not a terminal
    (tqdm's disable=None) and leaves no line behind when it is."""
    from tqdm import tqdm  # here: a module that only may draw a bar (read on every `run`) does not pay for tqdm

    if _terminal_only.get() and not kwargs.get("disable"):
        kwargs.update(disable=None, leave=False)
    return tqdm(*args, **kwargs)


@contextmanager
def terminal_only() -> Iterator[None]:
    """Bars made in this block, in this thread, draw only on a terminal; so do transformers' own (its loading
    bars), through its switch for them, which is process-wide: put back as it was at the end."""
    from transformers.utils import logging as hf_logging

    token = _terminal_only.set(True)
    hf_bars = hf_logging.is_progress_bar_enabled()
    if hf_bars and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        _terminal_only.reset(token)
        if hf_bars:
            hf_logging.enable_progress_bar()


_BAR = re.compile(r"\d+%\|")  # tqdm's "  42%|████      |"


@contextmanager
def library_bars() -> Iterator[None]:
    """Around a library call that draws tqdm bars past any switch (transformers' GGUF loader): inside
    terminal_only() with stderr no terminal, what the call writes to stderr is held, and all but its bars
    written after it."""
    if not _terminal_only.get() or sys.stderr.isatty():
        yield
        return
    held = io.StringIO()
    try:
        with redirect_stderr(held):
            yield
    finally:
        kept = [part for part in re.split(r"[\r\n]", held.getvalue()) if part.strip() and not _BAR.search(part)]
        sys.stderr.write("".join(part + "\n" for part in kept))
