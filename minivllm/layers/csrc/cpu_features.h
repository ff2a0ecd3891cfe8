// What the CPU our kernels run on can do, probed once for every kernel of the library.
#pragma once

#include <ATen/Version.h>
#include <cpuid.h>
#include <cstdlib>
#include <string_view>
#include <sys/syscall.h>
#include <unistd.h>

namespace minivllm {

// Whether the AVX-512 VNNI paths run here: the CPU has AVX-512 VNNI and torch runs its
// AVX-512 kernels (ATEN_CPU_CAPABILITY=avx2 keeps the AVX2 paths, so one machine tests both).
inline bool vnni_runs() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni") &&
                         at::get_cpu_capability() == "AVX512";
  return ok;
}

// Whether the AMX int8 paths run here: the VNNI paths do, the CPU has AMX tiles with int8
// products, and the operating system lends this process the tile registers (Linux lends them
// on request: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per process).
inline bool amx_runs() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const char* off = std::getenv("MINIVLLM_NO_AMX");  // A/B timings: the VNNI paths
    if (off != nullptr && *off != '\0' && std::string_view(off) != "0") return false;
    if (!vnni_runs() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (((d >> 24) & 1) == 0 || ((d >> 25) & 1) == 0) return false;  // AMX-TILE, AMX-INT8
#ifdef SYS_arch_prctl
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

}  // namespace minivllm
