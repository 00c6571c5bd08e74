// Second variants of the chunk-parallel KDA scan's two main launches (kda_chunked.cu has the math, the image
// layout and the first variants; kda.h the contract). Both read and write the same chunk image as the first
// variants, so any intra variant pairs with any seq variant.
//
// intra2: one 512-thread CTA per (chunk, head) as intra1, but the chunk's Dk channels stream through in
// quarters of 32, so a CTA needs 106 KB of shared memory instead of 190 KB and two CTAs share an SM (one
// computes while the other waits on memory or on a barrier). Per quarter (its q, k, g copied in by cp.async
// one quarter ahead): G by channel (f64 partial sums per 4 tokens, then a prefix over the 16 warps); the
// quarter's Q̃, K̂ᵀ, eG go straight to the image and e^G ⊙ K (TF32) to the image's W rows, which serve as a
// scratch until W itself is written; the A/QK operands k_t e^{G_t−r}, q_t e^{G_t−r}, k_s e^{r−G_s} of all four
// 16-row blocks (the intra1 references) go to shared memory, and the 40 (block, product, 8-column) tiles of A
// and QK accumulate over the quarters in registers (≤ 3 tiles per warp). Then L = β A, T by doubling (FP32
// FMAs: 16×16 diagonal blocks by forward substitution; T_10, T_32 = −T_ii L_ij T_jj; the lower-left 32×32
// block = −T_hi L_hi,lo T_lo), with e^G ⊙ K (from the scratch) and V copied in meanwhile; W = T diag(β)
// (e^G ⊙ K), U0 = T diag(β) V (TF32 mma) as in intra1.
//
// seq2<VM>: VM 16-column value tiles per CTA, two warps per tile that split the Dk keys: warp (tile, half)
// keeps Sᵀ [16 values × Dk/2 keys] and computes its halves of U0ᵀ − Sᵀ·Wᵀ and Sᵀ·Q̃ᵀ; the two warps of a
// tile swap these partial products through shared memory (v_new = own + partner's, the same float sum in
// both warps since IEEE addition commutes), each finishes o for half of the 8-token tiles (even / odd, which
// balances the triangular QK·v_new work) and updates its key half of the state. Per warp and chunk that is
// 64 + 64 TF32 and 42 BF16 mma at Dk 128 instead of 128 + 128 and 84. VM = 2 (seq variant 2): 48 CTAs at
// 12 heads × one sequence, four warps per SM; the swap area then lives in the stage's W rows, which costs a
// CTA barrier before the swap (the stage has all the shared memory). VM = 1 (variant 3): twice the CTAs,
// two warps per SM, a separate swap area; every CTA copies the shared part of the image, so twice the L2
// reads.
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kda_internal.cuh"

