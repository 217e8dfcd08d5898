// AVX2 + FMA + F16C kernels. Compiled with per-function target attributes so that the rest of the
// library stays portable; only called after the CPU has been checked (kernels_dispatch.cpp).
#include "kernels/kernels.h"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/packed.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

#define PI_TARGET __attribute__((target("avx2,fma,f16c")))

namespace pi {
namespace {

#define PI_VNNI 0
#define PI_AVX512 0
#include "kernels/kernels_x86.inc"

const KernelSet kAvx2 = x86_kernel_set("avx2");

}  // namespace

const KernelSet *avx2_kernels() {
    // decided once: CPUID traps to the hypervisor in a virtual machine (tens of microseconds a call)
    static const KernelSet *const set = [] {
        __builtin_cpu_init();
        // F16C through CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c ? &kAvx2 : nullptr;
    }();
    return set;
}

}  // namespace pi

#else

namespace pi {
const KernelSet *avx2_kernels() { return nullptr; }
}  // namespace pi

#endif
