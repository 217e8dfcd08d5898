#include "backend/library_check.h"

#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <set>

namespace pi {

namespace {

struct ElfFile {
    int fd = -1;
    uint64_t size = 0;
    ~ElfFile() {
        if (fd >= 0) close(fd);
    }
};

struct Refused {
    std::string why;
};

std::string span(uint64_t offset, uint64_t length) {
    return std::to_string(length) + " bytes at " + std::to_string(offset);
}

// Throws Refused unless [offset, offset + length) lies inside the file (no wrap-around).
void inside(const ElfFile &f, uint64_t offset, uint64_t length, const std::string &what) {
    if (offset > f.size || length > f.size - offset)
        throw Refused{"its " + what + " (" + span(offset, length) + ") lies past its end (" + std::to_string(f.size) +
                      " bytes): a truncated or damaged copy"};
}

std::vector<char> read_at(const ElfFile &f, uint64_t offset, uint64_t length, const std::string &what) {
    inside(f, offset, length, what);
    std::vector<char> out(length);
    uint64_t done = 0;
    while (done < length) {
        const ssize_t n = pread(f.fd, out.data() + done, length - done, off_t(offset + done));
        if (n <= 0) throw Refused{"reading its " + what + " failed"};
        done += uint64_t(n);
    }
    return out;
}

template <typename T>
T record(const std::vector<char> &bytes, uint64_t index) {
    T out;
    std::memcpy(&out, bytes.data() + index * sizeof(T), sizeof(T));
    return out;
}

bool holds(const Elf64_Phdr &seg, uint64_t offset, uint64_t length) {
    return seg.p_offset <= offset && offset + length <= seg.p_offset + seg.p_filesz;
}

// The loadable segments, each inside the file, in address order, the program headers and the dynamic section
// in segments mapped readable (the loader reads both through the mapping).
std::vector<Elf64_Phdr> loadable(const ElfFile &f, const Elf64_Ehdr &eh) {
    if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0)
        throw Refused{"its program header table is malformed (" + std::to_string(eh.e_phnum) + " entries of " +
                      std::to_string(eh.e_phentsize) + " bytes)"};
    const uint64_t table_bytes = uint64_t(eh.e_phnum) * sizeof(Elf64_Phdr);
    const std::vector<char> table = read_at(f, eh.e_phoff, table_bytes, "program header table");
    std::vector<Elf64_Phdr> loads;
    bool dynamic_found = false;
    Elf64_Phdr dynamic{};
    for (uint64_t i = 0; i < eh.e_phnum; ++i) {
        const auto seg = record<Elf64_Phdr>(table, i);
        if (seg.p_type != PT_LOAD && seg.p_type != PT_DYNAMIC) continue;
        inside(f, seg.p_offset, seg.p_filesz, "segment " + std::to_string(i));
        if (seg.p_type == PT_DYNAMIC) {
            dynamic_found = true;
            dynamic = seg;
            continue;
        }
        const uint64_t align = seg.p_align;
        if (seg.p_filesz > seg.p_memsz || (align & (align - 1)) != 0 || (align > 1 && (seg.p_vaddr - seg.p_offset) % align != 0))
            throw Refused{"its loadable segment " + std::to_string(i) + " is malformed"};
        if (!loads.empty() && seg.p_vaddr < loads.back().p_vaddr)
            throw Refused{"its loadable segment " + std::to_string(i) + " is out of order"};
        loads.push_back(seg);
    }
    if (loads.empty() || !dynamic_found) throw Refused{"it has no loadable segments or no dynamic section: not a shared library"};
    if (!holds(loads.front(), eh.e_phoff, table_bytes) || !(loads.front().p_flags & PF_R))
        throw Refused{"its program header table lies outside its first loadable segment"};
    bool dynamic_loaded = false;
    for (const Elf64_Phdr &seg : loads) dynamic_loaded |= holds(seg, dynamic.p_offset, dynamic.p_filesz) && (seg.p_flags & PF_R);
    if (!dynamic_loaded) throw Refused{"its dynamic section lies outside its loadable segments"};
    return loads;
}

// The section table, each section inside the file, and each one the program needs at run time where the
// segments put it, with the access it needs (a segment dropped, moved or made inaccessible leaves code or data
// the loader will not map as the program expects).
std::vector<Elf64_Shdr> sections_of(const ElfFile &f, const Elf64_Ehdr &eh, const std::vector<Elf64_Phdr> &loads) {
    if (eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shnum == 0)
        throw Refused{"its section table is malformed (" + std::to_string(eh.e_shnum) + " entries of " +
                      std::to_string(eh.e_shentsize) + " bytes)"};
    const std::vector<char> table = read_at(f, eh.e_shoff, uint64_t(eh.e_shnum) * sizeof(Elf64_Shdr), "section table");
    std::vector<Elf64_Shdr> sections;
    for (uint64_t i = 0; i < eh.e_shnum; ++i) {
        const auto sec = record<Elf64_Shdr>(table, i);
        sections.push_back(sec);
        const bool nobits = sec.sh_type == SHT_NOBITS;
        if (!nobits) inside(f, sec.sh_offset, sec.sh_size, "section " + std::to_string(i));
        if (!(sec.sh_flags & SHF_ALLOC) || (nobits && (sec.sh_flags & SHF_TLS))) continue;
        const uint32_t access = PF_R | ((sec.sh_flags & SHF_WRITE) ? PF_W : 0) | ((sec.sh_flags & SHF_EXECINSTR) ? PF_X : 0);
        bool mapped = false;
        for (const Elf64_Phdr &seg : loads)
            mapped |= seg.p_vaddr <= sec.sh_addr && sec.sh_addr + sec.sh_size <= seg.p_vaddr + seg.p_memsz &&
                      (seg.p_flags & access) == access &&
                      (nobits || (holds(seg, sec.sh_offset, sec.sh_size) && sec.sh_offset - seg.p_offset == sec.sh_addr - seg.p_vaddr));
        if (!mapped) throw Refused{"its section " + std::to_string(i) + " lies outside its loadable segments"};
    }
    return sections;
}

// The names the library defines in its dynamic symbol table.
std::set<std::string> dynamic_symbols(const ElfFile &f, const std::vector<Elf64_Shdr> &sections) {
    std::set<std::string> names;
    for (const Elf64_Shdr &sh : sections) {
        if (sh.sh_type != SHT_DYNSYM) continue;
        if (sh.sh_entsize != sizeof(Elf64_Sym) || sh.sh_link >= sections.size() || sections[sh.sh_link].sh_type != SHT_STRTAB)
            throw Refused{"its dynamic symbol table is malformed"};
        const Elf64_Shdr &strtab = sections[sh.sh_link];
        const std::vector<char> strings = read_at(f, strtab.sh_offset, strtab.sh_size, "symbol names");
        const std::vector<char> symbols = read_at(f, sh.sh_offset, sh.sh_size - sh.sh_size % sizeof(Elf64_Sym), "symbols");
        for (uint64_t j = 0; j < symbols.size() / sizeof(Elf64_Sym); ++j) {
            const auto sym = record<Elf64_Sym>(symbols, j);
            if (sym.st_shndx == SHN_UNDEF || sym.st_name >= strings.size()) continue;
            const char *start = strings.data() + sym.st_name;
            const void *end = std::memchr(start, 0, strings.size() - sym.st_name);
            if (end) names.emplace(start, static_cast<const char *>(end));
        }
    }
    return names;
}

}  // namespace

