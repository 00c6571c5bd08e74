// The second variant of the chunk-parallel KDA scan's intra-chunk launch (kda_chunked.cu has the math, the
// image layout and the entry points; kda.h the contract). It writes the chunk image any seq variant reads
// (in either format: TF32-rounded f32, or FP16 for the FP16 recurrence).
//
// intra2: one 512-thread CTA per (chunk, head) as intra1, but the chunk's Dk channels stream through in
// quarters of 32, so a CTA needs 106 KB of shared memory instead of 190 KB and two CTAs share an SM (one
// computes while the other waits on memory or on a barrier). Per quarter (its q, k, g copied in by cp.async
// one quarter ahead): G by channel (f64 partial sums per 4 tokens, then a prefix over the 16 warps); the
// quarter's Q̃, K̂ᵀ, eG go straight to the image and e^G ⊙ K (TF32, or FP16 in the FP16 format: as exact as
// an operand) to the image's W rows, which serve as a scratch until W itself is written; the A/QK operands k_t e^{G_t−r}, q_t e^{G_t−r}, k_s e^{r−G_s} of all four
// 16-row blocks (the intra1 references) go to shared memory, and the 40 (block, product, 8-column) tiles of A
// and QK accumulate over the quarters in registers (≤ 3 tiles per warp). Then L = β A, T by doubling (FP32
// FMAs: 16×16 diagonal blocks by forward substitution; T_10, T_32 = −T_ii L_ij T_jj; the lower-left 32×32
// block = −T_hi L_hi,lo T_lo), with e^G ⊙ K (from the scratch) and V copied in meanwhile; W = T diag(β)
// (e^G ⊙ K), U0 = T diag(β) V (TF32 mma) as in intra1, stored as f32 or FP16.
// Shared memory: 48 KB for the double-buffered quarter, 41 KB of A/QK operands, 17 KB for A → T (106 KB); 512
// threads at ≤ 64 registers (__launch_bounds__(512, 2)) fit two CTAs in the register file.
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kda_internal.cuh"

