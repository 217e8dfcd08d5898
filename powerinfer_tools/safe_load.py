"""Reading `.pt` files from elsewhere without running them: torch.load(weights_only=True) only, and one
clear line when a file is refused (a pickle that would call code) or damaged, never a traceback."""
from __future__ import annotations

import os
import pickle

from powerinfer_tools.errors import UserError


def load_pt(path: str | os.PathLike, what: str, mmap: bool = False):
    """torch.load restricted to tensors and plain containers; UserError naming `what` and `path` otherwise."""
    import torch

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