std::string library_problem(const std::string &path, const std::vector<std::string> &symbols) {
    ElfFile f;
    f.fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st {};
    if (f.fd < 0 || fstat(f.fd, &st) != 0) return std::string("cannot open it: ") + std::strerror(errno);
    if (!S_ISREG(st.st_mode)) return "not a regular file";
    f.size = uint64_t(st.st_size);
    try {
        if (f.size < sizeof(Elf64_Ehdr)) throw Refused{"not an ELF shared library (" + std::to_string(f.size) + " bytes)"};
        const auto eh = record<Elf64_Ehdr>(read_at(f, 0, sizeof(Elf64_Ehdr), "header"), 0);
        if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0) throw Refused{"not an ELF shared library"};
        if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_ident[EI_DATA] != ELFDATA2LSB)
            throw Refused{"not a 64-bit little-endian ELF file"};
        if (eh.e_type != ET_DYN || eh.e_ehsize < sizeof(Elf64_Ehdr))
            throw Refused{"not an ELF shared library (its header says another kind of file)"};
        const std::set<std::string> defined = dynamic_symbols(f, sections_of(f, eh, loadable(f, eh)));
        std::string missing;
        for (const std::string &name : symbols)
            if (!defined.count(name)) missing += (missing.empty() ? "" : ", ") + name;
        if (!missing.empty()) throw Refused{"it lacks " + missing};
    } catch (const Refused &r) {
        return r.why;
    }
    return "";
}

}  // namespace pi
