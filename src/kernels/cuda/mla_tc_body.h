// The body of the tensor-core MLA attention kernel (design in mla_tc.cu's header), written against a small
// set of warp primitives so that one text compiles twice:
//  - by nvcc in mla_tc.cu, where the primitives are mma.sync / ldmatrix / cp.async / shuffles;
//  - by g++ in tests/unit/test_mla_tc_emulated.cpp, where they are emulated on the CPU from the PTX ISA's
//    fragment definitions (one std::thread per CUDA thread, barriers for the warp- and block-level
//    synchronisation), so CI runs the kernel's index arithmetic, masking, pipeline and softmax logic
//    against the CPU twin without a GPU.
// Include this only after defining KTC_NS (the namespace kestrel::cuda::KTC_NS the body lands in: tc for the
// GPU, tc_emu for the emulator) and declaring these primitives in that namespace:
//   KTC_DEV                                   function qualifier (__device__ __forceinline__ / inline)
//   KTC_UNROLL                                loop-unroll hint (_Pragma("unroll") / empty)
//   float2, float4, uint2, uint4, make_float2, make_float4, __uint_as_float
//   sync_block(); shfl(int v, int src_lane); shfl_xor(float v, int mask); warp_min(int v);
//   smem_atomic_min(int* p, int v); ldg(const T* p)
//   smem_u32(const void* p) → u32 shared address; cp_async16(u32 dst, const void* src, int src_bytes);
//   cp_async4(...); cp_commit(); cp_wait<N>();
//   ldsm_x4(u32 addr, r0, r1, r2, r3); ldsm_x4_t(...);   (ldmatrix .x4 / .x4.trans, b16)
//   mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)  (m16n8k16 bf16, f32 accum)
//   pack_bf16(float lo, float hi) → u32; e4m3x2_to_bf16x2(uint32_t two_bytes, float scale) → u32
// No includes here on purpose (the emulator includes it inside its own set-up); <climits> and <cmath>
// must come first.

namespace kestrel::cuda::KTC_NS {

constexpr int kThreads = 256;  // 8 warps
constexpr int kStages = 3;     // cp.async pipeline depth

// Compile-time shape of one instantiation: C, R and the page format (FP8 or BF16).
template <int C_, int R_, bool FP8_>
struct Shape {
  static constexpr int C = C_, R = R_, CW = C + R;
  static constexpr bool FP8 = FP8_;
  static constexpr int NT = 64;                       // keys per tile
  static constexpr int KS = CW / 16;                  // k16 steps over [ĉ | k_pe]
  static constexpr int KS0 = (KS + 1) / 2;            // steps of K-half 0 (half 1 has KS − KS0)
  static constexpr int CH = CW / 8;                   // 16-byte chunks per bf16 row
  static constexpr bool SWZ = CH % 8 == 0;            // XOR swizzle, else one pad chunk per row
  static constexpr int ROWB = SWZ ? CW * 2 : CW * 2 + 16;
  static constexpr int TILE_BYTES = NT * ROWB;
  static constexpr int NCOL = C / 8;                  // ô columns per warp
  static constexpr int NJ = NCOL / 8;                 // n8 tiles per warp in P·V
  static constexpr int G = (C + 127) / 128;           // FP8 scale groups
  static constexpr int ROPE_OFF = C + 4 * G;          // FP8: byte offset of k_pe in a token
  static constexpr int TB = FP8 ? C + 4 * G + 2 * R : 2 * CW;  // pool bytes per token
  static constexpr int RAWB = (TB + 15) / 16 * 16;    // FP8 raw stage row stride
  static constexpr int CPB = (TB % 16 == 0) ? 16 : 4; // bytes per cp.async
  static constexpr int NCP = TB / CPB;                // cp.async per token
  static constexpr int STAGE_BYTES = FP8 ? NT * RAWB : TILE_BYTES;
  static constexpr int S_BYTES = 2 * 4 * 2 * 32 * 16; // partial scores: [half][key16][n8][lane] float4
  static constexpr int SMEM = kStages * STAGE_BYTES + (FP8 ? TILE_BYTES : 0) + S_BYTES;

