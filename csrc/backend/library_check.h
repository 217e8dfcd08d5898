// A shared library checked before dlopen maps it. The loader trusts the file: a segment that reaches past the
// end (a truncated copy) is a SIGBUS on first touch, a program header table outside the first loaded segment a
// SIGSEGV while relocating. The ELF header, program headers and section table (the System V ABI's "Object
// Files" chapter; <elf.h>'s ELF-64 records) are held to the file's size and the dynamic symbol table searched
// for the symbols the caller needs: the rules of engine/library_check.py, which checks the engine library
// before ctypes loads it.
#pragma once

#include <string>
#include <vector>

namespace pi {

// "" when `path` is a whole ELF shared library for this machine's word size that defines every one of
// `symbols`, else why not (one line, without the path).
std::string library_problem(const std::string &path, const std::vector<std::string> &symbols);

}  // namespace pi
