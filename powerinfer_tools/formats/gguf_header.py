"""A GGUF / PowerInfer file's header without its tensor data: the metadata and the tensor table, read with
the engine's bounds checks (csrc/format/gguf.cpp) and none of gguf-py's per-value parsing.

gguf-py's GGUFReader builds numpy views of every part of every value: a 32000-entry vocabulary is ~100k of
them, seconds at 7B size, for a command that needs a handful of hyperparameters and the tensor table
(`pi-tools plan`). This reader decodes scalars and strings, numeric arrays with one numpy call each, and
string arrays (the vocabulary, merges) only when asked for: otherwise it walks their lengths to skip them.
A file that does not hold what it declares (truncated, a count past its end, an unknown type, text that is
not UTF-8, a tensor outside the file) raises UserError with one line.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import GGUF_MAGIC, POWERINFER_I32, PWRI_MAGIC

# GGUF value types (gguf-py's GGUFValueType): fixed-size scalars as struct formats
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
DEFAULT_ALIGNMENT = 32
MAX_KEY_LENGTH = 1 << 16  # the engine's limits
MAX_NAME_LENGTH = 1 << 12
MAX_DIM = 1 << 40
MAX_ELEMENTS = 1 << 50


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF's dimensions reversed
    type: object  # gguf.GGMLQuantizationType
    n_bytes: int
    offset: int  # from the start of the file


@dataclass
class GGUFHeader:
    path: str
    magic: bytes
    version: int
    metadata: dict = field(default_factory=dict)  # key -> int/float/bool/str, or list for an array (read by get)
    skipped: dict = field(default_factory=dict)  # key -> element count of each string array not decoded
    tensors: list[TensorInfo] = field(default_factory=list)

    def get(self, key: str, default=None):
        """The value of `key`, `default` when absent; a string array skipped at reading is a programming
        error (name it in `strings`)."""
        if key in self.skipped:
            raise KeyError(f"{key} was skipped: pass it in read_header's `strings`")
        value = self.metadata.get(key, default)
        if value is _NOT_UTF8 or (isinstance(value, list) and any(v is _NOT_UTF8 for v in value)):
            raise UserError(f"{self.path}: metadata key {key} holds text that is not UTF-8")
        return value


@dataclass(frozen=True)
class _Skipped:
    count: int


_NOT_UTF8 = object()  # a value's text that is not UTF-8: refused when asked for (gguf-py decodes lazily too)


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def bad(self, what: str):
        raise UserError(f"{self.path}: damaged GGUF file: {what} (at byte {self.pos})")

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            self.bad(f"the file ends inside {what}")
        at = self.pos
        self.pos += n
        return at

    def unpack(self, fmt: str, what: str):
        at = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, at)[0]

    def raw_string(self, max_len: int, what: str) -> tuple[int, int]:
        n = self.unpack("<Q", what)
        if n > max_len:
            self.bad(f"{what} length {n} is implausible")
        return self.take(n, what), n

    def text(self, max_len: int, what: str):
        """The string at the cursor, or _NOT_UTF8 for bytes that are not UTF-8 text."""
        at, n = self.raw_string(max_len, what)
        try:
            return bytes(self.buf[at:at + n]).decode("utf-8")
        except UnicodeDecodeError:
            return _NOT_UTF8

    def name(self, max_len: int, what: str) -> str:
        text = self.text(max_len, what)
        if text is _NOT_UTF8:
            self.bad(f"{what} that is not UTF-8")
        return text

    def skip_strings(self, count: int) -> None:
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if size - pos < 8:
                self.pos = pos
                self.bad("the file ends inside an array string")
            n = unpack(buf, pos)[0]
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.bad(f"an array string of length {n} runs past the end")
            pos += n
        self.pos = pos


def _value(c: _Cursor, vtype: int, key: str, decode_strings: bool):
    if vtype == _STRING:
        return c.text(c.size, f"the string value of {key}")
    if vtype in _SCALARS:
        value = c.unpack("<" + _SCALARS[vtype], f"the value of {key}")
        if vtype == _BOOL:
            if value > 1:
                c.bad(f"bool value {value} of {key} is neither 0 nor 1")
            return bool(value)
        return value
    if vtype != _ARRAY:
        c.bad(f"unknown metadata value type {vtype} for key {key}")
    etype = c.unpack("<I", f"the element type of {key}")
    count = c.unpack("<Q", f"the length of {key}")
    if etype == _STRING:
        if count > (c.size - c.pos) // 8:
            c.bad(f"array {key} of {count} strings runs past the end")
        if not decode_strings:
            c.skip_strings(count)
            return _Skipped(count)
        return [c.text(c.size, f"a string of {key}") for _ in range(count)]
    if etype == _ARRAY:
        c.bad(f"nested metadata arrays (key {key}) are not supported")
    if etype not in _NUMPY:
        c.bad(f"unknown array element type {etype} for key {key}")
    dtype = np.dtype(_NUMPY[etype])
    if count > (c.size - c.pos) // dtype.itemsize:
        c.bad(f"array {key} of {count} elements runs past the end")
    at = c.take(count * dtype.itemsize, f"array {key}")
    values = np.frombuffer(bytes(c.buf[at:at + count * dtype.itemsize]), dtype)
    if etype == _BOOL:
        if values.size and int(values.max()) > 1:
            c.bad(f"bool array {key} holds a value that is neither 0 nor 1")
        return values.astype(bool).tolist()
    return values.tolist()


def read_header(path: str | os.PathLike, strings: Collection[str] = (), tensors: bool = True) -> GGUFHeader:
    """The metadata and tensor table of a GGUF or PWRI file. String arrays are decoded only for the keys in
    `strings` (the others are listed in `skipped` with their lengths). tensors=False: the metadata alone (no tensor
    table, nor gguf-py's type tables, whose import costs a run's start a tenth of a second)."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(f"no such file: {path}")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(4)
        if magic not in (GGUF_MAGIC, PWRI_MAGIC):
            raise UserError(f"{path}: not a GGUF/PowerInfer file (magic {magic!r})")
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _read(view, path, magic, set(strings), tensors)
            finally:
                view.release()