namespace kestrel::cuda::kda_detail {
namespace {

// ---- intra2 ------------------------------------------------------------------------------------------------------
constexpr int kIntra2Threads = 512;  // 16 warps

// Shared memory (floats). Channel passes: raw [2 buffers][k, q, g][C][QC] (cp.async destinations, 128-byte rows);
// Ek, Eq [C][EP] (row block j = rows 16j..16j+15, each with its own reference); E1 [160][EP] (row block j's right
// operand at rows 8j(j+1) .. +16(j+1)). After the passes the same bytes hold KE = e^G ⊙ K and V [C][KP], T's
// diagonal blocks TD [4][16][TDP], the level-1 products X1 [2][16][16] and the level-2 product Y [32][32].
// Am [C][LP] (A → L → T; during the passes it holds the cumulative-sum partials, f64 [16][32]) and bs [C] stay.
// EP ≡ LP ≡ KP ≡ 4 (mod 32): 4-byte fragment loads (row g, column t) hit 32 distinct banks.
template <int K, bool F16>
struct Intra2Smem {
  static constexpr int QC = 32, NQ = K / QC;  // channels per pass, passes
  static constexpr int EP = QC + 4, LP = kC + 4, KP = K + 4, TDP = 17;
  static constexpr int KP16 = K + 8;  // KE row stride in FP16 elements (F16): (K + 8)/2 ≡ 4 (mod 32) words
  static constexpr size_t raw_floats = size_t(3) * kC * QC;
  static constexpr size_t ek_off = 2 * raw_floats;
  static constexpr size_t eq_off = ek_off + size_t(kC) * EP;
  static constexpr size_t e1_off = eq_off + size_t(kC) * EP;
  static constexpr size_t pass_end = e1_off + size_t(160) * EP;
  static constexpr size_t ke_off = 0;
  static constexpr size_t v_off = ke_off + (F16 ? size_t(kC) * KP16 / 2 : size_t(kC) * KP);
  static constexpr size_t td_off = v_off + size_t(kC) * KP;
  static constexpr size_t x1_off = td_off + size_t(4 * 16) * TDP;
  static constexpr size_t y_off = x1_off + 512;
  static constexpr size_t late_end = y_off + 32 * 32;
  static constexpr size_t am_off = ((pass_end > late_end ? pass_end : late_end) + 3) / 4 * 4;
  static constexpr size_t bs_off = am_off + size_t(kC) * LP;
  static constexpr size_t floats = bs_off + kC;
  static constexpr size_t bytes = floats * 4;
  static_assert(K % QC == 0 && KP % 4 == 0 && v_off % 4 == 0, "16-byte cp.async rows");
  static_assert(2 * (bytes + 1024) <= 233472, "two CTAs per SM");
  static_assert(16 * 32 * 2 <= size_t(kC) * LP, "the f64 partial sums fit Am");
};

template <int K, bool F16>
__global__ void __launch_bounds__(kIntra2Threads, 2)
    intra2_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                  const int32_t* __restrict__ cu, const int32_t* __restrict__ cs, const int32_t* __restrict__ cseq,
                  int B, char* __restrict__ imgs, int H) {
  using I = Img<K, F16>;
  using Sm = Intra2Smem<K, F16>;
  using WT = std::conditional_t<F16, uint16_t, float>;  // image element of W, K̂ᵀ, U0ᵀ (and of the KE scratch)
  constexpr int QC = Sm::QC, NQ = Sm::NQ, EP = Sm::EP, LP = Sm::LP, KP = Sm::KP, KP16 = Sm::KP16, TDP = Sm::TDP,
                NT = kIntra2Threads;
  float* sm = dyn_smem<float>();
  float* Ek = sm + Sm::ek_off;  // k_t e^{G_t−r_j}   (TF32)
  float* Eq = sm + Sm::eq_off;  // q_t e^{G_t−r_j}   (TF32)
  float* E1 = sm + Sm::e1_off;  // k_s e^{r_j−G_s}   (TF32)
  float* KEs = sm + Sm::ke_off;  // f32 [C][KP], or FP16 [C][KP16] (F16)
  float* Vs = sm + Sm::v_off;
  float* TD = sm + Sm::td_off;
  float* X1 = sm + Sm::x1_off;
  float* Y = sm + Sm::y_off;
  float* Am = sm + Sm::am_off;
  double* tot = reinterpret_cast<double*>(Am);
  float* bs = sm + Sm::bs_off;

  const int ch = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  if (ch >= cs[B]) return;
  const int b = cseq[ch];
  const int64_t t0 = int64_t(cu[b]) + int64_t(ch - cs[b]) * kC;
  const int n = int(min(int64_t(kC), int64_t(cu[b + 1]) - t0));
  char* img = imgs + (size_t(ch) * H + h) * I::bytes;
  WT* ke_tmp = reinterpret_cast<WT*>(img + I::w_off);  // e^G ⊙ K [C][KPW] until W overwrites it
  uint16_t* qimg = reinterpret_cast<uint16_t*>(img + I::q_off);
  WT* khimg = reinterpret_cast<WT*>(img + I::kh_off);
  float* eimg = reinterpret_cast<float*>(img + I::e_off);

  // Quarter qt's k, q, g rows into raw buffer p: 64 rows × 8 pieces of 16 bytes per array, one piece of each
  // per thread; rows ≥ n are zero-filled (so G stays at G_{n−1} there and k, q vanish).
  auto load_quarter = [&](int qt, int p) {
    float* dst = sm + p * Sm::raw_floats;
    const int r = tid >> 3, pc = tid & 7;
    const bool ok = r < n;
    const int64_t row = (t0 + (ok ? r : 0)) * ld + int64_t(h) * K + qt * QC + 4 * pc;
    cp_async16(dst + (0 * kC + r) * QC + 4 * pc, k + row, ok ? 16u : 0u);
    cp_async16(dst + (1 * kC + r) * QC + 4 * pc, q + row, ok ? 16u : 0u);
    cp_async16(dst + (2 * kC + r) * QC + 4 * pc, g + row, ok ? 16u : 0u);
  };
  if (tid < kC) bs[tid] = tid < n ? beta[(t0 + tid) * ld_beta + h] : 0.0f;
  load_quarter(0, 0);
  cp_async_commit();

  // Tiles of A (product 0) and QK (1): job = (row block j, product, 8-column tile nt < 2(j+1)), numbered
  // from 2j(j+1); warp w owns jobs w, w + 16, w + 32 (< 40) and accumulates them over the quarters.
  auto job_of = [](int job, int& j, int& prod, int& nt) {
    j = int(job >= 4) + int(job >= 12) + int(job >= 24);
    const int r = job - 2 * j * (j + 1);
    prod = r & 1;
    nt = r >> 1;
  };
  float acc[3][4] = {};
#pragma unroll 1
  for (int qt = 0; qt < NQ; ++qt) {
    const int p = qt & 1;
    if (qt + 1 < NQ) load_quarter(qt + 1, p ^ 1);  // buffer p^1 was last read before the previous pass's last barrier
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // quarter qt is in buffer p for every thread
    float* Kr = sm + p * Sm::raw_floats;
    float* Qr = Kr + kC * QC;
    float* Gr = Qr + kC * QC;

    // G (log2 units) by channel: lane = channel, warp = tokens 4w..4w+3; f64 sums, prefix over the warps.
    {
      double loc[4], a = 0.0;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        a += double(Gr[(4 * warp + u) * QC + lane]);
        loc[u] = a;
      }
      tot[warp * 32 + lane] = a;
      __syncthreads();
      double ex = 0.0;
#pragma unroll
      for (int w2 = 0; w2 < 15; ++w2)  // unrolled: the 15 loads are independent, only the adds chain
        if (w2 < warp) ex += tot[w2 * 32 + lane];
#pragma unroll
      for (int u = 0; u < 4; ++u) Gr[(4 * warp + u) * QC + lane] = float((ex + loc[u]) * kLog2e);
      __syncthreads();
    }

    // Operands and image pieces: lane = channel cg, warp w = tokens w + 16i (row block i).
    const int cg = qt * QC + lane;
    const float gC = Gr[(kC - 1) * QC + lane];
    float rj[4];  // row block j's reference G_{16j−1} (0 for j = 0)
    rj[0] = 0.0f;
#pragma unroll
    for (int j = 1; j < 4; ++j) rj[j] = Gr[(16 * j - 1) * QC + lane];
    float kv[4], gv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = warp + 16 * i;
      kv[i] = Kr[t * QC + lane];
      gv[i] = Gr[t * QC + lane];
      const float qv = Qr[t * QC + lane];
      const float e = exp2f(gv[i] - rj[i]);  // ≤ 1
      Ek[t * EP + lane] = tf32f(kv[i] * e);
      Eq[t * EP + lane] = tf32f(qv * e);
      const float eg = exp2f(gv[i]);
      qimg[t * I::KPQ + cg] = __bfloat16_as_ushort(__float2bfloat16_rn(qv * eg));
      if constexpr (F16) {
        ke_tmp[t * I::KPW + cg] = __half_as_ushort(__float2half_rn(kv[i] * eg));
      } else {
        ke_tmp[t * I::KPW + cg] = tf32f(kv[i] * eg);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i <= j; ++i)  // ≤ 1 for s in an earlier row block, ≤ e^80 inside block j
        E1[(8 * j * (j + 1) + warp + 16 * i) * EP + lane] = tf32f(kv[i] * exp2f(rj[j] - gv[i]));
    {  // K̂ᵀ: tokens 4w..4w+3 of channel cg as one 16-byte (8-byte) store
      const float* kr = Kr + 4 * warp * QC + lane;
      const float* gr = Gr + 4 * warp * QC + lane;
      float x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = kr[u * QC] * exp2f(gC - gr[u * QC]);
      if constexpr (F16) {
        *reinterpret_cast<uint2*>(khimg + cg * I::TP + 4 * warp) = make_uint2(pack_f16(x[0], x[1]), pack_f16(x[2], x[3]));
      } else {
        *reinterpret_cast<float4*>(khimg + cg * I::TP + 4 * warp) =
            make_float4(tf32f(x[0]), tf32f(x[1]), tf32f(x[2]), tf32f(x[3]));
      }
    }
    if (warp == 0) eimg[cg] = exp2f(gC);
    __syncthreads();  // operands ready

#pragma unroll
    for (int jj = 0; jj < 3; ++jj) {
      const int job = warp + 16 * jj;
      if (job < 40) {
        int j, prod, nt;
        job_of(job, j, prod, nt);
        const float* Aop = (prod ? Eq : Ek) + 16 * j * EP;
        const float* Bop = E1 + (8 * j * (j + 1) + 8 * nt) * EP;
#pragma unroll
        for (int kk = 0; kk < QC / 8; ++kk) {
          const int col = 8 * kk + tq;
          const uint32_t a[4] = {__float_as_uint(Aop[gq * EP + col]), __float_as_uint(Aop[(gq + 8) * EP + col]),
                                 __float_as_uint(Aop[gq * EP + col + 4]),
                                 __float_as_uint(Aop[(gq + 8) * EP + col + 4])};
          const uint32_t bb[2] = {__float_as_uint(Bop[gq * EP + col]), __float_as_uint(Bop[gq * EP + col + 4])};
          mma_tf32(acc[jj], a, bb);
        }
      }
    }
    // No barrier: the next pass writes the operands only after its own barriers.
  }
  __syncthreads();  // the pass buffers are free

