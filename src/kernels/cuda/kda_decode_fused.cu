// The fused KDA decode chain (kda_decode_fused, kda.h): MODEL.md §3.3 steps 2–7 for one-token rows in one
// launch. Split out of kda.cu (which holds the step-by-step kernels this chain composes: conv_decode_kernel,
// qk_norm_gates_kernel, decode_kernel, out_norm_gate_kernel) to keep both files short; the 4-element state
// vectors and the conv window bound come from kda_internal.cuh, shared with decode_kernel.
#include <cuda_fp16.h>

#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_internal.cuh"
#include "kernels/cuda/launch.h"

namespace kestrel::cuda {
namespace {
using kda_detail::kMaxConvW;
using kda_detail::load4;
using kda_detail::store4;
using kda_detail::cp_async16;
using kda_detail::cp_async_commit;
using kda_detail::cp_async_wait;
}  // namespace

// ---- the fused decode chain (kda_decode_fused) -------------------------------------------------------------
// One CTA of 4·DK threads per (head h, row b). Before the PDL wait (weights are never written by a kernel) the
// CTA copies the head's f_b rows into shared memory (cp.async, when f_b is 16-byte aligned: fb_async) and each
// conv thread reads its channel's conv weights, so their DRAM latency overlaps the previous kernel instead of
// sitting in phase A's chain (the f_b rows were read as 2-byte loads, 8 in flight a thread, after the conv).
// With `early` (default; KESTREL_KDA_EARLY=0 for A/B) the row's state slice, its conv history and the per-head
// weights (dt_bias, a_log, o_norm) are loaded before the wait as well: no kernel of a pure-decode step writes
// them before this one (the previous step, and any copy between steps, completed before the step's input
// copies), so after the wait only the previous kernel's outputs (q|k|v, f_a, b, gate) are read.
// Phases, separated by barriers:
//  A. threads < 3·DK run the conv of one q/k/v channel of the head (conv_decode_kernel's arithmetic,
//     history shifted in place); then (without early) every thread starts its state loads (the decode_kernel
//     layout: DK/32 slices of 128 threads, slice c owning value columns 32c..32c+31) and all threads compute
//     the f_b rows of the head (4 threads per output, FP32, shuffle-summed, rounded to bf16);
//  Resources (ptxas): 64 registers at 512 threads (two CTAs per SM at Dk = 128); with the early loads (state
//  and history held in registers through phase A) 8 / 16 bytes of stack at Dk = 128 (FP32 / FP16 state).
//  B. one warp each sums q² and k²; threads < DK normalise, form g and keep exp(g) (qk_norm_gates' formulas);
//  C. the delta-rule step of decode_kernel for one token, o into shared memory;
//  D. one warp sums o²; threads < DK write ô (out_norm_gate's formula).
namespace {

template <int DK, typename StateT>
__global__ void __launch_bounds__(4 * DK, 256 / DK) kda_decode_fused_kernel(const KdaDecodeIn in, const KdaDecodeWeights wt,
                                                                   uint16_t* __restrict__ hist_pool,
                                                                   const int32_t* __restrict__ slots,
                                                                   StateT* __restrict__ pool,
                                                                   uint16_t* __restrict__ ohat, int H, int W,
                                                                   bool fb_async, bool early) {
  constexpr int R = DK / 16, SL = DK / 32;
  __shared__ __align__(16) uint16_t fbs[DK * DK];  // bf16 [DK, DK]: f_b rows h·DK .. h·DK + DK − 1 (fb_async)
  __shared__ float fas[DK];                        // f_a output of this row (bf16 values)
  __shared__ float cv[3 * DK];     // conv + SiLU outputs (bf16 values): q | k | v
  __shared__ float zs[DK];         // z (bf16 values)
  __shared__ float qs[DK], ks[DK], ds[DK];
  __shared__ float os[DK];
  __shared__ float red[SL][4][9][8];
  __shared__ float sums[3];
  dev::pdl_trigger();
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int64_t HD = int64_t(H) * DK, C3 = 3 * HD;
  if (fb_async) {
    const uint16_t* fb_h = wt.f_b + int64_t(h) * DK * DK;
    for (int v = tid; v < DK * DK / 8; v += 4 * DK) cp_async16(fbs + 8 * v, fb_h + 8 * v, 16);
    cp_async_commit();
  }
  float wcr[kMaxConvW];
  if (tid < 3 * DK) {
    const float* wc = wt.conv + ((tid / DK) * HD + int64_t(h) * DK + tid % DK) * W;
#pragma unroll
    for (int j = 0; j < kMaxConvW; ++j) wcr[j] = j < W ? wc[j] : 0.0f;
  }
  // early: the row's own recurrent state and conv history (written only by this layer's launch of an earlier
  // step, never by a kernel of this step: the fused path runs on pure-decode steps) and the per-head weights
  // are loaded before the PDL wait too, so no DRAM round trip is left on the chain after it.
  const bool padded = in.cu && in.cu[b + 1] - in.cu[b] != 1;  // a padded row of a graph bucket: no token, no state
  const int slot = padded ? 0 : slots[b];
  const int lane = tid & 31, warp = tid >> 5, slice = warp >> 2, w = warp & 3, sub = lane >> 3, c4 = lane & 7;
  const int col = slice * 32 + 4 * c4;
  StateT* S = pool + (int64_t(slot) * H + h) * DK * DK;
  const int64_t ch = (tid / DK) * HD + int64_t(h) * DK + tid % DK;  // this thread's q/k/v channel (tid < 3·DK)
  uint16_t* hist = hist_pool + int64_t(slot) * (W - 1) * C3;
  uint16_t hv[kMaxConvW];
  float s[R][4];
  float dtb = 0.0f, alog = 0.0f, onw = 0.0f;
  auto load_hist = [&] {
    if (tid < 3 * DK) {
#pragma unroll
      for (int j = 0; j < kMaxConvW - 1; ++j)
        if (j < W - 1) hv[j] = hist[j * C3 + ch];
    }
  };
  auto load_state = [&] {  // decode_kernel's layout
#pragma unroll
    for (int m = 0; m < R; ++m) load4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  };
  if (early && !padded) {
    load_hist();
    load_state();
    if (tid < DK) dtb = wt.dt_bias[int64_t(h) * DK + tid], alog = wt.a_log[h], onw = wt.o_norm[tid];
  }
  dev::pdl_wait();
  if (padded) {
    cp_async_wait<0>();
    return;
  }
  if (!early && tid < DK) dtb = wt.dt_bias[int64_t(h) * DK + tid], alog = wt.a_log[h], onw = wt.o_norm[tid];
  if (tid < DK) fas[tid] = dev::bf16_to_f32(in.fa[int64_t(b) * in.ld_fa + tid]);
  // The row's β logit and this thread's output-gate logit, read here beside f_a (all three written by the
  // previous kernel): issued at the end of phases C and D they put two more L2 round trips on the chain.
  const uint16_t bl_raw = in.bl[int64_t(b) * in.ld_bl + h];
  const uint16_t gate_raw = tid < DK ? in.gate[int64_t(b) * in.ld_gate + int64_t(h) * DK + tid] : uint16_t(0);
  // A. the conv of this thread's channel.
  if (!early) load_hist();
  if (tid < 3 * DK) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j)
      if (j < W - 1) acc += wcr[j] * dev::bf16_to_f32(hv[j]);
    const uint16_t cur = in.qkv[int64_t(b) * in.ld_qkv + ch];
    float wlast = wcr[0];  // wcr[W − 1], picked by unrolled compares: a runtime index would put wcr in local memory
#pragma unroll
    for (int j = 1; j < kMaxConvW; ++j)
      if (j == W - 1) wlast = wcr[j];
    acc += wlast * dev::bf16_to_f32(cur);
    cv[tid] = dev::round_bf16(acc * dev::sigmoid(acc));
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j)
      if (j < W - 1) hist[j * C3 + ch] = j + 1 < W - 1 ? hv[j + 1] : cur;
  }
  // Without early, the state loads go out here, under the f_b reads and the norms.
  if (!early) load_state();
  cp_async_wait<0>();
  __syncthreads();  // fbs and fas complete
  {  // z = bf16(f_b[h·DK + i, :]·fa), 4 threads per output, DK/4 terms each.
    const int i = tid >> 2, part = tid & 3;
    const float* fa = fas + part * (DK / 4);
    float acc = 0.0f;
    if (fb_async) {
      const uint16_t* fr = fbs + i * DK + part * (DK / 4);
#pragma unroll 8
      for (int j = 0; j < DK / 4; ++j) acc = fmaf(dev::bf16_to_f32(fr[j]), fa[j], acc);
    } else {
      const uint16_t* fr = wt.f_b + (int64_t(h) * DK + i) * DK + part * (DK / 4);
#pragma unroll 8
      for (int j = 0; j < DK / 4; ++j) acc = fmaf(dev::bf16_to_f32(fr[j]), fa[j], acc);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (part == 0) zs[i] = dev::round_bf16(acc);
  }
  __syncthreads();
  // B. norms and gates.
  if (warp < 2) {
    float a = 0.0f;
    for (int i = lane; i < DK; i += 32) a = fmaf(cv[warp * DK + i], cv[warp * DK + i], a);
    a = dev::warp_sum(a);
    if (lane == 0) sums[warp] = a;
  }
  __syncthreads();
  if (tid < DK) {
    const float qn = (1.0f / sqrtf(float(DK))) / sqrtf(sums[0] + 1e-6f), kn = 1.0f / sqrtf(sums[1] + 1e-6f);
    qs[tid] = cv[tid] * qn;
    ks[tid] = cv[DK + tid] * kn;
    const float a = expf(alog);
    const float zi = zs[tid] + dtb;
    ds[tid] = expf(wt.lower * dev::sigmoid(a * zi));
  }
  __syncthreads();
  // C. one delta-rule step (decode_kernel's arithmetic for one token).
  {
    const float bt = dev::sigmoid(dev::bf16_to_f32(bl_raw));
    float vv[4], kr[R], a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, bq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, kq = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) vv[c] = cv[2 * DK + col + c];
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = 16 * m + 4 * w + sub;
      const float d = ds[i], qi = qs[i];
      kr[m] = ks[i];
      kq = fmaf(kr[m], qi, kq);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[m][c] *= d;
        a[c] = fmaf(s[m][c], kr[m], a[c]);
        bq[c] = fmaf(s[m][c], qi, bq[c]);
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      a[c] += __shfl_xor_sync(0xffffffffu, a[c], 8);
      a[c] += __shfl_xor_sync(0xffffffffu, a[c], 16);
      bq[c] += __shfl_xor_sync(0xffffffffu, bq[c], 8);
      bq[c] += __shfl_xor_sync(0xffffffffu, bq[c], 16);
    }
    kq += __shfl_xor_sync(0xffffffffu, kq, 8);
    kq += __shfl_xor_sync(0xffffffffu, kq, 16);
    if (sub == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        red[slice][w][c][c4] = a[c];
        red[slice][w][4 + c][c4] = bq[c];
      }
      red[slice][w][8][c4] = kq;
    }
    __syncthreads();
    float u[4], ob[4], kqs = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = ob[c] = 0.0f;
