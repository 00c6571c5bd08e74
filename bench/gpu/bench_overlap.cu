// Would a resident decode kernel hide the small kernels' latency behind the weight stream? A probe for issue #14's
// batch-1 target (bench/RESULTS.md sessions 32–37: the reduced mini's step is ~305 µs of skinny GEMMs at ≈ 85 % of
// copy plus ~210 µs of small kernels' dependent latency between them; 1.3 × floor needs most of the latter hidden).
// The model: L layers, each a BF16 GEMV y_l = W_l·x_l (W_l [N, K], T = 1, FP32 sums), then a "gap" — one warp's
// dependent work, x_{l+1} = bf16(0.01·y_l[:K] + 0.5·x_l), plus a spin of G µs standing for the small kernels (AttnRes
// point, router, combine, ...) — before the next layer may start. Two ways to run the same arithmetic:
//   kernels    per layer a GEMV kernel and a one-warp gap kernel, programmatic dependent launch (as the decode step):
//              each GEMV CTA fills its ring with its first rows before its PDL wait, but with a ring of ~192 KB it
//              becomes resident only when the previous GEMV's CTA leaves its SM;
//   resident   one kernel, one CTA an SM for all layers: each warp streams its rows of every layer, layer after
//              layer, through its own ring of D rows (cp.async, 16 bytes a lane and piece), so during a gap the rings
//              fill with the next layer's first rows; the last warp to finish a layer (an arrival counter) runs the
//              gap and raises the next layer's flag, which the others poll before using x_{l+1}.
// Both read every weight byte once; the ideal is L·bytes/copy + the gaps not hidden by the rings' capacity (at most
// ~26 MB ≈ 6 µs of stream a gap at 132 × 192 KB). Printed: µs a layer, both ways, for gaps of 0 / 2 / 5 µs, beside
// the layer's bytes at the measured copy rate; the two outputs must match bit for bit (the same per-lane order of
// FMAs and the same warp sums), else the row says WRONG.
//
//   bench_overlap [--layers L] [--rows-per-warp R] [--reps N]     (packed by bench/gpu/run.sh pack)
//
// K = 4,096 (8 KB a row), 8 warps a CTA, N = SMs · 8 · R rows (R = 7: 7,392 rows, 60.5 MB a layer on 132 SMs).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "graph_replay.h"