  // KE (from the image scratch, written before the barrier above) and V into shared memory, landing while T
  // is computed.
  {
    constexpr int PE = K * int(sizeof(WT)) / 16, PV = K / 4;  // 16-byte pieces per row of KE / of V
    for (int idx = tid; idx < kC * PE; idx += NT) {
      const int r = idx / PE, pc = idx % PE;
      cp_async16(reinterpret_cast<char*>(KEs) + (r * (F16 ? KP16 : KP) * sizeof(WT)) + 16 * pc,
                 reinterpret_cast<const char*>(ke_tmp + r * I::KPW) + 16 * pc, 16u);
    }
    for (int idx = tid; idx < kC * PV; idx += NT) {
      const int r = idx / PV, pc = idx % PV;
      const bool ok = r < n;
      cp_async16(Vs + r * KP + 4 * pc, v + (t0 + (ok ? r : 0)) * ld + int64_t(h) * K + 4 * pc, ok ? 16u : 0u);
    }
    cp_async_commit();
  }

  // L = β_t A_ts (s < t) into Am, QK (s ≤ t) into the image; tiles no job covers are zero in the image (Am's
  // are never read).
  {
    uint32_t* aimg = reinterpret_cast<uint32_t*>(img + I::a_off);
#pragma unroll
    for (int jj = 0; jj < 3; ++jj) {
      const int job = warp + 16 * jj;
      if (job < 40) {
        int j, prod, nt;
        job_of(job, j, prod, nt);
        const int t = 16 * j + gq, s = 8 * nt + 2 * tq;
        if (prod == 0) {
          Am[t * LP + s] = s < t ? bs[t] * acc[jj][0] : 0.0f;
          Am[t * LP + s + 1] = s + 1 < t ? bs[t] * acc[jj][1] : 0.0f;
          Am[(t + 8) * LP + s] = s < t + 8 ? bs[t + 8] * acc[jj][2] : 0.0f;
          Am[(t + 8) * LP + s + 1] = s + 1 < t + 8 ? bs[t + 8] * acc[jj][3] : 0.0f;
        } else {
          aimg[(t * I::APQ + s) / 2] = pack_bf16(s <= t ? acc[jj][0] : 0.0f, s + 1 <= t ? acc[jj][1] : 0.0f);
          aimg[((t + 8) * I::APQ + s) / 2] =
              pack_bf16(s <= t + 8 ? acc[jj][2] : 0.0f, s + 1 <= t + 8 ? acc[jj][3] : 0.0f);
        }
      }
    }
    for (int idx = tid; idx < kC * kC / 2; idx += NT) {
      const int t = idx >> 5, s = 2 * (idx & 31);
      if (s >= 16 * (t / 16 + 1)) aimg[(t * I::APQ + s) / 2] = 0u;
    }
  }
  __syncthreads();

