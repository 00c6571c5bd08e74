// Benchmark of the tensor-core DSA indexer (kernels/cuda/indexer.h) at the real shape: 32 heads × 128,
// index_topk 2048, FP8 (132 B/token) and MXFP4 (68 B/token) keys in a paged pool (P = 128, one shared pool,
// pages reused when B·S exceeds it). Decode: B = 1, 8, 64 rows (one request each) at S = 4K, 32K, 128K;
// prefill: T = 2048 rows of one request ending at S = 32K (and 1M unless --quick). CUDA events, median of
// many launches of the whole launch sequence; µs, GB/s of key bytes (each key byte counted once per row
// group that reads it: B·S·bytes for decode, S·bytes per 8-row group for prefill is L2 traffic, so the
// prefill line reports TFLOP/s instead), % of a device-to-device copy measured in the same run. The exact-
// order kernel it replaces (paged.h indexer_select_paged) runs at B = 64, S = 32K for the speed-up, and the
// raw agreement of the two selections is printed. Lines `PERF <key> <value>` feed bench/gpu/perf.py.
//
//   bench_indexer [--quick]
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu_ref.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/paged.h"

using namespace kestrel;

namespace {

// bf16 values uniform-ish in ±[2^-3, 2^1): sign, exponent 124..127, random mantissa.
void fill_bf16(void* d, size_t n, uint64_t seed) {
  std::vector<uint16_t> h(std::min<size_t>(n, size_t(32) << 20));
  std::mt19937_64 r(seed);
  for (auto& x : h) {
    const uint64_t z = r();
    x = uint16_t(((z & 1) << 15) | ((124 + (z >> 1) % 4) << 7) | ((z >> 8) & 0x7f));
  }
  for (size_t off = 0; off < n; off += h.size())
    KCUDA_CHECK(cudaMemcpy(static_cast<uint16_t*>(d) + off, h.data(), std::min(h.size(), n - off) * 2,
                           cudaMemcpyHostToDevice));
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    KCUDA_CHECK(cudaEventCreate(&a));
    KCUDA_CHECK(cudaEventCreate(&b));
  }
  double median_us(const std::function<void()>& fn, int warm, int reps) {
    for (int i = 0; i < warm; ++i) fn();
    KCUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      KCUDA_CHECK(cudaEventRecord(a));
      fn();
      KCUDA_CHECK(cudaEventRecord(b));
      KCUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      KCUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms * 1000.0);
    }
    KCUDA_CHECK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