#pragma unroll
    for (int ww = 0; ww < 4; ++ww) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        u[c] += red[slice][ww][c][c4];
        ob[c] += red[slice][ww][4 + c][c4];
      }
      kqs += red[slice][ww][8][c4];
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = bt * (vv[c] - u[c]);
#pragma unroll
    for (int m = 0; m < R; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[m][c] = fmaf(kr[m], u[c], s[m][c]);
    if (w == 0 && sub == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) os[col + c] = fmaf(u[c], kqs, ob[c]);
    }
#pragma unroll
    for (int m = 0; m < R; ++m) store4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  }
  __syncthreads();
  // D. ô = bf16(RMSNorm(o) ⊙ σ(gate)).
  if (warp == 0) {
    float a = 0.0f;
    for (int i = lane; i < DK; i += 32) a = fmaf(os[i], os[i], a);
    a = dev::warp_sum(a);
    if (lane == 0) sums[2] = a;
  }
  __syncthreads();
  if (tid < DK) {
    const float r = 1.0f / sqrtf(sums[2] / float(DK) + wt.eps);
    const int64_t c = int64_t(h) * DK + tid;
    const float gt = dev::sigmoid(dev::bf16_to_f32(gate_raw));
    ohat[int64_t(b) * HD + c] = dev::f32_to_bf16(os[tid] * r * onw * gt);
  }
}

