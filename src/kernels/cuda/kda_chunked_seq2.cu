// The second variants of the chunk-parallel KDA scan's sequential launch (kda_chunked.cu has the math, the
// image layout and the entry points; kda.h the contract). They read the chunk image any intra variant writes.
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
// reads. F16 (the FP16 recurrence): W, K̂ᵀ and U0ᵀ arrive in FP16 and Sᵀ·Wᵀ and v_newᵀ·K̂ run as m16n8k16 FP16
// products, whose A operand takes the accumulator layout as it is (no permutation): 32 + 32 mma instead of
// 64 + 64, and the smaller stages leave room for a separate swap area at VM = 2 too.
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kda_internal.cuh"

namespace kestrel::cuda::kda_detail {
namespace {

// ---- seq2 ------------------------------------------------------------------------------------------------------
template <int K, int VM, bool F16, bool MC = false>
struct Seq2Layout {
  using I = Img<K, F16>;
  static constexpr int BV = 16 * VM;                       // value columns per CTA
  static constexpr size_t stage = I::stage_bytes(BV);
  static constexpr int XW = 1536;                          // swap floats per warp: v partial (8 m-tiles) + 4 o tiles
  static constexpr size_t x_bytes = size_t(2 * VM) * XW * 4;
  static constexpr bool x_separate = 2 * stage + x_bytes + 16 <= kMaxSmemPerBlock;
  static constexpr size_t bar_off = 2 * stage + (x_separate ? x_bytes : 0);
  static constexpr size_t smem = bar_off + 32;  // full[2], empty[2] (multicast)
  static_assert(x_separate || x_bytes <= I::kh_off, "the swap area must fit the stage's W rows");
  // Multicast: the cluster's other CTAs write this CTA's stages, so generic writes there (the swap) would need
  // cross-CTA proxy ordering; the swap gets its own area instead.
  static_assert(!MC || x_separate, "multicast needs a separate swap area");
  static constexpr int NCB = K / BV;  // CTAs per (head, sequence) = the cluster with multicast
  static_assert(NCB <= 8, "portable cluster size");
  static_assert(smem <= kMaxSmemPerBlock, "seq2 shared memory");
};

template <int K, typename StateT, int VM, bool F16, bool MC>
__global__ void __launch_bounds__(64 * VM, 1)
    seq2_kernel(const int32_t* __restrict__ cu, const int32_t* __restrict__ cs, const int32_t* __restrict__ slots,
                const char* __restrict__ imgs, StateT* __restrict__ pool, float* __restrict__ o, int64_t ld, int H) {
  using I = Img<K, F16>;
  using Lay = Seq2Layout<K, VM, F16, MC>;
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
  // ldmatrix.x4 row of this lane for B fragments of two adjacent n-tiles: tile l / 8 = (n-tile (l / 16), k half
  // (l / 8) % 2), row l % 8 → row offset lr (+8 for the second n-tile) and column offset lc (x2 reuses it).
  const int lr = (lane & 7) + 8 * (lane >> 4), lc = 8 * ((lane >> 3) & 1);

  // bars[s]: stage s is full (this CTA's copies and, with multicast, the leader's); bars[2 + s] (multicast, in
  // the leader only): every CTA of the cluster is done with stage s, so the leader may refill it everywhere.
  const uint32_t rank = MC ? cluster_rank() : 0u;
  if (tid == 0) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
    if (MC) {
      mbar_init(&bars[2], Lay::NCB);
      mbar_init(&bars[3], Lay::NCB);
    }
    fence_mbarrier_init();
  }
  if constexpr (MC) {
    cluster_sync();  // every CTA's barriers exist before the leader's first multicast
  } else {
    __syncthreads();
  }
  auto issue = [&](int c) {  // thread 0: chunk c's image into stage c & 1 (the shared part: the leader, once)
    const int s = c & 1;
    const char* src = imgs + (size_t(c_beg + c) * H + h) * I::bytes;
    unsigned char* dst = smraw + s * Lay::stage;
    mbar_expect_tx(&bars[s], uint32_t(Lay::stage));
    bulk_g2s(dst + I::shared_bytes, src + I::u_off + size_t(v0) * I::TP * I::WB, uint32_t(I::u_slice_bytes(Lay::BV)),
             &bars[s]);
    if constexpr (!MC) {
      bulk_g2s(dst, src, uint32_t(I::shared_bytes), &bars[s]);
    } else if (rank == 0) {
      if (c >= 2) {  // chunk c − 2 released stage s in every CTA: completion number (c >> 1) − 1 of bars[2 + s]
        while (!mbar_try_wait_cluster(&bars[2 + s], uint32_t(((c >> 1) - 1) & 1))) {
        }
      }
      bulk_g2s_multicast(dst, src, uint32_t(I::shared_bytes), &bars[s], uint16_t((1u << Lay::NCB) - 1));
    }
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
    using WT = std::conditional_t<F16, uint16_t, float>;
    const WT* Ws = reinterpret_cast<const WT*>(st + I::w_off);
    const WT* Kh = reinterpret_cast<const WT*>(st + I::kh_off);
    const uint16_t* Qs = reinterpret_cast<const uint16_t*>(st + I::q_off);
    const uint16_t* Aq = reinterpret_cast<const uint16_t*>(st + I::a_off);
    const float* eG = reinterpret_cast<const float*>(st + I::e_off);
    const WT* U0 = reinterpret_cast<const WT*>(st + I::shared_bytes);  // [BV values][TP]

    // Partial v_newᵀ [16 values × 64 tokens] over this warp's keys: U0ᵀ − Sᵀ·Wᵀ on the first half (which
    // starts from U0ᵀ), −Sᵀ·Wᵀ on the second. TF32 with the permuted key order of kda_chunked.cu, or FP16
    // (m16n8k16, whose A layout is the accumulator's: no permutation).
    float pv[8][4];
    if (kh == 0) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const WT* lo = U0 + (16 * vm + gq) * I::TP + 8 * m + 2 * tq;
        const WT* hi = U0 + (16 * vm + gq + 8) * I::TP + 8 * m + 2 * tq;
        if constexpr (F16) {
          const uint32_t l = *reinterpret_cast<const uint32_t*>(lo), u = *reinterpret_cast<const uint32_t*>(hi);
          pv[m][0] = f16lo(l);
          pv[m][1] = f16hi(l);
          pv[m][2] = f16lo(u);
          pv[m][3] = f16hi(u);
        } else {
          const float2 l = *reinterpret_cast<const float2*>(lo), u = *reinterpret_cast<const float2*>(hi);
          pv[m][0] = l.x;
          pv[m][1] = l.y;
          pv[m][2] = u.x;
          pv[m][3] = u.y;
        }
      }
    } else {
#pragma unroll
      for (int m = 0; m < 8; ++m) pv[m][0] = pv[m][1] = pv[m][2] = pv[m][3] = 0.0f;
    }
    if constexpr (F16) {
#pragma unroll
      for (int kk = 0; kk < NKK; ++kk) {
        const uint32_t a[4] = {pack_f16(-sa[2 * kk][0], -sa[2 * kk][1]), pack_f16(-sa[2 * kk][2], -sa[2 * kk][3]),
                               pack_f16(-sa[2 * kk + 1][0], -sa[2 * kk + 1][1]),
                               pack_f16(-sa[2 * kk + 1][2], -sa[2 * kk + 1][3])};
#pragma unroll
        for (int m = 0; m < 8; m += 2) {  // B fragments of token tiles m, m + 1 in one ldmatrix.x4
          uint32_t bw[4];
          ldsm_x4(bw, Ws + (8 * m + lr) * I::KPW + kb + 16 * kk + lc);
          mma_f16(pv[m], a, {bw[0], bw[1]});
          mma_f16(pv[m + 1], a, {bw[2], bw[3]});
        }
      }
    } else {
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
    }
    // Partial oᵀ [16 values × 64 tokens] = Sᵀ·Q̃ᵀ over this warp's keys (BF16).
    float po[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < NKK; ++kk) {
      const uint32_t a[4] = {pack_bf16(sa[2 * kk][0], sa[2 * kk][1]), pack_bf16(sa[2 * kk][2], sa[2 * kk][3]),
                             pack_bf16(sa[2 * kk + 1][0], sa[2 * kk + 1][1]),
                             pack_bf16(sa[2 * kk + 1][2], sa[2 * kk + 1][3])};
#pragma unroll
      for (int m = 0; m < 8; m += 2) {
        uint32_t bq[4];
        ldsm_x4(bq, Qs + (8 * m + lr) * I::KPQ + kb + 16 * kk + lc);
        mma_bf16(po[m], a, {bq[0], bq[1]});
        mma_bf16(po[m + 1], a, {bq[2], bq[3]});
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
        uint32_t bb[2];
        ldsm_x2(bb, Aq + (8 * m + (lane & 7)) * I::APQ + 16 * kk + lc);
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

    // Sᵀ ← Sᵀ·diag(eG) + v_newᵀ·K̂ on this warp's keys (TF32 with the permuted token order, or FP16).
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float2 e = *reinterpret_cast<const float2*>(eG + kb + 8 * j + 2 * tq);
      sa[j][0] *= e.x;
      sa[j][1] *= e.y;
      sa[j][2] *= e.x;
      sa[j][3] *= e.y;
    }
    if constexpr (F16) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a[4] = {pack_f16(vn[2 * kk][0], vn[2 * kk][1]), pack_f16(vn[2 * kk][2], vn[2 * kk][3]),
                               pack_f16(vn[2 * kk + 1][0], vn[2 * kk + 1][1]),
                               pack_f16(vn[2 * kk + 1][2], vn[2 * kk + 1][3])};
#pragma unroll
        for (int j = 0; j < NJ; j += 2) {  // key tiles j, j + 1 in one ldmatrix.x4
          uint32_t bk[4];
          ldsm_x4(bk, Kh + (kb + 8 * j + lr) * I::TP + 16 * kk + lc);
          mma_f16(sa[j], a, {bk[0], bk[1]});
          mma_f16(sa[j + 1], a, {bk[2], bk[3]});
        }
      }
    } else {
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
    }

    // The swap wrote this stage's W rows through the generic proxy; each writer orders that before the bulk
    // copy that will overwrite them (then the barrier, then the issue).
    if constexpr (!Lay::x_separate) fence_proxy_async();
    __syncthreads();  // every warp is done with stage s and with the swap area
    if (tid == 0 && c + 2 < nc) {
      if constexpr (MC) mbar_arrive_remote(&bars[2 + s], 0);  // tell the leader stage s is free here
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
  if constexpr (MC) cluster_sync();  // no CTA leaves while another may still signal its barriers
}

}  // namespace

