// Benchmark of the KDA delta-rule scans (kernels/cuda/kda.h) at one TP8 rank's K3.1 shape (12 heads × 128;
// also the full 96 heads for one prefill): the chunk-parallel prefill kda_chunked (explicit workspace, as
// the engine calls it) at 8K, 32K, 128K tokens, 8 × 8K packed, and 32K × 96 heads, next to FLA's
// chunk_kda measured on our H200 (ANCHORS.md; bench/gpu/kda_peer.py re-measures it in the same run); and
// decode (one token per request) through kda_decode and kda_recurrent at batch 1 .. 1024, FP32 and FP16
// state, with the state traffic (read + write of f32/f16 [H, 128, 128] per request) in TB/s.
//
// Timing: CUDA events around every launch, median of the repetitions after warm-ups. Decode rotates over
// disjoint slot sets of a state pool several times the L2, so every launch reads its states from HBM.
// Inputs are random (q, k unit-norm per head, q scaled by Dk^-1/2, g = −5·σ(z), β in (0, 1)), tiled from
// 4096 random rows for the long prefills.
//
//   bench_kda [--quick] [--only prefill|decode]
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kda.h"

using namespace kestrel;

namespace {

constexpr int64_t kDk = 128;

// Median over `reps` launches of fn, each bracketed by its own pair of events.
double median_us(const std::function<void()>& fn, int warm, int reps) {
  for (int i = 0; i < warm; ++i) fn();
  KCUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(size_t(2 * reps));
  for (auto& e : ev) KCUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    KCUDA_CHECK(cudaEventRecord(ev[size_t(2 * i)]));
    fn();
    KCUDA_CHECK(cudaEventRecord(ev[size_t(2 * i + 1)]));
  }
  KCUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> t(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]));
    t[size_t(i)] = 1e3 * ms;
  }
  for (auto& e : ev) KCUDA_CHECK(cudaEventDestroy(e));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Scan inputs for T rows of H heads: q, k, v, g f32 [T, H*Dk], beta f32 [T, H]. The host makes R ≤ 4096
// random rows; the device copies them down the buffer.
struct Inputs {
  cuda::DeviceBuffer q, k, v, g, beta;
};
Inputs make_inputs(int64_t T, int64_t H, uint64_t seed) {
  const int64_t HD = H * kDk, R = std::min<int64_t>(T, 4096);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(size_t(R * HD)), k(size_t(R * HD)), v(size_t(R * HD)), g(size_t(R * HD)), beta(size_t(R * H));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      float* qr = &q[size_t(r * HD + h * kDk)];
      float* kr = &k[size_t(r * HD + h * kDk)];
      double sq = 0, sk = 0;
      for (int64_t i = 0; i < kDk; ++i) qr[i] = u(rng), kr[i] = u(rng), sq += qr[i] * qr[i], sk += kr[i] * kr[i];
      const float nq = float(1.0 / std::sqrt(sq * double(kDk))), nk = float(1.0 / std::sqrt(sk));
      for (int64_t i = 0; i < kDk; ++i) qr[i] *= nq, kr[i] *= nk;
      beta[size_t(r * H + h)] = 0.5f + 0.45f * u(rng);
    }
  for (auto& x : v) x = u(rng);
  for (auto& x : g) x = -5.0f / (1.0f + std::exp(-3.0f * u(rng)));
  Inputs in{cuda::DeviceBuffer(size_t(T * HD) * 4), cuda::DeviceBuffer(size_t(T * HD) * 4),
            cuda::DeviceBuffer(size_t(T * HD) * 4), cuda::DeviceBuffer(size_t(T * HD) * 4),
            cuda::DeviceBuffer(size_t(T * H) * 4)};
  auto tile = [&](const cuda::DeviceBuffer& d, const std::vector<float>& h, int64_t row) {
    const size_t piece = size_t(R * row) * 4;
    KCUDA_CHECK(cudaMemcpy(d.data(), h.data(), piece, cudaMemcpyHostToDevice));
    for (int64_t r0 = R; r0 < T; r0 += R)
      KCUDA_CHECK(cudaMemcpy(static_cast<char*>(d.data()) + size_t(r0 * row) * 4, d.data(),
                             size_t(std::min(R, T - r0) * row) * 4, cudaMemcpyDeviceToDevice));
  };
  tile(in.q, q, HD);
  tile(in.k, k, HD);
  tile(in.v, v, HD);
  tile(in.g, g, HD);
  tile(in.beta, beta, H);
  return in;
}