namespace kestrel::bench {
namespace {

namespace dev = cuda::dev;

constexpr int kK = 4096;                  // inputs a row
constexpr int kRowBytes = kK * 2;         // bf16
constexpr int kPieces = kRowBytes / 512;  // 16-byte pieces a lane a row (32 lanes × 16 bytes = 512 bytes a piece row)
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kD = 3;                     // rows in flight a warp: 8 warps × 3 × 8 KB = 192 KB a CTA
constexpr int kSmem = kWarps * kD * kRowBytes;

struct Args {
  const uint16_t* w;  // bf16 [L, N, K]
  uint16_t* x;        // bf16 [L + 1, K]: x_0 given, x_l written by gap l − 1
  float* y;           // f32 [L, N]
  unsigned* done;     // u32 [L]: warps finished with layer l (resident)
  unsigned* flag;     // u32 [L]: x_l ready (resident; flag[0] unused)
  int L, N, R;        // layers, rows a layer, rows a warp a layer
  long long gap_cycles;
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The gap after layer l, by one whole warp: x_{l+1} from y_l and x_l, then the spin.
__device__ void gap(const Args& a, int l) {
  const long long t0 = clock64();
  const int lane = int(threadIdx.x) & 31;
  const uint16_t* xl = a.x + int64_t(l) * kK;
  uint16_t* xn = a.x + int64_t(l + 1) * kK;
  const float* yl = a.y + int64_t(l) * a.N;
  for (int k = lane; k < kK; k += 32)
    xn[k] = dev::f32_to_bf16(0.01f * __ldcg(yl + k) + 0.5f * dev::bf16_to_f32(__ldcg(xl + k)));
  while (clock64() - t0 < a.gap_cycles) {
  }
  __threadfence();
}

// One warp's stream: rows s = s0 .. s1 − 1 of its sequence (layer s / R, row (cta·8 + warp)·R + s % R), through its
// ring at `ring` (kD slots of a row). `issued` rows are already in flight (their groups committed, oldest first).
struct Stream {
  uint32_t ring;  // shared address of this lane's first piece in slot 0
  int cta, warp, lane;
  const Args* a;
  __device__ const uint16_t* row(int s) const {
    const int l = s / a->R, r = (cta * kWarps + warp) * a->R + s % a->R;
    return a->w + (int64_t(l) * a->N + r) * kK;
  }
  __device__ void issue(int s, int total) const {  // one commit group, empty past the end
    if (s < total) {
      const uint16_t* src = row(s);
#pragma unroll
      for (int p = 0; p < kPieces; ++p)
        dev::cp_async16(ring + uint32_t((s % kD) * kRowBytes + p * 512), src + (p * 32 + lane) * 8);
    }
    dev::cp_async_commit();
  }
  // Row s (its group landed: kD − 1 younger groups may be pending) · x (this lane's pieces), summed over the warp.
  __device__ float dot(int s, const uint4 (&xr)[kPieces]) const {
    dev::cp_async_wait<kD - 1>();
    float acc = 0.0f;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      uint4 wv;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(wv.x), "=r"(wv.y), "=r"(wv.z), "=r"(wv.w)
                   : "r"(ring + uint32_t((s % kD) * kRowBytes + p * 512))
                   : "memory");
      float f[8], g[8];
      dev::unpack8(wv, f);
      dev::unpack8(xr[p], g);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc = fmaf(f[j], g[j], acc);
    }
    return dev::warp_sum(acc);
  }
  __device__ void load_x(int l, uint4 (&xr)[kPieces]) const {
#pragma unroll
    for (int p = 0; p < kPieces; ++p)
      xr[p] = __ldcg(reinterpret_cast<const uint4*>(a->x + int64_t(l) * kK + (p * 32 + lane) * 8));
  }
  __device__ int out_row(int s) const { return (cta * kWarps + warp) * a->R + s % a->R; }
};

__device__ Stream make_stream(const Args& a) {
  extern __shared__ __align__(16) uint8_t smem[];
  Stream st;
  st.cta = int(blockIdx.x), st.warp = int(threadIdx.x) >> 5, st.lane = int(threadIdx.x) & 31, st.a = &a;
  st.ring = dev::smem_addr(smem) + uint32_t(st.warp * kD * kRowBytes + st.lane * 16);
  return st;
}

// kernels: layer l's GEMV (its first kD rows a warp issued before the PDL wait), then gap_kernel.
__global__ void __launch_bounds__(kThreads, 1) gemv_kernel(const __grid_constant__ Args a, int l) {
  dev::pdl_trigger();
  const Stream st = make_stream(a);
  const int s0 = l * a.R, s1 = s0 + a.R;
  for (int u = 0; u < kD; ++u) st.issue(s0 + u, s1);
  dev::pdl_wait();  // x_l comes from the gap kernel before
  uint4 xr[kPieces];
  st.load_x(l, xr);
  for (int s = s0; s < s1; ++s) {
    const float v = st.dot(s, xr);
    if (st.lane == 0) a.y[int64_t(l) * a.N + st.out_row(s)] = v;
    st.issue(s + kD, s1);
  }
}
__global__ void __launch_bounds__(32) gap_kernel(const __grid_constant__ Args a, int l) {
  dev::pdl_trigger();
  dev::pdl_wait();
  gap(a, l);
}

// resident: all layers in one launch of one CTA an SM (all co-resident: the flags are polled).
__global__ void __launch_bounds__(kThreads, 1) resident_kernel(const __grid_constant__ Args a) {
  const Stream st = make_stream(a);
  const int total = a.L * a.R, nwarps = int(gridDim.x) * kWarps;
  for (int u = 0; u < kD; ++u) st.issue(u, total);
  uint4 xr[kPieces];
  for (int s = 0; s < total; ++s) {
    const int l = s / a.R;
    if (s % a.R == 0) {  // a new layer: its x once the gap before it is done
      if (l > 0) {
        if (st.lane == 0)
          while (ld_acquire(a.flag + l) == 0u) {
          }
        __syncwarp();
      }
      st.load_x(l, xr);
    }
    const float v = st.dot(s, xr);
    if (st.lane == 0) a.y[int64_t(l) * a.N + st.out_row(s)] = v;
    st.issue(s + kD, total);
    if (s % a.R == a.R - 1 && l + 1 < a.L) {  // this warp's rows of layer l are out
      __threadfence();
      unsigned last = 0;
      if (st.lane == 0) last = atomicAdd(a.done + l, 1u) == unsigned(nwarps - 1);
      last = __shfl_sync(0xffffffffu, last, 0);
      if (last) {
        __threadfence();
        gap(a, l);
        if (st.lane == 0) st_release(a.flag + l + 1, 1u);
      }
    }
  }
  dev::cp_async_wait<0>();
}

struct Timing {
  double us_layer;
  std::vector<float> y_last;
};

Timing run(bool resident, const Args& a, int sms, int reps, cudaStream_t s) {  // x_0 is never overwritten
  cudaGraph_t graph;
  KCUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  KCUDA_CHECK(cudaMemsetAsync(a.done, 0, size_t(a.L) * 4, s));
  KCUDA_CHECK(cudaMemsetAsync(a.flag, 0, size_t(a.L) * 4, s));
  if (resident) {
    resident_kernel<<<unsigned(sms), kThreads, kSmem, s>>>(a);
    KCUDA_CHECK(cudaGetLastError());
  } else {
    for (int l = 0; l < a.L; ++l) {
      cuda::launch_pdl(gemv_kernel, dim3(unsigned(sms)), dim3(kThreads), size_t(kSmem), s, a, l);
      if (l + 1 < a.L) cuda::launch_pdl(gap_kernel, dim3(1), dim3(32), 0, s, a, l);
    }
  }
  KCUDA_CHECK(cudaStreamEndCapture(s, &graph));
  Timing out{median_replay_us(graph, s, reps) / a.L, std::vector<float>(size_t(a.N))};
  KCUDA_CHECK(cudaMemcpy(out.y_last.data(), a.y + int64_t(a.L - 1) * a.N, size_t(a.N) * 4, cudaMemcpyDeviceToHost));
  return out;
}

double copy_gbps(cudaStream_t s) {  // device-to-device copy of 1 GiB, median of 5 (read + write bytes)
  const size_t n = size_t(1) << 30;
  void *src = nullptr, *dst = nullptr;
  KCUDA_CHECK(cudaMalloc(&src, n));
  KCUDA_CHECK(cudaMalloc(&dst, n));
  cudaEvent_t e0, e1;
  KCUDA_CHECK(cudaEventCreate(&e0));
  KCUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> r;
  for (int i = 0; i < 6; ++i) {
    KCUDA_CHECK(cudaEventRecord(e0, s));
    KCUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s));
    KCUDA_CHECK(cudaEventRecord(e1, s));
    KCUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) r.push_back(2.0 * double(n) / (double(ms) * 1e6));
  }
  std::sort(r.begin(), r.end());
  KCUDA_CHECK(cudaEventDestroy(e0));
  KCUDA_CHECK(cudaEventDestroy(e1));
  KCUDA_CHECK(cudaFree(src));
  KCUDA_CHECK(cudaFree(dst));
  return r[r.size() / 2];
}

}  // namespace
}  // namespace kestrel::bench