def _read(buf, path: str, magic: bytes, strings: set, tensors: bool) -> GGUFHeader:
    c = _Cursor(buf, path)
    c.take(4, "the magic")
    version = c.unpack("<I", "the version")
    if version not in (2, 3):
        raise UserError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors = c.unpack("<Q", "the tensor count")
    n_kv = c.unpack("<Q", "the metadata count")
    if n_kv > (c.size - c.pos) // 12:
        c.bad(f"metadata count {n_kv} exceeds what the file can hold")
    if n_tensors > (c.size - c.pos) // 28:
        c.bad(f"tensor count {n_tensors} exceeds what the file can hold")
    header = GGUFHeader(path=path, magic=magic, version=version)
    for _ in range(n_kv):
        key = c.name(MAX_KEY_LENGTH, "a metadata key")
        if not key:
            c.bad("empty metadata key")
        if key in header.metadata or key in header.skipped:
            c.bad(f"duplicate metadata key {key}")
        vtype = c.unpack("<I", f"the type of {key}")
        value = _value(c, vtype, key, key in strings)
        if isinstance(value, _Skipped):
            header.skipped[key] = value.count
        else:
            header.metadata[key] = value
    alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 8 or alignment > 1 << 20
            or alignment & (alignment - 1)):
        raise UserError(f"{path}: general.alignment must be a power of two from 8 to 2^20")
    if not tensors:
        return header
    import gguf

    gpu_index = header.metadata.get(names.KEY_ARCHITECTURE) == names.GPU_INDEX_ARCH
    seen = set()
    raw = []
    for _ in range(n_tensors):
        name = c.name(MAX_NAME_LENGTH, "a tensor name")
        if not name:
            c.bad("empty tensor name")
        if name in seen:
            c.bad(f"duplicate tensor name {name}")
        seen.add(name)
        n_dims = c.unpack("<I", f"the dimension count of {name}")
        if not 1 <= n_dims <= 4:
            c.bad(f"tensor {name} has {n_dims} dimensions (1 to 4 allowed)")
        dims = [c.unpack("<Q", f"the shape of {name}") for _ in range(n_dims)]
        n_elements = 1
        for d in dims:
            if d > MAX_DIM:
                c.bad(f"tensor {name} has an implausible dimension {d}")
            n_elements *= d
            if n_elements > MAX_ELEMENTS:
                c.bad(f"tensor {name} is implausibly large")
        code = c.unpack("<I", f"the type of {name}")
        if gpu_index and code == POWERINFER_I32:
            code = int(gguf.GGMLQuantizationType.I32)
        try:
            qtype = gguf.GGMLQuantizationType(code)
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            c.bad(f"tensor {name} has unknown type id {code}")
        if dims[0] % block:
            c.bad(f"tensor {name} row length {dims[0]} is not a multiple of the {qtype.name} block size {block}")
        offset = c.unpack("<Q", f"the offset of {name}")
        if offset % alignment:
            c.bad(f"tensor {name} offset {offset} is not aligned to {alignment}")
        raw.append((name, tuple(reversed(dims)), qtype, n_elements // block * type_bytes, offset))
    data_start = (c.pos + alignment - 1) // alignment * alignment
    for name, shape, qtype, n_bytes, offset in raw:
        if data_start + offset + n_bytes > c.size:
            raise UserError(f"{path}: tensor {name} (offset {offset}, {n_bytes} bytes) lies past the end of the "
                            f"file ({c.size} bytes): truncated or damaged")
        header.tensors.append(TensorInfo(name, shape, qtype, n_bytes, data_start + offset))
    return header
