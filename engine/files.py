"""The engine's checks of a file's structure, for code that reads the file some other way (gguf-py): a header
that declares more than the file holds (an array of 2**62 elements, a tensor past the end) is refused here
in a moment instead of sending such a reader into unbounded work."""
from __future__ import annotations

import os

from ._lib import check, lib


def check_gguf(path: str | os.PathLike) -> None:
    """Raise EngineError (one line naming the defect) unless `path` is a structurally sound GGUF/PWRI file."""
    check(lib().pi_check_gguf(os.fsencode(path)))
