// Runtime choice of the kernel set: the widest one the CPU runs, decided once.
#include <cstring>

#include "kernels/kernels.h"

namespace pi {

const KernelSet *kernels_named(const char *isa) {
    if (isa == nullptr) return &best_kernels();
    if (std::strcmp(isa, "scalar") == 0) return &scalar_kernels();
    if (std::strcmp(isa, "avx2") == 0) return avx2_kernels();
    if (std::strcmp(isa, "avx512") == 0) return avx512_kernels();
    return nullptr;
}

const KernelSet &best_kernels() {
    static const KernelSet *chosen = [] {
        if (const KernelSet *k = avx512_kernels()) return k;
        if (const KernelSet *k = avx2_kernels()) return k;
        return &scalar_kernels();
    }();
    return *chosen;
}

}  // namespace pi