template <typename T>
T* up(cuda::DeviceBuffer& d, const std::vector<T>& h) {
  d = cuda::DeviceBuffer(std::max<size_t>(h.size(), 1) * sizeof(T));
  KCUDA_CHECK(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(d.data());
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && !std::strcmp(argv[1], "--quick");
  cudaDeviceProp prop{};
  KCUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  fmt::print("device: {} ({} SMs)\n", prop.name, prop.multiProcessorCount);
  Timer tm;
  double copy_gbs = 0;
  {
    const size_t n = size_t(2) << 30;
    cuda::DeviceBuffer a(n), b(n);
    KCUDA_CHECK(cudaMemset(a.data(), 1, n));
    const double us = tm.median_us([&] { KCUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), n, cudaMemcpyDeviceToDevice)); }, 2, 10);
    copy_gbs = 2.0 * double(n) / us / 1e3;
    fmt::print("device-to-device copy: {:.0f} GB/s (2 GiB, read + write)\n", copy_gbs);
  }
  const int64_t Hi = 32, Di = 128, Ki = 2048, P = 128, maxT = 2048;
  const int64_t pool_tokens = int64_t(8) << 20;
  cuda::DeviceBuffer qi(size_t(maxT * Hi * Di) * 2), hw(size_t(maxT * Hi) * 4), sel(size_t(maxT * Ki) * 4);
  fill_bf16(qi.data(), size_t(maxT * Hi * Di), 41);
  {
    std::vector<float> h(size_t(maxT * Hi));
    std::mt19937 r(42);
    for (auto& x : h) x = float(r() % 1000) / 500.0f - 0.5f;
    KCUDA_CHECK(cudaMemcpy(hw.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
  const auto q = static_cast<const uint16_t*>(qi.data());
  const auto w = static_cast<const float*>(hw.data());
  const auto s = static_cast<int32_t*>(sel.data());
  for (kestrel::IndexKeyFormat kf : {kestrel::IndexKeyFormat::fp8, kestrel::IndexKeyFormat::mxfp4}) {
    const char* fname = kf == kestrel::IndexKeyFormat::fp8 ? "fp8" : "mxfp4";
    cuda::PagedMlaCache c;
    c.key_format = kf, c.block_size = int(P), c.C = 512, c.R = 64, c.Di = Di;
    const int64_t tb = c.key_token_bytes();
    cuda::DeviceBuffer arena(size_t(pool_tokens * tb));
    {
      cuda::DeviceBuffer rows(size_t(65536 * Di) * 2), slots(65536 * 8);
      fill_bf16(rows.data(), size_t(65536 * Di), 43);
      std::vector<int64_t> hs(65536);
      c.keys = static_cast<uint8_t*>(arena.data());
      for (int64_t off = 0; off < pool_tokens; off += 65536) {
        std::iota(hs.begin(), hs.end(), off);
        KCUDA_CHECK(cudaMemcpy(slots.data(), hs.data(), hs.size() * 8, cudaMemcpyHostToDevice));
        cuda::paged_write_keys(c, static_cast<uint16_t*>(rows.data()), Di, static_cast<int64_t*>(slots.data()), 65536,
                               nullptr);
      }
      KCUDA_CHECK(cudaDeviceSynchronize());
    }
    fmt::print("\n### Indexer on tensor cores, {} keys ({} B/token), Hi 32 × Di 128, top-{}, P = {}\n\n"
               "| rows | S | µs | key GB/s | % of copy | TFLOP/s | workspace MiB | chunks |\n|---|---|---|---|---|---|---|---|\n",
               fname, tb, Ki, P);
    auto run = [&](const std::vector<int32_t>& lens, const std::vector<int32_t>& req, const std::vector<int32_t>& tables,
                   int64_t bt_stride, int64_t S, int reps, double key_bytes, const std::string& label) {
      cuda::DeviceBuffer dl, dr, dt;
      const int64_t T = int64_t(lens.size());
      const int32_t* pl = up(dl, lens);
      const int32_t* pr = up(dr, req);
      c.block_tables = up(dt, tables), c.bt_stride = bt_stride;
      const size_t wsb = cuda::indexer_select_paged_tc_workspace_bytes(T, S, Ki);
      cuda::DeviceBuffer ws(wsb);
      const int64_t chunk = cuda::indexer_select_paged_tc_chunk(T, S, Ki, wsb);
      const double us = tm.median_us([&] {
        cuda::indexer_select_paged_tc(q, w, c, pl, pr, T, S, Hi, Ki, ws.data(), wsb, s, nullptr);
      }, 2, reps);
      double flops = 0;
      for (int32_t n : lens) flops += 2.0 * double(n) * double(Hi * Di);
      const double gbs = key_bytes / us / 1e3;
      fmt::print("| {} | {} | {:.1f} | {:.0f} | {:.0f}% | {:.1f} | {:.1f} | {} |\n", label, S, us, gbs,
                 100 * gbs / copy_gbs, flops / us / 1e6, double(wsb) / (1 << 20), (S + chunk - 1) / chunk);
      std::fflush(stdout);
      return us;
    };
    for (int64_t S : {int64_t(4096), int64_t(32768), int64_t(131072)}) {
      for (int64_t B : {int64_t(1), int64_t(8), int64_t(64)}) {
        const int64_t nb = (S + P - 1) / P, pool_pages = pool_tokens / P;
        std::vector<int32_t> tables(static_cast<size_t>(B * nb)), lens(static_cast<size_t>(B), int32_t(S)),
            req(static_cast<size_t>(B));
        for (int64_t b = 0; b < B; ++b) {
          req[size_t(b)] = int32_t(b);
          for (int64_t j = 0; j < nb; ++j) tables[size_t(b * nb + j)] = int32_t((b * nb + j) % pool_pages);
        }
        const double us = run(lens, req, tables, nb, S, quick ? 10 : 50, double(B * S * tb), fmt::format("B={}", B));
        if (B == 64 && S == 32768) {
          fmt::print("PERF indexer_us_b64_s32k{} {:.1f}\n", kf == kestrel::IndexKeyFormat::fp8 ? "" : "_mxfp4", us);
          // The exact-order kernel it replaces, same inputs; and how often the two agree.
          cuda::DeviceBuffer dl, dr, dt, scores(size_t(B * S) * 4), sel_old(size_t(B * Ki) * 4);
          const int32_t* pl = up(dl, lens);
          const int32_t* pr = up(dr, req);
          c.block_tables = up(dt, tables), c.bt_stride = nb;
          const double old_us = tm.median_us([&] {
            cuda::indexer_select_paged(q, w, c, pl, pr, B, S, Hi, Ki, static_cast<float*>(scores.data()), S,
                                       static_cast<int32_t*>(sel_old.data()), nullptr);
          }, 1, quick ? 3 : 5);
          std::vector<int32_t> a(size_t(B * Ki)), o(size_t(B * Ki));
          const size_t wsb = cuda::indexer_select_paged_tc_workspace_bytes(B, S, Ki);
          cuda::DeviceBuffer ws(wsb);
          cuda::indexer_select_paged_tc(q, w, c, pl, pr, B, S, Hi, Ki, ws.data(), wsb, s, nullptr);
          KCUDA_CHECK(cudaMemcpy(a.data(), s, a.size() * 4, cudaMemcpyDeviceToHost));
          KCUDA_CHECK(cudaMemcpy(o.data(), sel_old.data(), o.size() * 4, cudaMemcpyDeviceToHost));
          int64_t agree = 0;
          for (int64_t b = 0; b < B; ++b) {
            const std::set<int32_t> os(o.begin() + b * Ki, o.begin() + (b + 1) * Ki);
            for (int64_t i = 0; i < Ki; ++i) agree += os.count(a[size_t(b * Ki + i)]) ? 1 : 0;
          }
          fmt::print("exact-order kernel (paged.h) B=64 S=32K: {:.1f} µs → {:.1f}× faster; raw agreement of the two "
                     "selections {:.5f}\n",
                     old_us, old_us / us, double(agree) / double(B * Ki));
        }
      }
    }
    // Prefill: T rows at positions S−T .. S−1 of one request.
    for (int64_t S : {int64_t(32768), int64_t(1) << 20}) {
      if (quick && S > 32768) continue;
      const int64_t T = maxT, nb = (S + P - 1) / P;
      std::vector<int32_t> tables(static_cast<size_t>(nb)), lens(static_cast<size_t>(T)), req(static_cast<size_t>(T), 0);
      std::iota(tables.begin(), tables.end(), 0);
      for (int64_t t = 0; t < T; ++t) lens[size_t(t)] = int32_t(S - T + t + 1);
      const double us = run(lens, req, tables, nb, S, S > 32768 ? 3 : 10, double(S * tb), fmt::format("prefill T={}", T));
      if (kf == kestrel::IndexKeyFormat::fp8)
        fmt::print("PERF indexer_prefill_us_t2048_s{} {:.1f}\n", S > 32768 ? "1m" : "32k", us);
    }
  }
  return 0;
}
