// Which SIMD kernels the CPU ops run, chosen once at run time from what the CPU reports
// (__builtin_cpu_supports, which also checks that the OS saves the wider registers), so one binary
// runs everywhere and uses AVX-512 BF16 where it exists.
//
//   avx512bf16  bf16 GEMMs and the MXFP4 expert products through vdpbf16ps (AVX-512 BF16), the MLA
//               latent attention in AVX-512 FP32 (mla_avx512.cpp), RMSNorm's sums of squares eight
//               rows at a time (bit-identical); everything else as avx2
//   avx2        AVX2 + FMA kernels (this project's baseline for speed)
//   portable    scalar twins: the avx2 kernels' exact summation order, one element at a time
//
// The avx2 and portable paths give bit-identical results (tests/unit/test_kernels_cpu.cpp checks);
// the avx512bf16 kernels sum in other orders (pairs inside vdpbf16ps, 16 lanes), so their results
// differ from the others in the last bits but are just as row- and batch-invariant.
#pragma once

namespace kestrel::cpu {

enum class Isa { portable = 0, avx2 = 1, avx512bf16 = 2 };

// The best ISA this CPU supports, capped by force_isa() and the environment variable
// KESTREL_CPU_ISA (portable | avx2 | avx512bf16) read once at first use.
Isa isa();
Isa detected_isa();  // what the CPU supports, ignoring any cap
const char* isa_name(Isa i);
// Caps the ISA for the whole process (tests compare the paths); a cap above the CPU's is ignored.
void force_isa(Isa cap);

}  // namespace kestrel::cpu

// Function attributes for the SIMD kernels: each kernel function carries its ISA, so the rest of the
// binary stays at the baseline ISA (no whole-file -mavx2 that could leak into shared inline code).
#define KESTREL_AVX2 __attribute__((target("avx2,fma")))
#define KESTREL_AVX512BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))
