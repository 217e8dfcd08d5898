// AVX-512 VNNI kernels (AVX-512 F/BW/VL + VNNI, with AVX2/FMA/F16C): the x86 bodies of kernels_x86.inc
// with integer dot products through dpbusd on 256-bit registers (VL encoding). On CPUs that split
// 512-bit operations in two (AMD Zen 4), 256-bit vectors give the same arithmetic throughput with
// fewer shuffles; what VNNI buys is fewer instructions per block (no madd, no sign work for q4_0).
// Results are bit-identical to the AVX2 set.
#include "kernels/kernels.h"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/packed.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define PI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace pi {
namespace {

#define PI_VNNI 1
#define PI_AVX512 1
#include "kernels/kernels_x86.inc"

const KernelSet kAvx512 = x86_kernel_set("avx512");

}  // namespace

const KernelSet *avx512_kernels() {
    static const KernelSet *const set = [] {  // decided once, as the AVX2 set
        __builtin_cpu_init();  // the AVX2 set's check covers AVX2, FMA and F16C
        return avx2_kernels() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")
                   ? &kAvx512
                   : nullptr;
    }();
    return set;
}

}  // namespace pi

#else

namespace pi {
const KernelSet *avx512_kernels() { return nullptr; }
}  // namespace pi

#endif
