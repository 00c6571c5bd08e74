// The body of the tensor-core MLA attention kernel (design in mla_tc.cu's header), written against a small
// set of warp primitives so that one text compiles twice:
//  - by nvcc in mla_tc.cu, where the primitives are mma.sync / ldmatrix / cp.async / shuffles;
//  - by g++ in tests/unit/test_mla_tc_emulated.cpp, where they are emulated on the CPU from the PTX ISA's
//    fragment definitions (one fiber per CUDA thread, barriers for the warp- and block-level
//    synchronisation), so CI runs the kernel's index arithmetic, masking, pipeline and softmax logic
//    against the CPU twin without a GPU.
// Include this only after defining KTC_NS (the namespace kestrel::cuda::KTC_NS the body lands in: tc for the
// GPU, tc_emu for the emulator) and declaring these primitives in that namespace:
//   KTC_DEV                                   function qualifier (__device__ __forceinline__ / inline)
//   KTC_UNROLL                                loop-unroll hint (_Pragma("unroll") / empty)
//   float2, float4, uint2, uint4, make_float2, make_float4, __uint_as_float, __float_as_uint, min, max
//   sync_block(); shfl(int v, int src_lane); shfl_xor(float v, int mask); warp_min(int v);
//   smem_atomic_min(int* p, int v); ldg(const T* p)
//   smem_u32(const void* p) → u32 shared address; cp_async16(u32 dst, const void* src, int src_bytes);
//   cp_async4(...); cp_commit(); cp_wait<N>();
//   ldsm_x4(u32 addr, r0, r1, r2, r3); ldsm_x4_t(...);   (ldmatrix .x4 / .x4.trans, b16)
//   mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)  (m16n8k16 bf16, f32 accum)
//   mma_f16(...)                              the same with f16 operands
//   pack_bf16(float lo, float hi) → u32; pack_f16(float lo, float hi) → u32   (RNE, lo in the low half)
//   e4m3x2_lo_to_f16x2(u32 v), e4m3x2_hi_to_f16x2(u32 v) → u32  (bytes 0, 1 / 2, 3 of v; exact; the lower
//                                             byte → the low half)
//   hmul2_bf16(u32 a, u32 b) → u32            (bf16x2 product, RNE; subnormal inputs kept)
//   warp_max(int v); smem_atomic_max(int* p, int v); warp_any(bool)
// No includes here on purpose (the emulator includes it inside its own set-up); <climits> and <cmath>
// must come first.

namespace kestrel::cuda::KTC_NS {

constexpr int kThreads = 256;  // 8 warps
constexpr int kMaxHeadsQ = 16; // heads per row, at most (the MMA's M side)
template <int V>
struct IntC {  // a compile-time int passed to a generic lambda
  static constexpr int value = V;
};

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
  static constexpr int STAGES = FP8 ? 4 : 3;         // cp.async pipeline depth (tiles)
  static constexpr int G = (C + 127) / 128;           // FP8 scale groups
  static constexpr int ROPE_OFF = C + 4 * G;          // FP8: byte offset of k_pe in a token
  static constexpr int TB = FP8 ? C + 4 * G + 2 * R : 2 * CW;  // pool bytes per token
  // FP8 tokens stay raw in shared memory, one row each: [ĉ e4m3 (C) | scales f32 (4G) | pad | k_pe bf16 (2R)
  // at KPE_S, 16-byte aligned for ldmatrix | pad], an odd number of 16-byte chunks (conflict-free ldmatrix).
  static constexpr int KPE_S = (ROPE_OFF + 15) / 16 * 16;
  static constexpr int RAWB0 = (KPE_S + 2 * R + 15) / 16 * 16;
  static constexpr int RAWB = (RAWB0 / 16) % 2 == 1 ? RAWB0 : RAWB0 + 16;
  static constexpr int CPB = (TB % 16 == 0 && (!FP8 || ROPE_OFF % 16 == 0)) ? 16 : 4;  // bytes per cp.async
  static constexpr int NCP = TB / CPB;                // cp.async per token
  static constexpr int STAGE_BYTES = FP8 ? NT * RAWB : TILE_BYTES;
  static constexpr int S_BYTES = 2 * 4 * 2 * 32 * 16; // partial scores: [half][key16][n8][lane] float4
  static constexpr int MUL_BYTES = FP8 ? G * NT * 2 : 0;  // FP8: P·V multipliers bf16 [G, NT]
  static constexpr int SMEM = STAGES * STAGE_BYTES + S_BYTES + MUL_BYTES;
  // FP8 split of the score's K: half ks takes ĉ chunks [ks·CS, (ks+1)·CS) (16 e4m3 = one k16 step each)
  // and k_pe steps [ks·PE0, min(RS, (ks+1)·PE0)); P·V: warp w < PVW owns NCW 16-byte ĉ chunks.
  static constexpr int CS = C / 32, RS = R / 16, PE0 = (RS + 1) / 2;
  static constexpr int NQ = FP8 ? CS + PE0 : KS0;     // A-fragment k16 steps per warp
  static constexpr int NCW = C >= 128 ? C / 128 : 1;
  static constexpr int PVW = FP8 ? (C / 16 < 8 ? C / 16 : 8) : 8;
  static constexpr int NO = FP8 ? 2 * NCW : NJ;       // n8 accumulator tiles of ô per warp

