// The tensor-core layout of MXFP4 expert weights (MODEL.md §4) used by the MoE expert kernels
// (moe_experts.cu), in one place for the host packer (moe_pack.cpp), the kernels and the layout tests.
// Plain C++ (no CUDA headers); under nvcc every function is __host__ __device__.
//
// The kernels run mma.sync.m16n8k16 (BF16 in, FP32 accumulate) with the weights as the A operand ("swap
// AB": 16 weight rows = M, 8 tokens = N), so each lane needs, per k16 step, the A fragment of rows g and
// g+8 (g = lane/4) at four K positions chosen by t = lane%4. The layout stores exactly that, so one
// coalesced 16-byte load per lane brings a lane its fragments for four k16 steps (64 columns):
//
//   W [R, C] (R rows of outputs, C = K) is cut into row tiles of 16 (RT = R/16) and column chunks of 64
//   (NC = C/64). packed u8 [RT][NC][32 lanes][16 B], scale u8 [RT][NC][8 groups][4 B].
//   Lane l = 4g + t, 16 bytes = four 32-bit words; word s (0..3) is the A fragment of k16 step s, which
//   lies in e8m0 block b = s/2 of the chunk (columns 32b..32b+31): a K step never straddles two scales,
//   so a step's FP32 partial sum can be scaled exactly (acc += 2^(e-127)·partial).
//   Register j (0..3) of step s holds two elements (low half h = 0, high half h = 1) at
//     row    g + 8·(j & 1)                                 (mma A rows: a0,a1 row g; a2,a3 row g+8)
//     column 32·(s>>1) + 8t + 4·(s&1) + 2·(j>>1) + h       (within the chunk)
//   K is permuted inside each 32-column block: logical mma k (2t+h, 2t+8+h) ↔ physical column
//   8t + 4·(s&1) + {0,1} / {2,3}. The activations (mma B) use the same permutation, which makes each
//   lane's B data for one block 8 consecutive bf16 = one 16-byte load: word m of it is B register
//   (m & 1) of step 2b + (m >> 1).
//   Group g's scale word: byte i = scale of row g + 8·(i & 1), block 2c + (i >> 1).
//
// Nibble placement inside a word (the decode trick). An E2M1 code s·e1·e0·m becomes a BF16 by putting
// e1·e0·m at bits 6..8 and s at bit 15 (exponent field e1e0, mantissa msb m) and multiplying by 2^126:
// for e ≥ 1 that is 2^(e-1)·(1 + m/2); for e = 0 (codes ±0 and ±0.5) the BF16 is subnormal, 2^-126·m/2,
// and the product is m/2 — exact, provided the BF16 multiply keeps subnormal inputs, as PTX half-precision
// arithmetic does by default (GpuMoe.MatmulEveryCodeAndScale checks all 16 codes on the GPU; building with
// KESTREL_MOE_INTEGER_DECODE swaps in an exact integer decode, ≈ 3× the instructions, if it ever fails).
// Each register's two halves are filled from one word by at most two shifts and two masks; the 8 elements
// of a word are placed so that two registers need one shift and one mask (magnitude and sign already 9 bits
// apart; no translate of that pattern tiles 16 bits four times) and two need two shifts and two masks:
//   register j: magnitude at bit kMagPos[j] (+16 for h = 1), sign at bit kSignPos[j] (+16 for h = 1).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define KMOE_HD __host__ __device__ __forceinline__
#else
#define KMOE_HD inline
#endif

namespace kestrel::cuda::moe_layout {

inline constexpr int kTileRows = 16;     // rows of one mma A tile
inline constexpr int kChunkCols = 64;    // columns per 16-byte lane load
inline constexpr int kTileChunkBytes = 512;  // 32 lanes × 16 B
inline constexpr int kTileChunkScaleBytes = 32;  // 8 groups × 4 B
inline constexpr uint32_t kBf16x2Pow126 = 0x7E807E80u;  // bf16 pair (2^126, 2^126)

inline constexpr int kMagPos[4] = {6, 3, 0, 9};
inline constexpr int kSignPos[4] = {15, 12, 13, 14};

// Row (within the 16-row tile) and column (within the 64-column chunk) of half h of A register j of
// k16 step s for the lane with g = lane/4, t = lane%4.
KMOE_HD constexpr int frag_row(int g, int j) { return g + 8 * (j & 1); }
KMOE_HD constexpr int frag_col(int t, int s, int j, int h) {
  return 32 * (s >> 1) + 8 * t + 4 * (s & 1) + 2 * (j >> 1) + h;
}

// The BF16 pair of A register j before the 2^126 multiply: magnitude bits at 6..8 / 22..24, signs at 15 / 31.
KMOE_HD uint32_t e2m1_pair_bits(uint32_t w, int j) {
  switch (j) {
    case 0:
      return w & 0x81C081C0u;
    case 1:
      return (w << 3) & 0x81C081C0u;
    case 2:
      return ((w << 6) & 0x01C001C0u) | ((w << 2) & 0x80008000u);
    default:
      return ((w >> 3) & 0x01C001C0u) | ((w << 1) & 0x80008000u);
  }
}

// The same pair after the 2^126 multiply, by integer operations only (no subnormal BF16 is ever formed):
// magnitude v ≥ 2 → (v << 6) + 0x3F00, v = 1 (0.5) → 0x3F00, v = 0 → 0; sign kept. The kernels use it when
// built with KESTREL_MOE_INTEGER_DECODE (for a GPU whose BF16 multiply flushed subnormal inputs).
KMOE_HD uint32_t e2m1_pair_bf16_exact(uint32_t r) {
  uint32_t o = r & 0x80008000u;
  for (int h = 0; h < 2; ++h) {
    const uint32_t v = (r >> (6 + 16 * h)) & 7u;
    o |= (v >= 2 ? (v << 6) + 0x3F00u : (v == 1 ? 0x3F00u : 0u)) << (16 * h);
  }
  return o;
}

// FP32 bit pattern of e8m0 scale byte i of a group word, for codes 1..254 (2^(e-127)); 0 gives 0.0 and
// 255 gives +inf here — `special` (some code is 0 or 255) fixes them to 2^-127 and NaN.
template <bool special>
KMOE_HD uint32_t e8m0_f32_bits(uint32_t word, int i) {
  uint32_t b = (i == 3 ? (word >> 1) : (word << (23 - 8 * i))) & 0x7F800000u;
  if (special && ((b + 0x00800000u) & 0x7F000000u) == 0) b |= 0x00400000u;  // 0 → 2^-127, 0x7F800000 → NaN
  return b;
}

// Upper bound on the number of (expert, token chunk) jobs for n routed slots over X experts with at most
// ct tokens per chunk: Σ_e ⌈n_e/ct⌉ ≤ (experts hit) + ⌊n/ct⌋, and every job holds at least one slot.
KMOE_HD constexpr int64_t job_bound(int64_t n, int64_t X, int64_t ct) {
  const int64_t hit = n < X ? n : X;
  const int64_t b = hit + n / ct;
  return b < n ? b : n;
}

}  // namespace kestrel::cuda::moe_layout
