// Benchmark of the routed MoE experts (cuda::moe_experts_mxfp4) at the real K3.1 shape: 896 experts, top-16,
// latent Lt 3584, intermediate I 3072, MXFP4 (15.7 GB of expert weights on the GPU, random bytes in the
// kernels' layout with e8m0 scales 2^-9..2^-4).
//
// For each batch T: 8 routings (16 distinct random experts per token, weights 1/16), rotated call to call so
// consecutive calls hit different experts (and nothing is served from the 50 MB L2 twice); median of the timed
// calls with CUDA events around each call, eager and as a replayed CUDA graph (the engine's decode path; each
// replay waits for the last, so the host's launch latency is inside the time), and the graph replays queued back
// to back with an event pair around each (the GPU never idles for the host, as inside the engine's step graph,
// where a kernel always precedes the experts: PERF moe_experts_queued_us_bT). Prints
// µs, the experts hit, the weight bytes those experts hold (every hit expert is read once: 17.55 MB each),
// GB/s of those bytes, % of a device-to-device copy measured in the same run, and TFLOP/s; per variant
// (moe.h MoeTokenTile and MoeExpertsOptions): auto (what the engine runs), the GEMM families forced (t8, t32:
// FP32-scale kernels; stream: decode; wide: prefill), stream without PDL / grouped at T ≤ 2 / ungrouped, wide
// without PDL, stream-ctasN (the persistent grid forced to N CTAs), t8-nopdl, t8-ksN (t8's K split forced to
// N), t8pM[-cN][-sS][-kK][-hH] (the persistent / fixed-grid t8 knobs), auto-norm (the latent RMSNorm fused into the
// combine launch, as the engine runs it: MoeExpertsOptions::norm_w; its kernel as KESTREL_MOE_COMBINE_CLUSTER says),
// auto-norm-cta / auto-norm-cluster (the same with the one-CTA or the cluster combine + norm forced,
// MoeExpertsOptions::combine_cluster = 0 / 1; moe_combine.cu) — so each change can be seen on its own.
// The comparison peer is bench/gpu/moe_peer.py.
//
//   bench_moe [--quick] [--batches 1,8,64,256,4096] [--variants auto,t8,...] [--breakdown] [--perf] [--topk K]
//
// --topk K (default 16): K experts a token instead of 16 — e.g. 2, what one rank of an EP8 deployment sees at batch 1
// (896 / 8 experts a rank, 16 / 8 of a token's hits) and what the reduced mini's MoE layers run (bench_ops).
// The cluster combine's A/B (moe_combine.cu), alternated in one process:
//   bench_moe --topk 2 --batches 1,8,64 --variants auto-norm-cta,auto-norm-cluster --breakdown
//
// --breakdown: per launch (group, w1|w3, w2, combine) median µs of eager calls with events between the launches
// (PDL off there), for each variant. --perf: the scoreboard only (auto, graph replay, T = 1, 8, 64, 256, 4096;
// well under a minute): lines `PERF moe_experts_us_b1 <µs>` ... `PERF copy_gbps <GB/s>`.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/moe.h"

using namespace kestrel;