  static_assert(CW % 16 == 0 && C % 64 == 0 && R % 8 == 0, "C multiple of 64, C+R multiple of 16");
  static_assert(KS - KS0 > 0, "both K-halves non-empty");
  static_assert(SWZ || (ROWB / 16) % 2 == 1, "padded rows must be an odd number of 16-byte chunks");
  static_assert(TB % 4 == 0 && ROPE_OFF % 4 == 0, "token bytes");
  static_assert(SMEM <= 227 * 1024, "shared memory per CTA");

  // Byte offset of 16-byte chunk c of tile row r.
  KTC_DEV static int off(int r, int c) { return r * ROWB + (SWZ ? (c ^ (r & 7)) : c) * 16; }
};

struct Params {
  const uint8_t* arena;      // u8 [pool rows, TB]
  const int32_t* bt;         // i32 [rows of tables, bt_stride]
  int64_t bt_stride;
  const int32_t* req;        // i32 [B] or null
  const int32_t* lens;       // i32 [B] (dense)
  const int32_t* sel;        // i32 [B, Ksel] or null
  int64_t Ksel;
  const float* qt;           // f32 [B, Hm, C]
  const uint16_t* q;         // bf16 [B, Hm, N+R]
  float* part_ml;            // f32 [B, n_splits, Hm, 2]
  float* part_acc;           // f32 [B, n_splits, Hm, C]
  uint16_t* ohat;            // bf16 [B, Hm, C] or null
  float sl2;                 // (N+R)^−½ · log2(e)
  int P, B, Hm, N, n_splits, chunk;
  bool longest_first;
};

KTC_DEV float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
KTC_DEV float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// One CTA: row blockIdx.x (or B−1−blockIdx.x), key split blockIdx.y; tid = threadIdx.x; smem: SMEM bytes.
template <int C, int R, bool FP8>
KTC_DEV void mla_tc_body(const Params& p, uint8_t* smem, const int tid, const int bx, const int by) {
  using S = Shape<C, R, FP8>;
  constexpr int NT = S::NT;
  uint8_t* const stages = smem;                                    // [kStages][STAGE_BYTES]
  uint8_t* const tile16 = smem + kStages * S::STAGE_BYTES;         // FP8: the dequantised bf16 tile
  float4* const sS = reinterpret_cast<float4*>(smem + kStages * S::STAGE_BYTES + (FP8 ? S::TILE_BYTES : 0));

  const int lane = tid & 31, w = tid >> 5, g = lane >> 2, qd = lane & 3;
  const int b = p.longest_first ? p.B - 1 - bx : bx;
  const int split = by;
  const int Hm = p.Hm;

  // ---- the row's key list: positions 0..lens[b]−1, or sel[b, 0..nk) with nk = index of the first −1 ----
  const int32_t* sel_row = p.sel ? p.sel + int64_t(b) * p.Ksel : nullptr;
  int nk;
  if (sel_row) {
    int* s_first = reinterpret_cast<int*>(sS);
    if (tid == 0) *s_first = int(p.Ksel);
    sync_block();
    int first = INT_MAX;
    for (int i = tid; i < int(p.Ksel); i += kThreads) first = min(first, ldg(sel_row + i) < 0 ? i : INT_MAX);
    first = warp_min(first);
    if (lane == 0 && first != INT_MAX) smem_atomic_min(s_first, first);
    sync_block();
    nk = *s_first;
    sync_block();  // sS is overwritten by the first tile
  } else {
    nk = ldg(p.lens + b);
  }
  const int begin = split * p.chunk, end = min(nk, begin + p.chunk);
  if (begin >= end) {  // nothing to attend in this split (uniform over the block)
    if (p.ohat) {
      for (int i = tid; i < Hm * C; i += kThreads) p.ohat[int64_t(b) * Hm * C + i] = 0;
    } else if (tid < Hm) {
      float* ml = p.part_ml + ((int64_t(b) * p.n_splits + split) * Hm + tid) * 2;
      ml[0] = -INFINITY, ml[1] = 0.0f;
    }
    return;
  }
  const int ntiles = (end - begin + NT - 1) / NT;
  const int32_t* table = p.bt + int64_t(p.req ? ldg(p.req + b) : b) * p.bt_stride;

  // ---- producer: warp w copies tile rows w + 8i (i < 8); lane tracks row i = lane & 7 ----------------------
  auto pos_of = [&](int u) -> int {  // position of this lane's row in tile u, −1 past the key list
    const int k = begin + u * NT + w + 8 * (lane & 7);
    if (k >= end) return -1;
    return sel_row ? ldg(sel_row + k) : k;
  };
  auto prow_of = [&](int pos) -> int {  // pool row (page·P + slot) of a position, −1 for none
    if (pos < 0) return -1;
    const int pg = ldg(table + pos / p.P);
    return pg < 0 ? -1 : pg * p.P + pos % p.P;
  };
  auto issue = [&](int u, int prow) {  // cp.async of tile u into stage u % kStages, then commit
    if (u < ntiles) {
      uint8_t* st = stages + (u % kStages) * S::STAGE_BYTES;
      constexpr int OPS = 8 * S::NCP;
KTC_UNROLL
      for (int j = 0; j < (OPS + 31) / 32; ++j) {
        const int idx = lane + 32 * j, i = idx / S::NCP, c = idx % S::NCP;
        const int pr = shfl(prow, i & 7);
        if (idx < OPS) {
          const int r = w + 8 * i;
          const uint8_t* src = p.arena + (pr >= 0 ? int64_t(pr) * S::TB + c * S::CPB : 0);
          const int n = pr >= 0 ? S::CPB : 0;
          if constexpr (!FP8)
            cp_async16(smem_u32(st + S::off(r, c)), src, n);
          else if constexpr (S::CPB == 16)
            cp_async16(smem_u32(st + r * S::RAWB + c * 16), src, n);
          else
            cp_async4(smem_u32(st + r * S::RAWB + c * 4), src, n);
        }
      }
    }
    cp_commit();
  };

  // Prologue: tiles 0..kStages−2 in flight, the pool row of tile kStages−1 and the position of tile kStages
  // in registers.
KTC_UNROLL
  for (int u = 0; u < kStages - 1; ++u) issue(u, prow_of(pos_of(u)));
  int prow_next = prow_of(pos_of(kStages - 1));
  int pos_next = pos_of(kStages);

  // ---- this warp's half of Q as A fragments (bf16), zero rows for heads ≥ Hm -------------------------------
  const int ks = w & 1, nb = w >> 1;
  uint32_t qa[S::KS0][4];
KTC_UNROLL
  for (int i = 0; i < S::KS0; ++i) {
    const int kk = ks * S::KS0 + i;
KTC_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int h = g + 8 * (r & 1), k = kk * 16 + 2 * qd + 8 * (r >> 1);
      uint32_t v = 0;
      if (kk < S::KS && h < Hm) {
        const int64_t row = int64_t(b) * Hm + h;
        if (k < C) {
          const float2 f = ldg(reinterpret_cast<const float2*>(p.qt + row * C + k));
          v = pack_bf16(f.x, f.y);
        } else {
          v = ldg(reinterpret_cast<const uint32_t*>(p.q + row * (p.N + R) + p.N + (k - C)));
        }
      }
      qa[i][r] = v;
    }
  }

