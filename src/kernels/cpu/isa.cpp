// See isa.h.
#include "kernels/cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace kestrel::cpu {
namespace {

Isa env_cap() {
  const char* e = std::getenv("KESTREL_CPU_ISA");
  if (!e) return Isa::avx512bf16;
  if (std::strcmp(e, "portable") == 0) return Isa::portable;
  if (std::strcmp(e, "avx2") == 0) return Isa::avx2;
  return Isa::avx512bf16;
}

std::atomic<int> g_cap{-1};

}  // namespace

Isa detected_isa() {
  static const Isa d = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!avx2) return Isa::portable;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"))
      return Isa::avx512bf16;
    return Isa::avx2;
  }();
  return d;
}

Isa isa() {
  int cap = g_cap.load(std::memory_order_relaxed);
  if (cap < 0) {
    cap = int(env_cap());
    g_cap.store(cap, std::memory_order_relaxed);
  }
  const Isa d = detected_isa();
  return int(d) < cap ? d : Isa(cap);
}

void force_isa(Isa cap) { g_cap.store(int(cap), std::memory_order_relaxed); }

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::avx512bf16: return "avx512bf16";
  }
  return "?";
}

}  // namespace kestrel::cpu
