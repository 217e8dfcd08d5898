"""SHA-256 digests of files and of saved structures: a file a resume or a later stage reads is compared with the
digest recorded when it was written, so damage (a truncated, flipped or deleted file) is refused in one line
instead of becoming a wrong result."""
from __future__ import annotations

import hashlib
from pathlib import Path

from powerinfer_tools.core.errors import UserError

_CHUNK = 1 << 22


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(value, h=None) -> str:
    """SHA-256 of everything a checkpoint holds (keys, numbers, strings, tensors' type, shape and bytes), in a
    fixed order: torch.save stores tensor data unchecked, so a flipped bit would otherwise load as a weight."""
    import torch

    h = h or hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy())  # the tensor's own bytes, not a copy
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            tree_sha256(value[key], h)
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}".encode())
        for item in value:
            tree_sha256(item, h)
    else:
        h.update(f"V{value!r}".encode())
    return h.hexdigest()


def check_file(path: Path, expected: str, fix: str, data: bytes | None = None) -> None:
    """UserError naming `path` and what to do (`fix`) when it is missing or its bytes are not those recorded;
    `data`: its bytes, where the caller has read them already (not read again)."""
    try:
        actual = file_sha256(path) if data is None else bytes_sha256(data)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: {fix}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror}): {fix}") from None
    if actual != expected:
        raise UserError(f"{path} is damaged (its contents do not match the checksum recorded when it was written): "
                        f"{fix}")