namespace {

// Random bytes in [lo, lo+span) on the device, filled on the host in 64 MiB pieces (splitmix per byte).
void fill_random(void* d, size_t n, uint8_t lo, uint8_t span, uint64_t seed) {
  const size_t piece = size_t(64) << 20;
  std::vector<uint8_t> h(std::min(n, piece));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < h.size(); ++i) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    h[i] = uint8_t(lo + (z ^ (z >> 31)) % span);
  }
  // One piece from the host, the rest copied on the device (the same 64 MiB pattern repeats).
  KCUDA_CHECK(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice));
  for (size_t off = piece; off < n; off += piece)
    KCUDA_CHECK(cudaMemcpy(static_cast<char*>(d) + off, d, std::min(piece, n - off), cudaMemcpyDeviceToDevice));
}
// bf16 values in ±[2^-3, 2^1).
void fill_bf16(void* d, size_t n, uint64_t seed) {
  std::vector<uint16_t> h(n);
  std::mt19937_64 r(seed);
  for (auto& x : h) {
    const uint64_t z = r();
    x = uint16_t(((z & 1) << 15) | ((124 + (z >> 1) % 4) << 7) | ((z >> 8) & 0x7f));
  }
  KCUDA_CHECK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    KCUDA_CHECK(cudaEventCreate(&a));
    KCUDA_CHECK(cudaEventCreate(&b));
  }
  // fn(i) for i = 0.. (warm-ups first); median µs of the timed calls.
  double median_us(const std::function<void(int)>& fn, int warm, int reps, cudaStream_t s) {
    int i = 0;
    for (int w = 0; w < warm; ++w) fn(i++);
    KCUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      KCUDA_CHECK(cudaEventRecord(a, s));
      fn(i++);
      KCUDA_CHECK(cudaEventRecord(b, s));
      KCUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      KCUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms * 1000.0);
    }
    KCUDA_CHECK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
  // The same calls queued back to back (an event pair around each, one sync at the end): the GPU never waits for
  // the host's launch, as inside the engine's step graph where another kernel always precedes the experts.
  double queued_median_us(const std::function<void(int)>& fn, int warm, int reps, cudaStream_t s) {
    int i = 0;
    for (int w = 0; w < warm; ++w) fn(i++);
    std::vector<cudaEvent_t> ev(size_t(2 * reps));
    for (auto& e : ev) KCUDA_CHECK(cudaEventCreate(&e));
    for (int r = 0; r < reps; ++r) {
      KCUDA_CHECK(cudaEventRecord(ev[size_t(2 * r)], s));
      fn(i++);
      KCUDA_CHECK(cudaEventRecord(ev[size_t(2 * r + 1)], s));
    }
    KCUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      float ms = 0;
      KCUDA_CHECK(cudaEventElapsedTime(&ms, ev[size_t(2 * r)], ev[size_t(2 * r + 1)]));
      t.push_back(ms * 1000.0);
    }
    for (auto& e : ev) KCUDA_CHECK(cudaEventDestroy(e));
    KCUDA_CHECK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