cuda::DeviceBuffer upload_i32(const std::vector<int32_t>& h) {
  cuda::DeviceBuffer d(h.size() * 4);
  d.copy_from_host(h.data(), h.size() * 4);
  return d;
}

void prefill(bool quick) {
  fmt::print("\n== KDA prefill: kda_chunked (chunk 64; TF32 recurrence, BF16 output products), FP32 state ==\n");
  fmt::print("{:<22} {:>10} {:>10} {:>12} {:>14}   {}\n", "shape", "ms", "Mtok/s", "ws GB", "bytes GB", "FLA chunk_kda (ANCHORS)");
  struct Case {
    int64_t H, L, B;
    const char* fla;
  };
  std::vector<Case> cases = {{12, 8192, 1, "0.54 ms"},     {12, 32768, 1, "1.94 ms"}, {12, 131072, 1, "7.57 ms"},
                             {12, 8192, 8, "2.90 ms"},      {96, 32768, 1, "10.9 ms"}};
  if (quick) cases.resize(2);
  for (const Case& c : cases) {
    const int64_t T = c.L * c.B, HD = c.H * kDk;
    Inputs in = make_inputs(T, c.H, 7);
    std::vector<int32_t> cu(size_t(c.B + 1)), slots(size_t(c.B));
    for (int64_t b = 0; b <= c.B; ++b) cu[size_t(b)] = int32_t(b * c.L);
    for (int64_t b = 0; b < c.B; ++b) slots[size_t(b)] = int32_t(b);
    auto dcu = upload_i32(cu), dslots = upload_i32(slots);
    cuda::DeviceBuffer pool(size_t(c.B * c.H * kDk * kDk) * 4), o(size_t(T * HD) * 4);
    KCUDA_CHECK(cudaMemset(pool.data(), 0, size_t(c.B * c.H * kDk * kDk) * 4));
    const size_t ws_bytes = cuda::kda_chunked_workspace_bytes(T, c.B, c.H, kDk);
    cuda::DeviceBuffer ws(ws_bytes);
    auto f = [&] {
      cuda::kda_chunked(static_cast<float*>(in.q.data()), static_cast<float*>(in.k.data()),
                        static_cast<float*>(in.v.data()), static_cast<float*>(in.g.data()), HD,
                        static_cast<float*>(in.beta.data()), c.H, static_cast<int32_t*>(dcu.data()),
                        static_cast<int32_t*>(dslots.data()), static_cast<float*>(pool.data()),
                        static_cast<float*>(o.data()), T, c.B, c.H, kDk, ws.data(), nullptr);
    };
    const double us = median_us(f, 2, quick ? 5 : 15);
    // HBM bytes the design must move: q, k, v, g in, the chunk images out and back in (the value-block
    // CTAs of one head share one read through L2), o out.
    const double img = double(ws_bytes), bytes = 4.0 * T * HD * 4 + 2 * img + double(T) * HD * 4;
    fmt::print("{:<22} {:>10.3f} {:>10.1f} {:>12.2f} {:>14.2f}   {}\n",
               fmt::format("H={} {}×{}", c.H, c.B, c.L), us / 1e3, double(T) / us, img / 1e9, bytes / 1e9, c.fla);
    if (c.H == 12 && c.L == 8192 && c.B == 1) {  // the token-by-token scan, for scale
      auto r = [&] {
        cuda::kda_recurrent(static_cast<float*>(in.q.data()), static_cast<float*>(in.k.data()),
                            static_cast<float*>(in.v.data()), static_cast<float*>(in.g.data()), HD,
                            static_cast<float*>(in.beta.data()), c.H, static_cast<int32_t*>(dcu.data()),
                            static_cast<int32_t*>(dslots.data()), static_cast<float*>(pool.data()),
                            static_cast<float*>(o.data()), c.B, c.H, kDk, nullptr);
      };
      fmt::print("{:<22} {:>10.3f}   (kda_recurrent, same shape)\n", fmt::format("H={} {}×{}", c.H, c.B, c.L),
                 median_us(r, 1, 3) / 1e3);
    }
  }
}