namespace kestrel::cuda::kda_detail {
namespace {

// ---- seq2 ------------------------------------------------------------------------------------------------------
template <int K, int VM>
struct Seq2Layout {
  using I = Img<K>;
  static constexpr int BV = 16 * VM;                       // value columns per CTA
  static constexpr size_t stage = I::stage_bytes(BV);
  static constexpr int XW = 1536;                          // swap floats per warp: v partial (8 m-tiles) + 4 o tiles
  static constexpr size_t x_bytes = size_t(2 * VM) * XW * 4;
  static constexpr bool x_separate = 2 * stage + x_bytes + 16 <= kMaxSmemPerBlock;
  static constexpr size_t bar_off = 2 * stage + (x_separate ? x_bytes : 0);
  static constexpr size_t smem = bar_off + 16;
  static_assert(x_separate || x_bytes <= I::kh_off, "the swap area must fit the stage's W rows");
  static_assert(smem <= kMaxSmemPerBlock, "seq2 shared memory");
};

template <int K, typename StateT, int VM>
__global__ void __launch_bounds__(64 * VM, 1)
    seq2_kernel(const int32_t* __restrict__ cu, const int32_t* __restrict__ cs, const int32_t* __restrict__ slots,
                const char* __restrict__ imgs, StateT* __restrict__ pool, float* __restrict__ o, int64_t ld, int H) {
  using I = Img<K>;
  using Lay = Seq2Layout<K, VM>;
  constexpr int KH = K / 2;     // keys per warp
  constexpr int NJ = KH / 8;    // its TF32 key n-tiles
  constexpr int NKK = KH / 16;  // its BF16 key k-steps
  constexpr int XW = Lay::XW;
  unsigned char* smraw = dyn_smem<unsigned char>();
  uint64_t* bars = reinterpret_cast<uint64_t*>(smraw + Lay::bar_off);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
  const int vm = warp % VM, kh = warp / VM, partner = (1 - kh) * VM + vm;
  const int vb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int c_beg = cs[b], nc = cs[b + 1] - c_beg;
  if (nc <= 0) return;  // empty sequence (or a workspace too small): the state stays as it was
  const int64_t t_beg = cu[b];
  const int len = cu[b + 1] - cu[b];
  const int v0 = vb * Lay::BV, vw = v0 + 16 * vm, kb = kh * KH;  // CTA's / warp's first value; warp's first key

  if (tid == 0) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  auto issue = [&](int c) {  // thread 0: chunk c's image into stage c & 1
    const int s = c & 1;
    const char* src = imgs + (size_t(c_beg + c) * H + h) * I::bytes;
    unsigned char* dst = smraw + s * Lay::stage;
    mbar_expect_tx(&bars[s], uint32_t(Lay::stage));
    bulk_g2s(dst, src, uint32_t(I::shared_bytes), &bars[s]);
    bulk_g2s(dst + I::shared_bytes, src + I::u_off + size_t(v0) * I::TP * 4, uint32_t(I::u_slice_bytes(Lay::BV)),
             &bars[s]);
  };
  if (tid == 0) {
    issue(0);
    if (nc > 1) issue(1);
  }

  // Sᵀ in accumulator layout: sa[j] = (value vw+g, key kb+8j+2t), (vw+g, kb+8j+2t+1), (vw+g+8, kb+8j+2t),
  // (vw+g+8, kb+8j+2t+1).
  StateT* S = pool + (int64_t(slots[b]) * H + h) * K * K;  // [K key][K value]
  float sa[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int key = kb + 8 * j + 2 * tq;
    sa[j][0] = load_state(S + key * K + vw + gq);
    sa[j][1] = load_state(S + (key + 1) * K + vw + gq);
    sa[j][2] = load_state(S + key * K + vw + gq + 8);
    sa[j][3] = load_state(S + (key + 1) * K + vw + gq + 8);
  }

#pragma unroll 1
  for (int c = 0; c < nc; ++c) {
    const int s = c & 1;
    while (!mbar_try_wait(&bars[s], uint32_t((c >> 1) & 1))) {
    }
    unsigned char* st = smraw + s * Lay::stage;
    const float* Ws = reinterpret_cast<const float*>(st + I::w_off);
    const float* Kh = reinterpret_cast<const float*>(st + I::kh_off);
    const uint16_t* Qs = reinterpret_cast<const uint16_t*>(st + I::q_off);
    const uint16_t* Aq = reinterpret_cast<const uint16_t*>(st + I::a_off);
    const float* eG = reinterpret_cast<const float*>(st + I::e_off);
    const float* U0 = reinterpret_cast<const float*>(st + I::shared_bytes);  // [BV values][TP]

    // Partial v_newᵀ [16 values × 64 tokens] over this warp's keys: U0ᵀ − Sᵀ·Wᵀ on the first half (which
    // starts from U0ᵀ), −Sᵀ·Wᵀ on the second. TF32 with the permuted key order of kda_chunked.cu.
    float pv[8][4];
    if (kh == 0) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float2 lo = *reinterpret_cast<const float2*>(U0 + (16 * vm + gq) * I::TP + 8 * m + 2 * tq);
        const float2 hi = *reinterpret_cast<const float2*>(U0 + (16 * vm + gq + 8) * I::TP + 8 * m + 2 * tq);
        pv[m][0] = lo.x;
        pv[m][1] = lo.y;
        pv[m][2] = hi.x;
        pv[m][3] = hi.y;
      }
    } else {
#pragma unroll
      for (int m = 0; m < 8; ++m) pv[m][0] = pv[m][1] = pv[m][2] = pv[m][3] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const uint32_t a[4] = {to_tf32(-sa[j][0]), to_tf32(-sa[j][2]), to_tf32(-sa[j][1]), to_tf32(-sa[j][3])};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float2 w = *reinterpret_cast<const float2*>(Ws + (8 * m + gq) * I::KPW + kb + 8 * j + 2 * tq);
        const uint32_t bb[2] = {__float_as_uint(w.x), __float_as_uint(w.y)};
        mma_tf32(pv[m], a, bb);
      }
    }
    // Partial oᵀ [16 values × 64 tokens] = Sᵀ·Q̃ᵀ over this warp's keys (BF16).
    float po[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < NKK; ++kk) {
      const uint32_t a[4] = {pack_bf16(sa[2 * kk][0], sa[2 * kk][1]), pack_bf16(sa[2 * kk][2], sa[2 * kk][3]),
                             pack_bf16(sa[2 * kk + 1][0], sa[2 * kk + 1][1]),
                             pack_bf16(sa[2 * kk + 1][2], sa[2 * kk + 1][3])};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const uint16_t* qrow = Qs + (8 * m + gq) * I::KPQ + kb + 16 * kk + 2 * tq;
        const uint32_t bb[2] = {*reinterpret_cast<const uint32_t*>(qrow), *reinterpret_cast<const uint32_t*>(qrow + 8)};
        mma_bf16(po[m], a, bb);
      }
    }

    // Swap with the partner warp: all 8 v tiles, and the o tiles it finishes (m ≡ 1 − kh mod 2). Fragments
    // are stored lane-major (16 bytes per lane per tile): both warps hold the same (value, token) positions.
    float* xb;
    if constexpr (Lay::x_separate) {
      xb = reinterpret_cast<float*>(smraw + 2 * Lay::stage);
    } else {
      __syncthreads();  // every warp is done with this stage's W rows, which now take the swap
      xb = reinterpret_cast<float*>(st + I::w_off);
    }
    float* mine = xb + warp * XW;
    const float* theirs = xb + partner * XW;