  // T = (I + L)^−1. Diagonal blocks: column c of (I + L_dd)^−1 by forward substitution, into TD.
  if (tid < kC) {
    const int d = tid >> 4, c = tid & 15;
    const float* Ld = Am + 16 * d * LP + 16 * d;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float a = 0.0f;
#pragma unroll
      for (int m = 0; m < r; ++m) a = fmaf(Ld[r * LP + m], x[m], a);
      x[r] = r < c ? 0.0f : (r == c ? 1.0f : -a);
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) TD[(16 * d + r) * TDP + c] = x[r];
  }
  __syncthreads();
  // Level 1: T_10 = −T_11·(L_10·T_00) and T_32 = −T_33·(L_32·T_22), 256 threads each.
  {
    const int pp = tid >> 8, r = (tid >> 4) & 15, c = tid & 15, i = 2 * pp + 1, j = 2 * pp;
    const float* Lr = Am + (16 * i + r) * LP + 16 * j;
    const float* Tj = TD + 16 * j * TDP + c;
    float a = 0.0f;
#pragma unroll
    for (int m = 0; m < 16; ++m) a = fmaf(Lr[m], Tj[m * TDP], a);
    X1[tid] = a;
  }
  __syncthreads();
  {
    const int pp = tid >> 8, r = (tid >> 4) & 15, c = tid & 15, i = 2 * pp + 1, j = 2 * pp;
    const float* Ti = TD + (16 * i + r) * TDP;  // zero above the diagonal
    const float* X = X1 + pp * 256 + c;
    float a = 0.0f;
#pragma unroll
    for (int m = 0; m < 16; ++m) a = fmaf(Ti[m], X[m * 16], a);
    Am[(16 * i + r) * LP + 16 * j + c] = -a;
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // the diagonal blocks (upper triangles zero) into Am
      const int idx = tid + NT * e, d = idx >> 8, rr = (idx >> 4) & 15, cc = idx & 15;
      Am[(16 * d + rr) * LP + 16 * d + cc] = TD[(16 * d + rr) * TDP + cc];
    }
  }
  __syncthreads();
  // Level 2: the lower-left 32×32 block T_hi,lo = −T_hi·(L_hi,lo·T_lo), with T_lo, T_hi the now complete
  // 32×32 diagonal blocks (only their lower triangles are read: the blocks above them were never written).
  {
    const int r = tid >> 5, c = lane;  // Y rows r and r + 16
    const float* L0 = Am + (32 + r) * LP;
    const float* L1 = Am + (48 + r) * LP;
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll 8
    for (int m = 0; m < 32; ++m) {
      const float tv = m >= c ? Am[m * LP + c] : 0.0f;
      a0 = fmaf(L0[m], tv, a0);
      a1 = fmaf(L1[m], tv, a1);
    }
    Y[r * 32 + c] = a0;
    Y[(r + 16) * 32 + c] = a1;
  }
  __syncthreads();
  {
    const int r = tid >> 5, c = lane;
    const float* T0 = Am + (32 + r) * LP + 32;
    const float* T1 = Am + (48 + r) * LP + 32;
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll 8
    for (int m = 0; m < 32; ++m) {
      const float y = Y[m * 32 + c];
      a0 = fmaf(m <= r ? T0[m] : 0.0f, y, a0);
      a1 = fmaf(m <= r + 16 ? T1[m] : 0.0f, y, a1);
    }
    Am[(32 + r) * LP + c] = -a0;  // L_hi,lo was last read before the barrier above
    Am[(48 + r) * LP + c] = -a1;
  }
  cp_async_wait<0>();
  __syncthreads();  // T complete; KE and V landed (so the W rows of the image may be overwritten)

  // W = T·diag(β)·KE → image (TF32), U0 = T·diag(β)·V → image transposed (f32). A job is (product, 16-column
  // pair of n-tiles, 16-row m-tile); the m-tile rotates with the warp so the triangular k-extent (2(m+1) steps)
  // is spread evenly.
  {
    constexpr int NP = K / 16, PN = 2 * NP, QW = PN / 4;
    static_assert(PN % 4 == 0, "job mapping");
    WT* wimg = reinterpret_cast<WT*>(img + I::w_off);
    WT* uimg = reinterpret_cast<WT*>(img + I::u_off);
    // B operand element (token, channel): V, or KE (FP16 when F16: exact in TF32).
    auto bval = [&](int prod, int tok, int ch) -> float {
      if (prod) return Vs[tok * KP + ch];
      if constexpr (F16) {
        return __half2float(__ushort_as_half(reinterpret_cast<const uint16_t*>(KEs)[tok * KP16 + ch]));
      } else {
        return KEs[tok * KP + ch];
      }
    };
#pragma unroll 1
    for (int qq = 0; qq < QW; ++qq) {
      const int pidx = (warp >> 2) + 4 * qq, m = (warp + qq) & 3;
      const int prod = pidx / NP, np = pidx % NP;
      float c2[2][4] = {};
      for (int kk = 0; kk < 2 * (m + 1); ++kk) {
        const int col = 8 * kk + tq;
        const float* Ta = Am + (16 * m + gq) * LP + col;
        const float b0 = bs[col], b1 = bs[col + 4];
        const uint32_t a[4] = {to_tf32(Ta[0] * b0), to_tf32(Ta[8 * LP] * b0), to_tf32(Ta[4] * b1),
                               to_tf32(Ta[8 * LP + 4] * b1)};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int ncol = 16 * np + 8 * nt + gq;
          const uint32_t bb[2] = {to_tf32(bval(prod, col, ncol)), to_tf32(bval(prod, col + 4, ncol))};
          mma_tf32(c2[nt], a, bb);
        }
      }
      const int tok = 16 * m + gq;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col0 = 16 * np + 8 * nt + 2 * tq;
        if constexpr (F16) {
          if (prod == 0) {
            *reinterpret_cast<uint32_t*>(wimg + tok * I::KPW + col0) = pack_f16(c2[nt][0], c2[nt][1]);
            *reinterpret_cast<uint32_t*>(wimg + (tok + 8) * I::KPW + col0) = pack_f16(c2[nt][2], c2[nt][3]);
          } else {
            uimg[col0 * I::TP + tok] = __half_as_ushort(__float2half_rn(c2[nt][0]));
            uimg[(col0 + 1) * I::TP + tok] = __half_as_ushort(__float2half_rn(c2[nt][1]));
            uimg[col0 * I::TP + tok + 8] = __half_as_ushort(__float2half_rn(c2[nt][2]));
            uimg[(col0 + 1) * I::TP + tok + 8] = __half_as_ushort(__float2half_rn(c2[nt][3]));
          }
        } else if (prod == 0) {
          *reinterpret_cast<float2*>(wimg + tok * I::KPW + col0) = make_float2(tf32f(c2[nt][0]), tf32f(c2[nt][1]));
          *reinterpret_cast<float2*>(wimg + (tok + 8) * I::KPW + col0) =
              make_float2(tf32f(c2[nt][2]), tf32f(c2[nt][3]));
        } else {
          uimg[col0 * I::TP + tok] = c2[nt][0];
          uimg[(col0 + 1) * I::TP + tok] = c2[nt][1];
          uimg[col0 * I::TP + tok + 8] = c2[nt][2];
          uimg[(col0 + 1) * I::TP + tok + 8] = c2[nt][3];
        }
      }
    }
  }
}

}  // namespace