void decode(bool quick) {
  const int64_t H = 12, HD = H * kDk;
  fmt::print("\n== KDA decode: one token per request, H={}, Dk={} (state traffic = 2 × B·H·Dk²·bytes) ==\n", H, kDk);
  fmt::print("{:<28} {:>6} {:>10} {:>10}   {}\n", "kernel", "B", "µs", "TB/s", "anchor (FLA fused_recurrent on our H200)");
  const std::vector<int64_t> batches = quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 8, 64, 256, 1024};
  auto fla = [](int64_t B) {
    return B == 1 ? "6.1 µs" : B == 8 ? "9.2 µs" : B == 64 ? "31.7 µs" : B == 256 ? "106.9 µs (3.8 TB/s)" : "—";
  };
  const double min_pool = 2.0e9;  // bytes of FP32 state the rotation spans (≫ 50 MB of L2)
  for (size_t bi = 0; bi < batches.size(); ++bi) {
    const int64_t B = batches[bi];
    const int64_t per_slot = H * kDk * kDk;
    const int64_t n_sets = std::max<int64_t>(2, int64_t(std::ceil(min_pool / (double(B) * per_slot * 4))));
    const int64_t n_slots = n_sets * B;
    Inputs in = make_inputs(B, H, 11 + uint64_t(B));
    std::vector<int32_t> cu(size_t(B + 1));
    for (int64_t b = 0; b <= B; ++b) cu[size_t(b)] = int32_t(b);
    std::vector<int32_t> slots(static_cast<size_t>(n_slots));
    for (int64_t i = 0; i < n_slots; ++i) slots[size_t(i)] = int32_t(i);  // set s = slots [s·B, (s+1)·B)
    auto dcu = upload_i32(cu), dslots = upload_i32(slots);
    cuda::DeviceBuffer o(size_t(B * HD) * 4);
    for (const bool f16 : {false, true}) {
      const size_t esz = f16 ? 2 : 4;
      cuda::DeviceBuffer pool(size_t(n_slots * per_slot) * esz);
      KCUDA_CHECK(cudaMemset(pool.data(), 0, size_t(n_slots * per_slot) * esz));
      for (const bool dec : {true, false}) {
        int64_t set = 0;
        auto f = [&] {
          const int32_t* sl = static_cast<int32_t*>(dslots.data()) + (set++ % n_sets) * B;
          const float *q = static_cast<float*>(in.q.data()), *k = static_cast<float*>(in.k.data()),
                      *v = static_cast<float*>(in.v.data()), *g = static_cast<float*>(in.g.data()),
                      *beta = static_cast<float*>(in.beta.data());
          const int32_t* cuu = static_cast<int32_t*>(dcu.data());
          float* out = static_cast<float*>(o.data());
          if (f16) {
            auto* p = static_cast<uint16_t*>(pool.data());
            dec ? cuda::kda_decode(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr)
                : cuda::kda_recurrent(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr);
          } else {
            auto* p = static_cast<float*>(pool.data());
            dec ? cuda::kda_decode(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr)
                : cuda::kda_recurrent(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr);
          }
        };
        const double us = median_us(f, 10, quick ? 50 : 200);
        const double tbs = 2.0 * double(B) * per_slot * esz / (us * 1e-6) / 1e12;
        fmt::print("{:<28} {:>6} {:>10.2f} {:>10.2f}   {}\n",
                   fmt::format("{} {}", dec ? "kda_decode" : "kda_recurrent", f16 ? "f16 state" : "f32 state"), B, us,
                   tbs, !f16 ? fla(B) : "");
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else {
      fmt::print(stderr, "usage: bench_kda [--quick] [--only prefill|decode]\n");
      return 2;
    }
  }
  try {
    cudaDeviceProp p{};
    KCUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    fmt::print("device: {} ({} SMs, L2 {} MB)\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);
    if (only.empty() || only == "decode") decode(quick);
    if (only.empty() || only == "prefill") prefill(quick);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