#pragma unroll
    for (int m = 0; m < 8; ++m)
      *reinterpret_cast<float4*>(mine + m * 128 + 4 * lane) = make_float4(pv[m][0], pv[m][1], pv[m][2], pv[m][3]);
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // the partner's tile m = 2p + 1 − kh
      float x[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) x[r] = kh ? po[2 * p][r] : po[2 * p + 1][r];
      *reinterpret_cast<float4*>(mine + 1024 + p * 128 + 4 * lane) = make_float4(x[0], x[1], x[2], x[3]);
    }
    if (vm == 0) {  // the two warps of tile vm (constant barrier ids)
      named_barrier<1, 64>();
    } else {
      named_barrier<2, 64>();
    }
    float vn[8][4];             // v_newᵀ
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const float4 x = *reinterpret_cast<const float4*>(theirs + m * 128 + 4 * lane);
      vn[m][0] = pv[m][0] + x.x;
      vn[m][1] = pv[m][1] + x.y;
      vn[m][2] = pv[m][2] + x.z;
      vn[m][3] = pv[m][3] + x.w;
    }
    float oo[4][4];  // this warp's o tiles m = 2p + kh
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float4 x = *reinterpret_cast<const float4*>(theirs + 1024 + p * 128 + 4 * lane);
      const float xr[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int r = 0; r < 4; ++r) oo[p][r] = (kh ? po[2 * p + 1][r] : po[2 * p][r]) + xr[r];
    }

    // oᵀ += v_newᵀ·QKᵀ on this warp's tiles (BF16; QK[t][s] = 0 for s > t, so k-steps kk ≤ m/2 = p), then o.
    uint32_t va16[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      va16[kk][0] = pack_bf16(vn[2 * kk][0], vn[2 * kk][1]);
      va16[kk][1] = pack_bf16(vn[2 * kk][2], vn[2 * kk][3]);
      va16[kk][2] = pack_bf16(vn[2 * kk + 1][0], vn[2 * kk + 1][1]);
      va16[kk][3] = pack_bf16(vn[2 * kk + 1][2], vn[2 * kk + 1][3]);
    }
    const int n = min(kC, len - kC * c);
    float* ob = o + (t_beg + int64_t(kC) * c) * ld + int64_t(h) * K + vw + gq;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int m = 2 * p + kh;
#pragma unroll
      for (int kk = 0; kk <= p; ++kk) {
        const uint16_t* arow = Aq + (8 * m + gq) * I::APQ + 16 * kk + 2 * tq;
        const uint32_t bb[2] = {*reinterpret_cast<const uint32_t*>(arow), *reinterpret_cast<const uint32_t*>(arow + 8)};
        mma_bf16(oo[p], va16[kk], bb);
      }
      const int tk = 8 * m + 2 * tq;
      if (tk < n) {
        ob[tk * ld] = oo[p][0];
        ob[tk * ld + 8] = oo[p][2];
      }
      if (tk + 1 < n) {
        ob[(tk + 1) * ld] = oo[p][1];
        ob[(tk + 1) * ld + 8] = oo[p][3];
      }
    }

    // Sᵀ ← Sᵀ·diag(eG) + v_newᵀ·K̂ on this warp's keys (TF32, permuted token order).
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float2 e = *reinterpret_cast<const float2*>(eG + kb + 8 * j + 2 * tq);
      sa[j][0] *= e.x;
      sa[j][1] *= e.y;
      sa[j][2] *= e.x;
      sa[j][3] *= e.y;
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const uint32_t a[4] = {to_tf32(vn[m][0]), to_tf32(vn[m][2]), to_tf32(vn[m][1]), to_tf32(vn[m][3])};
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float2 khv = *reinterpret_cast<const float2*>(Kh + (kb + 8 * j + gq) * I::TP + 8 * m + 2 * tq);
        const uint32_t bb[2] = {__float_as_uint(khv.x), __float_as_uint(khv.y)};
        mma_tf32(sa[j], a, bb);
      }
    }

    __syncthreads();  // every warp is done with stage s and with the swap area
    if (tid == 0 && c + 2 < nc) {
      fence_proxy_async();  // generic writes to the stage (the swap) before the bulk copy overwrites it
      issue(c + 2);
    }
  }