#ifndef KESTREL_SIMT_EMU
template <int K, bool F16>
void launch_intra2(const ChunkArgs& a, cudaStream_t stream) {
  auto intra = intra2_kernel<K, F16>;
  constexpr size_t smem = Intra2Smem<K, F16>::bytes;
  KCUDA_CHECK(cudaFuncSetAttribute(intra, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  KCUDA_CHECK(cudaFuncSetAttribute(intra, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   int(cudaSharedmemCarveoutMaxShared)));
  intra<<<dim3(unsigned(a.cap), unsigned(a.H)), kIntra2Threads, smem, stream>>>(
      a.q, a.k, a.v, a.g, a.ld, a.beta, a.ld_beta, a.cu, a.cs, a.cseq, a.B, a.imgs, a.H);
  KCUDA_CHECK_LAUNCH();
}

template void launch_intra2<32, false>(const ChunkArgs&, cudaStream_t);
template void launch_intra2<32, true>(const ChunkArgs&, cudaStream_t);
template void launch_intra2<64, false>(const ChunkArgs&, cudaStream_t);
template void launch_intra2<64, true>(const ChunkArgs&, cudaStream_t);
template void launch_intra2<128, false>(const ChunkArgs&, cudaStream_t);
template void launch_intra2<128, true>(const ChunkArgs&, cudaStream_t);
#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda::kda_detail