  float o[S::NJ][4];
KTC_UNROLL
  for (int j = 0; j < S::NJ; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  for (int t = 0; t < ntiles; ++t) {
    cp_wait<kStages - 2>();
    sync_block();  // tile t landed for everyone; everyone is done with tile t−1 and the score buffer
    issue(t + kStages - 1, prow_next);
    prow_next = prow_of(pos_next);
    pos_next = pos_of(t + kStages + 1);

    const uint8_t* tl = stages + (t % kStages) * S::STAGE_BYTES;
    if constexpr (FP8) {
      // Dequantise: units of 8 ĉ values (8 B raw → one 16-byte bf16 chunk), then k_pe as it is. A thread
      // keeps its unit column cu and steps over rows (kThreads is a multiple of the units per row).
      constexpr int UPR = C / 8, RPP = kThreads / UPR;  // units per row, rows per pass
      static_assert(kThreads % UPR == 0, "units per row divide the block");
      const int cu = tid % UPR;
      for (int r = tid / UPR; r < NT; r += RPP) {
        const uint8_t* rr = tl + r * S::RAWB;
        const uint2 v = *reinterpret_cast<const uint2*>(rr + cu * 8);
        const float s = *reinterpret_cast<const float*>(rr + C + (cu / 16) * 4);
        uint4 out;
        out.x = e4m3x2_to_bf16x2(v.x & 0xffffu, s);
        out.y = e4m3x2_to_bf16x2(v.x >> 16, s);
        out.z = e4m3x2_to_bf16x2(v.y & 0xffffu, s);
        out.w = e4m3x2_to_bf16x2(v.y >> 16, s);
        *reinterpret_cast<uint4*>(tile16 + S::off(r, cu)) = out;
      }
      if constexpr (S::ROPE_OFF % 16 == 0) {
        constexpr int RPR = R / 8;  // 16-byte chunks of k_pe per row
        static_assert(kThreads % RPR == 0, "chunks per row divide the block");
        const int cu = tid % RPR;
        for (int r = tid / RPR; r < NT; r += kThreads / RPR)
          *reinterpret_cast<uint4*>(tile16 + S::off(r, C / 8 + cu)) =
              *reinterpret_cast<const uint4*>(tl + r * S::RAWB + S::ROPE_OFF + cu * 16);
      } else {
        constexpr int RPR = R / 2;  // 4-byte words of k_pe per row
        static_assert(kThreads % RPR == 0, "words per row divide the block");
        const int cu = tid % RPR, byte = 2 * C + 4 * cu;
        for (int r = tid / RPR; r < NT; r += kThreads / RPR)
          *reinterpret_cast<uint32_t*>(tile16 + S::off(r, byte / 16) + byte % 16) =
              *reinterpret_cast<const uint32_t*>(tl + r * S::RAWB + S::ROPE_OFF + cu * 4);
      }
      sync_block();
      tl = tile16;
    }
    const uint32_t tl_s = smem_u32(tl);

    // ---- partial scores: keys [16·nb, +16) × this warp's K-half --------------------------------------------
    float sacc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
KTC_UNROLL
    for (int i = 0; i < S::KS0; ++i) {
      const int kk = ks * S::KS0 + i;
      if (kk < S::KS) {
        // Matrices: (keys +0..7, k lo), (keys +0..7, k hi), (keys +8..15, k lo), (keys +8..15, k hi).
        const int r = nb * 16 + ((lane >> 4) << 3) + (lane & 7), c = 2 * kk + ((lane >> 3) & 1);
        uint32_t b0, b1, b2, b3;
        ldsm_x4(tl_s + S::off(r, c), b0, b1, b2, b3);
        mma(sacc[0], qa[i], b0, b1);
        mma(sacc[1], qa[i], b2, b3);
      }
    }
    sS[((ks * 4 + nb) * 2 + 0) * 32 + lane] = make_float4(sacc[0][0], sacc[0][1], sacc[0][2], sacc[0][3]);
    sS[((ks * 4 + nb) * 2 + 1) * 32 + lane] = make_float4(sacc[1][0], sacc[1][1], sacc[1][2], sacc[1][3]);
    sync_block();

    // ---- online softmax over the 64 keys (every warp, identically), P as A fragments ---------------------------
    float x[4][2][4];
    const int kbase = begin + t * NT + 2 * qd;
KTC_UNROLL
    for (int kb = 0; kb < 4; ++kb) {
KTC_UNROLL
      for (int j = 0; j < 2; ++j) {
        const float4 a = sS[((0 * 4 + kb) * 2 + j) * 32 + lane], c = sS[((1 * 4 + kb) * 2 + j) * 32 + lane];
        const int k = kbase + 16 * kb + 8 * j;  // key index of elements 0 and 2 (1 and 3: k + 1)
        x[kb][j][0] = k < end ? (a.x + c.x) * p.sl2 : -INFINITY;
        x[kb][j][1] = k + 1 < end ? (a.y + c.y) * p.sl2 : -INFINITY;
        x[kb][j][2] = k < end ? (a.z + c.z) * p.sl2 : -INFINITY;
        x[kb][j][3] = k + 1 < end ? (a.w + c.w) * p.sl2 : -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
KTC_UNROLL
    for (int kb = 0; kb < 4; ++kb)
KTC_UNROLL
      for (int j = 0; j < 2; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(x[kb][j][0], x[kb][j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(x[kb][j][2], x[kb][j][3]));
      }
    float base[2], alpha[2];
KTC_UNROLL
    for (int hr = 0; hr < 2; ++hr) {
      mx[hr] = fmaxf(mx[hr], shfl_xor(mx[hr], 1));
      mx[hr] = fmaxf(mx[hr], shfl_xor(mx[hr], 2));
      const float mn = fmaxf(m_run[hr], mx[hr]);
      base[hr] = mn == -INFINITY ? 0.0f : mn;  // no key yet: keep every exponent at −inf, never NaN
      alpha[hr] = exp2f(m_run[hr] - base[hr]);
      m_run[hr] = mn;
    }
    uint32_t pa[4][4];
    float ls[2] = {0.0f, 0.0f};
KTC_UNROLL
    for (int kb = 0; kb < 4; ++kb)
KTC_UNROLL
      for (int j = 0; j < 2; ++j) {
        const uint32_t u01 = pack_bf16(exp2f(x[kb][j][0] - base[0]), exp2f(x[kb][j][1] - base[0]));
        const uint32_t u23 = pack_bf16(exp2f(x[kb][j][2] - base[1]), exp2f(x[kb][j][3] - base[1]));
        pa[kb][2 * j] = u01;      // rows g,   keys 16kb + 8j + 2q, +1
        pa[kb][2 * j + 1] = u23;  // rows g+8
        ls[0] += bf16_lo(u01) + bf16_hi(u01);
        ls[1] += bf16_lo(u23) + bf16_hi(u23);
      }
    l_run[0] = l_run[0] * alpha[0] + ls[0];
    l_run[1] = l_run[1] * alpha[1] + ls[1];
KTC_UNROLL
    for (int j = 0; j < S::NJ; ++j) {
      o[j][0] *= alpha[0], o[j][1] *= alpha[0];
      o[j][2] *= alpha[1], o[j][3] *= alpha[1];
    }

    // ---- ô[:, cols of warp w] += P · ĉ ---------------------------------------------------------------------
KTC_UNROLL
    for (int j = 0; j < S::NJ; ++j) {
      const int cc = w * S::NJ + j;  // 16-byte chunk = 8 ĉ columns
KTC_UNROLL
      for (int kp = 0; kp < 4; kp += 2) {
        // Matrices: keys 16kp + 0..7, +8..15, +16..23, +24..31 at columns 8cc..8cc+7, transposed.
        const int r = 16 * kp + lane;
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(tl_s + S::off(r, cc), b0, b1, b2, b3);
        mma(o[j], pa[kp], b0, b1);
        mma(o[j], pa[kp + 1], b2, b3);
      }
    }
  }
  cp_wait<0>();

  // ---- epilogue ------------------------------------------------------------------------------------------------
  float lf[2] = {l_run[0], l_run[1]};
KTC_UNROLL
  for (int hr = 0; hr < 2; ++hr) {
    lf[hr] += shfl_xor(lf[hr], 1);
    lf[hr] += shfl_xor(lf[hr], 2);
  }
  const int h0 = g, h1 = g + 8;
  if (p.ohat) {
    const float i0 = lf[0] > 0.0f ? 1.0f / lf[0] : 0.0f, i1 = lf[1] > 0.0f ? 1.0f / lf[1] : 0.0f;
    uint16_t* out = p.ohat + int64_t(b) * Hm * C;
KTC_UNROLL
    for (int j = 0; j < S::NJ; ++j) {
      const int col = w * S::NCOL + 8 * j + 2 * qd;
      if (h0 < Hm) *reinterpret_cast<uint32_t*>(out + h0 * C + col) = pack_bf16(o[j][0] * i0, o[j][1] * i0);
      if (h1 < Hm) *reinterpret_cast<uint32_t*>(out + h1 * C + col) = pack_bf16(o[j][2] * i1, o[j][3] * i1);
    }
  } else {
    const int64_t base_row = (int64_t(b) * p.n_splits + split) * Hm;
    float* acc = p.part_acc + base_row * C;
KTC_UNROLL
    for (int j = 0; j < S::NJ; ++j) {
      const int col = w * S::NCOL + 8 * j + 2 * qd;
      if (h0 < Hm) *reinterpret_cast<float2*>(acc + h0 * C + col) = make_float2(o[j][0], o[j][1]);
      if (h1 < Hm) *reinterpret_cast<float2*>(acc + h1 * C + col) = make_float2(o[j][2], o[j][3]);
    }
    if (w == 0 && qd == 0) {
      if (h0 < Hm) p.part_ml[(base_row + h0) * 2] = m_run[0], p.part_ml[(base_row + h0) * 2 + 1] = lf[0];
      if (h1 < Hm) p.part_ml[(base_row + h1) * 2] = m_run[1], p.part_ml[(base_row + h1) * 2 + 1] = lf[1];
    }
  }
}

}  // namespace kestrel::cuda::KTC_NS