  static_assert(CW % 16 == 0 && C % 64 == 0 && R % 8 == 0, "C multiple of 64, C+R multiple of 16");
  static_assert(KS - KS0 > 0, "both K-halves non-empty");
  static_assert(SWZ || (ROWB / 16) % 2 == 1, "padded rows must be an odd number of 16-byte chunks");
  static_assert(TB % 4 == 0 && ROPE_OFF % 4 == 0, "token bytes");
  static_assert(!FP8 || (R % 16 == 0 && (C % 128 == 0 || C / 16 <= 8) && NCW * 16 <= 128),
                "FP8: k_pe in k16 steps; a warp's P·V chunks inside one scale group");
  static_assert(!FP8 || CPB == 4 || KPE_S == ROPE_OFF, "16-byte copies keep the token layout");
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

// FP8 P·V operands straight from the raw e4m3 bytes: after ldmatrix.trans of a raw tile (b16 units) a
// register holds [V(k, c), V(k, c+1), V(k+1, c), V(k+1, c+1)] (bytes, low first). even() places bytes 0 and 2
// (column c, keys k and k+1), odd() bytes 1 and 3 (column c+1), as bf16 bit patterns: sign to bit 15, the 7
// exponent+mantissa bits to bits 10..4. The bf16 value is then exactly e4m3 · 2^−120 (normal e4m3: exponent
// field e ≥ 1 reads as 2^(e−127)·1.m = 2^(e−7)·1.m · 2^−120; subnormal e = 0 as the bf16 subnormal
// 2^−126·0.m = 2^−6·0.m · 2^−120; zero as zero). The MMA keeps subnormal bf16 operands.
// Written as bit selects (one LOP3 each) between the shifted bytes and their sign bits sg = v & 0x80808080:
// outside the magnitude field 0x07f007f0 only bits 15 and 31 of sg (even: of sg << 8) can be set.
KTC_DEV uint32_t e4m3_sel(uint32_t mag, uint32_t sgn) { return (mag & 0x07f007f0u) | (sgn & ~0x07f007f0u); }
KTC_DEV uint32_t e4m3_even(uint32_t v, uint32_t sg) { return e4m3_sel(v << 4, sg << 8); }
KTC_DEV uint32_t e4m3_odd(uint32_t v, uint32_t sg) { return e4m3_sel(v >> 4, sg); }

// One CTA: row blockIdx.x (or B−1−blockIdx.x), key split blockIdx.y; tid = threadIdx.x; smem: SMEM bytes.
template <int C, int R, bool FP8>
KTC_DEV void mla_tc_body(const Params& p, uint8_t* smem, const int tid, const int bx, const int by) {
  using S = Shape<C, R, FP8>;
  constexpr int NT = S::NT, ST = S::STAGES;
  uint8_t* const stages = smem;                                        // [ST][STAGE_BYTES]
  float4* const sS = reinterpret_cast<float4*>(smem + ST * S::STAGE_BYTES);
  uint16_t* const mulT = reinterpret_cast<uint16_t*>(smem + ST * S::STAGE_BYTES + S::S_BYTES);  // FP8: bf16 [G, NT]

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
    for (int i0 = tid; i0 < int(p.Ksel); i0 += 4 * kThreads) {  // 4 independent loads per round trip
      int v[4];
KTC_UNROLL
      for (int j = 0; j < 4; ++j) v[j] = i0 + j * kThreads < int(p.Ksel) ? ldg(sel_row + i0 + j * kThreads) : 0;
KTC_UNROLL
      for (int j = 0; j < 4; ++j)
        if (v[j] < 0) first = min(first, i0 + j * kThreads);
    }
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
  // Both lookups load from a clamped, always valid address and select afterwards: no branch, so the
  // prologue's loads of several tiles are in flight together.
  auto pos_of = [&](int u) -> int {  // position of this lane's row in tile u, −1 past the key list
    const int k = begin + u * NT + w + 8 * (lane & 7);
    const int pos = sel_row ? ldg(sel_row + min(k, end - 1)) : k;
    return k < end ? pos : -1;
  };
  auto prow_of = [&](int pos) -> int {  // pool row (page·P + slot) of a position, −1 for none
    const int pg = ldg(table + max(pos, 0) / p.P);
    return pos < 0 || pg < 0 ? -1 : pg * p.P + pos % p.P;
  };
  auto issue = [&](int u, int prow) {  // cp.async of tile u into stage u % ST, then commit
    if (u < ntiles) {
      uint8_t* st = stages + (u % ST) * S::STAGE_BYTES;
      constexpr int OPS = 8 * S::NCP;
KTC_UNROLL
      for (int j = 0; j < (OPS + 31) / 32; ++j) {
        const int idx = lane + 32 * j, i = idx / S::NCP, c = idx % S::NCP;
        const int pr = shfl(prow, i & 7);
        if (idx < OPS) {
          const int r = w + 8 * i;
          const uint8_t* src = p.arena + (pr >= 0 ? int64_t(pr) * S::TB + c * S::CPB : 0);
          const int n = pr >= 0 ? S::CPB : 0;
          if constexpr (!FP8) {
            cp_async16(smem_u32(st + S::off(r, c)), src, n);
          } else if constexpr (S::CPB == 16) {
            cp_async16(smem_u32(st + r * S::RAWB + c * 16), src, n);
          } else {  // 4-byte words; k_pe moves to its aligned place KPE_S
            const int by4 = c * 4, dst = by4 < S::ROPE_OFF ? by4 : by4 - S::ROPE_OFF + S::KPE_S;
            cp_async4(smem_u32(st + r * S::RAWB + dst), src, n);
          }
        }
      }
    }
    cp_commit();
  };

  // Prologue: tiles 0..ST−2 in flight, the pool row of tile ST−1 and the position of tile ST in registers.
  // Positions first, then pages, then the copies: two rounds of loads, not one per tile.
  int pos0[ST + 1], prow0[ST];
KTC_UNROLL
  for (int u = 0; u <= ST; ++u) pos0[u] = pos_of(u);
KTC_UNROLL
  for (int u = 0; u < ST; ++u) prow0[u] = prow_of(pos0[u]);
KTC_UNROLL
  for (int u = 0; u < ST - 1; ++u) issue(u, prow0[u]);
  int prow_next = prow0[ST - 1];
  int pos_next = pos0[ST];

  // ---- this warp's half of Q as A fragments, zero rows for heads ≥ Hm -----------------------------------
  // Every load reads a valid address (rows clamped to Hm − 1, zeroed after) and nothing branches per
  // element, so the ~40–72 loads of a thread are in flight together (per-element branches made them one L2
  // round trip each: ~20 µs per CTA). The softmax scale log2(e)·(N+R)^−½ is applied to Q before rounding
  // (relative error unchanged), so the score accumulators hold log2-domain logits.
  const int ks = w & 1, nb = w >> 1;
  const int64_t row0 = int64_t(b) * Hm;
  const int hc0 = min(g, Hm - 1), hc1 = min(g + 8, Hm - 1);  // clamped rows g, g + 8
  const bool hv0 = g < Hm, hv1 = g + 8 < Hm;
  uint32_t qa[S::NQ][4];
  const float sl2 = p.sl2;
  float inv_sq = 1.0f;  // FP8: 2^−es, folded into the per-group scales
  if constexpr (!FP8) {
    // bf16 [q̃ | q_pe]·sl2, k in natural order; which steps are q̃ and which q_pe depends on the K-half, so
    // each half has its own (compile-time) code.
    auto load_half = [&](auto half) {
      constexpr int K0 = decltype(half)::value * S::KS0;
KTC_UNROLL
      for (int i = 0; i < S::KS0; ++i) {
        const int kk = K0 + i;
KTC_UNROLL
        for (int r = 0; r < 4; ++r) {
          const int hc = (r & 1) ? hc1 : hc0, k = kk * 16 + 2 * qd + 8 * (r >> 1);
          const bool hv = (r & 1) ? hv1 : hv0;
          uint32_t v = 0;
          if (kk < S::KS) {
            if (kk * 16 < C) {  // the whole k16 step is q̃ (C is a multiple of 64)
              const float2 f = ldg(reinterpret_cast<const float2*>(p.qt + (row0 + hc) * C + k));
              v = pack_bf16(f.x * sl2, f.y * sl2);
            } else {
              const uint32_t x = ldg(reinterpret_cast<const uint32_t*>(p.q + (row0 + hc) * (p.N + R) + p.N + (k - C)));
              v = pack_bf16(bf16_lo(x) * sl2, bf16_hi(x) * sl2);
            }
          }
          qa[i][r] = hv ? v : 0u;
        }
      }
    };
    if (ks == 0)
      load_half(IntC<0>{});
    else
      load_half(IntC<1>{});
  } else {
    // FP8: the ĉ part of the scores runs as an f16 MMA against the raw e4m3 keys (exact in f16): q̃·sl2 in
    // f16, scaled by 2^es so that the row's max lands in [2^14, 2^15) (relative rounding 2^−11); 2^−es goes
    // into the per-group scales that fold the ĉ partial sums into the scores. The k_pe part stays bf16.
    // First the row's max |q̃| (every thread a slice, loads in flight together, then the block).
    const float* qrow = p.qt + row0 * C;
    float amax = 0.0f;
KTC_UNROLL
    for (int j = 0; j < (kMaxHeadsQ * C) / (4 * kThreads); ++j) {
      const int i = 4 * (tid + j * kThreads);
      const float4 v = ldg(reinterpret_cast<const float4*>(qrow + min(i, Hm * C - 4)));
      if (i < Hm * C) amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    int* s_amax = reinterpret_cast<int*>(sS) + 1;  // [0] is the sparse rows' first −1 (done with by now)
    if (tid == 0) *s_amax = 0;
    sync_block();
    const int wmax = warp_max(int(__float_as_uint(amax)));  // non-negative floats order as their bits
    if (lane == 0) smem_atomic_max(s_amax, wmax);
    sync_block();
    const int ex = int((__float_as_uint(__uint_as_float(uint32_t(*s_amax)) * sl2) >> 23) & 0xffu) - 127;
    const int es = min(max(14 - ex, -64), 64);                   // amax·sl2 ∈ [2^ex, 2^(ex+1)) → ·2^es
    const float sq = sl2 * __uint_as_float(uint32_t(127 + es) << 23);  // sl2·2^es
    inv_sq = __uint_as_float(uint32_t(127 - es) << 23);
    // ĉ steps in the key operand's k order (see the score loop): slots 2q, 2q+1 ↔ columns 4q, 4q+1 and
    // slots 2q+8, 2q+9 ↔ columns 4q+2, 4q+3 of the 16-column chunk.
KTC_UNROLL
    for (int i = 0; i < S::CS; ++i) {
      const int kk = ks * S::CS + i;
      const float4 f0 = ldg(reinterpret_cast<const float4*>(qrow + hc0 * C + 16 * kk + 4 * qd));
      const float4 f1 = ldg(reinterpret_cast<const float4*>(qrow + hc1 * C + 16 * kk + 4 * qd));
      qa[i][0] = hv0 ? pack_f16(f0.x * sq, f0.y * sq) : 0u, qa[i][2] = hv0 ? pack_f16(f0.z * sq, f0.w * sq) : 0u;
      qa[i][1] = hv1 ? pack_f16(f1.x * sq, f1.y * sq) : 0u, qa[i][3] = hv1 ? pack_f16(f1.z * sq, f1.w * sq) : 0u;
    }
KTC_UNROLL
    for (int i = 0; i < S::PE0; ++i) {
      const int ps = ks * S::PE0 + i, psc = min(ps, S::RS - 1);  // half 1 may have fewer k_pe steps
KTC_UNROLL
      for (int r = 0; r < 4; ++r) {
        const int hc = (r & 1) ? hc1 : hc0, k = psc * 16 + 2 * qd + 8 * (r >> 1);
        const bool hv = (r & 1) ? hv1 : hv0;
        const uint32_t x = ldg(reinterpret_cast<const uint32_t*>(p.q + (row0 + hc) * (p.N + R) + p.N + k));
        qa[S::CS + i][r] = hv && ps < S::RS ? pack_bf16(bf16_lo(x) * sl2, bf16_hi(x) * sl2) : 0u;
      }
    }
  }

  float o[S::NO][4];
KTC_UNROLL
  for (int j = 0; j < S::NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  for (int t = 0; t < ntiles; ++t) {
    cp_wait<ST - 2>();
    sync_block();  // tile t landed for everyone; everyone is done with tile t−1, the scores and multipliers
    issue(t + ST - 1, prow_next);
    prow_next = prow_of(pos_next);
    pos_next = pos_of(t + ST + 1);

    const uint8_t* const tl = stages + (t % ST) * S::STAGE_BYTES;
    const uint32_t tl_s = smem_u32(tl);
    const int ldr = nb * 16 + ((lane >> 4) << 3) + (lane & 7);  // ldmatrix row of this lane (score keys)
    float sacc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};

    if constexpr (!FP8) {
      // ---- partial scores: keys [16·nb, +16) × this warp's K-half ------------------------------------------
KTC_UNROLL
      for (int i = 0; i < S::KS0; ++i) {
        const int kk = ks * S::KS0 + i;
        if (kk < S::KS) {
          // Matrices: (keys +0..7, k lo), (keys +0..7, k hi), (keys +8..15, k lo), (keys +8..15, k hi).
          uint32_t b0, b1, b2, b3;
          ldsm_x4(tl_s + S::off(ldr, 2 * kk + ((lane >> 3) & 1)), b0, b1, b2, b3);
          mma(sacc[0], qa[i], b0, b1);
          mma(sacc[1], qa[i], b2, b3);
        }
      }
    } else {
      // ---- FP8: the P·V multipliers of this tile, bf16(s·2^56) per (scale group, key); read after the barrier
KTC_UNROLL
      for (int i = 0; i < (S::G * NT + kThreads - 1) / kThreads; ++i) {
        const int e = tid + i * kThreads, key = e % NT, grp = e / NT;
        if ((S::G * NT) % kThreads != 0 && e >= S::G * NT) break;
        const uint32_t sb = *reinterpret_cast<const uint32_t*>(tl + key * S::RAWB + C + 4 * grp);
        const uint32_t m = (sb >> 16) + (56u << 7);  // s = 2^k exactly: its bf16 bits plus 56 in the exponent
        mulT[e] = uint16_t(sb == 0 ? 0u : (m >= 0x7f80u ? 0x7f80u : m));  // s > 2^71 (|ĉ| > 1e24): inf
      }
      // ---- partial scores: ĉ chunks of this half in pairs (x4 = keys 0..7 / 8..15 × chunks ch, ch+1), f16
      // MMA into per-group sums that the keys' scales then fold into sacc; k_pe as in the BF16 path.
      float tmp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
KTC_UNROLL
      for (int i = 0; i < S::CS / 2; ++i) {
        const int ch = ks * S::CS + 2 * i;
        uint32_t k0, k1, k2, k3;
        ldsm_x4(tl_s + ldr * S::RAWB + 16 * (ch + ((lane >> 3) & 1)), k0, k1, k2, k3);
        // A register holds e4m3 bytes 4q..4q+3 of its key's chunk: b0 = bytes 4q, 4q+1 (slots 2q, 2q+1),
        // b1 = bytes 4q+2, 4q+3 (slots 2q+8, 2q+9), the order qa was loaded in.
        mma_f16(tmp[0], qa[2 * i], e4m3x2_lo_to_f16x2(k0), e4m3x2_hi_to_f16x2(k0));
        mma_f16(tmp[1], qa[2 * i], e4m3x2_lo_to_f16x2(k2), e4m3x2_hi_to_f16x2(k2));
        mma_f16(tmp[0], qa[2 * i + 1], e4m3x2_lo_to_f16x2(k1), e4m3x2_hi_to_f16x2(k1));
        mma_f16(tmp[1], qa[2 * i + 1], e4m3x2_lo_to_f16x2(k3), e4m3x2_hi_to_f16x2(k3));
        if ((ch + 2) % 8 == 0 || i == S::CS / 2 - 1) {  // end of a 128-column scale group (or of the half)
          const int grp = ch / 8;
KTC_UNROLL
          for (int j = 0; j < 2; ++j) {
            const int key = nb * 16 + 8 * j + 2 * qd;  // C fragment: elements 0, 2 at key, 1, 3 at key + 1
            const float s0 = *reinterpret_cast<const float*>(tl + key * S::RAWB + C + 4 * grp) * inv_sq;
            const float s1 = *reinterpret_cast<const float*>(tl + (key + 1) * S::RAWB + C + 4 * grp) * inv_sq;
            sacc[j][0] += tmp[j][0] * s0, sacc[j][1] += tmp[j][1] * s1;
            sacc[j][2] += tmp[j][2] * s0, sacc[j][3] += tmp[j][3] * s1;
            tmp[j][0] = tmp[j][1] = tmp[j][2] = tmp[j][3] = 0.0f;
          }
        }
      }
KTC_UNROLL
      for (int i = 0; i < S::PE0; ++i) {
        const int ps = ks * S::PE0 + i;
        if (ps < S::RS) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(tl_s + ldr * S::RAWB + S::KPE_S + 32 * ps + 16 * ((lane >> 3) & 1), b0, b1, b2, b3);
          mma(sacc[0], qa[S::CS + i], b0, b1);
          mma(sacc[1], qa[S::CS + i], b2, b3);
        }
      }
    }
    sS[((ks * 4 + nb) * 2 + 0) * 32 + lane] = make_float4(sacc[0][0], sacc[0][1], sacc[0][2], sacc[0][3]);
    sS[((ks * 4 + nb) * 2 + 1) * 32 + lane] = make_float4(sacc[1][0], sacc[1][1], sacc[1][2], sacc[1][3]);
    sync_block();

    // ---- online softmax over the 64 keys (every warp, identically), P as A fragments ---------------------------
    float x[4][2][4];
    if (begin + (t + 1) * NT <= end) {  // every key of the tile exists (uniform over the block)
KTC_UNROLL
      for (int kb = 0; kb < 4; ++kb)
KTC_UNROLL
        for (int j = 0; j < 2; ++j) {
          const float4 a = sS[((0 * 4 + kb) * 2 + j) * 32 + lane], c = sS[((1 * 4 + kb) * 2 + j) * 32 + lane];
          x[kb][j][0] = a.x + c.x, x[kb][j][1] = a.y + c.y, x[kb][j][2] = a.z + c.z, x[kb][j][3] = a.w + c.w;
        }
    } else {  // the last tile: keys past the end are −inf
      const int kbase = begin + t * NT + 2 * qd;
KTC_UNROLL
      for (int kb = 0; kb < 4; ++kb)
KTC_UNROLL
        for (int j = 0; j < 2; ++j) {
          const float4 a = sS[((0 * 4 + kb) * 2 + j) * 32 + lane], c = sS[((1 * 4 + kb) * 2 + j) * 32 + lane];
          const int k = kbase + 16 * kb + 8 * j;  // key index of elements 0 and 2 (1 and 3: k + 1)
          x[kb][j][0] = k < end ? a.x + c.x : -INFINITY;
          x[kb][j][1] = k + 1 < end ? a.y + c.y : -INFINITY;
          x[kb][j][2] = k < end ? a.z + c.z : -INFINITY;
          x[kb][j][3] = k + 1 < end ? a.w + c.w : -INFINITY;
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
    // FP8: this warp's ô columns lie in scale group pgrp; P is multiplied by s·2^56 of its key there.
    const int pgrp = (w * S::NCW * 16) / 128 < S::G ? (w * S::NCW * 16) / 128 : 0;
    uint32_t pa[4][4];
    float ls[2] = {0.0f, 0.0f};
KTC_UNROLL
    for (int kb = 0; kb < 4; ++kb)
KTC_UNROLL
      for (int j = 0; j < 2; ++j) {
        const uint32_t u01 = pack_bf16(exp2f(x[kb][j][0] - base[0]), exp2f(x[kb][j][1] - base[0]));
        const uint32_t u23 = pack_bf16(exp2f(x[kb][j][2] - base[1]), exp2f(x[kb][j][3] - base[1]));
        ls[0] += bf16_lo(u01) + bf16_hi(u01);
        ls[1] += bf16_lo(u23) + bf16_hi(u23);
        if constexpr (FP8) {
          // bf16(p)·bf16(s·2^56): a power of two, exact. Keys k, k+1 = 16kb + 8j + 2q, +1.
          const uint32_t m = *reinterpret_cast<const uint32_t*>(mulT + pgrp * NT + 16 * kb + 8 * j + 2 * qd);
          pa[kb][2 * j] = hmul2_bf16(u01, m);
          pa[kb][2 * j + 1] = hmul2_bf16(u23, m);
        } else {
          pa[kb][2 * j] = u01;      // rows g,   keys 16kb + 8j + 2q, +1
          pa[kb][2 * j + 1] = u23;  // rows g+8
        }
      }
    l_run[0] = l_run[0] * alpha[0] + ls[0];
    l_run[1] = l_run[1] * alpha[1] + ls[1];
    if (warp_any(alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // most tiles of a long row move no row's max
KTC_UNROLL
      for (int j = 0; j < S::NO; ++j) {
        o[j][0] *= alpha[0], o[j][1] *= alpha[0];
        o[j][2] *= alpha[1], o[j][3] *= alpha[1];
      }
    }

    // ---- ô[:, cols of warp w] += P · ĉ ---------------------------------------------------------------------
    if constexpr (!FP8) {
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
    } else if (S::PVW == 8 || w < S::PVW) {
      // FP8: chunk ch = 16 e4m3 columns; the transposed b16 matrices give column pairs of two keys, split into
      // an even-column and an odd-column n8 tile (o[2cc], o[2cc+1]). ô here is in units of 2^−64: P carries
      // s·2^56, the placed bytes e4m3·2^−120.
KTC_UNROLL
      for (int cc = 0; cc < S::NCW; ++cc) {
        const int ch = w * S::NCW + cc;
KTC_UNROLL
        for (int kp = 0; kp < 4; kp += 2) {
          uint32_t v0, v1, v2, v3;  // keys 16kp + 0..7, +8..15, +16..23, +24..31
          ldsm_x4_t(tl_s + (16 * kp + lane) * S::RAWB + 16 * ch, v0, v1, v2, v3);
          const uint32_t s0 = v0 & 0x80808080u, s1 = v1 & 0x80808080u, s2 = v2 & 0x80808080u, s3 = v3 & 0x80808080u;
          mma(o[2 * cc], pa[kp], e4m3_even(v0, s0), e4m3_even(v1, s1));
          mma(o[2 * cc + 1], pa[kp], e4m3_odd(v0, s0), e4m3_odd(v1, s1));
          mma(o[2 * cc], pa[kp + 1], e4m3_even(v2, s2), e4m3_even(v3, s3));
          mma(o[2 * cc + 1], pa[kp + 1], e4m3_odd(v2, s2), e4m3_odd(v3, s3));
        }
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
  // Row hr of this thread's fragments: the ô values and their columns, scaled by f (1/l or 1).
  auto put = [&](float f0, float f1, auto&& store2, auto&& store4) {
    if constexpr (!FP8) {
KTC_UNROLL
      for (int j = 0; j < S::NJ; ++j) {
        const int col = w * S::NCOL + 8 * j + 2 * qd;
        if (h0 < Hm) store2(h0, col, o[j][0] * f0, o[j][1] * f0);
        if (h1 < Hm) store2(h1, col, o[j][2] * f1, o[j][3] * f1);
      }
    } else if (S::PVW == 8 || w < S::PVW) {
      const float u = 18446744073709551616.0f;  // 2^64: back from the P·V units
      f0 *= u, f1 *= u;
KTC_UNROLL
      for (int cc = 0; cc < S::NCW; ++cc) {
        const int col = 16 * (w * S::NCW + cc) + 4 * qd;  // columns col..col+3: even d0, odd d0, even d1, odd d1
        const float* e = o[2 * cc];
        const float* d = o[2 * cc + 1];
        if (h0 < Hm) store4(h0, col, make_float4(e[0] * f0, d[0] * f0, e[1] * f0, d[1] * f0));
        if (h1 < Hm) store4(h1, col, make_float4(e[2] * f1, d[2] * f1, e[3] * f1, d[3] * f1));
      }
    }
  };
  if (p.ohat) {
    const float i0 = lf[0] > 0.0f ? 1.0f / lf[0] : 0.0f, i1 = lf[1] > 0.0f ? 1.0f / lf[1] : 0.0f;
    uint16_t* out = p.ohat + int64_t(uint32_t(b)) * Hm * C;  // b ≥ 0: zero-extended, one register less
    put(
        i0, i1,
        [&](int h, int col, float a, float c) { *reinterpret_cast<uint32_t*>(out + h * C + col) = pack_bf16(a, c); },
        [&](int h, int col, float4 v) {
          *reinterpret_cast<uint2*>(out + h * C + col) = uint2{pack_bf16(v.x, v.y), pack_bf16(v.z, v.w)};
        });
  } else {
    const int64_t base_row = (int64_t(uint32_t(b)) * p.n_splits + split) * Hm;
    float* acc = p.part_acc + base_row * C;
    put(
        1.0f, 1.0f,
        [&](int h, int col, float a, float c) { *reinterpret_cast<float2*>(acc + h * C + col) = make_float2(a, c); },
        [&](int h, int col, float4 v) { *reinterpret_cast<float4*>(acc + h * C + col) = v; });
    if (w == 0 && qd == 0) {
      if (h0 < Hm) p.part_ml[(base_row + h0) * 2] = m_run[0], p.part_ml[(base_row + h0) * 2 + 1] = lf[0];
      if (h1 < Hm) p.part_ml[(base_row + h1) * 2] = m_run[1], p.part_ml[(base_row + h1) * 2 + 1] = lf[1];
    }
  }
}

}  // namespace kestrel::cuda::KTC_NS
