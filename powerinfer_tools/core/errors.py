"""The one exception type the CLI turns into a one-line message and a non-zero exit, and the write failures
(a full disk above all) that get one line too, whichever library met them."""
from __future__ import annotations

import errno
import re


class UserError(Exception):
    """Bad input or an impossible request: the message is shown to the user as is."""


class RequestError(UserError):
    """A request the model cannot serve as asked (a prompt longer than the context, a bad sampling value); `param`
    and `code` name the field and the kind where an API answering with it wants them."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


_FULL = (errno.ENOSPC, errno.EDQUOT)
# How the writers the toolkit uses report a failed write when they drop errno: safetensors (Rust's io::Error),
# numpy's tofile (a short write), torch.save (its C++ stream: "basic_ios::clear: iostream error", "file write
# failed", then "unexpected pos" while closing the zip). A full disk is by far their likeliest cause.
_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|os error (28|122)\b")
_WRITE_FAILED_TEXT = re.compile(r"\d+ requested and \d+ written|iostream error|file write failed|unexpected pos \d+")


def write_failure(exc: BaseException) -> str | None:
    """'disk full ...' when `exc` (or what it was raised from) says the output could not be written for want of
    space, or a writer failed in a way that hides why; None for anything else."""
    seen, hidden = set(), None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            where = f" while writing {exc.filename}" if exc.filename else ""
            return f"disk full{where} ({exc.strerror}); the output was not kept"
        if isinstance(exc, (OSError, RuntimeError)) and _FULL_TEXT.search(str(exc)):
            return f"disk full ({str(exc).splitlines()[0][:200]}); the output was not kept"
        if isinstance(exc, (OSError, RuntimeError)) and _WRITE_FAILED_TEXT.search(str(exc)):
            hidden = hidden or str(exc).splitlines()[0][:200]
        exc = exc.__cause__ or exc.__context__
    return f"disk full? writing the output failed ({hidden}); it was not kept" if hidden else None
