"""Reading and writing PowerInfer's GGUF flavour with gguf-py.

PowerInfer's files are GGUF v3 with the magic `PWRI` in place of `GGUF`; everything after the
first four bytes is plain GGUF. gguf-py writes GGUF, so writers patch the magic afterwards, and
the reader below accepts either magic.
"""
from __future__ import annotations

import os

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names

GGUF_MAGIC = b"GGUF"
PWRI_MAGIC = b"PWRI"
# PowerInfer's ggml and gguf-py number i32 18 (ggml.h's enum ggml_type ends I8, I16, I32 after q8_K); later
# ggml gives 18 to iq3_xxs and i32 26. PowerInfer's engine cannot read 26, so gpu-index files carry 18.
POWERINFER_I32 = 18
# A thresholded (SiLU/GELU) model's file names its architecture `<PowerInfer's name>-<activation>` (llama-silu),
# its hyperparameter keys under that name as GGUF does: PowerInfer's loader stops at an unknown architecture,
# where under `llama` its ReLU-only sparse FFN would run the file as a ReLU model without a word.
THRESHOLDED_ACTIVATIONS = ("silu", "gelu")


def thresholded_arch(base: str, activation: str) -> str:
    return f"{base}-{activation}"


def base_arch(name: str) -> str:
    """PowerInfer's (and llama.cpp's) architecture name behind a file's general.architecture."""
    base, dash, activation = name.rpartition("-")
    return base if dash and activation in THRESHOLDED_ACTIVATIONS else name


def head_width(get, arch: str, n_embd: int, n_head: int) -> int:
    """A head's width (q/k/v rows per head) in a file whose metadata `get(key, default)` reads: attention.key_length
    where the file sets it (qwen3's heads are not embedding_length / head_count wide), as the engine reads it."""
    return int(get(f"{arch}.attention.key_length", None) or n_embd // n_head)


def read_magic(path: str | os.PathLike) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def set_pwri_magic(path: str | os.PathLike) -> None:
    """Turn a GGUF file written by gguf-py into a PowerInfer file (the version field stays 3)."""
    with open(path, "r+b") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        f.seek(0)
        f.write(PWRI_MAGIC)


def open_reader(path: str | os.PathLike, writable: bool = False):
    """A gguf.GGUFReader over a GGUF or PWRI file; bad files raise UserError with one line.

    `writable` maps the file read-write: assigning into a field's parts changes the file in place."""
    import gguf

    class PwriReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if offset == 0 and count == 1 and bytes(self.data[:4]) == PWRI_MAGIC:
                return np.array([gguf.GGUF_MAGIC], dtype=np.uint32)
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            if field(self, names.KEY_ARCHITECTURE) == names.GPU_INDEX_ARCH:  # PowerInfer's i32 code, read as i32
                for info in fields:
                    if int(info.parts[4][0]) == POWERINFER_I32:
                        info.parts[4] = np.array([gguf.GGMLQuantizationType.I32], dtype=np.uint32)
            super()._build_tensors(start_offs, fields)

    if not os.path.isfile(path):
        raise UserError(f"no such file: {path}")
    magic = read_magic(path)
    if magic not in (GGUF_MAGIC, PWRI_MAGIC):
        raise UserError(f"{path}: not a GGUF/PowerInfer file (magic {magic!r})")
    check_structure(path)
    try:
        reader = PwriReader(path, "r+" if writable else "r")
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError) as exc:
        raise UserError(f"{path}: damaged GGUF file ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    reader.source_path = str(path)
    return reader


def check_structure(path: str | os.PathLike) -> None:
    """The engine's bounds checks of the header, before gguf-py trusts it: gguf-py allocates what a count
    declares, so one array of 2**62 elements would grow its memory without bound."""
    import powerinfer_engine as engine

    try:
        engine.check_gguf(path)
    except engine.EngineError as exc:
        raise UserError(str(exc)) from None


def field(reader, key: str, default=None, lossy: bool = False):
    """The value of metadata `key` (str, number or list), or `default` when absent. A string that is not
    UTF-8 is refused with one line, or with `lossy` shown with U+FFFD in place of the bad bytes."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        if not lossy:
            raise UserError(f"{reader.source_path}: metadata key {key} holds text that is not UTF-8") from None
    import gguf

    def text(part: int) -> str:
        return bytes(f.parts[part]).decode("utf-8", "replace")

    return [text(i) for i in f.data] if f.types[0] == gguf.GGUFValueType.ARRAY else text(-1)


def set_powerinfer_i32(path: str | os.PathLike) -> None:
    """Rewrite, in place, the i32 tensor types of a gpu-index file written by gguf-py to PowerInfer's code."""
    import gguf

    reader = open_reader(path, writable=True)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.I32:
            t.field.parts[4][0] = POWERINFER_I32
    reader.data.flush()