struct Variant {
  std::string name;
  cuda::MoeExpertsOptions opt;
  bool norm = false;  // the latent RMSNorm in the combine launch (norm_w, normed: set per batch below)
};
// The variants bench_moe knows, by name.
bool make_variant(const std::string& name, Variant& v) {
  using cuda::MoeTokenTile;
  v.name = name;
  v.opt = cuda::MoeExpertsOptions{};
  if (name == "auto") return true;
  if (name == "auto-norm") return v.norm = true, true;
  if (name == "auto-norm-cta") return v.norm = true, v.opt.combine_cluster = 0, true;
  if (name == "auto-norm-cluster") return v.norm = true, v.opt.combine_cluster = 1, true;
  if (name == "auto-f32") return v.opt.t8_scales = 0, true;   // t8: FP32 scales in both GEMMs
  if (name == "auto-fold") return v.opt.t8_scales = 1, true;  // t8: w1|w3 folded, w2 FP32 scales
  if (name == "auto-raw") return v.opt.t8_scales = 2, true;   // t8: w1|w3 folded, w2's raw decode of h·2^100
  if (name == "t8") return v.opt.tile = MoeTokenTile::t8, true;
  if (name == "t32") return v.opt.tile = MoeTokenTile::t32, true;
  if (name == "stream") return v.opt.tile = MoeTokenTile::stream, true;
  if (name == "wide") return v.opt.tile = MoeTokenTile::wide, true;
  if (name == "stream-nopdl") return v.opt.tile = MoeTokenTile::stream, v.opt.pdl = 0, true;
  if (name == "stream-grouped") return v.opt.tile = MoeTokenTile::stream, v.opt.grouped = 1, true;
  if (name == "stream-ungrouped") return v.opt.tile = MoeTokenTile::stream, v.opt.grouped = 0, true;
  if (name == "wide-nopdl") return v.opt.tile = MoeTokenTile::wide, v.opt.pdl = 0, true;
  if (name == "t8-nopdl") return v.opt.tile = MoeTokenTile::t8, v.opt.pdl = 0, true;
  if (name.rfind("t8-ks", 0) == 0) {  // t8-ksN: the t8 kernel's K split forced to N
    const int n = std::atoi(name.c_str() + 5);
    if (n < 1 || n > 8) return false;
    return v.opt.tile = MoeTokenTile::t8, v.opt.t8_ksplit = n, true;
  }
  if (name.rfind("t8p", 0) == 0) {  // t8pM[-cN][-sS][-kK][-hH]: persistent t8 for the GEMMs of mask M (1 w1|w3, 2 w2),
    const int m = std::atoi(name.c_str() + 3);  // ≤ N CTAs per SM, its K split S; the fixed-grid GEMM's split K; H K halves
    const size_t c = name.find("-c"), sp = name.find("-s"), k = name.find("-k"), h = name.find("-h");
    if (m < 0 || m > 3) return false;
    v.opt.t8_persist = m;
    if (c != std::string::npos) v.opt.t8p_ctas = std::atoi(name.c_str() + c + 2);
    if (sp != std::string::npos) v.opt.t8p_split = std::atoi(name.c_str() + sp + 2);
    if (k != std::string::npos) v.opt.t8_ksplit = std::atoi(name.c_str() + k + 2);
    if (h != std::string::npos) v.opt.t8p_kh = std::atoi(name.c_str() + h + 2);
    return true;
  }
  if (name.rfind("stream-ctas", 0) == 0) {  // stream-ctasN: the persistent grid forced to N CTAs
    const int n = std::atoi(name.c_str() + 11);
    if (n < 1 || n > 1024) return false;
    return v.opt.tile = MoeTokenTile::stream, v.opt.stream_ctas = n, true;
  }
  return false;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  size_t p = 0;
  while (p < s.size()) {
    const size_t q = s.find(',', p);
    v.push_back(s.substr(p, q == std::string::npos ? std::string::npos : q - p));
    p = q == std::string::npos ? s.size() : q + 1;
  }
  return v;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  size_t p = 0;
  while (p < s.size()) {
    const size_t q = s.find(',', p);
    v.push_back(std::stoll(s.substr(p, q == std::string::npos ? std::string::npos : q - p)));
    p = q == std::string::npos ? s.size() : q + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, perf = false, breakdown = false;
  int64_t K = 16;  // experts a token (--topk)
  std::vector<int64_t> batches = {1, 8, 64, 256, 4096};
  std::vector<std::string> vnames = {"auto", "t8", "stream", "stream-nopdl", "stream-grouped", "t32", "wide", "wide-nopdl"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--perf") {
      perf = true;
    } else if (a == "--breakdown") {
      breakdown = true;
    } else if (a == "--batches" && i + 1 < argc) {
      batches = parse_list(argv[++i]);
    } else if (a == "--variants" && i + 1 < argc) {
      vnames = split(argv[++i]);
    } else if (a == "--topk" && i + 1 < argc) {
      K = std::atoll(argv[++i]);
      if (K < 1 || K > 64) {
        fmt::print(stderr, "bench_moe: --topk {} outside [1, 64]\n", K);
        return 2;
      }
    } else {
      fmt::print(stderr,
                 "usage: bench_moe [--quick] [--perf] [--breakdown] [--topk K] [--batches 1,8,64,256,4096] [--variants auto,auto-f32,auto-fold,auto-raw,t8,t32,"
                 "stream,wide,stream-nopdl,stream-grouped,stream-ungrouped,wide-nopdl,stream-ctasN,t8-nopdl,t8-ksN,"
                 "t8pM[-cN][-sS][-kK][-hH],auto-norm,auto-norm-cta,auto-norm-cluster]\n");
      return 2;
    }
  }
  if (perf && K != 16) {
    fmt::print(stderr, "bench_moe: --perf measures the scoreboard's top-16 only\n");
    return 2;
  }
  if (perf) {
    quick = true;
    batches = {1, 8, 64, 256, 4096};
    vnames = {"auto"};
  }
  std::vector<Variant> variants;
  for (const auto& n : vnames) {
    Variant v;
    if (!make_variant(n, v)) {
      fmt::print(stderr, "bench_moe: unknown variant {}\n", n);
      return 2;
    }
    variants.push_back(v);
  }
  try {
    cudaDeviceProp prop{};
    KCUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    KCUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Timer tm;

    // Ceiling: device-to-device copy of 4 GiB (bytes read + written).
    double copy_gbs = 0;
    {
      const size_t n = size_t(4) << 30;
      cuda::DeviceBuffer a(n), b(n);
      KCUDA_CHECK(cudaMemset(a.data(), 1, n));
      KCUDA_CHECK(cudaDeviceSynchronize());
      const double us = tm.median_us(
          [&](int) { KCUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), n, cudaMemcpyDeviceToDevice, stream)); }, 2, 10,
          stream);
      copy_gbs = 2.0 * double(n) / us / 1e3;
    }

    const int64_t X = 896, Lt = 3584, I = 3072;
    const int64_t p13 = I * Lt / 2, s13 = I * Lt / 32, p2 = Lt * I / 2, s2 = Lt * I / 32;
    const double expert_bytes = double(2 * (p13 + s13) + p2 + s2);
    cuda::DeviceBuffer w1p(size_t(X * p13)), w3p(size_t(X * p13)), w2p(size_t(X * p2)), w1s(size_t(X * s13)),
        w3s(size_t(X * s13)), w2s(size_t(X * s2));
    fill_random(w1p.data(), w1p.size(), 0, 255, 8);
    fill_random(w3p.data(), w3p.size(), 0, 255, 9);
    fill_random(w2p.data(), w2p.size(), 0, 255, 10);
    fill_random(w1s.data(), w1s.size(), 118, 6, 11);
    fill_random(w3s.data(), w3s.size(), 118, 6, 12);
    fill_random(w2s.data(), w2s.size(), 118, 6, 13);
    cuda::MoeExpertWeights mw{static_cast<uint8_t*>(w1p.data()), static_cast<uint8_t*>(w1s.data()),
                              static_cast<uint8_t*>(w3p.data()), static_cast<uint8_t*>(w3s.data()),
                              static_cast<uint8_t*>(w2p.data()), static_cast<uint8_t*>(w2s.data()),
                              p13, s13, p2, s2};
    mw.layout = cuda::kMoeExpertLayout;  // random bytes are valid weights in any layout
    KCUDA_CHECK(cudaDeviceSynchronize());

    fmt::print("## MoE routed experts, MXFP4 W4A16 on tensor cores — {} ({} SMs)\n\n", prop.name,
               prop.multiProcessorCount);
    fmt::print("896 experts, top-{}, Lt 3584, I 3072: {:.2f} MB per expert, {:.1f} GB in all. Device-to-device copy "
               "measured now: {:.0f} GB/s.\n\n",
               K, expert_bytes / 1e6, expert_bytes * double(X) / 1e9, copy_gbs);
    if (perf) fmt::print("PERF copy_gbps {:.1f}\n", copy_gbs);
    fmt::print("| T | variant | experts hit | weight bytes | eager µs | graph µs | graph queued µs | GB/s (graph) | % of copy "
               "| % of copy (queued) | TFLOP/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<std::string> breakdown_rows;
    const int kSets = 8;
    for (int64_t T : batches) {
      // kSets routings, their z, and one workspace/output.
      std::mt19937 r(uint32_t(14 + T));
      std::vector<cuda::DeviceBuffer> dids, dz;
      std::vector<int64_t> hit(kSets);
      cuda::DeviceBuffer dw(size_t(T * K) * 4), dut(size_t(T * Lt) * 2),
          ws(cuda::moe_experts_workspace_bytes(T, X, K, Lt, I)), dnw(size_t(Lt) * 2), dnormed(size_t(T * Lt) * 2);
      fill_bf16(dnw.data(), size_t(Lt), 99);  // the *-norm variants' latent norm weight
      {
        std::vector<float> wts(size_t(T * K), 1.0f / K);
        KCUDA_CHECK(cudaMemcpy(dw.data(), wts.data(), wts.size() * 4, cudaMemcpyHostToDevice));
      }
      for (int s = 0; s < kSets; ++s) {
        std::vector<int32_t> ids(size_t(T * K));
        std::vector<char> used(size_t(X), 0);
        std::vector<int32_t> perm(static_cast<size_t>(X));
        for (int64_t t = 0; t < T; ++t) {
          std::iota(perm.begin(), perm.end(), 0);
          for (int64_t k = 0; k < K; ++k) {  // partial Fisher–Yates: K distinct experts
            std::swap(perm[size_t(k)], perm[size_t(k + int64_t(r() % uint32_t(X - k)))]);
            ids[size_t(t * K + k)] = perm[size_t(k)];
            used[size_t(perm[size_t(k)])] = 1;
          }
        }
        hit[size_t(s)] = std::accumulate(used.begin(), used.end(), int64_t(0));
        dids.emplace_back(ids.size() * 4);
        KCUDA_CHECK(cudaMemcpy(dids.back().data(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        dz.emplace_back(size_t(T * Lt) * 2);
        fill_bf16(dz.back().data(), size_t(T * Lt), uint64_t(100 + s));
      }
      KCUDA_CHECK(cudaDeviceSynchronize());  // setup copies ran on the legacy stream
      const double mean_hit = double(std::accumulate(hit.begin(), hit.end(), int64_t(0))) / kSets;
      const double bytes = mean_hit * expert_bytes;
      const double flops = 2.0 * double(T * K) * double(2 * I * Lt + Lt * I);
      const int reps = perf ? (T >= 1024 ? 10 : 30) : quick ? 10 : (T >= 1024 ? 20 : 50);
      for (Variant var : variants) {
        // Variants that only differ from another at this T are still run: their rows show the same path.
        if (var.norm) {
          var.opt.norm_w = static_cast<const uint16_t*>(dnw.data()), var.opt.norm_eps = 1e-6f;
          var.opt.normed = static_cast<uint16_t*>(dnormed.data());
        }
        auto call = [&](int i, const cuda::MoeExpertsOptions& opt) {
          const int s = i % kSets;
          cuda::moe_experts_mxfp4(static_cast<uint16_t*>(dz[size_t(s)].data()),
                                  static_cast<int32_t*>(dids[size_t(s)].data()), static_cast<float*>(dw.data()), mw, T,
                                  X, K, Lt, I, 4.0f, 25.0f, ws.data(), static_cast<uint16_t*>(dut.data()), stream, opt);
        };
        const double eager = perf ? 0.0 : tm.median_us([&](int i) { call(i, var.opt); }, 3, reps, stream);
        // One graph per routing set, replayed in rotation.
        std::vector<cudaGraphExec_t> execs(kSets);
        for (int s = 0; s < kSets; ++s) {
          cudaGraph_t g;
          KCUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          call(s, var.opt);
          KCUDA_CHECK(cudaStreamEndCapture(stream, &g));
          KCUDA_CHECK(cudaGraphInstantiate(&execs[size_t(s)], g, 0));
          KCUDA_CHECK(cudaGraphDestroy(g));
        }
        const double graph = tm.median_us(
            [&](int i) { KCUDA_CHECK(cudaGraphLaunch(execs[size_t(i % kSets)], stream)); }, 3, reps, stream);
        const double queued = tm.queued_median_us(
            [&](int i) { KCUDA_CHECK(cudaGraphLaunch(execs[size_t(i % kSets)], stream)); }, 3, reps, stream);
        for (auto e : execs) KCUDA_CHECK(cudaGraphExecDestroy(e));
        const double gbs = bytes / graph / 1e3, pct = 100.0 * gbs / copy_gbs, tflops = flops / graph / 1e6;
        fmt::print("| {} | {} | {:.0f} | {:.3g} | {:.1f} | {:.1f} | {:.1f} | {:.0f} | {:.0f}% | {:.0f}% | {:.1f} |\n", T,
                   var.name, mean_hit, bytes, eager, graph, queued, gbs, pct, 100.0 * bytes / queued / 1e3 / copy_gbs,
                   tflops);
        if (perf && var.name == "auto") {
          if (T == 4096) {
            fmt::print("PERF moe_experts_us_t4096 {:.1f}\nPERF moe_experts_tflops_t4096 {:.1f}\n", graph, tflops);
          } else {
            fmt::print("PERF moe_experts_us_b{} {:.1f}\nPERF moe_experts_pct_copy_b{} {:.1f}\n", T, graph, T, pct);
            fmt::print("PERF moe_experts_queued_us_b{} {:.1f}\n", T, queued);
          }
        }
        std::fflush(stdout);
        if (breakdown) {
          // Eager calls with events between the launches (PDL off): median µs per launch.
          cudaEvent_t ev[5];
          for (auto& e : ev) KCUDA_CHECK(cudaEventCreate(&e));
          cuda::MoeExpertsOptions o = var.opt;
          o.marks = ev;
          std::vector<std::vector<double>> part(5);
          int i = 0;
          for (int w = 0; w < 3; ++w) call(i++, o);
          KCUDA_CHECK(cudaStreamSynchronize(stream));
          for (int r = 0; r < reps; ++r) {
            call(i++, o);
            KCUDA_CHECK(cudaEventSynchronize(ev[4]));
            for (int k = 0; k < 4; ++k) {
              float ms = 0;
              KCUDA_CHECK(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
              part[size_t(k)].push_back(ms * 1000.0);
            }
            float ms = 0;
            KCUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[4]));
            part[4].push_back(ms * 1000.0);
          }
          for (auto& e : ev) KCUDA_CHECK(cudaEventDestroy(e));
          double med[5];
          for (int k = 0; k < 5; ++k) {
            std::sort(part[size_t(k)].begin(), part[size_t(k)].end());
            med[k] = part[size_t(k)][part[size_t(k)].size() / 2];
          }
          // w1|w3 and w2 bytes: 2/3 and 1/3 of an expert's.
          breakdown_rows.push_back(fmt::format(
              "| {} | {} | {:.1f} | {:.1f} ({:.0f}%) | {:.1f} ({:.0f}%) | {:.1f} | {:.1f} |", T, var.name, med[0], med[1],
              100.0 * bytes * 2 / 3 / med[1] / 1e3 / copy_gbs, med[2], 100.0 * bytes / 3 / med[2] / 1e3 / copy_gbs,
              med[3], med[4]));
        }
      }
    }
    if (breakdown) {
      fmt::print("\nPer launch, eager, PDL off (% of copy for the GEMMs' weight bytes):\n\n"
                 "| T | variant | group µs | w1·w3 µs | w2 µs | combine µs | total µs |\n|---|---|---|---|---|---|---|\n");
      for (const auto& r : breakdown_rows) fmt::print("{}\n", r);
    }
    fmt::print("\nTargets (issue #14): ≥ 70 % of copy at T = 1, ≥ 60 % at T = 64.\n");
    KCUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
