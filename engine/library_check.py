"""A shared library checked before the dynamic loader maps it. The loader trusts the file: a segment that
reaches past the end (a truncated copy) is a SIGBUS on first touch, a program header table outside the first
loaded segment a SIGSEGV while relocating, a library without our functions a ctypes traceback. Here the ELF
header, program headers and section table are read with struct and held to the file's size (the layout of
the System V ABI's "Object Files" chapter, ELF-64 little-endian as on x86-64 and AArch64), and the dynamic
symbol table is searched for the symbols the caller needs; the same rules as csrc/backend/library_check.cpp,
which checks the device libraries the engine dlopens.
"""
from __future__ import annotations

import os
import struct
import sys
from typing import NamedTuple

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_PT_LOAD, _PT_DYNAMIC = 1, 2
_PF_X, _PF_W, _PF_R = 1, 2, 4
_SHT_STRTAB, _SHT_NOBITS, _SHT_DYNSYM = 3, 8, 11
_SHF_WRITE, _SHF_ALLOC, _SHF_EXECINSTR, _SHF_TLS = 0x1, 0x2, 0x4, 0x400
_ET_DYN = 3


class LibraryRefused(ValueError):
    """Why a file cannot be loaded as a shared library (one line, without the path)."""


class Segment(NamedTuple):
    type: int
    flags: int
    offset: int
    vaddr: int
    paddr: int
    filesz: int
    memsz: int
    align: int

    def holds(self, offset: int, length: int) -> bool:
        return self.offset <= offset and offset + length <= self.offset + self.filesz


class Section(NamedTuple):
    name: int
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    addralign: int
    entsize: int


def _inside(offset: int, length: int, what: str, file_size: int) -> None:
    if offset + length > file_size:
        raise LibraryRefused(f"its {what} ({length} bytes at {offset}) lies past its end ({file_size} bytes): "
                             "a truncated or damaged copy")


def _read(fd: int, offset: int, length: int, what: str, file_size: int) -> bytes:
    _inside(offset, length, what, file_size)
    return os.pread(fd, length, offset)


def _loadable(fd: int, header: tuple, size: int) -> list[Segment]:
    """The loadable segments, each inside the file, in address order, the program headers and the dynamic
    section in segments mapped readable (the loader reads both through the mapping)."""
    phoff, phentsize, phnum = header[5], header[9], header[10]
    if phentsize != _PHDR.size or phnum == 0:
        raise LibraryRefused(f"its program header table is malformed ({phnum} entries of {phentsize} bytes)")
    table = _read(fd, phoff, phnum * phentsize, "program header table", size)
    loads, dynamic = [], None
    for i in range(phnum):
        seg = Segment(*_PHDR.unpack_from(table, i * phentsize))
        if seg.type not in (_PT_LOAD, _PT_DYNAMIC):
            continue
        _inside(seg.offset, seg.filesz, f"segment {i}", size)
        if seg.type == _PT_DYNAMIC:
            dynamic = seg
            continue
        if seg.filesz > seg.memsz or seg.align & (seg.align - 1) or (seg.align > 1 and (seg.vaddr - seg.offset) % seg.align):
            raise LibraryRefused(f"its loadable segment {i} is malformed")
        if loads and seg.vaddr < loads[-1].vaddr:
            raise LibraryRefused(f"its loadable segment {i} is out of order")
        loads.append(seg)
    if not loads or dynamic is None:
        raise LibraryRefused("it has no loadable segments or no dynamic section: not a shared library")
    if not (loads[0].holds(phoff, phnum * phentsize) and loads[0].flags & _PF_R):
        raise LibraryRefused("its program header table lies outside its first loadable segment")
    if not any(seg.holds(dynamic.offset, dynamic.filesz) and seg.flags & _PF_R for seg in loads):
        raise LibraryRefused("its dynamic section lies outside its loadable segments")
    return loads


def _sections(fd: int, header: tuple, size: int, loads: list[Segment]) -> list[Section]:
    """The section table, each section inside the file, and each one the program needs at run time where the
    segments put it, with the access it needs (a segment dropped, moved or made inaccessible leaves code or data
    the loader will not map as the program expects)."""
    shoff, shentsize, shnum = header[6], header[11], header[12]
    if shentsize != _SHDR.size or shnum == 0:
        raise LibraryRefused(f"its section table is malformed ({shnum} entries of {shentsize} bytes)")
    table = _read(fd, shoff, shnum * shentsize, "section table", size)
    sections = [Section(*_SHDR.unpack_from(table, i * shentsize)) for i in range(shnum)]
    for i, sec in enumerate(sections):
        nobits = sec.type == _SHT_NOBITS
        if not nobits:
            _inside(sec.offset, sec.size, f"section {i}", size)
        if not sec.flags & _SHF_ALLOC or (nobits and sec.flags & _SHF_TLS):
            continue
        access = _PF_R | (_PF_W if sec.flags & _SHF_WRITE else 0) | (_PF_X if sec.flags & _SHF_EXECINSTR else 0)
        if not any(seg.vaddr <= sec.addr and sec.addr + sec.size <= seg.vaddr + seg.memsz and seg.flags & access == access
                   and (nobits or (seg.holds(sec.offset, sec.size) and sec.offset - seg.offset == sec.addr - seg.vaddr))
                   for seg in loads):
            raise LibraryRefused(f"its section {i} lies outside its loadable segments")
    return sections


def _dynamic_symbols(fd: int, sections: list[Section]) -> set[str]:
    """The names the library defines in its dynamic symbol table."""
    names: set[str] = set()
    for sec in sections:
        if sec.type != _SHT_DYNSYM:
            continue
        if sec.entsize != _SYM.size or sec.link >= len(sections) or sections[sec.link].type != _SHT_STRTAB:
            raise LibraryRefused("its dynamic symbol table is malformed")
        strings = os.pread(fd, sections[sec.link].size, sections[sec.link].offset)
        symbols = os.pread(fd, sec.size - sec.size % _SYM.size, sec.offset)
        for j in range(len(symbols) // _SYM.size):
            name, _, _, shndx, _, _ = _SYM.unpack_from(symbols, j * _SYM.size)
            end = strings.find(b"\0", name)
            if shndx != 0 and name < len(strings) and end >= 0:
                names.add(strings[name:end].decode("utf-8", "replace"))
    return names


def check_library(path: str | os.PathLike, symbols: list[str]) -> None:
    """Raise LibraryRefused unless `path` is an ELF shared library, whole, that defines every one of `symbols`.
    Elsewhere than on ELF systems the loader's own checks stand."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise LibraryRefused(f"cannot open it: {exc.strerror}") from None
    with f:
        fd, size = f.fileno(), os.fstat(f.fileno()).st_size
        ident = os.pread(fd, _EHDR.size, 0)
        if ident[:4] != b"\x7fELF" or len(ident) < _EHDR.size:
            if not sys.platform.startswith("linux"):
                return
            raise LibraryRefused(f"not an ELF shared library ({size} bytes)" if size < _EHDR.size else "not an ELF shared library")
        if ident[4] != 2 or ident[5] != 1:
            raise LibraryRefused("not a 64-bit little-endian ELF file")
        header = _EHDR.unpack(ident)
        if header[1] != _ET_DYN or header[8] < _EHDR.size:
            raise LibraryRefused("not an ELF shared library (its header says another kind of file)")
        defined = _dynamic_symbols(fd, _sections(fd, header, size, _loadable(fd, header, size)))
        missing = [s for s in symbols if s not in defined]
    if missing:
        raise LibraryRefused(f"it lacks {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
