// What the CPU our kernels run on can do, probed once for every kernel of the library.
#pragma once

#include <ATen/Version.h>

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

}  // namespace minivllm