int main(int argc, char** argv) {
  using namespace kestrel::bench;
  int L = 8, R = 7, reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--layers" && i + 1 < argc) L = std::max(2, std::atoi(argv[++i]));
    else if (a == "--rows-per-warp" && i + 1 < argc) R = std::max(1, std::atoi(argv[++i]));
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: bench_overlap [--layers L] [--rows-per-warp R] [--reps N]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  KCUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount, N = sms * kWarps * R;
  if (N < kK) {
    std::fprintf(stderr, "bench_overlap: N = %d rows < K = %d (the gap reads y_l[:K]); raise --rows-per-warp\n", N, kK);
    return 2;
  }
  KCUDA_CHECK(cudaFuncSetAttribute(gemv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  KCUDA_CHECK(cudaFuncSetAttribute(resident_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  int per_sm = 0;
  KCUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, resident_kernel, kThreads, kSmem));
  if (per_sm < 1) {
    std::fprintf(stderr, "bench_overlap: the resident kernel does not fit an SM\n");
    return 1;
  }
  cudaStream_t s;
  KCUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t wbytes = size_t(L) * N * kRowBytes;
  std::vector<uint16_t> wh(size_t(L) * N * kK);
  uint32_t rng = 12345u;
  for (auto& e : wh) {
    rng = rng * 1664525u + 1013904223u;
    e = kestrel::f32_to_bf16(float(int32_t(rng >> 9) - (1 << 22)) / float(1 << 22) * 0.02f);
  }
  std::vector<uint16_t> x0(kK);
  for (int k = 0; k < kK; ++k) x0[size_t(k)] = kestrel::f32_to_bf16(float((k * 37) % 101 - 50) / 50.0f);
  Args a{};
  uint16_t* w = nullptr;
  KCUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&w), wbytes));
  KCUDA_CHECK(cudaMemcpy(w, wh.data(), wbytes, cudaMemcpyHostToDevice));
  a.w = w;
  KCUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&a.x), size_t(L + 1) * kK * 2));
  KCUDA_CHECK(cudaMemcpy(a.x, x0.data(), kK * 2, cudaMemcpyHostToDevice));
  KCUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&a.y), size_t(L) * N * 4));
  KCUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&a.done), size_t(L) * 4));
  KCUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&a.flag), size_t(L) * 4));
  a.L = L, a.N = N, a.R = R;
  const double gbps = copy_gbps(s);
  const double layer_mb = double(N) * kRowBytes / 1e6, floor_us = double(N) * kRowBytes / (gbps * 1e3);
  std::printf("## Resident vs kernel-a-layer GEMVs — %s (%d SMs), %d layers of %.1f MB (N = %d, K = %d), copy %.0f GB/s "
              "(the layer's bytes: %.1f µs), median of %d graph replays\n\n",
              prop.name, sms, L, layer_mb, N, kK, gbps, floor_us, reps);
  std::printf("| gap µs | kernels µs a layer | resident µs a layer | floor + gap | outputs |\n|---|---|---|---|---|\n");
  int clock_khz = 0;  // the SM clock, for the gaps' spins (clock64)
  KCUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  bool all_ok = true;
  for (double gap_us : {0.0, 2.0, 5.0}) {
    a.gap_cycles = (long long)(gap_us * double(clock_khz) * 1e-3);
    const Timing k = run(false, a, sms, reps, s);
    const Timing r = run(true, a, sms, reps, s);
    const bool same = std::equal(k.y_last.begin(), k.y_last.end(), r.y_last.begin(),
                                 [](float p, float q) { return std::memcmp(&p, &q, 4) == 0; });
    all_ok &= same;
    std::printf("| %.0f | %.2f | %.2f | %.2f | %s |\n", gap_us, k.us_layer, r.us_layer, floor_us + gap_us,
                same ? "equal" : "WRONG");
    std::fprintf(stderr, "OVERLAP kernels_us_gap%.0f %.3f\nOVERLAP resident_us_gap%.0f %.3f\n", gap_us, k.us_layer,
                 gap_us, r.us_layer);
  }
  KCUDA_CHECK(cudaStreamDestroy(s));
  return all_ok ? 0 : 1;
}