#ifndef KESTREL_SIMT_EMU
template <int K, typename StateT, int VM, bool F16, bool MC>
void launch_seq2(const ChunkArgs& a, StateT* pool, cudaStream_t stream) {
  auto seq = seq2_kernel<K, StateT, VM, F16, MC>;
  using Lay = Seq2Layout<K, VM, F16, MC>;
  constexpr size_t smem = Lay::smem;
  KCUDA_CHECK(cudaFuncSetAttribute(seq, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned(Lay::NCB), unsigned(a.H), unsigned(a.B));
  if constexpr (!MC) {
    seq<<<grid, 64 * VM, smem, stream>>>(a.cu, a.cs, a.slots, a.imgs, pool, a.o, a.ld, a.H);
    KCUDA_CHECK_LAUNCH();
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(64 * VM);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(Lay::NCB);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const char* imgs = a.imgs;
    KCUDA_CHECK(cudaLaunchKernelEx(&cfg, seq, a.cu, static_cast<const int32_t*>(a.cs), a.slots, imgs, pool, a.o, a.ld,
                                   a.H));
  }
}

#define KDA_INSTANTIATE_SEQ(K, F16)                                                                 \
  template void launch_seq2<K, float, 1, F16, false>(const ChunkArgs&, float*, cudaStream_t);       \
  template void launch_seq2<K, float, 2, F16, false>(const ChunkArgs&, float*, cudaStream_t);       \
  template void launch_seq2<K, float, 1, F16, true>(const ChunkArgs&, float*, cudaStream_t);        \
  template void launch_seq2<K, uint16_t, 1, F16, false>(const ChunkArgs&, uint16_t*, cudaStream_t); \
  template void launch_seq2<K, uint16_t, 2, F16, false>(const ChunkArgs&, uint16_t*, cudaStream_t); \
  template void launch_seq2<K, uint16_t, 1, F16, true>(const ChunkArgs&, uint16_t*, cudaStream_t);
#define KDA_INSTANTIATE(K)    \
  KDA_INSTANTIATE_SEQ(K, false) \
  KDA_INSTANTIATE_SEQ(K, true)
KDA_INSTANTIATE(32)
KDA_INSTANTIATE(64)
KDA_INSTANTIATE(128)
#undef KDA_INSTANTIATE
#undef KDA_INSTANTIATE_SEQ
#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda::kda_detail