#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int key = kb + 8 * j + 2 * tq;
    store_state(S + key * K + vw + gq, sa[j][0]);
    store_state(S + (key + 1) * K + vw + gq, sa[j][1]);
    store_state(S + key * K + vw + gq + 8, sa[j][2]);
    store_state(S + (key + 1) * K + vw + gq + 8, sa[j][3]);
  }
}

// ---- intra2 ------------------------------------------------------------------------------------------------------
constexpr int kIntra2Threads = 512;  // 16 warps

// Shared memory (floats). Channel passes: raw [2 buffers][k, q, g][C][QC] (cp.async destinations, 128-byte rows);
// Ek, Eq [C][EP] (row block j = rows 16j..16j+15, each with its own reference); E1 [160][EP] (row block j's right
// operand at rows 8j(j+1) .. +16(j+1)). After the passes the same bytes hold KE = e^G ⊙ K and V [C][KP], T's
// diagonal blocks TD [4][16][TDP], the level-1 products X1 [2][16][16] and the level-2 product Y [32][32].
// Am [C][LP] (A → L → T; during the passes it holds the cumulative-sum partials, f64 [16][32]) and bs [C] stay.
// EP ≡ LP ≡ KP ≡ 4 (mod 32): 4-byte fragment loads (row g, column t) hit 32 distinct banks.
template <int K>
struct Intra2Smem {
  static constexpr int QC = 32, NQ = K / QC;  // channels per pass, passes
  static constexpr int EP = QC + 4, LP = kC + 4, KP = K + 4, TDP = 17;
  static constexpr size_t raw_floats = size_t(3) * kC * QC;
  static constexpr size_t ek_off = 2 * raw_floats;
  static constexpr size_t eq_off = ek_off + size_t(kC) * EP;
  static constexpr size_t e1_off = eq_off + size_t(kC) * EP;
  static constexpr size_t pass_end = e1_off + size_t(160) * EP;
  static constexpr size_t ke_off = 0;
  static constexpr size_t v_off = ke_off + size_t(kC) * KP;
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

template <int K>
__global__ void __launch_bounds__(kIntra2Threads, 2)
    intra2_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                  const int32_t* __restrict__ cu, const int32_t* __restrict__ cs, const int32_t* __restrict__ cseq,
                  int B, char* __restrict__ imgs, int H) {
  using I = Img<K>;
  using Sm = Intra2Smem<K>;
  constexpr int QC = Sm::QC, NQ = Sm::NQ, EP = Sm::EP, LP = Sm::LP, KP = Sm::KP, TDP = Sm::TDP, NT = kIntra2Threads;
  float* sm = dyn_smem<float>();
  float* Ek = sm + Sm::ek_off;  // k_t e^{G_t−r_j}   (TF32)
  float* Eq = sm + Sm::eq_off;  // q_t e^{G_t−r_j}   (TF32)
  float* E1 = sm + Sm::e1_off;  // k_s e^{r_j−G_s}   (TF32)
  float* KEs = sm + Sm::ke_off;
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
  float* ke_tmp = reinterpret_cast<float*>(img + I::w_off);  // e^G ⊙ K [C][KPW] until W overwrites it
  uint16_t* qimg = reinterpret_cast<uint16_t*>(img + I::q_off);
  float* khimg = reinterpret_cast<float*>(img + I::kh_off);
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
      for (int w2 = 0; w2 < warp; ++w2) ex += tot[w2 * 32 + lane];
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
      ke_tmp[t * I::KPW + cg] = tf32f(kv[i] * eg);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i <= j; ++i)  // ≤ 1 for s in an earlier row block, ≤ e^80 inside block j
        E1[(8 * j * (j + 1) + warp + 16 * i) * EP + lane] = tf32f(kv[i] * exp2f(rj[j] - gv[i]));
    {  // K̂ᵀ: tokens 4w..4w+3 of channel cg as one 16-byte store
      const float* kr = Kr + 4 * warp * QC + lane;
      const float* gr = Gr + 4 * warp * QC + lane;
      float4 r4;
      r4.x = tf32f(kr[0] * exp2f(gC - gr[0]));
      r4.y = tf32f(kr[QC] * exp2f(gC - gr[QC]));
      r4.z = tf32f(kr[2 * QC] * exp2f(gC - gr[2 * QC]));
      r4.w = tf32f(kr[3 * QC] * exp2f(gC - gr[3 * QC]));
      *reinterpret_cast<float4*>(khimg + cg * I::TP + 4 * warp) = r4;
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
    constexpr int PR = K / 4, NL = 2 * kC * PR / NT;
    static_assert(2 * kC * PR % NT == 0, "copy mapping");
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const int idx = tid + l * NT, arr = idx / (kC * PR), rem = idx % (kC * PR), r = rem / PR, pc = rem % PR;
      if (arr == 0) {
        cp_async16(KEs + r * KP + 4 * pc, ke_tmp + r * I::KPW + 4 * pc, 16u);
      } else {
        const bool ok = r < n;
        cp_async16(Vs + r * KP + 4 * pc, v + (t0 + (ok ? r : 0)) * ld + int64_t(h) * K + 4 * pc, ok ? 16u : 0u);
      }
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
    float* wimg = reinterpret_cast<float*>(img + I::w_off);
    float* uimg = reinterpret_cast<float*>(img + I::u_off);
#pragma unroll 1
    for (int qq = 0; qq < QW; ++qq) {
      const int pidx = (warp >> 2) + 4 * qq, m = (warp + qq) & 3;
      const int prod = pidx / NP, np = pidx % NP;
      const float* Bm = prod ? Vs : KEs;
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
          const uint32_t bb[2] = {to_tf32(Bm[col * KP + ncol]), to_tf32(Bm[(col + 4) * KP + ncol])};
          mma_tf32(c2[nt], a, bb);
        }
      }
      const int tok = 16 * m + gq;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col0 = 16 * np + 8 * nt + 2 * tq;
        if (prod == 0) {
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
template <int K, typename StateT, int VM>
void launch_seq2(const ChunkArgs& a, StateT* pool, cudaStream_t stream) {
  auto seq = seq2_kernel<K, StateT, VM>;
  constexpr size_t smem = Seq2Layout<K, VM>::smem;
  KCUDA_CHECK(cudaFuncSetAttribute(seq, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  seq<<<dim3(unsigned(K / (16 * VM)), unsigned(a.H), unsigned(a.B)), 64 * VM, smem, stream>>>(
      a.cu, a.cs, a.slots, a.imgs, pool, a.o, a.ld, a.H);
  KCUDA_CHECK_LAUNCH();
}

template <int K>
void launch_intra2(const ChunkArgs& a, cudaStream_t stream) {
  auto intra = intra2_kernel<K>;
  constexpr size_t smem = Intra2Smem<K>::bytes;
  KCUDA_CHECK(cudaFuncSetAttribute(intra, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  KCUDA_CHECK(cudaFuncSetAttribute(intra, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   int(cudaSharedmemCarveoutMaxShared)));
  intra<<<dim3(unsigned(a.cap), unsigned(a.H)), kIntra2Threads, smem, stream>>>(
      a.q, a.k, a.v, a.g, a.ld, a.beta, a.ld_beta, a.cu, a.cs, a.cseq, a.B, a.imgs, a.H);
  KCUDA_CHECK_LAUNCH();
}

#define KDA_INSTANTIATE(K)                                                              \
  template void launch_intra2<K>(const ChunkArgs&, cudaStream_t);                       \
  template void launch_seq2<K, float, 1>(const ChunkArgs&, float*, cudaStream_t);       \
  template void launch_seq2<K, float, 2>(const ChunkArgs&, float*, cudaStream_t);       \
  template void launch_seq2<K, uint16_t, 1>(const ChunkArgs&, uint16_t*, cudaStream_t); \
  template void launch_seq2<K, uint16_t, 2>(const ChunkArgs&, uint16_t*, cudaStream_t);
KDA_INSTANTIATE(32)
KDA_INSTANTIATE(64)
KDA_INSTANTIATE(128)
#undef KDA_INSTANTIATE
#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda::kda_detail
