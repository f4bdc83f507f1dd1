// The CPU a benchmark ran on, for its first lines: machines differ (AVX2 on some, AVX-512 or
// AMX on others), so every bench prints it beside its figures.
#pragma once

#include <fstream>
#include <string>

namespace ucp::cli {

/// /proc/cpuinfo's "model name" and the SIMD flags that matter, e.g. "AMD EPYC (avx2 fma
/// avx512f)"; "unknown CPU" where the file has none.
inline std::string CpuDescription() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, name = "unknown CPU", flags;
  while (std::getline(f, line)) {
    if (name == "unknown CPU" && line.rfind("model name", 0) == 0) {
      name = line.substr(line.find(':') + 2);
    }
    if (flags.empty() && line.rfind("flags", 0) == 0) flags = line + " ";
  }
  std::string simd;
  for (const char* fl : {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"}) {
    // (Whole words: " avx512f" alone would also match avx512fp16.)
    if (flags.find(std::string(" ") + fl + " ") != std::string::npos) {
      simd += (simd.empty() ? "" : " ") + std::string(fl);
    }
  }
  return name + " (" + (simd.empty() ? "no AVX2" : simd) + ")";
}

}  // namespace ucp::cli
