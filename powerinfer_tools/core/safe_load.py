"""Reading `.pt` files from elsewhere without running them: torch.load(weights_only=True) only, after a look at
the sizes the file declares, and one clear line when a file is refused (a pickle that would call code, a
compressed payload) or damaged, or holds something other than the tensors asked for; never a traceback."""
from __future__ import annotations

import os
import pickle

from powerinfer_tools.core.errors import UserError


def load_pt(path: str | os.PathLike, what: str, mmap: bool = False):
    """torch.load restricted to tensors and plain containers; UserError naming `what` and `path` otherwise."""
    import torch

    check_declared_sizes(path, what)
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():  # torch's weights_only unpickler met a global it does not allow
            raise UserError(f"{path}: refused to load this {what}: it holds Python objects other than tensors "
                            "(a pickle that could run code); only weights-only .pt files are read") from None
        raise UserError(f"cannot read {what} {path}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # zip/pickle/storage errors of many types for a damaged file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"cannot read {what} {path}: {first}") from None


def check_declared_sizes(path: str | os.PathLike, what: str) -> None:
    """torch.save stores tensor data uncompressed in its zip; entries declaring more bytes than the whole file
    holds are compressed (a 1 MB file can declare a 1 GiB tensor that torch.load would inflate into memory
    before any shape is checked), so such a file is refused before it is loaded; so is a file that is neither
    that zip nor the legacy format's pickle (text, say: not a `what` at all)."""
    import zipfile

    try:
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                if f.read(1) != b"\x80":  # the legacy format: a pickle, protocol 2 or later
                    raise UserError(f"{path} is not a {what}: not a file torch.save writes")
            return  # the legacy format stores its tensors raw: what it declares, the file holds
        with zipfile.ZipFile(path) as archive:
            declared = sum(entry.file_size for entry in archive.infolist())
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise UserError(f"cannot read {what} {path}: {exc}") from None
    size = os.path.getsize(path)
    if declared > size:
        raise UserError(f"{path}: refused to load this {what}: it declares {declared:,} bytes of data in a file of "
                        f"{size:,} bytes (compressed entries; torch.save writes none)")


def checked_tensor(value, source: str, what: str, ndim: int, integers: bool = False, max_abs: float | None = None):
    """`value` if it is a dense CPU tensor of `ndim` dimensions holding finite real numbers (floating point, or
    also integers with `integers`), at most `max_abs` in magnitude; UserError naming `what` otherwise.
    weights_only admits plain ints, 0-d, meta, quantized and sparse tensors alike: the readers need none."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise UserError(f"{source}: {what} must be a tensor, not {type(value).__name__}")
    kind = ("meta" if value.is_meta else "quantized" if value.is_quantized else
            "sparse" if value.layout != torch.strided else None)
    if kind:
        raise UserError(f"{source}: {what} must be a dense tensor, not a {kind} one")
    if not (value.is_floating_point() or (integers and not value.is_complex() and value.dtype != torch.bool)):
        expected = "real numbers" if integers else "floating-point numbers"
        raise UserError(f"{source}: {what} must hold {expected}, not {str(value.dtype).removeprefix('torch.')}")
    if value.dim() != ndim:
        raise UserError(f"{source}: {what} must have {ndim} dimension{'s' * (ndim != 1)}, not {value.dim()}")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise UserError(f"{source}: {what} holds NaN or infinity")
    if max_abs is not None and value.numel() and float(value.abs().max()) > max_abs:
        raise UserError(f"{source}: {what} holds values of magnitude {float(value.abs().max()):.3g}, beyond "
                        f"{max_abs:g}")
    return value