// A/B switches, on unless the variable is "0": KESTREL_KDA_FB_ASYNC (the f_b rows through shared memory) and
// KESTREL_KDA_EARLY (the state, conv history and per-head weights before the PDL wait).
bool env_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e && e[0] == '0');
}

template <typename StateT>
void decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool, const int32_t* slots,
                  StateT* pool, uint16_t* ohat, int64_t B, int64_t H, int64_t Dk, int64_t W, cudaStream_t stream) {
  KCUDA_REQUIRE(in.qkv && in.gate && in.fa && in.bl && w.conv && w.f_b && w.dt_bias && w.a_log && w.o_norm && slots &&
                    pool && ohat && (W == 1 || hist_pool),
                std::string("kda_decode_fused: null pointer"));
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && W >= 1 && W <= kMaxConvW,
                std::string("kda_decode_fused: bad B, H or W"));
  KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(pool) % (4 * sizeof(StateT)) == 0,
                std::string("kda_decode_fused: the state pool must be aligned for 4-element vectors"));
  if (B == 0) return;
  const dim3 grid{unsigned(H), unsigned(B), 1u};
  // f_b rows through shared memory when the 16-byte copies are aligned (every head's block is, if the base is).
  static const bool fb_async_on = env_on("KESTREL_KDA_FB_ASYNC"), early = env_on("KESTREL_KDA_EARLY");
  const bool fb_async = (reinterpret_cast<uintptr_t>(w.f_b) & 15u) == 0 && fb_async_on;
  switch (Dk) {
    case 32: {
      void (*k)(KdaDecodeIn, KdaDecodeWeights, uint16_t*, const int32_t*, StateT*, uint16_t*, int, int, bool, bool) =
          kda_decode_fused_kernel<32, StateT>;
      launch_pdl(k, grid, dim3(128), 0, stream, in, w, hist_pool, slots, pool, ohat, int(H), int(W), fb_async, early);
      break;
    }
    case 64: {
      void (*k)(KdaDecodeIn, KdaDecodeWeights, uint16_t*, const int32_t*, StateT*, uint16_t*, int, int, bool, bool) =
          kda_decode_fused_kernel<64, StateT>;
      launch_pdl(k, grid, dim3(256), 0, stream, in, w, hist_pool, slots, pool, ohat, int(H), int(W), fb_async, early);
      break;
    }
    case 128: {
      void (*k)(KdaDecodeIn, KdaDecodeWeights, uint16_t*, const int32_t*, StateT*, uint16_t*, int, int, bool, bool) =
          kda_decode_fused_kernel<128, StateT>;
      launch_pdl(k, grid, dim3(512), 0, stream, in, w, hist_pool, slots, pool, ohat, int(H), int(W), fb_async, early);
      break;
    }
    default: KCUDA_REQUIRE(false, "kda_decode_fused: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  }
}

}  // namespace

void kda_decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool, const int32_t* slots,
                      float* state_pool, uint16_t* ohat, int64_t B, int64_t H, int64_t Dk, int64_t W,
                      cudaStream_t stream) {
  decode_fused(in, w, hist_pool, slots, state_pool, ohat, B, H, Dk, W, stream);
}
void kda_decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool, const int32_t* slots,
                      uint16_t* state_pool, uint16_t* ohat, int64_t B, int64_t H, int64_t Dk, int64_t W,
                      cudaStream_t stream) {
  decode_fused(in, w, hist_pool, slots, state_pool, ohat, B, H, Dk, W, stream);
}

}  // namespace kestrel::cuda
